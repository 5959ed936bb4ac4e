"""grouped_linear under torch.compile: no graph breaks or recompiles, the Triton template (run
under the interpreter on CPU) with its fused epilogues, and graph/kernel snapshots pinned on
torch 2.13 (regenerate with EXPECTTEST_ACCEPT=1)."""
import expecttest
import pytest
import torch

from compileops.grouped_linear.kernels import Config
import torch.nn.functional as F

import compileops
from compileops.grouped_linear import reference
from compileops.testing import aot_graph_text, assert_close_to_reference, inductor_kernels
from lowerings import _compat

needs_213 = pytest.mark.skipif(not torch.__version__.startswith("2.13"),
                               reason="snapshots are pinned on torch 2.13")


def make(sizes, k=16, n=24, extra_rows=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes) + extra_rows
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(len(sizes), n, k, generator=gen) / k**0.5
    b = torch.randn(len(sizes), n, generator=gen)
    p = torch.rand(m, generator=gen)
    return x, w, torch.cumsum(torch.tensor(sizes), 0).to(torch.int32), b, p


def moe_expert(x, w, offs, b, p):
    """Fused gate/up SwiGLU, then per-row router-probability scaling."""
    return compileops.grouped_linear_swiglu(x, w, offs, b) * p[:, None]


def ref_moe_expert(x, w, offs, b, p):
    h = reference.grouped_linear_forward(x.double(), w.double(), offs, b.double())
    return reference.swiglu(h) * p.double()[:, None]


def _compiled_fw_bw(fn, args, grad):
    """Compile ``fn`` (fullgraph), run forward and backward; returns (output, generated code)."""
    compiled = torch.compile(fn, fullgraph=True)

    def fw_bw():
        out = compiled(*args)
        out.backward(grad)
        return out

    return _compat.run_and_get_code(fw_bw)


