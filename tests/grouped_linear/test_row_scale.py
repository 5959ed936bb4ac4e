"""``grouped_linear(..., row_scale=p)``: the MoE down projection times each routed row's router
probability. Same forward as the written-out product; its backward takes dp from the dX
product (a sum over K) and keeps nothing ``[M, N]`` from forward to backward."""
import pytest
import torch

import compileops
from compileops.testing import assert_close_to_reference, inductor_kernels
from tests.bad_inputs import raises
from tests.grouped_linear._helpers import TOL, make_grouped

SIZES = [5, 0, 7, 3]  # an empty group, and 2 rows past the last offset (extra_rows)
SHAPES = {"K<N": (6, 10), "K>N": (10, 6)}


def _inputs(dtype, k, n, seed=0):
    x, w, offs, _ = make_grouped(SIZES, k, n, dtype, bias=False, extra_rows=2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scale = torch.rand(x.shape[0], generator=gen) + 0.05
    grad = torch.randn(x.shape[0], n, generator=gen).to(dtype)
    return x, w, offs, scale, grad


def _run(fn, x, w, offs, scale, grad):
    x, w, scale = (t.detach().requires_grad_() for t in (x, w, scale))
    y = fn(x, w, offs, scale)
    return (y, *torch.autograd.grad(y, (x, w, scale), grad))


def _scaled(x, w, offs, scale):
    return compileops.grouped_linear(x, w, offs, row_scale=scale)


def _written_out(x, w, offs, scale):
    return compileops.grouped_linear(x, w, offs) * scale.to(x.dtype)[:, None]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_written_out_product_in_fp64(shape):
    k, n = SHAPES[shape]
    args = _inputs(torch.float64, k, n)
    with compileops.use_backend("reference"):  # fp64: the ground truth's backend
        got, want = _run(_scaled, *args), _run(_written_out, *args)
    assert torch.equal(got[0], want[0]), "forward must be the same bits"
    for g, e, what in zip(got[1:], want[1:], ("dx", "dw", "dscale")):
        assert_close_to_reference(g, e, max_relative_error=1e-13, what=what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_within_the_contract(dtype, shape):
    k, n = SHAPES[shape]
    args = _inputs(dtype, k, n, seed=3)
    with compileops.use_backend("reference"):
        want = _run(_written_out, *(a.double() if a.is_floating_point() else a for a in args))
    got = _run(_scaled, *args)
    assert got[0].dtype == dtype and got[3].dtype == torch.float32
    for g, e, what in zip(got, want, ("y", "dx", "dw", "dscale")):
        assert_close_to_reference(g, e, max_relative_error=TOL[dtype], what=what)


def test_keeps_nothing_of_the_output_shape_for_backward():
    # The written-out product keeps the unscaled output [M, N] for dscale; the row-scaled
    # form keeps x, the weight, the offsets and the scale only.
    x, w, offs, scale, _ = _inputs(torch.float32, 6, 10)
    x, w, scale = (t.requires_grad_() for t in (x, w, scale))

    def saved_shapes(fn):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            fn(x, w, offs, scale)
        return shapes

    output_shape = (x.shape[0], w.shape[1])
    assert output_shape in saved_shapes(_written_out)  # the check can see it
    assert output_shape not in saved_shapes(_scaled)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_fullgraph_matches_eager(dynamic):
    torch._dynamo.reset()
    args = _inputs(torch.float32, 10, 6, seed=5)
    compiled = torch.compile(_scaled, fullgraph=True, dynamic=dynamic)
    for g, e, what in zip(_run(compiled, *args), _run(_scaled, *args), ("y", "dx", "dw", "ds")):
        assert_close_to_reference(g, e, max_relative_error=1e-6, what=what)


def test_scale_is_an_input_of_the_template():
    """Compiled, one kernel: the row-scaled template, the scale applied inside it."""
    x, w, offs, scale, _ = _inputs(torch.float32, 16, 32)
    kernels = inductor_kernels(_scaled, x, w, offs, scale, triton=True)
    assert kernels == "triton_tem_fused_grouped_linear_row_scaled", kernels


@pytest.mark.parametrize("dtype,backend", [(torch.float32, "triton"), (torch.float32, "reference"),
                                           (torch.bfloat16, "reference")], ids=str)
def test_row_scaled_op_is_the_written_out_product_bitwise(dtype, backend):
    """``compileops::grouped_linear_row_scaled`` (the eager Triton kernel, the reference):
    the bits of ``grouped_linear(...) * scale`` written out, tail rows included. (16-bit on
    the Triton kernel: test_gpu.py; Triton's interpreter casts fp32 to bf16 by truncation,
    where the GPU and PyTorch round to nearest, so the kernel's two roundings cannot match
    PyTorch's product on CPU.)"""
    from compileops.grouped_linear.op import grouped_linear_row_scaled_op

    x, w, offs, scale, _ = _inputs(dtype, 10, 6)
    scale = scale.to(dtype)
    scale[-1] = 3.0  # a tail row (past the last offset): 0 * scale
    with compileops.use_backend(backend):
        got = grouped_linear_row_scaled_op(x, w, offs, scale)
        want = compileops.grouped_linear(x, w, offs) * scale[:, None]
    assert torch.equal(got, want)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_row_scaled_template_is_the_eager_kernel_bitwise(dynamic):
    """The template (Triton code for CPU tensors, run by the interpreter) and the eager
    kernel share the tile body and the row scaling: the same bits, bf16."""
    from compileops.lowerings import _compat

    x, w, offs, scale, _ = _inputs(torch.bfloat16, 24, 40)
    scale = scale.to(torch.bfloat16)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(_scaled, fullgraph=True, dynamic=dynamic)
        got, sources = _compat.run_and_get_code(compiled, x, w, offs, scale)
    assert "scale_rows(" in "\n".join(sources)
    assert torch.equal(got, _scaled(x, w, offs, scale))


def test_row_scaled_op_opcheck():
    from compileops.grouped_linear.op import grouped_linear_row_scaled_op

    x, w, offs, scale, _ = _inputs(torch.float32, 6, 10)
    torch.library.opcheck(grouped_linear_row_scaled_op, (x, w, offs, scale))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_row_scaled_op_wants_the_scale_in_x_dtype(mode):
    """The op itself takes the scale in x's dtype (the public function casts it)."""
    from compileops.grouped_linear.op import grouped_linear_row_scaled_op

    x, w, offs, scale, _ = _inputs(torch.float32, 6, 10)
    fn = grouped_linear_row_scaled_op
    if mode == "compiled":
        fn = torch.compile(fn, fullgraph=True)
    with raises(TypeError, "row_scale must have x's dtype", compiled=mode == "compiled"):
        fn(x, w, offs, scale.double())


def test_with_bias_is_the_written_out_product():
    x, w, offs, b = make_grouped(SIZES, 6, 10, torch.float32, bias=True, extra_rows=2)
    scale = torch.rand(x.shape[0])
    got = compileops.grouped_linear(x, w, offs, b, row_scale=scale)
    want = compileops.grouped_linear(x, w, offs, b) * scale[:, None]
    assert torch.equal(got, want)


def test_inputs_are_not_modified():
    args = _inputs(torch.float32, 6, 10)
    before = [a.clone() for a in args]
    _run(_scaled, *args)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


BAD = {
    "wrong length": (lambda m: torch.rand(m + 1), ValueError, "row_scale must be \\[M\\]"),
    "2-D": (lambda m: torch.rand(m, 1), ValueError, "row_scale must be \\[M\\]"),
    "integer": (lambda m: torch.ones(m, dtype=torch.int64), TypeError, "floating-point"),
    "not a tensor": (lambda m: 0.5, TypeError, "must be a tensor"),
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", BAD)
def test_bad_row_scale_is_a_clear_error(case, mode):
    make_scale, error, pattern = BAD[case]
    x, w, offs, _, _ = _inputs(torch.float32, 6, 10)
    fn = torch.compile(_scaled, fullgraph=True) if mode == "compiled" else _scaled
    with raises(error, pattern, compiled=mode == "compiled"):
        fn(x, w, offs, make_scale(x.shape[0]))
