"""fp32 precision at long sequences: the output and every gradient of ``compileops.mlstm``
against fp64 autograd through the reference, within the docstring's 1e-5 relative L2 error,
at S = 1024 on the CPU (both backends, both forms) and at S = 4096 on the GPU, for the gate
regimes where it was lost: forget gates around -1 or 0 (their sums reach -1.3 S and -0.8 S),
and an input gate spread N(-1, 2**2) (a cancelling normaliser).

The cell reads differences of the forget-gate sums ``F_i - F_j``; summed and held in fp32,
each ``F`` was rounded at its own size, and every decay with it (before this test: at S =
1024, forget gates N(-1, 1), the output 1.7e-5 off on the reference backend, 1.9e-5 on the
kernels; the kernels' forget-gate gradient 5.2e-4, through the reverse sum of row sums less
column sums). Each head of an input below draws its gates from one regime, and each head's
errors are checked on their own.
"""
import dataclasses

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import compileops
from compileops.mlstm.kernels import config
from tests.fuzzing import gate_regimes
from tests.mlstm._helpers import Inputs, cotangent, fw_bw, op_out, out_shape, reference_out

#: Per head: (igate mean, igate std, fgate mean, fgate std).
REGIMES = {
    "closing": (0.0, 1.0, -1.0, 1.0),
    "balanced": (0.0, 1.0, 0.0, 1.0),
    "spread-input": (-1.0, 2.0, 3.0, 1.0),
}
BOUND = 1e-5
FORMS = ["parallel", "chunkwise"]


def regime_inputs(batch, seq, dqk, dv, regimes, *, normed, seed=0, device="cpu") -> Inputs:
    """fp64 inputs holding fp32 values (rounded, so that fp32 and fp64 see the same numbers),
    one head per regime ``(igate mean, igate std, fgate mean, fgate std)``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    heads = len(regimes)
    igate = torch.stack([mean + std * randn(batch, seq) for mean, std, _, _ in regimes], 1)
    fgate = torch.stack([mean + std * randn(batch, seq) for _, _, mean, std in regimes], 1)
    x = Inputs(randn(batch, heads, seq, dqk), randn(batch, heads, seq, dqk),
               randn(batch, heads, seq, dv), igate, fgate,
               randn(heads * dv) if normed else None, randn(heads * dv) if normed else None)
    return x.map(lambda t: t.float().double().to(device))


def _head(name: str, t: torch.Tensor, head: int, dv: int, normed: bool) -> torch.Tensor:
    """Head ``head``'s part of an output or gradient."""
    if name in ("norm_weight", "norm_bias") or (name == "out" and normed):
        return t[..., head * dv:(head + 1) * dv]
    return t[:, head]


def head_errors(x: Inputs, backend: str, kernel: str) -> dict[str, list[float]]:
    """Relative L2 errors per head, of the output and of each gradient (a random
    cotangent): fp32 ``compileops.mlstm`` against fp64 autograd through the reference."""
    grad = cotangent(out_shape(x), torch.float64, device=x.q.device)
    want_out, want = fw_bw(reference_out, x, grad)
    with compileops.use_backend(backend):
        got_out, got = fw_bw(op_out, x.map(lambda t: t.float()), grad.float(), kernel=kernel)
    dv = x.v.shape[-1]
    errors = {}
    for name, g, w in [("out", got_out, want_out), *zip(x.names(), got, want)]:
        assert g.dtype == torch.float32, name
        errors[name] = [
            float((_head(name, g, h, dv, x.normed).double() - _head(name, w, h, dv, x.normed))
                  .norm() / _head(name, w, h, dv, x.normed).norm())
            for h in range(x.q.shape[1])]
    return errors


def assert_within_bound(errors: dict[str, list[float]], heads: list[str]) -> None:
    text = "; ".join(f"{name} " + " ".join(f"{e:.1e}" for e in errs)
                     for name, errs in errors.items())
    worst = max((e, name, heads[h]) for name, errs in errors.items()
                for h, e in enumerate(errs))
    assert worst[0] <= BOUND, f"d{worst[1]} ({worst[2]}) {worst[0]:.2e} > {BOUND}: {text}"


