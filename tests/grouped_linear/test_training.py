"""The grouped linear as a MoE layer trains it: the training-grade SwiGLU (pre-activations kept
for the backward, or recomputed on request), the whole layer compiled under dynamic shapes,
and the lowering keeping its aligned variant when sizes are symbolic."""
import re

import pytest
import torch

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from compileops.grouped_linear.kernels import choose_config
from compileops.testing import aot_graph_text, assert_close_to_reference, assert_deterministic
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import offsets_of, template_source


def _swiglu_inputs(sizes, k=32, hidden=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    x = torch.randn(m, k, generator=gen, dtype=torch.float32).to(dtype).requires_grad_()
    w = (torch.randn(len(sizes), 2 * hidden, k, generator=gen) / k**0.5).to(dtype).requires_grad_()
    return x, w, offsets_of(sizes)


def _fw_bw(x, w, offs, *, recompute):
    out = compileops.grouped_linear_swiglu(x, w, offs, recompute=recompute)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    return (out, *torch.autograd.grad(out, [x, w], grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kept_and_recomputed_preactivations_give_the_same_gradients(dtype):
    """Bitwise where both forwards use the same K blocking (the kept pre-activations come from
    the SwiGLU kernel's tiles, the recomputed ones from the plain forward's); otherwise the
    pre-activations differ by their rounding to x's dtype, and so do the gradients."""
    x, w, offs = _swiglu_inputs([5, 0, 17, 9], dtype=dtype)
    kept = _fw_bw(x, w, offs, recompute=False)
    recomputed = _fw_bw(x, w, offs, recompute=True)
    m, g, n, k = x.shape[0], w.shape[0], w.shape[1], x.shape[1]
    same_k_blocking = (choose_config(m, g, n // 2, k, dtype, x.device, swiglu=True).block_k
                       == choose_config(m, g, n, k, dtype, x.device).block_k)
    for a, b, what in zip(kept, recomputed, ("out", "dX", "dW")):
        if same_k_blocking:
            assert torch.equal(a, b), what
        else:  # one rounding of the pre-activation to dtype, propagated
            bound = 1e-5 if dtype == torch.float32 else 1e-2
            assert_close_to_reference(a, b.double(), max_relative_error=bound, what=what)


def test_saved_preactivations_match_fp64_autograd():
    x, w, offs = _swiglu_inputs([3, 11, 0, 6])
    out, dx, dw = _fw_bw(x, w, offs, recompute=False)
    xr, wr = (t.detach().double().requires_grad_() for t in (x, w))
    from compileops.grouped_linear import reference

    ref = reference.swiglu(reference.grouped_linear_forward(xr, wr, offs))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).double()
    ref.backward(grad)
    assert_close_to_reference(out, ref, max_relative_error=1e-5)
    assert_close_to_reference(dx, xr.grad, max_relative_error=1e-5, what="dX")
    assert_close_to_reference(dw, wr.grad, max_relative_error=1e-5, what="dW")


def test_the_kept_preactivations_are_the_grouped_linear_output():
    x, w, offs = _swiglu_inputs([4, 9, 2])
    with torch.no_grad():
        out, preact = torch.ops.compileops.grouped_linear_swiglu_with_preact(x, w, offs)
        assert torch.equal(out, compileops.grouped_linear_swiglu(x, w, offs))
        plain = compileops.grouped_linear(x, w, offs)
    assert_close_to_reference(preact, plain.double(), max_relative_error=1e-6)
    # Inference stores nothing: without a gradient the plain SwiGLU op runs.
    with torch.no_grad():
        forward, backward = aot_graph_text(lambda a: compileops.grouped_linear_swiglu(a, w, offs), x)
    assert "grouped_linear_swiglu.default" in forward
    assert "grouped_linear_swiglu_with_preact" not in forward and backward == ""


def test_backward_has_no_gemm_but_dx_and_dw_unless_recompute():
    """The default backward is the SwiGLU derivative, dX and dW: the forward GEMM appears in
    the backward graph only with recompute=True."""
    x, w, offs = _swiglu_inputs([6, 10])

    def backward_graph(recompute):
        def f(a, b):
            return compileops.grouped_linear_swiglu(a, b, offs, recompute=recompute).sum()

        return aot_graph_text(f, x, w)[1]

    kept, recomputed = backward_graph(False), backward_graph(True)
    assert "compileops.grouped_linear.default" not in kept
    assert "compileops.grouped_linear_dx" in kept and "compileops.grouped_linear_wgrad" in kept
    assert "compileops.grouped_linear.default" in recomputed


def test_preact_op_opcheck():
    x, w, offs = _swiglu_inputs([3, 5])
    b = torch.randn(2, w.shape[1], requires_grad=True)
    for args in ((x, w, offs), (x, w, offs, b)):
        torch.library.opcheck(torch.ops.compileops.grouped_linear_swiglu_with_preact.default, args)


class MoE(torch.nn.Module):
    """The examples/moe_layer.py layer: router, top-k, permute, SwiGLU experts, down * p."""

    def __init__(self, dim=16, hidden=12, experts=4, top_k=2, recompute=False):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.top_k, self.experts, self.recompute = top_k, experts, recompute
        self.router = torch.nn.Parameter(torch.randn(experts, dim, generator=gen) / dim**0.5)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * hidden, dim, generator=gen)
                                          / dim**0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, dim, hidden, generator=gen)
                                       / hidden**0.5)

    def forward(self, x):
        probs = torch.softmax(torch.nn.functional.linear(x, self.router), dim=-1)
        probs, ids = torch.topk(probs, self.top_k, dim=-1)
        xs, order, offsets = permute_by_expert(x, ids, self.experts)
        h = compileops.grouped_linear_swiglu(xs, self.gate_up, offsets, recompute=self.recompute)
        y = compileops.grouped_linear(h, self.down, offsets, row_scale=probs.reshape(-1)[order])
        return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)


