"""The embedding ops' argument checks and id preprocessing (``compileops/embedding/checks.py``),
on their own: both backends rely on them, so the kernel-vs-reference tests cannot catch a bug
in them."""
import pytest
import torch

from compileops.embedding import checks


@pytest.mark.parametrize("bad", [-1, 10, 11])
def test_out_of_range_raises_index_error_naming_the_id(bad):
    with pytest.raises(IndexError, match=f"id {bad} is out of range for a table of 10 rows"):
        checks.check_ids_in_range(torch.tensor([0, bad, 3]), 10)


def test_check_ids_in_range_names_the_first_bad_id_in_order():
    ids = torch.tensor([[0, 3, 12], [-4, 9, 40]])
    with pytest.raises(IndexError, match=r"id 12 is out of range .* \(valid ids are 0\.\.9\)"):
        checks.check_ids_in_range(ids, 10)
    with pytest.raises(IndexError, match="id -4 is out of range"):
        checks.check_ids_in_range(ids.t(), 10)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_check_ids_in_range_accepts_valid_and_empty_ids(id_dtype):
    checks.check_ids_in_range(torch.tensor([0, 9, 5], dtype=id_dtype), 10)
    checks.check_ids_in_range(torch.empty(0, 3, dtype=id_dtype), 10)
    checks.check_ids_in_range(torch.empty(0, dtype=id_dtype), 0)
    with pytest.raises(IndexError, match="id 0 is out of range for a table of 0 rows"):
        checks.check_ids_in_range(torch.tensor([0], dtype=id_dtype), 0)


def test_normalize_padding_idx():
    assert checks.normalize_padding_idx(None, 10) is None
    assert checks.normalize_padding_idx(3, 10) == 3
    assert checks.normalize_padding_idx(-1, 10) == 9
    assert checks.normalize_padding_idx(-10, 10) == 0
    assert checks.normalize_padding_idx(-11, 10) == -1  # then rejected by check_padding_idx


def test_check_padding_idx():
    checks.check_padding_idx(None, 0)
    checks.check_padding_idx(0, 1)
    checks.check_padding_idx(9, 10)
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 10\) once normalised"):
            checks.check_padding_idx(bad, 10)


def test_check_forward_args():
    ids, weight = torch.tensor([1, 2]), torch.randn(5, 4)
    checks.check_forward_args(ids, weight, None, None)
    checks.check_forward_args(ids.int(), weight.bfloat16(), torch.float32, 4)
    for args, error, message in [
        ((ids.float(), weight, None, None), Exception, "ids must be int32 or int64"),
        ((ids, weight[0], None, None), Exception, "weight must be 2-D"),
        ((ids, weight.long(), None, None), Exception, "weight must be a floating-point tensor"),
        ((ids.to("meta"), weight, None, None), RuntimeError, "ids is on meta but weight is on cpu"),
        ((ids, weight, torch.int32, None), TypeError, "out_dtype must be a floating-point dtype"),
        ((ids, weight, None, 5), ValueError, r"padding_idx must be in \[0, 5\)"),
    ]:
        with pytest.raises(error, match=message):
            checks.check_forward_args(*args)


def test_check_backward_args():
    ids = torch.tensor([[1, 2, 3]])
    grad = torch.randn(1, 3, 4)
    checks.check_backward_args(grad, ids, 5, None, torch.float32)
    checks.check_backward_args(grad.bfloat16(), ids.int(), 5, 4, torch.bfloat16)
    for args, error, message in [
        ((grad, ids.float(), 5, None, torch.float32), Exception, "ids must be int32 or int64"),
        ((grad.long(), ids, 5, None, torch.float32), Exception, "grad must be a floating-point"),
        ((grad[0], ids, 5, None, torch.float32), ValueError, r"grad must be \[\*ids.shape, D\]"),
        ((grad[:, :2], ids, 5, None, torch.float32), ValueError,
         r"grad must be \[\*ids.shape, D\] = \[1, 3, D\], got \(1, 2, 4\)"),
        ((grad, ids, -1, None, torch.float32), ValueError, "num_embeddings must be >= 0"),
        ((grad, ids, 5, None, torch.int64), TypeError, "weight_dtype must be a floating-point"),
        ((grad, ids, 5, 5, torch.float32), ValueError, r"padding_idx must be in \[0, 5\)"),
        ((grad, ids.to("meta"), 5, None, torch.float32), RuntimeError,
         "ids is on meta but grad is on cpu"),
    ]:
        with pytest.raises(error, match=message):
            checks.check_backward_args(*args)


def test_flatten_ids_is_dense_and_a_view_when_it_can_be():
    ids = torch.arange(12).reshape(3, 4)
    flat = checks.flatten_ids(ids)
    assert flat.shape == (12,) and flat.data_ptr() == ids.data_ptr()
    for strided in (ids.t(), torch.arange(24)[::2], ids[:, ::2]):
        flat = checks.flatten_ids(strided)
        assert flat.is_contiguous() and flat.dim() == 1
        assert torch.equal(flat, strided.reshape(-1))
