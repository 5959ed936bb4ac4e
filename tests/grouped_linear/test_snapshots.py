"""Graph and kernel snapshots of grouped_linear under torch.compile, on every supported torch
(tests/snapshot.py; regenerate with EXPECTTEST_ACCEPT=1): the AOT forward and backward graphs, and the Inductor
kernels with what fused into them."""
import torch

import compileops
from compileops.grouped_linear.routing import permute_by_expert
from compileops.testing import aot_graph_text, inductor_kernels
from tests.grouped_linear._helpers import make_expert_inputs as make
from tests.grouped_linear._helpers import moe_expert
from tests.snapshot import SnapshotTestCase



class Snapshots(SnapshotTestCase):
    def test_aot_graphs(self):
        x, w, offs, b, _ = make([3, 4])
        w.requires_grad_(), b.requires_grad_(), x.requires_grad_()
        fw, bw = aot_graph_text(compileops.grouped_linear, x, w, offs, b)
        self.assertSnapshot(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[9, 16]", primals_2: "f32[2, 24, 16]", primals_3: "i32[2]", primals_4: "f32[2, 24]"):
        grouped_linear: "f32[9, 24]" = torch.ops.compileops.grouped_linear.default(primals_1, primals_2, primals_3, primals_4);  primals_4 = None
        return (grouped_linear, primals_1, primals_2, primals_3)""")
        self.assertSnapshot(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[9, 16]", primals_2: "f32[2, 24, 16]", primals_3: "i32[2]", tangents_1: "f32[9, 24]"):
        grouped_linear_dx: "f32[9, 16]" = torch.ops.compileops.grouped_linear_dx.default(tangents_1, primals_2, primals_3);  primals_2 = None
        grouped_linear_wgrad = torch.ops.compileops.grouped_linear_wgrad.default(tangents_1, primals_1, primals_3, torch.float32, torch.float32);  tangents_1 = primals_1 = primals_3 = None
        getitem: "f32[2, 24, 16]" = grouped_linear_wgrad[0]
        getitem_1: "f32[2, 24]" = grouped_linear_wgrad[1];  grouped_linear_wgrad = None
        return (grouped_linear_dx, getitem, None, getitem_1)""")

    def test_aot_backward_without_bias_skips_db(self):
        # No bias: the wgrad op is called with with_db=False (no column sums) and its empty
        # db output is dropped.
        x, w, offs, _, _ = make([3, 4])
        w.requires_grad_(), x.requires_grad_()
        _, bw = aot_graph_text(compileops.grouped_linear, x, w, offs)
        self.assertSnapshot(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[9, 16]", primals_2: "f32[2, 24, 16]", primals_3: "i32[2]", tangents_1: "f32[9, 24]"):
        grouped_linear_dx: "f32[9, 16]" = torch.ops.compileops.grouped_linear_dx.default(tangents_1, primals_2, primals_3);  primals_2 = None
        grouped_linear_wgrad = torch.ops.compileops.grouped_linear_wgrad.default(tangents_1, primals_1, primals_3, torch.float32, torch.float32, False);  tangents_1 = primals_1 = primals_3 = None
        getitem: "f32[2, 24, 16]" = grouped_linear_wgrad[0];  grouped_linear_wgrad = None
        return (grouped_linear_dx, getitem, None)""")

    def test_swiglu_template_kernels(self):
        x, w, offs, b, p = make([5, 0, 11, 3])
        kernels = inductor_kernels(moe_expert, x, w, offs, b, p, triton=True)
        self.assertSnapshot(kernels, """triton_tem_fused_grouped_linear_swiglu_mul_unsqueeze""")

    def test_swiglu_template_kernels_fw_bw(self):
        # Forward: the SwiGLU template, storing its pre-activations, with the router scaling
        # epilogue. Backward: no GEMM but dX and dW: one pointwise kernel for the SwiGLU
        # derivative (the cat fused in), the dX template, our dW/db op as an extern call.
        x, w, offs, b, p = make([5, 0, 11, 3])
        for t in (x, w, b):
            t.requires_grad_()
        kernels = inductor_kernels(moe_expert, x, w, offs, b, p, triton=True, backward=True)
        self.assertSnapshot(kernels, """\
triton_tem_fused_grouped_linear_swiglu_with_preact_mul_unsqueeze
# backward
triton_poi_fused_add_expand_mul_rsub_select_sigmoid_unsqueeze
triton_tem_fused_grouped_linear_dx
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_swiglu_recompute_template_kernels_fw_bw(self):
        # recompute=True: the plain SwiGLU template forward; the backward recomputes the
        # pre-activation with the plain template, then the derivative, dX and dW/db.
        x, w, offs, b, p = make([5, 0, 11, 3])
        for t in (x, w, b):
            t.requires_grad_()

        def expert(x, w, offs, b, p):
            return compileops.grouped_linear_swiglu(x, w, offs, b, recompute=True) * p[:, None]

        kernels = inductor_kernels(expert, x, w, offs, b, p, triton=True, backward=True)
        self.assertSnapshot(kernels, """\
triton_tem_fused_grouped_linear_swiglu_mul_unsqueeze
# backward
triton_tem_fused_grouped_linear
triton_poi_fused_add_expand_mul_rsub_select_sigmoid_split_unsqueeze
triton_tem_fused_grouped_linear_dx
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_cpu_cpp_backend_is_extern_call(self):
        x, w, offs, b, p = make([5, 0, 11, 3])
        kernels = inductor_kernels(moe_expert, x, w, offs, b, p)
        self.assertSnapshot(kernels, """\
cpp_fused_mul_unsqueeze
torch.ops.compileops.grouped_linear_swiglu.default""")

    def test_fp8_expert_kernels_fw_bw(self):
        # fp8="rowwise": the products are templates (each kernel named once). Forward: the
        # gate/up weight's and x's quantisation (a fused reduction and cast each), then the
        # SwiGLU template with the router scaling as its epilogue. Backward: the SwiGLU
        # derivative (with the probability's gradient), dY's quantisation and the weight's
        # for dX (per input channel, written transposed), the dX template, and dW in bf16
        # (extern) from the unquantised x.
        x, w, offs, _, p = make([5, 0, 11, 3])
        x, w, p = (t.to(torch.bfloat16).requires_grad_() for t in (x, w, p))

        def expert(x, w, offs, p):
            return compileops.grouped_linear_swiglu(x, w, offs, fp8="rowwise") * p[:, None]

        kernels = inductor_kernels(expert, x, w, offs, p, triton=True, backward=True)
        self.assertSnapshot(kernels, """\
triton_per_fused_fp8_weight_rowwise
triton_per_fused_grouped_linear_swiglu_fp8_with_preact
triton_tem_fused_grouped_linear_swiglu_fp8_with_preact_mul_unsqueeze
triton_poi_fused_clone_transpose
# backward
triton_per_fused__to_copy_add_expand_mul_rsub_select_sigmoid_split_sum_unsqueeze
triton_per_fused_grouped_linear_fp8_dx_from_copy
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_fp8_permuted_wide_rows_are_quantised_before_the_gather(self):
        # Training at a width above Inductor's persistent-reduction limit (1024): the
        # permuted tokens are saved for dW, so Inductor writes them (the index_select kernel)
        # before the fp8 lowering runs, and a quantisation that reads each 1280-wide row in
        # two parts cannot fuse with a producer that writes whole rows. So x's 4 token rows
        # are quantised (the first kernel) and their codes and scales gathered with the
        # copies: the index_select kernel writes the kept rows and the codes, and the
        # scales' gather fuses into the routing's checks. (At widths up to 1024 the copy and
        # the quantisation of the gathered rows are one kernel.) benchmarks/RESULTS.md times
        # it.
        gen = torch.Generator().manual_seed(0)
        ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 1]])

        def permuted_experts(x, w, ids):
            xs, _, offs = permute_by_expert(x, ids, 2)
            return compileops.grouped_linear_swiglu(xs, w, offs, fp8="rowwise")

        def step_kernels(width):
            x = torch.randn(4, width, generator=gen).bfloat16().requires_grad_()
            w = (torch.randn(2, 16, width, generator=gen) / width ** 0.5).bfloat16()
            return inductor_kernels(permuted_experts, x, w.requires_grad_(), ids, triton=True,
                                    launches=True)

        narrow = step_kernels(64).splitlines()
        assert any("index_select" in k and "swiglu_fp8_with_preact" in k
                   for k in narrow if k.startswith("triton_per_")), narrow
        kernels = step_kernels(1280)
        self.assertSnapshot(kernels, """\
triton_per_fused_grouped_linear_swiglu_fp8_with_preact
triton_per_fused_fp8_weight_rowwise
triton_per_fused__assert_async_all_bitwise_and_ge_grouped_linear_swiglu_fp8_with_preact_lt_scalar_tensor_sort_view_where
triton_poi_fused__to_copy_arange_searchsorted
triton_poi_fused_floor_divide_grouped_linear_swiglu_fp8_with_preact_index_select_sort_view
triton_tem_fused_grouped_linear_swiglu_fp8_with_preact
triton_poi_fused_clone_transpose""")

    def test_fp8_moe_step_launches(self):
        # The MoE experts as the benchmark layer runs them in fp8 (cached weights, fast
        # accumulation, the router probability in the down projection's epilogue), forward
        # and backward: every launch of one compiled step. The cached weights are the only
        # extern calls before each product (a dictionary lookup each); no product runs
        # Python.
        x, w, offs, _, p = make([5, 0, 11, 3], k=32, n=32)
        x, w, p = (t.to(torch.bfloat16).requires_grad_() for t in (x, w, p))
        down = (w[:, :, :16].detach().clone() * 0.5).requires_grad_()

        def experts(x, w, down, offs, p):
            h = compileops.grouped_linear_swiglu(x, w, offs, fp8="rowwise",
                                                 cache_fp8_weights=True, fp8_fast_accum=True)
            return compileops.grouped_linear(h, down, offs, row_scale=p, fp8="rowwise",
                                             cache_fp8_weights=True, fp8_fast_accum=True)

        kernels = inductor_kernels(experts, x, w, down, offs, p, triton=True, backward=True,
                                   launches=True)
        self.assertSnapshot(kernels, """\
torch.ops.compileops.fp8_weight_cached.default
triton_per_fused_grouped_linear_swiglu_fp8_with_preact
triton_tem_fused_grouped_linear_swiglu_fp8_with_preact
torch.ops.compileops.fp8_weight_cached.default
triton_per_fused_grouped_linear_row_scaled_fp8
triton_tem_fused_grouped_linear_row_scaled_fp8
torch.ops.compileops.fp8_weight_cached.default
torch.ops.compileops.fp8_weight_cached.default
# backward
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_per_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy
triton_per_fused__to_copy_add_expand_grouped_linear_wgrad_mul_rsub_select_sigmoid_split_sum_unsqueeze
torch.ops.compileops.grouped_linear_wgrad.default
torch.ops.compileops.grouped_linear_wgrad.default
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_per_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy""")