def _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p):
    """Output and the grads of x, w, b (already backpropagated) against fp64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = ref_moe_expert(leaves[0], leaves[1], offs, leaves[2], p)
    ref.backward(grad.double())
    assert_close_to_reference(out, ref, max_relative_error=1e-5)
    for got, exp, what in zip((x.grad, w.grad, b.grad), leaves, ("dX", "dW", "db")):
        assert_close_to_reference(got, exp.grad, max_relative_error=1e-5, what=what)


def test_fullgraph_dynamic_no_recompiles_fw_bw():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    def f(x, w, offs, b):
        return F.gelu(compileops.grouped_linear(x, w, offs, b)).sum()

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for sizes in ([3, 0, 5], [7, 2, 9], [1, 1, 20]):
        x, w, offs, b, _ = make(sizes)
        w.requires_grad_()
        compiled(x, w, offs, b).backward()
        wr = w.detach().double().requires_grad_()
        F.gelu(reference.grouped_linear_forward(x.double(), wr, offs, b.double())).sum().backward()
        assert_close_to_reference(w.grad, wr.grad, max_relative_error=1e-5)
    assert counter.frame_count == 1


def test_template_runs_under_interpreter_with_fused_epilogue():
    x, w, offs, b, p = make([5, 0, 11, 3])
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(moe_expert, fullgraph=True)
        out, sources = _compat.run_and_get_code(compiled, x, w, offs, b, p)
    code = "\n".join(sources)
    assert "from compileops.grouped_linear.kernels import" in code
    assert "torch.ops.compileops.grouped_linear_swiglu.default(" not in code, "must be lowered"
    assert "def triton_tem_fused_grouped_linear_swiglu_mul" in code
    assert_close_to_reference(out, ref_moe_expert(x, w, offs, b, p), max_relative_error=1e-5)


def test_compiled_fw_bw_on_triton_templates_matches_fp64():
    x, w, offs, b, p = make([5, 0, 11, 3])
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 12)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        out, sources = _compiled_fw_bw(moe_expert, (x, w, offs, b, p), grad)
    assert "def triton_tem_fused_grouped_linear_dx" in "\n".join(sources)
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)


def test_template_strided_offsets_fw_bw():
    """Offsets sliced out of a larger tensor inside the compiled graph (stride 2): the template
    reads offsets[g] at OFFS + g, so the lowering must hand it a dense copy."""
    x, w, offs, b, p = make([5, 0, 11, 3])
    interleaved = torch.stack([offs, torch.full_like(offs, 10**6)], 1).reshape(-1)
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 12)

    def strided_expert(x, w, interleaved, b, p):
        return moe_expert(x, w, interleaved[::2], b, p)

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        out, sources = _compiled_fw_bw(strided_expert, (x, w, interleaved, b, p), grad)
    assert "def triton_tem_fused_grouped_linear_swiglu" in "\n".join(sources)
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)


def test_template_dynamic_token_counts_bf16():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    def f(x, w, offs, b):
        return compileops.grouped_linear(x, w, offs, b).float() * 2

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
        for sizes in ([3, 0, 5], [9, 4, 0]):
            x, w, offs, b, _ = make(sizes)
            x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
            out = compiled(x, w, offs, b)
            ref = reference.grouped_linear_forward(x.double(), w.double(), offs, b.double()) * 2
            assert_close_to_reference(out, ref, max_relative_error=1e-2)
    assert counter.frame_count == 1


def test_gelu_and_bias_epilogue_codegen():
    x, w, offs, b, _ = make([4, 4])

    def f(x, w, offs, b):
        return F.gelu(compileops.grouped_linear(x, w, offs, b)).to(torch.float16)

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        # GELU's erf goes through libdevice, which the interpreter lacks: compile only.
        sources = _compat.get_code(torch.compile(f, fullgraph=True), x, w, offs, b)
    code = "\n".join(sources)
    assert "def triton_tem_fused__to_copy_gelu_grouped_linear" in code
    assert "triton_poi" not in code, "GELU and the cast must fuse into the template"


class Snapshots(expecttest.TestCase):
    @needs_213
    def test_aot_graphs(self):
        x, w, offs, b, _ = make([3, 4])
        w.requires_grad_(), b.requires_grad_(), x.requires_grad_()
        fw, bw = aot_graph_text(compileops.grouped_linear, x, w, offs, b)
        self.assertExpectedInline(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[9, 16]", primals_2: "f32[2, 24, 16]", primals_3: "i32[2]", primals_4: "f32[2, 24]"):
        grouped_linear: "f32[9, 24]" = torch.ops.compileops.grouped_linear.default(primals_1, primals_2, primals_3, primals_4);  primals_4 = None
        return (grouped_linear, primals_1, primals_2, primals_3)""")
        self.assertExpectedInline(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[9, 16]", primals_2: "f32[2, 24, 16]", primals_3: "i32[2]", tangents_1: "f32[9, 24]"):
        grouped_linear_dx: "f32[9, 16]" = torch.ops.compileops.grouped_linear_dx.default(tangents_1, primals_2, primals_3);  primals_2 = None
        grouped_linear_wgrad = torch.ops.compileops.grouped_linear_wgrad.default(tangents_1, primals_1, primals_3, torch.float32, torch.float32);  tangents_1 = primals_1 = primals_3 = None
        getitem: "f32[2, 24, 16]" = grouped_linear_wgrad[0]
        getitem_1: "f32[2, 24]" = grouped_linear_wgrad[1];  grouped_linear_wgrad = None
        return (grouped_linear_dx, getitem, None, getitem_1)""")

    @needs_213
    def test_aot_backward_without_bias_skips_db(self):
        # No bias: the wgrad op is called with with_db=False (no column sums) and its empty
        # db output is dropped.
        x, w, offs, _, _ = make([3, 4])
        w.requires_grad_(), x.requires_grad_()
        _, bw = aot_graph_text(compileops.grouped_linear, x, w, offs)
        self.assertExpectedInline(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[9, 16]", primals_2: "f32[2, 24, 16]", primals_3: "i32[2]", tangents_1: "f32[9, 24]"):
        grouped_linear_dx: "f32[9, 16]" = torch.ops.compileops.grouped_linear_dx.default(tangents_1, primals_2, primals_3);  primals_2 = None
        grouped_linear_wgrad = torch.ops.compileops.grouped_linear_wgrad.default(tangents_1, primals_1, primals_3, torch.float32, torch.float32, False);  tangents_1 = primals_1 = primals_3 = None
        getitem: "f32[2, 24, 16]" = grouped_linear_wgrad[0];  grouped_linear_wgrad = None
        return (grouped_linear_dx, getitem, None)""")

    @needs_213
    def test_swiglu_template_kernels(self):
        x, w, offs, b, p = make([5, 0, 11, 3])
        kernels = inductor_kernels(moe_expert, x, w, offs, b, p, triton=True)
        self.assertExpectedInline(kernels, """triton_tem_fused_grouped_linear_swiglu_mul_unsqueeze""")

    @needs_213
    def test_swiglu_template_kernels_fw_bw(self):
        # Forward: the SwiGLU template with the router scaling epilogue. Backward: the
        # pre-activation recomputed by the plain template, one pointwise kernel for the
        # SwiGLU derivative (the cat fused in), then our dX and dW/db ops as extern calls.
        x, w, offs, b, p = make([5, 0, 11, 3])
        for t in (x, w, b):
            t.requires_grad_()
        kernels = inductor_kernels(moe_expert, x, w, offs, b, p, triton=True, backward=True)
        self.assertExpectedInline(kernels, """\
triton_tem_fused_grouped_linear_swiglu_mul_unsqueeze
# backward
triton_tem_fused_grouped_linear
triton_poi_fused_add_mul_rsub_sigmoid_split_unsqueeze
triton_tem_fused_grouped_linear_dx
torch.ops.compileops.grouped_linear_wgrad.default""")

    @needs_213
    def test_cpu_cpp_backend_is_extern_call(self):
        x, w, offs, b, p = make([5, 0, 11, 3])
        kernels = inductor_kernels(moe_expert, x, w, offs, b, p)
        self.assertExpectedInline(kernels, """\
cpp_fused_mul_unsqueeze
torch.ops.compileops.grouped_linear_swiglu.default""")


