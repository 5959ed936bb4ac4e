"""The seed's contract (REFERENCE.md section 3; shared/seeds/002): in fp64, with the loss
``((LN(h) + offset) ** 2).sum()`` and ``offset = 3 * randn``, every gradient of our op (q, k,
v, igate, fgate and the norm's weight and bias) matches fp64 autograd through
``reference.mlstm_parallel -> reference.multihead_layernorm`` at atol = rtol = 1e-5, on both
backends (the Triton one under the interpreter on CPU, 16-row tiles).

Cases: the seed's own shape and settings (B=1, NH=1, S=8, DH=4, cell eps 0, the residual-form
weight at zero, no bias), S up to 256 with DQK != DV, S not a multiple of 16, weight only /
bias only / both / ``residual_weight``, cell eps 0 and 1e-6, and the raw output (no norm,
where the normaliser's and stabiliser's own gradients matter) under the same loss.
"""
import pytest
import torch

from tests.mlstm._helpers import BACKENDS, Inputs, check_contract, make_inputs


def seed_inputs() -> Inputs:
    """The seed notebook's draws (torch.manual_seed(1) there, on CUDA; here on the CPU), in
    its order: q, k, v, igate, fgate ``[B, NH, S, 1]``; its layernorm is the residual form
    (``1 + weight``) with the weight at zero and no bias."""
    gen = torch.Generator().manual_seed(1)
    b, nh, s, dh = 1, 1, 8, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(b, nh, s, dh), randn(b, nh, s, dh), randn(b, nh, s, dh)
    igate, fgate = randn(b, nh, s, 1)[..., 0], randn(b, nh, s, 1)[..., 0]
    return Inputs(q, k, v, igate, fgate, torch.zeros(nh * dh, dtype=torch.float64), None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_case(backend):
    check_contract(backend, seed_inputs(), eps=0.0, residual_weight=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_case_without_norm(backend):
    x = seed_inputs()
    x.norm_weight = None
    check_contract(backend, x, eps=0.0)


# (B, NH, S, DQK, DV), norm: weight / bias / both / residual / none, cell eps.
# Interpreter cost grows with S^2 * B * NH: long sequences get one head.
CASES = {
    "S256-both": ((1, 1, 256, 16, 32), "both", 1e-6),
    "S128-raw-eps0": ((1, 1, 128, 32, 16), "none", 0.0),
    "S37-bias-eps0": ((1, 2, 37, 16, 32), "bias", 0.0),
    "S37-raw": ((2, 1, 37, 32, 16), "none", 1e-6),
    "S100-residual": ((1, 1, 100, 16, 32), "residual", 1e-6),
    "S100-weight-eps0": ((1, 1, 100, 32, 16), "weight", 0.0),
    "S64-both-eps0": ((2, 1, 64, 8, 24), "both", 0.0),
    "S23-residual-bias-eps0": ((1, 2, 23, 16, 8), "residual", 0.0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_contract(backend, case):
    shape, norm, eps = CASES[case]
    x = make_inputs(*shape, weight=norm in ("weight", "both", "residual"),
                    bias=norm in ("bias", "both") or case.endswith("residual-bias-eps0"),
                    seed=sum(shape))
    if norm == "residual":
        x.norm_weight = 0.3 * x.norm_weight  # the residual form's weights sit near 0
    check_contract(backend, x, eps=eps, residual_weight=norm == "residual")


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_closing_gates_and_norm_eps_1e5(backend):
    """Forget gates mostly closed (centred at -2, as at the seed's plain randn and below) and
    the original cell's layernorm eps 1e-5."""
    x = make_inputs(1, 2, 40, 16, 16, fgate_bias=-2.0, seed=11)
    check_contract(backend, x, eps=1e-6, norm_eps=1e-5)
