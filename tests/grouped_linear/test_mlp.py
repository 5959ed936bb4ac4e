"""``compileops.grouped_swiglu_mlp``: the SwiGLU expert MLP in one call, whose backward runs
the SwiGLU derivative, the row scaling and the scale's gradient as the epilogue of the down
projection's dX product (``compileops::grouped_swiglu_down_dx``)."""
import pytest
import torch

import compileops
from compileops.grouped_linear import reference
from compileops.grouped_linear.op import grouped_swiglu_down_dx_op
from compileops.testing import assert_close_to_reference
from tests.bad_inputs import raises
from tests.grouped_linear._helpers import TOL, offsets_of, record_triton_launches

SIZES = [5, 0, 7, 3]  # an empty group, and tail rows past the last offset
TAIL = 2
D, H = 12, 10


def _inputs(dtype, seed=0, d=D, h=H, sizes=SIZES):
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes) + TAIL
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate_up = (torch.randn(len(sizes), 2 * h, d, generator=gen) / d**0.5).to(dtype)
    down = (torch.randn(len(sizes), d, h, generator=gen) / h**0.5).to(dtype)
    scale = torch.rand(m, generator=gen) + 0.05
    grad = torch.randn(m, d, generator=gen).to(dtype)
    return x, gate_up, down, offsets_of(sizes), scale, grad


def _fused(x, gate_up, down, offs, scale):
    return compileops.grouped_swiglu_mlp(x, gate_up, down, offs, row_scale=scale)


def _two_calls(x, gate_up, down, offs, scale):
    h = compileops.grouped_linear_swiglu(x, gate_up, offs)
    return compileops.grouped_linear(h, down, offs, row_scale=scale)


def _run(fn, x, gate_up, down, offs, scale, grad, *, with_scale=True):
    leaves = [t.detach().requires_grad_() for t in (x, gate_up, down)]
    s = scale.detach().requires_grad_() if with_scale else None
    y = fn(*leaves, offs, s)
    grads = torch.autograd.grad(y, leaves + ([s] if with_scale else []), grad)
    return (y, *grads)


WHAT = ("y", "dx", "d_gate_up", "d_down", "d_scale")


@pytest.mark.parametrize("with_scale", [True, False], ids=["row_scale", "no_scale"])
def test_matches_the_two_calls_in_fp64(with_scale):
    args = _inputs(torch.float64)
    with compileops.use_backend("reference"):
        got = _run(_fused, *args, with_scale=with_scale)
        want = _run(_two_calls, *args, with_scale=with_scale)
    assert torch.equal(got[0], want[0]), "the forward must be the same bits"
    for g, e, what in zip(got[1:], want[1:], WHAT[1:]):
        assert_close_to_reference(g, e, max_relative_error=1e-13, what=what)


# Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest), and
# the fused epilogue casts three times where the two calls' kernel casts once (the rest is
# PyTorch's, rounded to nearest): on CPU its bf16 gradients measure 1.4-1.7e-2 against fp64
# where the two calls' measure 1.0-1.4e-2. The GPU holds it to the contract (test_gpu.py).
CPU_TOL = {torch.float32: TOL[torch.float32], torch.bfloat16: 2.5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_kernels_within_the_contract(dtype):
    args = _inputs(dtype, seed=3)
    with compileops.use_backend("reference"):
        want = _run(_two_calls, *(a.double() if a.is_floating_point() else a for a in args))
    with compileops.use_backend("triton"):
        got = _run(_fused, *args)
        two = _run(_two_calls, *args)
    assert torch.equal(got[0], two[0]), "the forward must be the two calls' bits"
    assert got[4].dtype == torch.float32
    for g, e, what in zip(got, want, WHAT):
        assert_close_to_reference(g, e, max_relative_error=CPU_TOL[dtype], what=what)


def test_the_fused_op_is_the_written_out_chain():
    """The kernel against :func:`reference.grouped_swiglu_down_dx` (dX product, rounding,
    row scaling, derivative) in fp32, with tail rows of h and the pre-activations holding
    inf and NaN: the tail's gradients are exact zeros, as the written-out chain's are where
    the tail holds zeros."""
    x, gate_up, down, offs, scale, grad = _inputs(torch.float32, seed=5)
    m = x.shape[0]
    gen = torch.Generator().manual_seed(9)
    preact = torch.randn(m, 2 * H, generator=gen)
    h = torch.randn(m, H, generator=gen)
    preact[-TAIL:], h[-TAIL:] = float("inf"), float("nan")
    with compileops.use_backend("triton"):
        dpreact, ds = grouped_swiglu_down_dx_op(grad, down, offs, preact, h, scale)
        dpreact_plain, ds_none = grouped_swiglu_down_dx_op(grad, down, offs, preact)
    live = slice(0, m - TAIL)
    want_dpreact, want_ds = reference.grouped_swiglu_down_dx(
        grad[live], down, offs, preact[live], h[live], scale[live])
    assert_close_to_reference(dpreact[live], want_dpreact, max_relative_error=1e-5,
                              what="dpreact")
    assert_close_to_reference(ds[live], want_ds, max_relative_error=1e-5, what="ds")
    assert torch.equal(dpreact[-TAIL:], torch.zeros(TAIL, 2 * H))
    assert torch.equal(ds[-TAIL:], torch.zeros(TAIL))
    want_plain, _ = reference.grouped_swiglu_down_dx(grad[live], down, offs, preact[live])
    assert_close_to_reference(dpreact_plain[live], want_plain, max_relative_error=1e-5,
                              what="dpreact without a scale")
    assert ds_none.shape == (0,)


@pytest.mark.parametrize("block_n", [64, 128], ids=["2 slices", "4 slices"])
def test_column_slices_give_the_same_gradients(block_n):
    """The epilogue in column slices of 32 (wide tiles, see ``swiglu_grad_epilogue``) against
    one slice (32-column tiles): the pre-activation gradients bitwise (the K loop is the
    same), the scale's gradient up to its summation order. H = 130: a last tile of 2
    columns, and slices past H entirely masked."""
    import dataclasses

    from compileops.grouped_linear import kernels

    h_size = 130
    x, gate_up, down, offs, scale, grad = _inputs(torch.float32, seed=8, h=h_size)
    m = x.shape[0]
    gen = torch.Generator().manual_seed(1)
    preact, h = torch.randn(m, 2 * h_size, generator=gen), torch.randn(m, h_size, generator=gen)
    base = kernels.choose_config(m, 4, h_size, D, torch.float32, x.device)
    results = {}
    for width in (32, block_n):
        cfg = dataclasses.replace(base, block_m=16, block_n=width, block_k=16)
        results[width] = kernels.grouped_swiglu_down_dx(grad, down, offs, preact, h,
                                                        scale.float(), config=cfg)
    assert torch.equal(results[32][0], results[block_n][0])
    assert_close_to_reference(results[block_n][1], results[32][1], max_relative_error=1e-6,
                              what="ds")


def test_backward_has_no_separate_derivative_kernel(monkeypatch):
    """Eager, on the Triton backend: the backward launches the fused dX kernel, then the
    gate/up dX and the three dW kernels; no pointwise derivative and no [M, H] dX product."""
    args = _inputs(torch.float32, seed=2)
    leaves = [t.detach().requires_grad_() for t in args[:3]]
    scale = args[4].detach().requires_grad_()
    with compileops.use_backend("triton"):
        y = _fused(*leaves, args[3], scale)
        launches = record_triton_launches(monkeypatch)
        torch.autograd.grad(y, leaves + [scale], args[5])
    assert sorted(launches) == sorted(["mjagged_gemm_kernel"] * 2 + ["kjagged_gemm_kernel"] * 2), \
        launches


def test_deterministic_and_inputs_unchanged():
    args = _inputs(torch.bfloat16, seed=4)
    before = [a.clone() for a in args]
    with compileops.use_backend("triton"):
        first, second = _run(_fused, *args), _run(_fused, *args)
    for a, b, what in zip(first, second, WHAT):
        assert torch.equal(a, b), what
    for a, b in zip(args, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_fullgraph_matches_eager(dynamic):
    torch._dynamo.reset()
    args = _inputs(torch.float32, seed=6)
    compiled = torch.compile(_fused, fullgraph=True, dynamic=dynamic)
    for g, e, what in zip(_run(compiled, *args), _run(_fused, *args), WHAT):
        assert_close_to_reference(g, e, max_relative_error=1e-6, what=what)


def test_no_grad_and_fp8_are_the_two_calls():
    args = _inputs(torch.float32, seed=7)
    with torch.no_grad():
        assert torch.equal(_fused(*args[:5]), _two_calls(*args[:5]))
    x, gate_up, down, offs, scale, _ = args
    got = compileops.grouped_swiglu_mlp(x, gate_up, down, offs, row_scale=scale, fp8="rowwise")
    h = compileops.grouped_linear_swiglu(x, gate_up, offs, fp8="rowwise")
    want = compileops.grouped_linear(h, down, offs, row_scale=scale, fp8="rowwise")
    assert torch.equal(got, want)


def test_op_opcheck():
    x, gate_up, down, offs, scale, grad = _inputs(torch.float32)
    m = x.shape[0]
    preact, h = torch.randn(m, 2 * H), torch.randn(m, H)
    torch.library.opcheck(grouped_swiglu_down_dx_op, (grad, down, offs, preact, h, scale))
    torch.library.opcheck(grouped_swiglu_down_dx_op, (grad, down, offs, preact))


def _op_args():
    x, gate_up, down, offs, scale, grad = _inputs(torch.float32)
    m = x.shape[0]
    return dict(grad=grad, down=down, offsets=offs, preact=torch.randn(m, 2 * H),
                h=torch.randn(m, H), row_scale=scale)


BAD_OP = {
    "h without row_scale": (dict(row_scale=None), ValueError, "h and row_scale come together"),
    "preact of H columns": (dict(preact=torch.randn(17, H)), ValueError, "preact must be \\[M, 2H\\]"),
    "h of the wrong rows": (dict(h=torch.randn(16, H)), ValueError, "h must be \\[M, H\\]"),
    "scale in bf16": (dict(row_scale=torch.rand(17, dtype=torch.bfloat16)), TypeError,
                      "row_scale must have grad's dtype"),
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", BAD_OP)
def test_bad_op_inputs_are_clear_errors(case, mode):
    change, error, pattern = BAD_OP[case]
    kwargs = {**_op_args(), **change}
    fn = grouped_swiglu_down_dx_op
    if mode == "compiled":
        fn = torch.compile(fn, fullgraph=True)
    with raises(error, pattern, compiled=mode == "compiled"):
        fn(**kwargs)


def test_bad_public_inputs_are_clear_errors():
    x, gate_up, down, offs, scale, _ = _inputs(torch.float32)
    with raises(ValueError, "row_scale must be \\[M\\]"):
        compileops.grouped_swiglu_mlp(x, gate_up, down, offs, row_scale=scale[:-1])
    with raises(ValueError, "cache_fp8_weights=True"):
        compileops.grouped_swiglu_mlp(x, gate_up, down, offs, cache_fp8_weights=True)
    with raises(ValueError, "mismatched K"):  # down given as [G, H, D]
        compileops.grouped_swiglu_mlp(x, gate_up, down.transpose(1, 2), offs)
