"""Projection files, the cache, and the exact token map."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from compileops.xtoken import file_cache, files
from compileops.xtoken import (
    ProjectionCOO,
    build_exact_token_map,
    clear_caches,
    get_projection,
    parse_projection_file,
)
from compileops.xtoken.module import SparseProjection


@pytest.fixture(autouse=True)
def _empty_cache():
    clear_caches()
    yield
    clear_caches()


def _dense_topk_file(tmp_path):
    indices = torch.tensor([[0, 2, -1], [1, -1, -1], [-1, -1, -1], [2, 0, 1]])
    likelihoods = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0],
                                [0.7, 0.2, 0.1]])
    path = tmp_path / "topk.pt"
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    return path


def _sparse_file(tmp_path):
    path = tmp_path / "sparse.pt"
    torch.save({(0, 1): 3, (0, 4): 1, (2, 1): 2.5, (5, 0): 1, (3, -1): 9}, path)
    return path


def _as_set(coo: ProjectionCOO):
    return {(int(s), int(t), round(float(w), 6))
            for s, t, w in zip(coo.student_ids, coo.teacher_ids, coo.weights)}


def test_parse_dense_topk(tmp_path):
    coo = parse_projection_file(_dense_topk_file(tmp_path))
    assert _as_set(coo) == {(0, 0, 0.5), (0, 2, 0.5), (1, 1, 1.0), (3, 2, 0.7), (3, 0, 0.2),
                            (3, 1, 0.1)}
    assert (coo.num_student, coo.num_teacher) == (4, 3)


def test_parse_sparse_counts(tmp_path):
    coo = parse_projection_file(_sparse_file(tmp_path))
    assert _as_set(coo) == {(0, 1, 3.0), (0, 4, 1.0), (2, 1, 2.5), (5, 0, 1.0)}
    assert (coo.num_student, coo.num_teacher) == (6, 5)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        parse_projection_file(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"weights": torch.ones(3)}, bad)
    with pytest.raises(ValueError, match=r"unknown projection format.*'weights'"):
        parse_projection_file(bad)
    torch.save([1, 2, 3], bad)
    with pytest.raises(ValueError, match="unknown projection format.*list"):
        parse_projection_file(bad)
    torch.save({(1, 2): "x"}, bad)
    with pytest.raises(ValueError, match="sparse projection entries must be"):
        parse_projection_file(bad)
    torch.save({"indices": torch.ones(3, 2), "likelihoods": torch.ones(3, 2)}, bad)
    with pytest.raises(ValueError, match="'indices' must be an integer tensor"):
        parse_projection_file(bad)
    torch.save({(-1, 3): 9.0}, bad)  # -1 is a sentinel only as a teacher id
    with pytest.raises(ValueError, match=r"entry \(-1, 3\) -> 9\.0: student id -1 is negative"):
        parse_projection_file(bad)


def test_unsafe_pickle_is_refused(tmp_path):
    """Only weights_only=True loading: an arbitrary object is refused, never executed."""
    path = tmp_path / "evil.pt"
    torch.save({"indices": torch.ones(1, 1, dtype=torch.long), "likelihoods": ProjectionCOO},
               path)
    with pytest.raises(ValueError, match="weights_only=True"):
        parse_projection_file(path)


@pytest.fixture
def settled(monkeypatch):
    """Files count as settled at once (the racy window is 0), so a test can see cache hits on
    files it has just written; each rewrite must then change the file's identity
    (:func:`_rewrite` sets a new mtime)."""
    monkeypatch.setattr(file_cache, "RACY_WINDOW_NS", -1)


def _rewrite(path, obj, mtime_s):
    torch.save(obj, path)
    os.utime(path, ns=(mtime_s * 10**9, mtime_s * 10**9))


@pytest.fixture
def loads(monkeypatch):
    """How often a projection file was read from disk."""
    count = [0]
    real = files._load

    def counting(path):
        count[0] += 1
        return real(path)

    monkeypatch.setattr(files, "_load", counting)
    return count


def _same_buffers(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))


def _shares_memory(a, b):
    return any(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
               for x in a.buffers() for y in b.buffers() if x.numel() and y.numel())


def test_cache_keying_sizes_and_private_copies(tmp_path, settled, loads):
    path = _dense_topk_file(tmp_path)
    a = get_projection(path, "cpu", num_student=10, num_teacher=2)
    again = get_projection(str(path), torch.device("cpu"), num_student=10, num_teacher=2)
    assert loads[0] == 1  # a hit reads nothing from disk
    assert _same_buffers(again, a) and not _shares_memory(again, a)  # equal, but its own
    assert (a.num_student, a.num_teacher) == (10, 3)  # max(configured, observed + 1)
    b = get_projection(path, "cpu", num_student=10, num_teacher=8)
    assert b.num_teacher == 8 and loads[0] == 2
    get_projection(path, "cpu", num_student=10, num_teacher=2, normalize_rows=True)
    assert loads[0] == 3
    dense = a.to_dense()
    assert dense.shape == (10, 3) and dense[1, 1] == 1.0 and dense[2:].sum() == 0.7 + 0.2 + 0.1
    clear_caches()
    get_projection(path, "cpu", num_student=10, num_teacher=2)
    assert loads[0] == 4


def test_changing_a_handout_changes_no_other_caller(tmp_path, settled):
    """Audit finding: the cache handed out its own tensors, and SparseProjection.from_file
    made them its buffers, so one caller's in-place change or load_state_dict reached every
    other module and the cache itself."""
    path = _dense_topk_file(tmp_path)
    want = get_projection(path).to_dense()
    first = get_projection(path)
    first.row_weights.mul_(100)
    assert torch.equal(get_projection(path).to_dense(), want)
    m1, m2 = SparseProjection.from_file(path), SparseProjection.from_file(path)
    m1.load_state_dict({k: v * 3 for k, v in m1.state_dict().items()})
    m1.col_weights.add_(1)
    assert torch.equal(m2.csr().to_dense(), want)
    assert torch.equal(SparseProjection.from_file(path).csr().to_dense(), want)


def test_a_file_changed_on_disk_is_read_again(tmp_path, settled):
    """Audit finding: the key was the path alone, so a rewritten file kept being served from
    the cache. Same size, new mtime (what any later write gives)."""
    path = tmp_path / "projection.pt"
    likelihoods = torch.tensor([[1.0, 0.0], [0.25, 0.75]])
    indices = torch.tensor([[0, -1], [1, 0]])
    _rewrite(path, {"indices": indices, "likelihoods": likelihoods}, 1_600_000_000)
    assert get_projection(path).to_dense()[1, 1] == 0.25
    size = os.path.getsize(path)
    _rewrite(path, {"indices": indices, "likelihoods": likelihoods.flip(1)}, 1_600_000_001)
    assert os.path.getsize(path) == size
    assert get_projection(path).to_dense()[1, 1] == 0.75


def test_a_file_changed_within_the_racy_window_is_not_cached(tmp_path, loads):
    """A rewrite inside one timestamp tick can keep size, mtime and even ctime: a file read
    less than RACY_WINDOW_NS after its last change is not cached at all."""
    path = tmp_path / "projection.pt"
    indices = torch.tensor([[0, 1]])
    torch.save({"indices": indices, "likelihoods": torch.tensor([[0.5, 0.5]])}, path)
    stat = os.stat(path)
    assert get_projection(path).to_dense().tolist() == [[0.5, 0.5]]
    torch.save({"indices": indices, "likelihoods": torch.tensor([[0.25, 0.75]])}, path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old mtime again
    assert os.path.getsize(path) == stat.st_size
    assert get_projection(path).to_dense().tolist() == [[0.25, 0.75]]
    assert loads[0] == 2


def test_normalize_rows_turns_counts_into_likelihoods(tmp_path):
    csr = get_projection(_sparse_file(tmp_path), normalize_rows=True)
    dense = csr.to_dense()
    assert torch.allclose(dense[0], torch.tensor([0.0, 0.75, 0.0, 0.0, 0.25]))
    assert torch.allclose(dense.sum(1), torch.tensor([1.0, 0, 1, 0, 0, 1]))


def test_normalize_rows_zero_total_row_gives_no_nan(tmp_path):
    """A student row whose weights sum to 0 must not become NaN (0/0) entries in M."""
    from compileops.xtoken.files import _normalize_rows

    coo = ProjectionCOO(torch.tensor([0, 0, 1, 1]), torch.tensor([1, 2, 0, 2]),
                        torch.tensor([3.0, 1.0, 0.0, 0.0]), 3, 3)
    weights = coo.weights.clone()
    out = _normalize_rows(coo)
    assert torch.equal(coo.weights, weights)  # the input is not modified
    assert torch.isfinite(out.weights).all()
    assert torch.allclose(out.weights, torch.tensor([0.75, 0.25, 0.0, 0.0]))

    path = tmp_path / "zero_row.pt"
    torch.save({(0, 1): 3, (0, 2): 1, (1, 0): 0, (1, 2): 0.0}, path)
    dense = get_projection(path, normalize_rows=True).to_dense()
    assert torch.isfinite(dense).all()
    assert torch.allclose(dense.sum(1), torch.tensor([1.0, 0.0]))


def test_cache_is_thread_safe(tmp_path, settled, loads):
    path = _dense_topk_file(tmp_path)
    results = []
    threads = [threading.Thread(target=lambda: results.append(get_projection(path, "cpu", num_student=4, num_teacher=3)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and loads[0] == 1
    assert all(_same_buffers(r, results[0]) for r in results)
    assert not any(_shares_memory(r, results[0]) for r in results[1:])


def _coo(entries, num_student, num_teacher):
    s, t, w = zip(*entries)
    return ProjectionCOO(torch.tensor(s), torch.tensor(t), torch.tensor(w, dtype=torch.float32),
                         num_student, num_teacher)


def test_exact_map_strict():
    coo = _coo([
        (0, 3, 1.0),                 # exact
        (1, 2, 1.0), (1, 4, 0.5),    # second candidate: not exact
        (2, 5, 0.9),                 # below 1.0
        (4, 0, 1.0), (3, 0, 1.0),    # collision on teacher 0: lowest student (3) wins
        (6, 1, 1.0),
    ], 8, 7)
    m = build_exact_token_map(coo, "strict")
    assert m.student_to_teacher.tolist() == [3, -1, -1, 0, -1, -1, 1, -1]
    assert m.teacher_to_student.tolist() == [3, 6, -1, 0, -1, -1, -1]
    assert m.common_student_ids.tolist() == [0, 3, 6]
    assert m.common_teacher_ids.tolist() == [3, 0, 1]
    assert m.uncommon_student_ids.tolist() == [1, 2, 4, 5, 7]
    assert m.uncommon_teacher_ids.tolist() == [2, 4, 5, 6]
    # A partition of each vocab.
    assert sorted(m.common_student_ids.tolist() + m.uncommon_student_ids.tolist()) == list(range(8))


def test_exact_map_relaxed():
    coo = _coo([
        (0, 3, 0.6), (0, 1, 0.4),    # top >= 0.6: pairs with 3
        (1, 2, 0.59),                # below threshold
        (2, 4, 0.7), (5, 4, 0.9),    # collision on 4: highest weight (student 5) wins
        (3, 6, 0.8), (4, 6, 0.8),    # tie on weight: lowest id (3) wins
        (6, 0, 0.65), (6, 5, 0.65),  # own tie: lowest teacher id (0)
    ], 7, 7)
    m = build_exact_token_map(coo, "relaxed")
    assert m.student_to_teacher.tolist() == [3, -1, -1, 6, -1, 4, 0]
    assert m.teacher_to_student.tolist() == [6, -1, -1, 0, 5, -1, 3]
    with pytest.raises(ValueError, match="rule"):
        build_exact_token_map(coo, "loose")


def test_exact_map_from_file(tmp_path):
    coo = parse_projection_file(_dense_topk_file(tmp_path))
    strict = build_exact_token_map(coo, "strict", num_student=6)
    assert strict.student_to_teacher.tolist() == [-1, 1, -1, -1, -1, -1]
    relaxed = build_exact_token_map(coo, "relaxed")
    assert relaxed.student_to_teacher.tolist() == [-1, 1, -1, 2]


def test_vocabulary_sizes_are_keyword_only(tmp_path):
    """Audit finding: two vocabulary sizes by position could be swapped silently."""
    path = _sparse_file(tmp_path)
    with pytest.raises(TypeError):
        get_projection(path, "cpu", 10, 2)
    with pytest.raises(TypeError):
        SparseProjection.from_file(path, "cpu", 10, 2)
    csr = get_projection(path, "cpu", num_student=10, num_teacher=8)
    assert csr.num_student == 10 and csr.num_teacher == 8
