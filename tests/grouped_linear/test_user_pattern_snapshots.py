"""What the MoE code users write compiles to: the Inductor kernels of each pattern around a
grouped linear (tests/snapshot.py; regenerate with EXPECTTEST_ACCEPT=1).

The patterns are those of Hugging Face's and torchtitan's expert code: the router probability
multiplied into the down projection's output (``* p[:, None]``, ``* p.unsqueeze(-1)``, the
probability in fp32 and the product cast back), a cast of the output, a bias or a residual
added, and the gate and up products as two weights (``silu(x @ w1) * (x @ w3)``), each with
the kernels of the compiled forward and backward, static and ``dynamic=True``. The explicit
``row_scale=`` form is pinned beside them; the probability written as a product in the
product's dtype compiles to it, and the two gate/up products to the pair kernel
(``lowerings/user_patterns.py``). Each line is one launch of the step (a kernel
launched twice is listed twice), so a change in what fuses into the templates, or in how many
kernels a step runs, shows here as a changed line.
"""
import torch
import torch.nn.functional as F

import compileops
from compileops.testing import inductor_kernels
from tests.snapshot import SnapshotTestCase

SIZES = [5, 0, 11, 3]
D, H = 16, 24


def _inputs(dtype=torch.float32):
    """``(x [M, D], h [M, H], w1 [G, H, D], w3 [G, H, D], w2 [G, D, H], offsets [G], p [M],
    residual [M, D])``, M = sum(SIZES) + 2 rows past the last group."""
    gen = torch.Generator().manual_seed(0)
    m = sum(SIZES) + 2
    x = torch.randn(m, D, generator=gen)
    h = torch.randn(m, H, generator=gen)
    w1, w3 = (torch.randn(len(SIZES), H, D, generator=gen) / D ** 0.5 for _ in range(2))
    w2 = torch.randn(len(SIZES), D, H, generator=gen) / H ** 0.5
    p = torch.rand(m, generator=gen)
    residual = torch.randn(m, D, generator=gen)
    offsets = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    x, h, w1, w3, w2, residual = (t.to(dtype) for t in (x, h, w1, w3, w2, residual))
    return x, h, w1, w3, w2, offsets, p, residual


def _kernels(fn, *args, dynamic=False):
    """The launches of a forward and a backward step, in order, every floating input
    requiring a gradient."""
    args = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    return inductor_kernels(fn, *args, triton=True, backward=True, dynamic=dynamic,
                            launches=True)


def down_times_p(h, w2, offsets, p):
    return compileops.grouped_linear(h, w2, offsets) * p[:, None]


def down_times_p_unsqueezed(h, w2, offsets, p):
    return compileops.grouped_linear(h, w2, offsets) * p.unsqueeze(-1)


def down_times_fp32_p_cast_back(h, w2, offsets, p):
    y = compileops.grouped_linear(h, w2, offsets)
    return (y.float() * p[:, None]).to(h.dtype)


def down_row_scale(h, w2, offsets, p):
    return compileops.grouped_linear(h, w2, offsets, row_scale=p)


def down_cast(h, w2, offsets, residual):
    return compileops.grouped_linear(h, w2, offsets).type_as(residual)


def down_plus_residual(h, w2, offsets, residual):
    return residual + compileops.grouped_linear(h, w2, offsets)


def _fp8_layer_kernels(**options):
    """The launches of the rowwise fp8 expert layer as users write it (gate/up SwiGLU, the
    down projection times ``p``), bf16, with more fp8 ``options``."""
    x, _, w1, w3, w2, offsets, p, _ = _inputs(torch.bfloat16)

    def layer(x, w13, w2, offsets, p):
        h = compileops.grouped_linear_swiglu(x, w13, offsets, fp8="rowwise", **options)
        return compileops.grouped_linear(h, w2, offsets, fp8="rowwise", **options) * p[:, None]

    return _kernels(layer, x, torch.cat([w1, w3], dim=1), w2, offsets, p)


