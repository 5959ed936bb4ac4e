"""Property tests of the projection-file loaders (``compileops.xtoken`` and its NeMo-RL
facade ``compileops.xtoken.nemo``), against oracles written here:

* validation: a valid file with one defect injected (``tests/fuzzing.py``:
  :func:`malformed_projection_files`) is refused by every loader with a ``ValueError``
  naming the file and the entry (or the array); a valid file reads as the oracle says;
* caches: every loader hands out its caller's own copy (a caller changing what it got, in
  place or through ``load_state_dict``, changes nothing another caller gets), and a file
  changed on disk is read again (the key is the file's identity, not its path).
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compileops.xtoken import SparseProjection, file_cache, files, get_projection, nemo
from tests.fuzzing import malformed_projection_files, projection_file_objects, projection_oracle
from tests.xtoken.test_nemo import oracle_exact_map

_names = itertools.count()
EXACT_MAP_TEACHERS = 8


def _write(directory, obj):
    path = directory / f"projection-{next(_names)}.pt"
    torch.save(obj, path)
    return path


def _dense_student_rows(obj) -> int:
    return obj["indices"].shape[0] if "indices" in obj else 0


LOADERS = {
    "parse_projection_file": lambda path, obj: files.parse_projection_file(path),
    "get_projection": lambda path, obj: get_projection(path),
    "SparseProjection.from_file": lambda path, obj: SparseProjection.from_file(path),
    "nemo.parse_projection_file": lambda path, obj: nemo.parse_projection_file(path),
    "nemo.get_sparse_projection_matrix": lambda path, obj: nemo.get_sparse_projection_matrix(
        path, "cpu", student_vocab_size=_dense_student_rows(obj), teacher_vocab_size=0),
    "nemo.get_topk_projection": lambda path, obj: nemo.get_topk_projection(path, "cpu"),
    "nemo.build_exact_token_map": lambda path, obj: nemo.build_exact_token_map(
        path, "cpu", xtoken_loss=True, teacher_vocab_size=EXACT_MAP_TEACHERS),
}
DENSE_ONLY = {"nemo.get_topk_projection", "nemo.build_exact_token_map"}
CACHED = ["get_projection", "SparseProjection.from_file", "nemo.get_sparse_projection_matrix",
          "nemo.get_topk_projection", "nemo.build_exact_token_map"]


def _loaders_for(obj, names=LOADERS):
    return [name for name in names if "indices" in obj or name not in DENSE_ONLY]


def _clear():
    files.clear_caches()
    nemo.clear_caches()


# ---------------------------------------------------------------------------------------
# Validation


@given(case=malformed_projection_files())
def test_every_loader_refuses_a_malformed_file_naming_file_and_entry(case, tmp_path):
    obj, defect, level, quoted = case
    path = _write(tmp_path, obj)
    for name in _loaders_for(obj):
        _clear()
        if name == "nemo.parse_projection_file" and level == "range":
            LOADERS[name](path, obj)  # the raw reader applies no id policy (NeMo-RL's contract)
            continue
        with pytest.raises(ValueError) as info:
            LOADERS[name](path, obj)
        message = str(info.value)
        assert str(path) in message and quoted in message, (name, defect, message)


def _csr_as_dense(csr) -> tuple[torch.Tensor, torch.Tensor]:
    """``M`` from each of the two CSR layouts, fp64."""
    def layout(indptr, ids, weights, transpose):
        segments = torch.repeat_interleave(torch.arange(indptr.numel() - 1), indptr.diff())
        rows, cols = (ids, segments) if transpose else (segments, ids)
        dense = torch.zeros(csr.num_student, csr.num_teacher, dtype=torch.float64)
        dense.index_put_((rows, cols), weights.double(), accumulate=True)
        return dense
    return (layout(csr.row_indptr, csr.row_teacher_ids, csr.row_weights, False),
            layout(csr.col_indptr, csr.col_student_ids, csr.col_weights, True))


def _check_loaded(name, value, obj):
    """What loader ``name`` returned for a file holding ``obj``, against the oracles."""
    close = dict(rtol=1e-6, atol=1e-6)
    if name in ("get_projection", "SparseProjection.from_file"):
        want = projection_oracle(obj)
        for dense in _csr_as_dense(value.csr() if name.startswith("Sparse") else value):
            torch.testing.assert_close(dense, want, **close)
    elif name == "parse_projection_file":
        want = projection_oracle(obj)
        got = torch.zeros(value.num_student, value.num_teacher, dtype=torch.float64)
        got.index_put_((value.student_ids, value.teacher_ids), value.weights.double(),
                       accumulate=True)
        torch.testing.assert_close(got, want, **close)
    elif name == "nemo.parse_projection_file":
        indices, values, _, _ = value
        if "indices" in obj:
            assert indices[1].tolist() == obj["indices"].reshape(-1).tolist()
            assert values.tolist() == obj["likelihoods"].reshape(-1).float().tolist()
        else:
            assert indices.t().tolist() == [list(k) for k in obj]
            assert values.tolist() == torch.tensor([float(c) for c in obj.values()]).tolist()
    elif name == "nemo.get_sparse_projection_matrix":
        torch.testing.assert_close(value.to_dense().double(),
                                   projection_oracle(obj, _dense_student_rows(obj)), **close)
    elif name == "nemo.get_topk_projection":
        indices, likelihoods = value
        assert torch.equal(indices, obj["indices"].long())
        assert torch.equal(likelihoods, obj["likelihoods"].float())
    else:
        want = oracle_exact_map(obj["indices"], obj["likelihoods"], True, EXACT_MAP_TEACHERS)
        assert {key: t.tolist() for key, t in value.items()} == want


@given(obj=projection_file_objects())
def test_every_loader_reads_a_valid_file_as_the_oracle(obj, tmp_path):
    path = _write(tmp_path, obj)
    for name in _loaders_for(obj):
        _clear()
        _check_loaded(name, LOADERS[name](path, obj), obj)


# ---------------------------------------------------------------------------------------
# Caches


def _change_in_place(name, value, how: str) -> None:
    """What a caller may do to what it got: every tensor changed in place (a module also
    through ``load_state_dict``)."""
    if name == "SparseProjection.from_file" and how == "load_state_dict":
        value.load_state_dict({k: v + 1 for k, v in value.state_dict().items()})
        return
    if name == "SparseProjection.from_file":
        tensors = list(value.buffers())
    elif name == "get_projection":
        tensors = list(value.buffers())
    elif name == "nemo.get_sparse_projection_matrix":
        tensors = [value._values()]  # changed ids could make an invalid sparse tensor
    elif name == "nemo.get_topk_projection":
        tensors = list(value)
    else:
        tensors = list(value.values())
    for t in tensors:
        t.add_(1)


@given(data=st.data())
def test_caches_hand_out_private_copies_of_the_current_file(data, tmp_path, monkeypatch):
    """A random sequence of rewrites of one file, loads through every cached loader and
    in-place changes of earlier results: each load equals the oracle of the file as it is
    then. Every file counts as settled here (so hits happen); each rewrite gets its own
    mtime, as a file rewritten later than the racy window always does."""
    monkeypatch.setattr(file_cache, "RACY_WINDOW_NS", -(2**62))
    _clear()
    path = tmp_path / f"projection-{next(_names)}.pt"
    mtime_ns = 1_600_000_000 * 10**9

    def write():
        nonlocal mtime_ns
        obj = data.draw(projection_file_objects(), label="file")
        torch.save(obj, path)
        mtime_ns += 10**9
        os.utime(path, ns=(mtime_ns, mtime_ns))
        return obj

    obj, handouts = write(), []
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        step = data.draw(st.sampled_from(["load", "load", "change", "rewrite"]), label="step")
        if step == "rewrite":
            obj = write()
        elif step == "change" and handouts:
            name, value = data.draw(st.sampled_from(handouts), label="change which")
            _change_in_place(name, value, data.draw(
                st.sampled_from(["in place", "load_state_dict"]), label="how"))
        else:
            name = data.draw(st.sampled_from(_loaders_for(obj, CACHED)), label="loader")
            value = LOADERS[name](path, obj)
            _check_loaded(name, value, obj)
            handouts.append((name, value))
    _clear()
