"""The embedding reference against fp64 ground truth and direct indexing."""
import pytest
import torch

from compileops.embedding import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_forward_is_direct_indexing_bitwise(dtype, id_dtype):
    weight = torch.randn(97, 33).to(dtype)
    ids = torch.randint(0, 97, (4, 5, 6), dtype=id_dtype)
    out = reference.embedding_forward(ids, weight)
    assert out.dtype == dtype and out.shape == (4, 5, 6, 33)
    assert torch.equal(out, weight[ids.long()])


def test_fp32_path_upcasts_gathered_rows_only():
    weight = torch.randn(50, 8).to(torch.bfloat16)
    ids = torch.tensor([[3, 3, 49], [0, 7, 1]])
    out = reference.embedding_forward(ids, weight, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, weight.float()[ids])


def test_backward_matches_fp64_scatter_add():
    torch.manual_seed(0)
    V, D = 40, 12
    ids = torch.randint(0, V, (6, 25))
    ids[0, :12] = 5  # heavy repeats
    grad = torch.randn(6, 25, D, dtype=torch.float64)
    expected = torch.zeros(V, D, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad.reshape(-1, D))
    got = reference.embedding_backward(grad.float(), ids, V, None, torch.float64)
    # fp32 accumulation of <= 25 terms of unit size: far below 1e-6 relative.
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[ids.reshape(-1)] = False
    assert untouched.any() and torch.all(got[untouched] == 0)


def test_backward_padding_row_gets_no_gradient():
    ids = torch.tensor([1, 2, 2, 0, 2])
    grad = torch.ones(5, 3)
    got = reference.embedding_backward(grad, ids, 4, 2, torch.float32)
    assert torch.equal(got, torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3]))


def test_backward_sums_in_position_order():
    # Order matters in fp32: 1e8 + 1 - 1e8 is 0 left to right, 1 in another order.
    ids = torch.tensor([4, 4, 4])
    grad = torch.tensor([[1e8], [1.0], [-1e8]])
    got = reference.embedding_backward(grad, ids, 5, None, torch.float32)
    assert got[4, 0] == (torch.tensor(1e8) + 1.0 - 1e8)