def gate_up_apart(x, w1, w3, offsets):
    return F.silu(compileops.grouped_linear(x, w1, offsets)) * \
        compileops.grouped_linear(x, w3, offsets)


class UserPatternSnapshots(SnapshotTestCase):
    @classmethod
    def setUpClass(cls):
        # The first grouped-linear compile in a process names its dX kernel
        # triton_tem_fused_grouped_linear_dx_mul_unsqueeze, every later one
        # triton_tem_fused_grouped_linear_dx, on torch 2.11, 2.13 and 2.15 alike. The code is
        # the same: neither fuses the probability's multiply into the template (Inductor's
        # fusion log: "template has no allowed prologue inputs"; the multiply runs in the
        # reduction kernel before it). The first compile's backward graph lists its outputs
        # in another order (sum, mul against mul, sum), and with that order the multiply's
        # FX nodes are counted among the template's origins, which Inductor names kernels
        # after. One compile first, so that the names pinned here are the later compiles'
        # whatever ran before in this process. The fp8 layer with fp8 dW names its backward
        # kernels the same way (a compile of it anywhere before, e.g. in
        # test_fp8_weight_grad.py, gave the later names), so it is compiled once first too.
        super().setUpClass()
        _, h, _, _, w2, offsets, p, _ = _inputs()
        _kernels(down_times_p, h, w2, offsets, p)
        _fp8_layer_kernels(fp8_weight_grad=True)


    def test_down_projection_times_probability(self):
        _, h, _, _, w2, offsets, p, _ = _inputs()
        # Rewritten before autograd to the row-scaled op (lowerings/user_patterns.py): the
        # same launches as row_scale= below.
        self.assertSnapshot(_kernels(down_times_p, h, w2, offsets, p), """\
triton_tem_fused_grouped_linear_row_scaled
# backward
triton_tem_fused_grouped_linear_dx
triton_per_fused_mul_sum_unsqueeze
triton_poi_fused_grouped_linear_wgrad_mul_unsqueeze
torch.ops.compileops.grouped_linear_wgrad.default""")
        self.assertSnapshot(_kernels(down_times_p_unsqueezed, h, w2, offsets, p), """\
triton_tem_fused_grouped_linear_row_scaled
# backward
triton_tem_fused_grouped_linear_dx
triton_per_fused_mul_sum_unsqueeze
triton_poi_fused_grouped_linear_wgrad_mul_unsqueeze
torch.ops.compileops.grouped_linear_wgrad.default""")
        self.assertSnapshot(_kernels(down_times_p, h, w2, offsets, p, dynamic=True), """\
triton_tem_fused_grouped_linear_row_scaled
# backward
triton_tem_fused_grouped_linear_dx
triton_red_fused_mul_sum_unsqueeze
triton_poi_fused_grouped_linear_wgrad_mul_unsqueeze
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_down_projection_bf16_times_fp32_probability(self):
        _, h, _, _, w2, offsets, p, _ = _inputs(torch.bfloat16)
        self.assertSnapshot(_kernels(down_times_fp32_p_cast_back, h, w2, offsets, p), """\
triton_tem_fused__to_copy_grouped_linear_mul_unsqueeze
# backward
triton_per_fused__to_copy_mul_sum_unsqueeze
triton_tem_fused_grouped_linear_dx
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_row_scale_beside_them(self):
        _, h, _, _, w2, offsets, p, _ = _inputs()
        self.assertSnapshot(_kernels(down_row_scale, h, w2, offsets, p), """\
triton_tem_fused_grouped_linear_row_scaled
# backward
triton_tem_fused_grouped_linear_dx
triton_per_fused_mul_sum_unsqueeze
triton_poi_fused_grouped_linear_wgrad_mul_unsqueeze
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_cast_and_residual(self):
        _, h, _, _, w2, offsets, _, residual = _inputs(torch.bfloat16)
        self.assertSnapshot(_kernels(down_cast, h, w2, offsets, residual.float()), """\
triton_tem_fused__to_copy_grouped_linear
# backward
triton_poi_fused__to_copy
triton_tem_fused__to_copy_grouped_linear_dx
torch.ops.compileops.grouped_linear_wgrad.default""")
        self.assertSnapshot(_kernels(down_plus_residual, h, w2, offsets, residual), """\
triton_tem_fused_add_grouped_linear
# backward
triton_tem_fused_grouped_linear_dx
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_gate_and_up_as_two_weights(self):
        x, _, w1, w3, _, offsets, _, _ = _inputs()
        self.assertSnapshot(_kernels(gate_up_apart, x, w1, w3, offsets), """\
triton_tem_fused_grouped_linear_swiglu_pair_with_preact
# backward
triton_poi_fused_add_expand_mul_rsub_select_sigmoid_unsqueeze
triton_tem_fused_grouped_linear_dx_pair
torch.ops.compileops.grouped_linear_wgrad.default
torch.ops.compileops.grouped_linear_wgrad.default""")
        self.assertSnapshot(_kernels(gate_up_apart, x, w1, w3, offsets, dynamic=True), """\
triton_tem_fused_grouped_linear_swiglu_pair_with_preact
# backward
triton_poi_fused_add_expand_mul_rsub_select_sigmoid_unsqueeze
triton_tem_fused_grouped_linear_dx_pair
torch.ops.compileops.grouped_linear_wgrad.default
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_fp8_layer_launches(self):
        # fp8 rowwise, the expert layer as users write it: each product is a template that
        # reads e4m3 operands, each operand quantised by one fused kernel (the weights every
        # call, uncached), and the user's `* p` fuses as the down projection's epilogue;
        # backward, the probability's gradient fuses with dY's quantisation.
        self.assertSnapshot(_fp8_layer_kernels(), """\
triton_per_fused_fp8_weight_rowwise
triton_per_fused_grouped_linear_swiglu_fp8_with_preact
triton_per_fused_fp8_weight_rowwise
triton_poi_fused_clone_transpose
triton_tem_fused_grouped_linear_swiglu_fp8_with_preact
triton_poi_fused_clone_transpose
triton_per_fused_grouped_linear_fp8
triton_tem_fused_grouped_linear_fp8_mul_unsqueeze
# backward
triton_per_fused__to_copy_grouped_linear_fp8_dx_from_copy_mul_sum_unsqueeze
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy
torch.ops.compileops.grouped_linear_wgrad.default
triton_poi_fused__to_copy_add_expand_mul_rsub_select_sigmoid_split_unsqueeze
triton_per_fused_grouped_linear_fp8_dx_from_copy
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy
torch.ops.compileops.grouped_linear_wgrad.default""")

    def test_fp8_layer_with_fp8_weight_grad_launches(self):
        # The same layer with fp8_weight_grad=True: the same launches (on torch 2.14 and
        # 2.15 in another order: tests/snapshots), each weight gradient the fp8 dW op (an
        # extern call that quantises its two operands itself) in place of the 16-bit one.
        self.assertSnapshot(_fp8_layer_kernels(fp8_weight_grad=True), """\
triton_per_fused_fp8_weight_rowwise
triton_per_fused_grouped_linear_swiglu_fp8_with_preact
triton_per_fused_fp8_weight_rowwise
triton_poi_fused_clone_transpose
triton_tem_fused_grouped_linear_swiglu_fp8_with_preact
triton_poi_fused_clone_transpose
triton_per_fused_grouped_linear_fp8
triton_tem_fused_grouped_linear_fp8_mul_unsqueeze
# backward
triton_per_fused__to_copy_grouped_linear_fp8_dx_from_copy_mul_sum_unsqueeze
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy
torch.ops.compileops.grouped_linear_wgrad_fp8.default
triton_poi_fused__to_copy_add_expand_mul_rsub_select_sigmoid_split_unsqueeze
triton_per_fused_grouped_linear_fp8_dx_from_copy
triton_poi_fused_grouped_linear_fp8_dx_from_copy
triton_tem_fused_grouped_linear_fp8_dx_from_copy
torch.ops.compileops.grouped_linear_wgrad_fp8.default""")