@pytest.fixture
def wide_interpreter_tiles(monkeypatch):
    """The fp32 GPU tiles (64-row query tiles, 32-key tiles: 2 blocks of near pairs per
    query tile in the backward) instead of the interpreter's 16 x 16, which run S = 1024
    about 7x slower."""
    monkeypatch.setattr(config, "INTERPRETER_FORWARD", dataclasses.replace(
        config.INTERPRETER_FORWARD, block_m=64, block_n=32))
    monkeypatch.setattr(config, "INTERPRETER_BACKWARD", dataclasses.replace(
        config.INTERPRETER_BACKWARD, block_m=64, block_n=32))


@pytest.mark.parametrize("kernel", FORMS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp32_at_s1024(wide_interpreter_tiles, backend, kernel):
    x = regime_inputs(1, 1024, 16, 16, list(REGIMES.values()), normed=False, seed=1)
    assert_within_bound(head_errors(x, backend, kernel), list(REGIMES))


@pytest.mark.parametrize("kernel", FORMS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp32_at_s1024_normed(wide_interpreter_tiles, backend, kernel):
    """With the multi-head norm (its weight's and bias's gradients too); the closing gates,
    whose sums are the largest."""
    x = regime_inputs(1, 1024, 16, 16, [REGIMES["closing"]], normed=True, seed=2)
    assert_within_bound(head_errors(x, backend, kernel), ["closing"])


@settings(max_examples=6)
@given(regime=gate_regimes(), seq=st.integers(300, 800), kernel=st.sampled_from(FORMS))
def test_fp32_reference_backend_over_gate_regimes(regime, seq, kernel):
    """The reference backend (the CPU's ground truth) over drawn regimes and lengths."""
    x = regime_inputs(1, seq, 8, 8, [regime], normed=False, seed=seq)
    assert_within_bound(head_errors(x, "reference", kernel), [str(regime)])


@pytest.mark.gpu
@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
@pytest.mark.parametrize("kernel", FORMS)
def test_fp32_at_s4096_gpu(monkeypatch, kernel, normed):
    """S = 4096 with the model's head dims (DQK 128, DV 256), IEEE fp32 dots, against the
    fp64 reference computed on the GPU."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    x = regime_inputs(1, 4096, 128, 256, list(REGIMES.values()), normed=normed, seed=3,
                      device="cuda")
    assert_within_bound(head_errors(x, "triton", kernel), list(REGIMES))


# --------------------------------------------------------------------------- the sums alone


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_log_forget_sums_in_fp64(backend):
    """``compileops::mlstm_log_forget`` sums in fp64: returned in fp64 (``fp64=True``) they
    are the fp64 sums; in fp32, those sums rounded once (an fp32 running sum of 4096 terms
    drifts by many ulps)."""
    from compileops.mlstm.gates import log_forget_op

    fgate = torch.randn(2, 3, 4096, generator=torch.Generator().manual_seed(4)) - 1.0
    want = torch.cumsum(torch.nn.functional.logsigmoid(fgate.double()), dim=-1)
    with compileops.use_backend(backend):
        precise = log_forget_op(fgate, fp64=True)
        rounded = log_forget_op(fgate)
        torch.library.opcheck(log_forget_op, (fgate.requires_grad_(), 0, None, True))
    assert precise.dtype == torch.float64 and rounded.dtype == torch.float32
    torch.testing.assert_close(precise, want, rtol=1e-13, atol=1e-10)
    assert ((rounded.double() - want).abs() <= want.abs() * 2.0**-24).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_log_forget_backward_sums_an_fp64_gradient_in_fp64(backend):
    """The forget sums' gradient (row sums less column sums of dlogD) is reverse-summed as
    it comes: here its fp32 rounding would lose the 1 next to 1e8."""
    from compileops.mlstm.gates import log_forget_backward_op

    fgate = torch.zeros(1, 1, 3)
    grad = torch.tensor([[[1e-3, 1e8 + 1.0, -1e8]]], dtype=torch.float64)
    with compileops.use_backend(backend):
        got = log_forget_backward_op(grad, fgate)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([[[0.5005, 0.5, -5e7]]]))
