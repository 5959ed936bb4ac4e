"""Graph snapshots of the embedding family, on every supported torch (tests/snapshot.py).

Regenerate with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/embedding/test_snapshots.py``.
"""
import torch

import compileops
from compileops import testing
from tests.snapshot import SnapshotTestCase



def stem(ids, weight):
    return (compileops.embedding(ids, weight, out_dtype=torch.float32) * 3.0).to(torch.bfloat16)


def inputs():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=gen).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 64, (4, 9), generator=gen)
    return ids, weight


class EmbeddingSnapshots(SnapshotTestCase):
    def test_aot_forward_and_backward_graphs(self):
        forward, backward = testing.aot_graph_text(stem, *inputs())
        self.assertSnapshot(forward, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "i64[4, 9]", primals_2: "bf16[64, 32]"):
        embedding: "f32[4, 9, 32]" = torch.ops.compileops.embedding.default(primals_1, primals_2, torch.float32);  primals_2 = None

        mul: "f32[4, 9, 32]" = torch.ops.aten.mul.Tensor(embedding, 3.0);  embedding = None
        _to_copy: "bf16[4, 9, 32]" = torch.ops.aten._to_copy.default(mul, dtype = torch.bfloat16);  mul = None
        return (_to_copy, primals_1)""")
        self.assertSnapshot(backward, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "i64[4, 9]", tangents_1: "bf16[4, 9, 32]"):
        _to_copy_1: "f32[4, 9, 32]" = torch.ops.aten._to_copy.default(tangents_1, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'));  tangents_1 = None
        mul_1: "f32[4, 9, 32]" = torch.ops.aten.mul.Tensor(_to_copy_1, 3.0);  _to_copy_1 = None

        embedding_backward: "bf16[64, 32]" = torch.ops.compileops.embedding_backward.default(mul_1, primals_1, 64, None, torch.bfloat16);  mul_1 = primals_1 = None
        return (None, embedding_backward)""")

    def test_cpp_kernels_forward_and_backward(self):
        self.assertSnapshot(
            testing.inductor_kernels(stem, *inputs(), backward=True), """\
cpp_fused__to_copy_embedding_mul
# backward
cpp_fused__to_copy_embedding_backward_mul
torch.ops.compileops.embedding_backward.default"""
        )

    def test_triton_kernels_forward_and_backward(self):
        self.assertSnapshot(
            testing.inductor_kernels(stem, *inputs(), triton=True, backward=True), """\
triton_poi_fused__to_copy_embedding_mul
# backward
triton_poi_fused__to_copy_embedding_backward_mul
torch.ops.compileops.embedding_backward.default"""
        )
