"""The column terms and their running max (``compileops::mlstm_column_terms``) and the forward's
two forms around it: one loop over every key tile while a query tile's column terms spread
by at most ``ONE_LOOP_SPREAD`` (log2 units), else two loops (left of the diagonal, then the
diagonal tiles with the exact exponential). Gates that jump inside one tile, an input-gate
spike or strongly closing forget gates, take each form; both keep the seed's fp64 contract
and the bf16 output's precision bound (Triton under the interpreter, 16-row tiles)."""
import pytest
import torch

import compileops
from compileops.mlstm.gates import column_terms_op, log_forget_op
from compileops.mlstm.kernels.config import INTERPRETER_FORWARD
from compileops.mlstm.kernels.forward import ONE_LOOP_SPREAD
from compileops.mlstm.reference import LOG2E
from compileops.testing import assert_close_to_reference
from tests.mlstm._helpers import OUT_TOL, check_contract, make_inputs, op_out, reference_out

@pytest.mark.parametrize("seq,chunk", [(2500, 0), (37, 0), (200, 64), (100, 16)])
def test_running_max_equals_cummax_bitwise(seq, chunk):
    """Triton (blocks of 1024 with a carry, or one window per chunk) against torch.cummax of
    the same terms, restarted every ``chunk`` elements."""
    from compileops.mlstm.kernels.stabiliser import column_terms

    gen = torch.Generator().manual_seed(seq)
    igate = torch.randn(2, 3, seq, generator=gen) * 4
    logf = log_forget_op(torch.randn(2, 3, seq, generator=gen), chunk)
    got_terms, got = column_terms(igate, logf, chunk)
    terms = (igate - logf) * LOG2E
    assert torch.equal(got_terms, terms)
    window = chunk or seq
    pad = -seq % window
    blocks = torch.nn.functional.pad(terms, (0, pad)).reshape(2, 3, -1, window)
    want = torch.cummax(blocks, dim=-1).values.reshape(2, 3, -1)[..., :seq]
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_column_terms_op(backend):
    igate = torch.randn(2, 2, 50, dtype=torch.float64)
    logf = log_forget_op(torch.randn(2, 2, 50, dtype=torch.float64))
    with compileops.use_backend(backend):
        terms, colmax = column_terms_op(igate, logf)
        torch.library.opcheck(column_terms_op, (igate, logf))
    assert torch.equal(terms, (igate - logf) * LOG2E)
    assert torch.equal(colmax, torch.cummax(terms, dim=-1).values)
    with pytest.raises(ValueError, match="igate .* and logf .* must match"):
        column_terms_op(igate[..., :49], logf)


def _largest_tile_spread(x, tile: int = INTERPRETER_FORWARD.block_m) -> float:
    """The widest spread (log2 units) of the column terms' running max inside one query tile
    of ``tile`` rows (the interpreter's by default), over every (batch, head)."""
    logf = log_forget_op(x.fgate.double())
    with compileops.use_backend("reference"):
        _, colmax = column_terms_op(x.igate.double(), logf)
    seq = colmax.shape[-1]
    spreads = [colmax[..., min(s + tile, seq) - 1] - colmax[..., s] for s in range(0, seq, tile)]
    return torch.stack(spreads).max().item()


# An input-gate spike of `size` nats at position 37 (inside the third 16-row tile), or forget
# gates centred at -12 (each step forgets e**-12: 16 rows spread by ~270 log2 units).
FORMS = {
    "one-loop-spike": dict(spike=30.0, fgate_bias=3.0, one_loop=True),
    "two-loops-spike": dict(spike=250.0, fgate_bias=3.0, one_loop=False),
    "two-loops-closing-forget-gates": dict(spike=0.0, fgate_bias=-12.0, one_loop=False),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_both_forms_keep_the_contract(form, normed):
    case = FORMS[form]
    x = make_inputs(1, 2, 64, 16, 32, weight=normed, bias=normed, seed=5,
                    fgate_bias=case["fgate_bias"])
    x.igate[:, 0, 37] += case["spike"]
    spread = _largest_tile_spread(x)
    # The case takes the form it is named for (and the one-loop case its large row factors).
    assert (spread <= ONE_LOOP_SPREAD) == case["one_loop"], spread
    if case["one_loop"]:
        assert spread > 32, spread
    check_contract("triton", x, eps=1e-6)
    # bf16 inputs accumulate in fp32, where 2**spread would overflow. (The output only: this
    # is the forward's choice; the backward is the same for both. fp32 inputs always take
    # the two loops.)
    rounded = x.map(lambda t: t.to(torch.bfloat16).double())
    with compileops.use_backend("triton"):
        got = op_out(rounded.map(lambda t: t.to(torch.bfloat16)))
    assert_close_to_reference(got, reference_out(rounded),
                              max_relative_error=OUT_TOL[torch.bfloat16], what="bf16 output")


@pytest.mark.parametrize("form", list(FORMS))
def test_both_forms_keep_the_contract_chunkwise_with_state(form):
    """The chunkwise form: the state entering a chunk joins the spread's ends."""
    from tests.mlstm.test_chunkwise import _contract

    case = FORMS[form]
    x = make_inputs(1, 2, 64, 16, 24, seed=6, fgate_bias=case["fgate_bias"])
    x.igate[:, 0, 37] += case["spike"]
    _contract(x, "triton", 32)


# fp32 runs without the closing gates: at S = 512 their sum reaches -6000, and its fp32
# rounding alone puts the output 4.6e-5 off (H100), past the 1e-5 bound. That input takes the
# two loops, the kernel's form before the one-loop one.
GPU_CASES = [(form, torch.bfloat16) for form in FORMS] + [
    (form, torch.float32) for form in FORMS if FORMS[form]["fgate_bias"] > 0]


@pytest.mark.gpu
@pytest.mark.parametrize("form,dtype", GPU_CASES, ids=[f"{f}-{d}" for f, d in GPU_CASES])
def test_both_forms_on_the_gpu(form, dtype):
    """The GPU's tiles (128 rows; fp32 always in two loops, unpipelined): against the fp64
    reference computed on the GPU, eagerly and compiled (the template)."""
    from compileops.mlstm.kernels.config import choose_forward_config

    case = FORMS[form]
    # Raw (no norm): Triton compiles the fp32 normed kernels slowly (tests/mlstm/test_gpu.py).
    x = make_inputs(1, 2, 512, 64, 64, weight=False, bias=False, seed=8,
                    fgate_bias=case["fgate_bias"], device="cuda")
    x.igate[:, 0, 300] += case["spike"] * 0.8  # inside the third 128-row tile
    tile = choose_forward_config(x.q.to(dtype), 64, 64).block_m
    spread = _largest_tile_spread(x.map(lambda t: t.cpu()), tile)
    assert (spread <= ONE_LOOP_SPREAD) == case["one_loop"], spread
    want = reference_out(x)
    xd = x.map(lambda t: t.to(dtype))
    with compileops.use_backend("triton"):
        eager = op_out(xd)
        compiled = torch.compile(op_out, fullgraph=True)(xd)
    for what, got in (("eager", eager), ("compiled", compiled)):
        assert_close_to_reference(got, want, max_relative_error=OUT_TOL[dtype], what=what)
