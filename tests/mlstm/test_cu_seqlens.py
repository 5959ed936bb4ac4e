"""``cu_seqlens`` (packed documents) is checked before anything runs.

* the layout (1-D, at least two entries, int32 or int64, the inputs' device, B = 1): always,
  a ``ValueError``/``TypeError`` naming ``cu_seqlens``;
* the values (starting at 0, ending at S, never decreasing): eagerly on CPU tensors, naming
  the entry; compiled, by a device-side assert (no host sync) whose ``RuntimeError`` names
  ``cu_seqlens``. Property tests draw every kind of invalid packing (tests/fuzzing.py,
  ``invalid_cu_seqlens``), and valid ones with empty documents.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compileops
from compileops.mlstm.checks import CU_SEQLENS_INVALID
from tests.fuzzing import cumulative_ends, document_lengths, invalid_cu_seqlens


def _inputs(seq):
    gen = torch.Generator().manual_seed(seq)

    def randn(*shape, shift=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) + shift

    return (randn(1, 2, seq, 8), randn(1, 2, seq, 8), randn(1, 2, seq, 8), randn(1, 2, seq),
            randn(1, 2, seq, shift=3.0))


def _call(tensors, cu, backend="reference"):
    with compileops.use_backend(backend):
        return compileops.mlstm(*tensors, kernel="chunkwise", chunk_size=16, cu_seqlens=cu)


@given(seq=st.integers(0, 40), data=st.data())
def test_invalid_values_raise_eagerly_naming_cu_seqlens(seq, data):
    ends = data.draw(invalid_cu_seqlens(seq), "cu_seqlens")
    cu = torch.tensor(ends, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    with pytest.raises(ValueError, match=r"cu_seqlens(\[-?\d+\])? must"):
        _call(_inputs(seq), cu)


@given(lengths=document_lengths(4, 20))
def test_valid_packings_run(lengths):
    ends = cumulative_ends(lengths)
    out = _call(_inputs(ends[-1]), torch.tensor(ends, dtype=torch.int32))
    assert out.shape == (1, 2, ends[-1], 8) and bool(out.isfinite().all())


@pytest.mark.parametrize("ends", [[0, 12, 10], [1, 10], [0, 5, 11], [0, -1, 10]],
                         ids=["decreasing", "not from 0", "past S", "negative"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_invalid_values_raise_compiled(ends, backend):
    tensors = _inputs(10)

    def packed(tensors, cu):
        return compileops.mlstm(*tensors, kernel="chunkwise", chunk_size=16, cu_seqlens=cu)

    compiled = torch.compile(packed, fullgraph=True)
    with compileops.use_backend(backend):
        compiled(tensors, torch.tensor([0, 4, 10], dtype=torch.int32))  # a valid packing
        with pytest.raises(RuntimeError, match="cu_seqlens must be the cumulative document"):
            compiled(tensors, torch.tensor(ends, dtype=torch.int32))


@pytest.mark.parametrize("cu,error,match", [
    ([0], ValueError, r"cu_seqlens must be 1-D \[N \+ 1\] with N >= 1"),
    ([[0, 10]], ValueError, r"cu_seqlens must be 1-D"),
    ("float", ValueError, "cu_seqlens must be int32 or int64"),
    ("list", TypeError, "cu_seqlens must be a tensor"),
])
def test_bad_layout_is_named(cu, error, match):
    if cu == "float":
        cu = torch.tensor([0.0, 10.0])
    elif cu == "list":
        cu = [0, 10]
    else:
        cu = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(error, match=match):
        _call(_inputs(10), cu)


def test_the_device_message_names_cu_seqlens():
    assert "cu_seqlens" in CU_SEQLENS_INVALID
    assert "strict_offset_checks" in CU_SEQLENS_INVALID
