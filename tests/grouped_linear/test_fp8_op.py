"""The fp8 grouped linear (``fp8="rowwise"`` and ``"blockwise"``): forward and gradients
against their plain-PyTorch formulation, opcheck, compiled against eager, the error against
exact arithmetic, and bad inputs. On CPU the ops run their Triton kernels under the
interpreter (and the reference backend where forced)."""
import pytest
import torch

import compileops
from compileops.grouped_linear import fp8, reference
from compileops.grouped_linear.fp8_op import (
    RECIPES,
    fp8_weight_rowwise_op,
    grouped_linear_fp8_dx_op,
    grouped_linear_fp8_dx_from_copy_op,
    grouped_linear_fp8_op,
    grouped_linear_row_scaled_fp8_op,
    grouped_linear_swiglu_fp8_with_preact_op,
)

SPLITS = [10, 0, 15, 11]  # an empty group, and 4 rows past the last group
#: Relative error of the fp8 products against the reference's exact fp32 sums: 0 in the
#: interpreter (fp32 sums), about 1e-4 on Hopper, whose fp8 MMA sums each K step at reduced
#: precision (tests/grouped_linear/test_fp8_kernels.py).
SUMS = {"cpu": 1e-6, "cuda": 1e-3}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


def _inputs(dtype=torch.float32, n=48, k=200, seed=0, grad=True, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(len(SPLITS), n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    offs = torch.cumsum(torch.tensor(SPLITS), 0).to(torch.int32).to(device)
    if grad:
        x.requires_grad_()
        w.requires_grad_()
    return x, w, offs


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _expected(x, w, offs, dy, scaling, swiglu=False):
    """(y, dx, dw) as the recipe defines them: the fp8 references for the forward and for dX
    (rowwise: from the forward's weight copy), dW from the unquantised x in fp32."""
    xd, wd = x.detach(), w.detach()
    pre = fp8.grouped_linear_reference(xd.float(), wd.float(), offs, scaling)
    if swiglu:
        gate, up = pre.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
        dpre = torch.func.vjp(lambda p: reference.swiglu(p), pre.to(x.dtype).float())[1](
            dy.float())[0].to(x.dtype)
    else:
        y, dpre = pre, dy
    dx = fp8.grouped_linear_dx_reference(dpre.float(), wd.float(), offs, scaling)
    dw = reference.grouped_linear_wgrad(dpre.float(), xd.float(), offs, torch.float32,
                                        torch.float32, False)[0]
    return y, dx, dw


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_forward_and_gradients_follow_the_recipe(backend, swiglu, scaling, device):
    """K = 200 and N = 48 / 24: ragged 128-wide blocks for the blockwise scaling."""
    if device == "cuda" and backend == "reference":
        pytest.skip("the reference backend runs on CPU")
    x, w, offs = _inputs(n=48, device=device)
    fn = compileops.grouped_linear_swiglu if swiglu else compileops.grouped_linear
    with compileops.use_backend(backend):
        y = fn(x, w, offs, fp8=scaling)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
        y.backward(dy)
    cpu = [t.detach().cpu() for t in (x, w, offs, dy)]
    want_y, want_dx, want_dw = _expected(*cpu, scaling, swiglu)
    assert y.shape == want_y.shape and y.dtype == x.dtype
    assert _rel(y.cpu(), want_y) <= SUMS[device]
    # With SwiGLU the gradients start from the kernel's pre-activations: on a GPU they differ
    # from the reference's by its sums (above), and quantising dY can turn that into an e4m3
    # step for a value near a rounding boundary.
    bound = 1e-2 if swiglu and device == "cuda" else SUMS[device]
    assert _rel(x.grad.cpu(), want_dx) <= bound
    assert _rel(w.grad.cpu(), want_dw) <= bound
    assert torch.count_nonzero(y[36:]) == 0 and torch.count_nonzero(x.grad[36:]) == 0


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_row_scale_is_the_products_epilogue(backend, scaling, device):
    """``row_scale``: the forward's bits are those of the product written out, ``fp8 product
    * p[:, None]``; dX and dW those of the same product's backward; the scale's gradient is
    the sum over K of the fp8 dX product with x (not over N of dY with the unscaled output,
    as the written-out product's is), so it differs from that by fp8's error."""
    if device == "cuda" and backend == "reference":
        pytest.skip("the reference backend runs on CPU")
    x, w, offs = _inputs(device=device)
    p = torch.rand(40, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
    dy = torch.randn(40, 48, generator=torch.Generator().manual_seed(4)).to(device)
    with compileops.use_backend(backend):
        y = compileops.grouped_linear(x, w, offs, row_scale=p, fp8=scaling)
        got = torch.autograd.grad(y, (x, w, p), dy)
        written = compileops.grouped_linear(x, w, offs, fp8=scaling) * p[:, None]
        want = torch.autograd.grad(written, (x, w, p), dy)
        dx_fp8 = grouped_linear_fp8_dx_op(dy, w.detach(), offs, scaling)
    assert torch.equal(y, written)
    assert _rel(got[0], want[0]) <= 1e-6 and _rel(got[1], want[1]) <= 1e-6
    ds = (dx_fp8.double() * x.detach().double()).sum(-1)
    assert _rel(got[2], ds) <= 1e-6
    assert 1e-3 < _rel(got[2], want[2]) <= 1e-1


def _unit_normal(seed, k=128, n=96):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, k, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(len(SPLITS), n, k, generator=gen).bfloat16().requires_grad_()
    offs = torch.cumsum(torch.tensor(SPLITS), 0).to(torch.int32)
    return x, w, offs, gen


@pytest.mark.parametrize("scaling", RECIPES)
def test_each_gemm_is_within_the_contract_against_exact_arithmetic(scaling):
    """bf16, unit-normal data: the forward and the dX product within 4e-2 relative L2 of
    fp64 (torchao's rowwise fp8 grouped GEMM measures 3.8e-2 against bf16); dW, in bf16,
    within bf16's 1e-2."""
    x, w, offs, gen = _unit_normal(2)
    y = compileops.grouped_linear(x, w, offs, fp8=scaling)
    dy = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    reference.grouped_linear_forward(*leaves, offs).backward(dy.double())
    exact = reference.grouped_linear_forward(*leaves, offs)
    assert 1e-2 < _rel(y, exact) <= 4e-2
    assert 1e-2 < _rel(x.grad, leaves[0].grad) <= 4e-2
    assert _rel(w.grad, leaves[1].grad) <= 1e-2


def test_swiglu_errors_compound_as_stated():
    """The gate/up GEMM's output (the pre-activations) meets the 4e-2 of a GEMM; through
    ``silu(gate) * up`` and its derivative the errors of the two halves add: the output, dX
    and dW measured 4.9-7.7e-2 against fp64 (bf16, unit-normal, three seeds)."""
    x, w, offs, gen = _unit_normal(0)
    y, pre = grouped_linear_swiglu_fp8_with_preact_op(x, w, offs, "rowwise")
    dy = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    exact_pre = reference.grouped_linear_forward(*leaves, offs)
    exact = reference.swiglu(exact_pre)
    exact.backward(dy.double())
    assert _rel(pre, exact_pre) <= 4e-2
    for got, want in ((y, exact), (x.grad, leaves[0].grad), (w.grad, leaves[1].grad)):
        assert _rel(got, want) <= 1e-1


@pytest.mark.parametrize("scaling", RECIPES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_matches_eager(dynamic, scaling, device):
    """The forward bitwise (the same op and kernels); the gradients to fp32 rounding: compiled,
    Inductor fuses the SwiGLU derivative (the input of dX and dW) into its own kernel."""
    x, w, offs = _inputs(device=device)

    p = torch.rand(40, generator=torch.Generator().manual_seed(5)).to(device)

    def layer(x, w, offs):
        h = compileops.grouped_linear_swiglu(x, w, offs, fp8=scaling).relu() * 2
        return compileops.grouped_linear(h, w[:, :, :24], offs, row_scale=p, fp8=scaling)

    eager = layer(x, w, offs)
    eager.sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)(x, w, offs)
    compiled.sum().backward()
    assert torch.equal(compiled, eager)
    assert _rel(x.grad, grads[0]) <= 1e-5 and _rel(w.grad, grads[1]) <= 1e-5


@pytest.mark.parametrize("scaling", RECIPES)
def test_opcheck(scaling):
    """Small operands (opcheck runs each op many times under the interpreter); K of 144
    keeps a ragged 128-wide block."""
    x, w, offs = _inputs(n=16, k=144)
    torch.library.opcheck(grouped_linear_fp8_op, (x, w, offs, scaling))
    torch.library.opcheck(grouped_linear_swiglu_fp8_with_preact_op, (x, w, offs, scaling))
    grad = torch.randn(40, 16)
    torch.library.opcheck(grouped_linear_fp8_dx_op, (grad, w.detach(), offs, scaling))
    if scaling == "rowwise":
        weight_q_t, weight_scale = fp8_weight_rowwise_op(w.detach(), True)
        # Not test_schema with an e4m3 argument: its aliasing check multiplies every tensor
        # argument, which torch has no e4m3 kernel for.
        no_schema = ("test_faketensor", "test_autograd_registration",
                     "test_aot_dispatch_dynamic")
        torch.library.opcheck(grouped_linear_fp8_dx_from_copy_op,
                              (grad, weight_q_t, weight_scale, offs, False),
                              test_utils=no_schema)
        # With the weight's copy passed in, as grouped_linear does.
        torch.library.opcheck(grouped_linear_fp8_op,
                              (x, w, offs, scaling, False, False, None,
                               *fp8_weight_rowwise_op(w.detach(), False)),
                              test_utils=no_schema)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_the_compiled_products_weight_lookup(transposed, backend):
    """``fp8_weight_rowwise`` (the compiled products' weight): opcheck, and the quantisers'
    bits in the layout each product reads (dX's written ``[G, K, N]``)."""
    from compileops.grouped_linear.kernels import fp8 as fp8_kernels

    _, w, _ = _inputs(grad=False)
    with compileops.use_backend(backend):
        torch.library.opcheck(fp8_weight_rowwise_op, (w, transposed))
        q, scale = fp8_weight_rowwise_op(w, transposed)
    want_q, want_scale = fp8_kernels.quantize_weight_rowwise(w, transpose=transposed)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert q.shape == ((4, 200, 48) if transposed else (4, 48, 200))
    assert scale.shape == (4, 48)  # per output channel in both layouts
    if transposed:  # the forward's copy, transposed
        forward_q, forward_scale = fp8_weight_rowwise_op(w, False)
        assert torch.equal(q.view(torch.uint8), forward_q.transpose(1, 2).view(torch.uint8))
        assert torch.equal(scale, forward_scale)


@pytest.mark.parametrize("scaling", RECIPES)
def test_opcheck_row_scaled(scaling):
    """Small operands (opcheck runs the op many times under the interpreter); K and N of 144
    keep a ragged 128-wide block."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(12, 144, generator=gen).requires_grad_()
    w = (torch.randn(3, 16, 144, generator=gen) / 12).requires_grad_()
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    p = torch.rand(12, generator=gen).requires_grad_()
    torch.library.opcheck(grouped_linear_row_scaled_fp8_op, (x, w, offs, p, scaling))


def test_module():
    layer = compileops.nn.GroupedLinear(len(SPLITS), 200, 48, bias=False, fp8="rowwise")
    assert "fp8='rowwise'" in repr(layer)
    x, _, offs = _inputs()
    y = layer(x, torch.tensor(SPLITS))
    assert torch.equal(y, compileops.grouped_linear(x, layer.weight, offs, fp8="rowwise"))
    assert torch.equal(layer(x, offs, offsets=True), y)
    with pytest.raises(ValueError, match="takes no bias"):
        compileops.nn.GroupedLinear(2, 8, 8, bias=True, fp8="rowwise")


def test_inputs_are_not_modified():
    x, w, offs = _inputs(grad=False)
    before = [t.clone() for t in (x, w, offs)]
    compileops.grouped_linear(x, w, offs, fp8="rowwise")
    compileops.grouped_linear_swiglu(x, w, offs, fp8="rowwise")
    assert all(torch.equal(a, b) for a, b in zip((x, w, offs), before))


def test_bad_recipes_and_unsupported_options_are_clear_errors():
    x, w, offs = _inputs(grad=False)
    with pytest.raises(ValueError, match=r"fp8 must be None or one of \('rowwise', 'blockwise'\)"):
        compileops.grouped_linear(x, w, offs, fp8="tensorwise")
    with pytest.raises(ValueError, match="takes no bias"):
        compileops.grouped_linear(x, w, offs, torch.zeros(len(SPLITS), 48), fp8="rowwise")
    with pytest.raises(ValueError, match=r"row_scale must be \[M\] = \[40\]"):
        compileops.grouped_linear(x, w, offs, row_scale=torch.ones(39), fp8="rowwise")
    with pytest.raises(ValueError, match="does not support recompute"):
        compileops.grouped_linear_swiglu(x, w, offs, recompute=True, fp8="rowwise")
    with pytest.raises(TypeError, match="fp8 grouped linear takes bf16, fp16 or fp32"):
        compileops.grouped_linear(x.double(), w.double(), offs, fp8="rowwise")
    with pytest.raises(ValueError, match="even N"):
        compileops.grouped_linear_swiglu(x, w[:, :47], offs, fp8="rowwise")


def test_non_finite_inputs_stay_non_finite():
    x, w, offs = _inputs(grad=False)
    x[3, 5] = float("nan")
    y = compileops.grouped_linear(x, w, offs, fp8="rowwise")
    assert not torch.isfinite(y[3]).any()  # the row holding the NaN
    assert torch.isfinite(y[[0, 1, 2, 4]]).all()  # the other rows of its group


@pytest.mark.parametrize("scaling", RECIPES)
def test_kernel_launches_per_layer_step(scaling, monkeypatch):
    """The Triton launches of one fp8 SwiGLU product, forward and backward, pinned: each
    operand quantised once per product that reads it, by one kernel, and nothing else
    launched (the weights are quantised on every call: no cache yet). Counted under the
    interpreter, whose launches pass through ``InterpretedFunction.run``."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts the interpreter's launches")
    from tests.grouped_linear._helpers import record_triton_launches

    launched = record_triton_launches(monkeypatch)
    x, w, offs = _inputs(n=48)
    with compileops.use_backend("triton"):
        y = compileops.grouped_linear_swiglu(x, w, offs, fp8=scaling)
        forward = list(launched)
        launched.clear()
        y.backward(torch.ones_like(y))
    quantise = {"rowwise": "rowwise_quantize_kernel", "blockwise": "blockwise_quantize_kernel"}
    q = quantise[scaling]
    assert forward == [q, q, "mjagged_gemm_kernel"], forward
    # dX: rowwise, the forward's weight copy (saved) and dY times its scales (after the
    # SwiGLU derivative), quantised; blockwise, the weight's square blocks again, then dY;
    # then the GEMM; dW in the inputs' dtype.
    dx_quantisers = [q] if scaling == "rowwise" else [q, q]
    assert launched == [*dx_quantisers, "mjagged_gemm_kernel", "kjagged_gemm_kernel"], launched


# ---------------------------------------------------------------------------------------
# fp8_fast_accum: the MMA accumulates over the whole K loop (rowwise only)


def _fast_accum_layer(x, w, offs, p, fast):
    h = compileops.grouped_linear_swiglu(x, w, offs, fp8="rowwise", fp8_fast_accum=fast)
    return compileops.grouped_linear(h, w[:, :, :24], offs, row_scale=p, fp8="rowwise",
                                     fp8_fast_accum=fast)


def test_fast_accum_reaches_every_fp8_product(monkeypatch):
    """Every fp8 product of a SwiGLU layer (gate/up and down, forward and dX) launches with
    the accumulation asked for, and the default launches without it. The interpreter sums
    exactly either way, so the results are the default's bit for bit; on a GPU they differ
    (the gpu test below)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("reads the interpreter's launches")
    from triton.runtime.interpreter import InterpretedFunction

    seen = []
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        if self.fn.__name__ == "mjagged_gemm_kernel":
            seen.append(kwargs["FP8_FAST_ACCUM"])
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    x, w, offs = _inputs()
    p = torch.rand(40, generator=torch.Generator().manual_seed(5))
    results = {}
    for fast in (True, False):
        seen.clear()
        x.grad = w.grad = None
        with compileops.use_backend("triton"):
            y = _fast_accum_layer(x, w, offs, p, fast)
            y.sum().backward()
        assert seen == [fast] * 4, (fast, seen)  # two forward products, two dX products
        results[fast] = (y, x.grad.clone(), w.grad.clone())
    for fast_result, default_result in zip(results[True], results[False]):
        assert torch.equal(fast_result, default_result)


def test_fast_accum_compiles_and_passes_opcheck():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(12, 144, generator=gen).requires_grad_()
    w = (torch.randn(3, 16, 144, generator=gen) / 12).requires_grad_()
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    p = torch.rand(12, generator=gen).requires_grad_()
    torch.library.opcheck(grouped_linear_row_scaled_fp8_op,
                          (x, w, offs, p, "rowwise", False, True))
    torch.library.opcheck(grouped_linear_swiglu_fp8_with_preact_op,
                          (x, w, offs, "rowwise", False, True))

    def layer(x, w):
        return compileops.grouped_linear(x, w, offs, row_scale=p, fp8="rowwise",
                                         fp8_fast_accum=True)

    eager = layer(x, w)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)(x, w)
    assert torch.equal(compiled, eager)


def test_fast_accum_needs_rowwise():
    x, w, offs = _inputs(grad=False)
    with pytest.raises(ValueError, match="fp8_fast_accum=True .* needs fp8='rowwise'"):
        compileops.grouped_linear(x, w, offs, fp8_fast_accum=True)
    with pytest.raises(ValueError, match="fp8_fast_accum=True applies to fp8='rowwise'"):
        compileops.grouped_linear_swiglu(x, w, offs, fp8="blockwise", fp8_fast_accum=True)
    with pytest.raises(ValueError, match="fp8_fast_accum=True applies to fp8='rowwise'"):
        compileops.nn.GroupedLinear(2, 8, 8, bias=False, fp8="blockwise", fp8_fast_accum=True)
    with pytest.raises(ValueError, match="fast_accum applies to rowwise scaling"):
        grouped_linear_fp8_op(x, w, offs, "blockwise", False, True)
    layer = compileops.nn.GroupedLinear(len(SPLITS), 200, 48, bias=False, fp8="rowwise",
                                        fp8_fast_accum=True)
    assert "fp8_fast_accum=True" in repr(layer)
    y = layer(x, torch.tensor(SPLITS))
    assert torch.equal(y, compileops.grouped_linear(x, layer.weight, offs, fp8="rowwise",
                                                    fp8_fast_accum=True))


@pytest.mark.gpu
def test_fast_accum_on_the_gpu_is_deterministic_and_close_to_exact_sums():
    """On Hopper the two accumulations give different bits (the flag reaches the MMA), each
    deterministic, and fast accumulation stays close to the exact fp32 sums of the same e4m3
    operands: measured at this shape (K = 4096, unit-normal) about 2e-3 relative L2, against
    about 1.7e-3 for the default (the bf16 output's own rounding)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1024, 4096, generator=gen).bfloat16().cuda()
    w = (torch.randn(4, 512, 4096, generator=gen) / 64).bfloat16().cuda()
    offs = torch.tensor([256, 512, 768, 1024], dtype=torch.int32, device="cuda")
    exact = fp8.grouped_linear_reference(x.float(), w.float(), offs, "rowwise")
    runs = {fast: [compileops.grouped_linear(x, w, offs, fp8="rowwise", fp8_fast_accum=fast)
                   for _ in range(2)] for fast in (False, True)}
    for fast, (first, second) in runs.items():
        assert torch.equal(first, second), f"fast={fast}: not deterministic"
    assert not torch.equal(runs[False][0], runs[True][0])
    assert _rel(runs[False][0], exact) <= 2.5e-3
    assert _rel(runs[True][0], exact) <= 5e-3


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_no_groups_give_zero_output_and_gradient(backend):
    """G = 0 (every row belongs to no group): y and dX are zeros, dW empty, rowwise dX's
    per-group weight scales included."""
    x = torch.randn(5, 16, requires_grad=True)
    w = torch.randn(0, 8, 16, requires_grad=True)
    offsets = torch.zeros(0, dtype=torch.int32)
    with compileops.use_backend(backend):
        y = compileops.grouped_linear(x, w, offsets, fp8="rowwise")
        y.backward(torch.ones_like(y))
    assert y.shape == (5, 8) and not y.any()
    assert x.grad.shape == (5, 16) and not x.grad.any() and w.grad.shape == (0, 8, 16)