def test_moe_layer_forward_and_backward_are_bitwise_deterministic():
    layer = MoE()
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    assert_deterministic(layer, [x.requires_grad_()], runs=3)


def test_compiled_moe_layer_dynamic_one_frame_no_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counters.clear()
    layer = MoE()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for tokens in (8, 13, 21, 40):
        x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(tokens),
                        requires_grad=True)
        out = compiled(x)
        out.square().sum().backward()
        expected = layer(x.detach())
        assert_close_to_reference(out, expected.double(), max_relative_error=1e-5)
    assert counter.frame_count == 1
    assert sum(counters["graph_break"].values()) == 0


def test_dynamic_compile_keeps_the_static_variant():
    """With every size symbolic (dynamic=True) the lowering must pick the config it picks
    statically, and tell Triton that the row strides are 16-divisible (guarded on K and N), so
    the kernel keeps vectorised loads (and TMA on sm90): a dynamic compile once ran 40x slower
    on an H100 because the symbolic row stride carried no divisibility."""
    m, g, n, k = 96, 4, 64, 128
    x = torch.randn(m, k)
    w = torch.randn(g, n, k) / k**0.5
    offs = offsets_of([20, 30, 16, 30])

    def f(a, b, o):
        return compileops.grouped_linear(a, b, o) * 2

    static = template_source(f, x, w, offs, dynamic=False)
    dynamic = template_source(f, x, w, offs, dynamic=True)

    def constants(src, names=("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_PROGS", "USE_TMA")):
        return {name: re.search(rf"{name} : tl.constexpr = (\w+)", src).group(1)
                for name in names}

    assert constants(dynamic) == constants(static)
    assert "G = 4\n" in dynamic, "the group count stays static (a model constant)"
    # (STRIDE // 16) * 16: the same value under the guard, with the factor Triton's alignment
    # analysis needs (tl.multiple_of on a scalar argument does not reach it).
    assert "STRIDE_XM = (STRIDE_XM // 16) * 16" in dynamic, (
        "the row strides lost their alignment under dynamic=True")
    assert "// 16) * 16" not in static  # static strides are constants Triton already sees
    # and the output's row stride (N, a kernel size argument) for store_output's stores
    assert re.search(r"\n    (ks\d+) = \(\1 // 16\) \* 16", dynamic), (
        "the output's row stride lost its alignment under dynamic=True")


def test_misaligned_dynamic_sizes_do_not_claim_alignment():
    """K = 30 (not a multiple of 16 elements): the aligned form must not be claimed, and the
    result stays correct."""
    x = torch.randn(40, 30)
    w = torch.randn(3, 24, 30) / 30**0.5
    offs = offsets_of([10, 20, 10])

    def f(a, b, o):
        return compileops.grouped_linear(a, b, o) * 2

    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        out, sources = _compat.run_and_get_code(torch.compile(f, fullgraph=True, dynamic=True),
                                                x, w, offs)
    assert "// 16) * 16" not in "\n".join(sources)
    from compileops.grouped_linear import reference

    assert_close_to_reference(out, 2 * reference.grouped_linear_forward(x.double(), w.double(),
                                                                         offs), max_relative_error=1e-5)
