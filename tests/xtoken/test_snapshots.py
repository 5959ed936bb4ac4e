"""Graph snapshots for the xtoken ops, on every supported torch (tests/snapshot.py; regenerate with
EXPECTTEST_ACCEPT=1). The ops are extern calls under Inductor (no lowering for this family):
the snapshots pin that the AOT graphs hold exactly our ops (the backward is our own op, the
projection input is cast to fp32 under autocast) and that no graph break or decomposition
sneaks in."""
from __future__ import annotations

import torch

from compileops.testing import aot_graph_text, inductor_kernels
from compileops.xtoken import chunk_average

from tests.xtoken._helpers import random_projection
from tests.snapshot import SnapshotTestCase



class TestXtokenSnapshots(SnapshotTestCase):
    def test_project_aot_graphs_under_autocast(self):
        proj = random_projection(num_student=11, num_teacher=9, k=2)

        def fn(p):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return proj(p)

        fw, bw = aot_graph_text(fn, torch.rand(3, 11).bfloat16().requires_grad_())
        self.assertSnapshot(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "i64[10]", primals_2: "i64[18]", primals_3: "f32[18]", primals_4: "i64[12]", primals_5: "i64[18]", primals_6: "f32[18]", primals_7: "bf16[3, 11]"):
        _to_copy: "f32[3, 11]" = torch.ops.aten._to_copy.default(primals_7, dtype = torch.float32);  primals_7 = None
        xtoken_project: "f32[3, 9]" = torch.ops.compileops.xtoken_project.default(_to_copy, primals_1, primals_2, primals_3, primals_4, primals_5, primals_6);  _to_copy = primals_1 = primals_2 = primals_3 = None
        return (xtoken_project, primals_4, primals_5, primals_6)""")
        self.assertSnapshot(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_4: "i64[12]", primals_5: "i64[18]", primals_6: "f32[18]", tangents_1: "f32[3, 9]"):
        xtoken_project_backward: "f32[3, 11]" = torch.ops.compileops.xtoken_project_backward.default(tangents_1, primals_4, primals_5, primals_6, 9);  tangents_1 = primals_4 = primals_5 = primals_6 = None
        _to_copy_1: "bf16[3, 11]" = torch.ops.aten._to_copy.default(xtoken_project_backward, dtype = torch.bfloat16, layout = torch.strided, device = device(type='cpu'));  xtoken_project_backward = None
        return (None, None, None, None, None, None, _to_copy_1)""")

    def test_chunk_average_aot_graphs(self):
        fw, bw = aot_graph_text(
            lambda lp, ids: chunk_average(lp, ids, 4)[0],
            torch.randn(2, 6, 5, requires_grad=True), torch.tensor([[0, 0, 1, -1, 3, 3]] * 2),
        )
        self.assertSnapshot(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 6, 5]", primals_2: "i64[2, 6]"):
        xtoken_chunk_sums = torch.ops.compileops.xtoken_chunk_sums.default(primals_1, primals_2, 4);  primals_1 = None
        getitem: "f32[2, 4, 5]" = xtoken_chunk_sums[0]
        getitem_1: "f32[2, 4]" = xtoken_chunk_sums[1];  xtoken_chunk_sums = None

        clamp: "f32[2, 4]" = torch.ops.aten.clamp.default(getitem_1, 1);  getitem_1 = None
        unsqueeze: "f32[2, 4, 1]" = torch.ops.aten.unsqueeze.default(clamp, -1);  clamp = None
        div: "f32[2, 4, 5]" = torch.ops.aten.div.Tensor(getitem, unsqueeze);  getitem = None
        return (div, primals_2, unsqueeze)""")
        self.assertSnapshot(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_2: "i64[2, 6]", unsqueeze: "f32[2, 4, 1]", tangents_1: "f32[2, 4, 5]"):
        div_1: "f32[2, 4, 5]" = torch.ops.aten.div.Tensor(tangents_1, unsqueeze);  tangents_1 = unsqueeze = None

        xtoken_chunk_sums_backward: "f32[2, 6, 5]" = torch.ops.compileops.xtoken_chunk_sums_backward.default(div_1, primals_2, torch.float32);  div_1 = primals_2 = None
        return (xtoken_chunk_sums_backward, None)""")

    def test_inductor_kernels(self):
        proj = random_projection(num_student=11, num_teacher=9, k=2)

        def fn(logits, ids):
            lp = torch.log(proj(logits.softmax(-1)) + 1e-8)
            return chunk_average(lp, ids, 4)[0] * 2

        kernels = inductor_kernels(
            fn, torch.randn(2, 6, 11, requires_grad=True),
            torch.tensor([[0, 0, 1, -1, 3, 3]] * 2), backward=True,
        )
        self.assertSnapshot(kernels, """\
cpp_fused__softmax
cpp_fused_add_log_xtoken_chunk_sums
cpp_fused_clamp_div_mul_unsqueeze
torch.ops.compileops.xtoken_project.default
torch.ops.compileops.xtoken_chunk_sums.default
# backward
cpp_fused_div_mul_xtoken_chunk_sums_backward
cpp_fused_add_div_xtoken_project_backward
cpp_fused__softmax_backward_data
torch.ops.compileops.xtoken_chunk_sums_backward.default
torch.ops.compileops.xtoken_project_backward.default""")