def test_autotune_offsets_are_skewed_and_valid():
    from lowerings.grouped_linear import AUTOTUNE_CONFIGS, skewed_offsets

    offs = skewed_offsets(16, 4096, "cpu")
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert offs.dtype == torch.int32 and int(offs[-1]) == 4096 and bool((sizes >= 0).all())
    assert int(sizes.max()) > 2 * 4096 // 16, "Dirichlet(1) sizes should be skewed"
    assert len(AUTOTUNE_CONFIGS) <= 8


def test_grouped_mm_anchor_choice_zeroes_the_tail():
    from lowerings.grouped_linear import grouped_mm_anchor, grouped_mm_dx_anchor

    x, w, offs, _, _ = make([3, 0, 6], extra_rows=4)
    x, w = x.bfloat16(), w.bfloat16()
    y = grouped_mm_anchor(x, w, offs)
    assert torch.equal(y[9:], torch.zeros_like(y[9:]))
    ref = reference.grouped_linear_forward(x.double(), w.double(), offs)
    assert_close_to_reference(y.float(), ref, max_relative_error=1e-2)
    dy = torch.randn(13, 24).bfloat16()
    dx = grouped_mm_dx_anchor(dy, w, offs)
    assert_close_to_reference(dx.float(), reference.grouped_linear_dx(dy.double(), w.double(), offs),
                              max_relative_error=1e-2)


def test_max_autotune_path_benchmarks_choices_on_skewed_offsets():
    """The max-autotune branch (GPU-only by default) forced on CPU with two tiny template
    configs (one through TMA descriptors) + the extern op: benchmarks run on generated skewed
    offsets, result is right."""
    from unittest import mock

    import lowerings.grouped_linear as lowering

    x, w, offs, b, _ = make([5, 0, 11, 14], extra_rows=10)
    calls = []
    real_gen = lowering.skewed_offsets

    def gen(*args, **kwargs):
        calls.append(args)
        return real_gen(*args, **kwargs)

    def two_configs(*args, **kwargs):
        return [(Config(16, 32, 16, 1, 1), False), (Config(16, 16, 16, 1, 1, flatten=True), True)], True

    def f(x, w, offs, b):
        return compileops.grouped_linear(x, w, offs, b) * 2

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.inductor_config_patch(max_autotune=True), \
            mock.patch.object(lowering, "_configs", two_configs), \
            mock.patch.object(lowering, "skewed_offsets", gen):
        out = torch.compile(f, fullgraph=True)(x, w, offs, b)
    assert calls, "autotuning must benchmark on generated (skewed) offsets"
    ref = 2 * reference.grouped_linear_forward(x.double(), w.double(), offs, b.double())
    assert_close_to_reference(out, ref, max_relative_error=1e-5)


def test_template_tma_variant_fw_bw_under_interpreter():
    """The template's TMA-descriptor variant (a max-autotune choice on sm90) forced as the only
    config: SwiGLU forward, recomputed forward and dX in the backward, all through it."""
    from unittest import mock

    import lowerings.grouped_linear as lowering

    x, w, offs, b, p = make([5, 0, 11, 3], k=24, n=40)
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 20)

    def tma_only(*args, **kwargs):
        return [(Config(16, 16, 16, 1, 1), True)], False

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            mock.patch.object(lowering, "_configs", tma_only):
        out, sources = _compiled_fw_bw(moe_expert, (x, w, offs, b, p), grad)
    code = "\n".join(sources)
    assert code.count("make_descriptors(") >= 3, "forward, recompute and dX templates use TMA"
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)
