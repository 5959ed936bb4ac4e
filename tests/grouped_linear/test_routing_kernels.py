"""What the routing helpers compile into. The sums over a token's k slots (the combine's
forward, the permute's backward) are pointwise kernels whose loads run along D: written as
one gather and a ``.sum(1)``, Inductor made them reductions over k with k as the tile's fast
axis, about 0.8 TB/s on an H100 (benchmarks/RESULTS.md, "What was tried", "Grouped linear")."""
import pytest
import torch

from compileops.grouped_linear.routing import permute_by_expert, sum_over_slots, unpermute_and_combine
from compileops.testing import aot_graph_text, inductor_kernels

T, D, E = 12, 64, 10


def _routing(top_k):
    gen = torch.Generator().manual_seed(top_k)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])
    return torch.randn(T, D, generator=gen), ids, torch.rand(T, top_k, generator=gen)


@pytest.mark.parametrize("top_k", [2, 8])
def test_compiled_combine_is_one_pointwise_kernel(top_k):
    x, ids, probs = _routing(top_k)

    def combine(x, ids, probs):
        xs, order, _ = permute_by_expert(x, ids, E)
        return unpermute_and_combine(xs * 2, order, probs, order_is_permutation=True)

    kernels = [k for k in inductor_kernels(combine, x, ids, probs, triton=True).splitlines()
               if "index_select" in k]
    assert len(kernels) == 1 and kernels[0].startswith("triton_poi_"), kernels


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_permute_backward_sums_slots_without_a_reduction(top_k):
    x, ids, _ = _routing(top_k)
    x.requires_grad_()
    w = torch.randn(1, D)
    _, backward = aot_graph_text(lambda x: permute_by_expert(x, ids, E)[0] * w, x)
    assert "aten.sum" not in backward, backward
    assert "aten.index_select" in backward, backward


@pytest.mark.parametrize("weighted", [False, True])
def test_sum_over_slots_eager_and_compiled_agree(weighted):
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(24, D, generator=gen)
    slots = torch.randperm(24, generator=gen).reshape(T, 2)
    weights = torch.rand(T, 2, generator=gen) if weighted else None
    eager = sum_over_slots(rows, slots, weights)
    expected = rows[slots].mul(1 if weights is None else weights[..., None]).sum(1)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)
    compiled = torch.compile(sum_over_slots, fullgraph=True)(rows, slots, weights)
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
