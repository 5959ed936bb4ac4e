"""compileops.xtoken.checks on its own: every check accepts good input and rejects each kind of
bad input with its message, and chunk_segments matches a brute-force definition.

Both backends run these helpers, so a kernel-vs-reference comparison cannot catch a bug in
them: a check that let bad input through, or a wrong chunk run, would go unnoticed there.
"""
from __future__ import annotations

import pytest
import torch

from compileops.xtoken import checks

from tests.xtoken._helpers import chunk_runs, random_projection


def _csr(num_segments=4, nnz=6):
    indptr = torch.tensor([0, 2, 2, 5, nnz][:num_segments] + [nnz])
    return indptr, torch.arange(nnz), torch.rand(nnz)


def _project_args(columns=None, lead=(2, 3)):
    proj = random_projection(num_student=11, num_teacher=9, k=2)
    p = torch.rand(*lead, proj.num_student)
    return [p, proj.col_indptr, proj.col_student_ids, proj.col_weights,
            proj.row_indptr, proj.row_teacher_ids, proj.row_weights, columns], proj


def _meta(t):
    return torch.empty_like(t, device="meta")


# ---------------------------------------------------------------------------------------
# CSR and columns


def test_check_csr_accepts_valid_layouts():
    checks.check_csr(*_csr(), "row CSR")
    checks.check_csr(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                     torch.zeros(0), "empty CSR")  # no segments, no entries


@pytest.mark.parametrize("case,error,match", [
    ("indptr_2d", RuntimeError, r"row CSR indptr must be 1-D \[n_segments \+ 1\]"),
    ("indptr_float", RuntimeError, "row CSR indptr must be int32 or int64"),
    ("indptr_empty", ValueError, "row CSR indptr must have >= 1 entry"),
    ("ids_2d", RuntimeError, r"row CSR ids must be 1-D \[nnz\]"),
    ("ids_float", RuntimeError, "row CSR ids must be int32 or int64"),
    ("weights_2d", RuntimeError, r"row CSR weights must be 1-D \[nnz\]"),
    ("weights_fp64", TypeError, "row CSR weights must be float32, got torch.float64"),
    ("weights_bf16", TypeError, "row CSR weights must be float32"),
    ("length_mismatch", ValueError, "ids and weights must have the same length, got 6 and 5"),
])
def test_check_csr_rejects(case, error, match):
    indptr, ids, weights = _csr()
    if case == "indptr_2d":
        indptr = indptr[None]
    elif case == "indptr_float":
        indptr = indptr.float()
    elif case == "indptr_empty":
        indptr = indptr[:0]
    elif case == "ids_2d":
        ids = ids.reshape(2, 3)
    elif case == "ids_float":
        ids = ids.float()
    elif case == "weights_2d":
        weights = weights.reshape(3, 2)
    elif case == "weights_fp64":
        weights = weights.double()
    elif case == "weights_bf16":
        weights = weights.bfloat16()
    elif case == "length_mismatch":
        weights = weights[:5]
    with pytest.raises(error, match=match):
        checks.check_csr(indptr, ids, weights, "row CSR")


def test_check_columns():
    checks.check_columns(torch.zeros(2, 3, 4, dtype=torch.int32), (2, 3), "p")
    checks.check_columns(torch.zeros(4, dtype=torch.long), (), "p")  # p [V_s], columns [K]
    with pytest.raises(RuntimeError, match="columns must be int32 or int64"):
        checks.check_columns(torch.zeros(2, 3, 4), (2, 3), "p")
    with pytest.raises(ValueError, match=r"columns must be \[\*p.shape\[:-1\], K\] = \[2, 3, K\], "
                                         r"got \(3, 2, 4\)"):
        checks.check_columns(torch.zeros(3, 2, 4, dtype=torch.long), (2, 3), "p")
    with pytest.raises(ValueError, match=r"columns must be \[\*grad"):
        checks.check_columns(torch.zeros(2, 4, dtype=torch.long), (2, 3), "grad")
    with pytest.raises(ValueError, match="columns must be"):
        checks.check_columns(torch.tensor(1), (), "p")  # 0-d


# ---------------------------------------------------------------------------------------
# Projection forward / backward arguments


@pytest.mark.parametrize("with_columns", [False, True])
def test_check_project_args_accepts_valid(with_columns):
    cols = torch.zeros(2, 3, 4, dtype=torch.long) if with_columns else None
    args, _ = _project_args(cols)
    checks.check_project_args(*args)
    args, _ = _project_args(None, lead=())  # p [V_s]
    checks.check_project_args(*args)


@pytest.mark.parametrize("case,error,match", [
    ("p_int", RuntimeError, "p must be a floating-point tensor"),
    ("p_0d", ValueError, r"p must be \[\*, V_s\], got a 0-d tensor"),
    ("p_vocab", ValueError, r"p's last dim \(12\) must equal the projection's student vocab \(11\)"),
    ("col_csr", TypeError, "column CSR weights must be float32"),
    ("row_csr", RuntimeError, "row CSR ids must be int32 or int64"),
    ("nnz_mismatch", ValueError, "the column CSR and the row CSR must hold the same number"),
    ("columns_lead", ValueError, r"columns must be \[\*p.shape\[:-1\], K\]"),
    ("columns_float", RuntimeError, "columns must be int32 or int64"),
    ("device", RuntimeError, "col_weights is on meta but p is on cpu"),
    ("columns_device", RuntimeError, "columns is on meta but p is on cpu"),
])
def test_check_project_args_rejects(case, error, match):
    args, proj = _project_args(torch.zeros(2, 3, 4, dtype=torch.long))
    if case == "p_int":
        args[0] = args[0].long()
    elif case == "p_0d":
        args[0] = torch.tensor(1.0)
    elif case == "p_vocab":
        args[0] = torch.rand(2, 3, proj.num_student + 1)
    elif case == "col_csr":
        args[3] = args[3].double()
    elif case == "row_csr":
        args[5] = args[5].float()
    elif case == "nnz_mismatch":
        # Each layout is valid on its own, but they disagree on nnz.
        args[1], args[2], args[3] = args[1].clamp(max=len(args[2]) - 1), args[2][:-1], args[3][:-1]
    elif case == "columns_lead":
        args[7] = torch.zeros(3, 2, 4, dtype=torch.long)
    elif case == "columns_float":
        args[7] = torch.zeros(2, 3, 4)
    elif case == "device":
        args[3] = _meta(args[3])
    elif case == "columns_device":
        args[7] = _meta(args[7])
    with pytest.raises(error, match=match):
        checks.check_project_args(*args)


def _backward_args(columns=None, k=None):
    proj = random_projection(num_student=11, num_teacher=9, k=2)
    grad = torch.randn(2, 3, proj.num_teacher if columns is None else (k or columns.shape[-1]))
    return [grad, proj.row_indptr, proj.row_teacher_ids, proj.row_weights, proj.num_teacher,
            columns]


def test_check_project_backward_args_accepts_valid():
    checks.check_project_backward_args(*_backward_args())
    checks.check_project_backward_args(*_backward_args(torch.zeros(2, 3, 4, dtype=torch.long)))
    args = _backward_args()
    args[4] = 0
    args[0] = torch.randn(2, 3, 0)  # an empty teacher vocab
    checks.check_project_backward_args(*args)


@pytest.mark.parametrize("case,error,match", [
    ("grad_int", RuntimeError, "grad must be a floating-point tensor"),
    ("grad_0d", ValueError, r"grad must be \[\*, V_t\] or \[\*, K\]"),
    ("row_csr", ValueError, "row CSR ids and weights must have the same length"),
    ("num_teacher_negative", ValueError, "num_teacher must be >= 0"),
    ("grad_vocab", ValueError, r"grad's last dim \(9\) must equal num_teacher \(10\)"),
    ("columns_lead", ValueError, r"columns must be \[\*grad.shape\[:-1\], K\]"),
    ("columns_k", ValueError, r"columns \[\*, K\] and grad \[\*, K\] disagree on K: 4 vs 5"),
    ("device", RuntimeError, "row_indptr is on meta but grad is on cpu"),
])
def test_check_project_backward_args_rejects(case, error, match):
    args = _backward_args()
    if case == "grad_int":
        args[0] = args[0].long()
    elif case == "grad_0d":
        args[0] = torch.tensor(1.0)
    elif case == "row_csr":
        args[3] = args[3][:-1]
    elif case == "num_teacher_negative":
        args[4] = -1
    elif case == "grad_vocab":
        args[4] = 10
    elif case == "columns_lead":
        args = _backward_args(torch.zeros(3, 2, 4, dtype=torch.long))
        args[0] = torch.randn(2, 3, 4)
    elif case == "columns_k":
        args = _backward_args(torch.zeros(2, 3, 4, dtype=torch.long), k=5)
    elif case == "device":
        args[1] = _meta(args[1])
    with pytest.raises(error, match=match):
        checks.check_project_backward_args(*args)


# ---------------------------------------------------------------------------------------
# Column values


def test_check_columns_in_range_accepts_every_valid_id():
    checks.check_columns_in_range(torch.arange(9).reshape(3, 3), 9)
    checks.check_columns_in_range(torch.zeros(2, 0, dtype=torch.long), 0)  # empty
    checks.check_columns_in_range(torch.zeros(0, dtype=torch.int32), 5)


@pytest.mark.parametrize("bad", [-1, 9, 10, -(2**40), 2**40])
def test_check_columns_in_range_names_the_first_bad_id(bad):
    cols = torch.randint(0, 9, (2, 3, 4), generator=torch.Generator().manual_seed(0))
    cols[1, 0, 2] = bad
    cols[1, 2, 3] = 9 if bad != 9 else -1  # a later bad id is not the one named
    with pytest.raises(IndexError, match=rf"teacher id {bad}, out of range for a projection "
                                         r"with 9 teacher columns \(valid ids are 0..8\)"):
        checks.check_columns_in_range(cols, 9)
    with pytest.raises(IndexError, match=rf"teacher id {bad},"):
        checks.check_columns_in_range(cols.int() if abs(bad) < 2**31 else cols, 9)


def test_check_columns_in_range_with_no_teacher_columns():
    with pytest.raises(IndexError, match="teacher id 0, out of range .* 0 teacher columns"):
        checks.check_columns_in_range(torch.zeros(1, 1, dtype=torch.long), 0)


def test_check_column_values_reads_cpu_tensors_only(monkeypatch):
    bad = torch.tensor([[0, 9]])
    checks.check_column_values(None, 9)
    checks.check_column_values(torch.tensor([[0, 8]]), 9)
    with pytest.raises(IndexError, match="teacher id 9"):
        checks.check_column_values(bad, 9)
    # Off the CPU nothing is read on the host (the kernels mask bad ids instead) ...
    checks.check_column_values(_meta(bad), 9)
    # ... and nothing is read while compiling (a host sync cannot be traced).
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    checks.check_column_values(bad, 9)


# ---------------------------------------------------------------------------------------
# Chunk arguments


def test_check_chunk_args_accepts_valid():
    checks.check_chunk_args(torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.int32), 4)
    checks.check_chunk_args(torch.randn(2, 5, 3).bfloat16(), torch.zeros(2, 5, dtype=torch.long), 0)
    checks.check_chunk_args(torch.randn(2, 0, 3), torch.zeros(2, 0, dtype=torch.long), 3)


@pytest.mark.parametrize("case,error,match", [
    ("lp_2d", RuntimeError, r"log_probs must be 3-D \[B, T, V\], got shape \(2, 5\)"),
    ("lp_int", RuntimeError, "log_probs must be a floating-point tensor"),
    ("ids_3d", RuntimeError, r"chunk_id must be 2-D \[B, T\]"),
    ("ids_float", RuntimeError, "chunk_id must be int32 or int64"),
    ("ids_shape", ValueError, r"chunk_id must be \[B, T\] = \(2, 5\), got \(2, 4\)"),
    ("ids_batch", ValueError, r"chunk_id must be \[B, T\] = \(2, 5\), got \(3, 5\)"),
    ("max_chunks", ValueError, "max_chunks must be >= 0, got -1"),
    ("device", RuntimeError, "chunk_id is on meta but log_probs is on cpu"),
])
def test_check_chunk_args_rejects(case, error, match):
    lp, ids, max_chunks = torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.long), 4
    if case == "lp_2d":
        lp = lp[:, :, 0]
    elif case == "lp_int":
        lp = lp.long()
    elif case == "ids_3d":
        ids = ids[..., None]
    elif case == "ids_float":
        ids = ids.float()
    elif case == "ids_shape":
        ids = ids[:, :4]
    elif case == "ids_batch":
        ids = torch.zeros(3, 5, dtype=torch.long)
    elif case == "max_chunks":
        max_chunks = -1
    elif case == "device":
        ids = _meta(ids)
    with pytest.raises(error, match=match):
        checks.check_chunk_args(lp, ids, max_chunks)


def test_check_chunk_backward_args():
    g, ids = torch.randn(2, 4, 3), torch.zeros(2, 5, dtype=torch.long)
    checks.check_chunk_backward_args(g, ids, torch.float32)
    checks.check_chunk_backward_args(g, ids.int(), torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"grad_sums must be 3-D \[B, C, V\]"):
        checks.check_chunk_backward_args(g[0], ids, torch.float32)
    with pytest.raises(RuntimeError, match="grad_sums must be a floating-point tensor"):
        checks.check_chunk_backward_args(g.long(), ids, torch.float32)
    with pytest.raises(RuntimeError, match="chunk_id must be int32 or int64"):
        checks.check_chunk_backward_args(g, ids.float(), torch.float32)
    with pytest.raises(RuntimeError, match=r"chunk_id must be 2-D \[B, T\]"):
        checks.check_chunk_backward_args(g, ids[0], torch.float32)
    with pytest.raises(ValueError, match=r"disagree on B: 3 vs 2"):
        checks.check_chunk_backward_args(g, torch.zeros(3, 5, dtype=torch.long), torch.float32)
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype, got torch.int64"):
        checks.check_chunk_backward_args(g, ids, torch.int64)
    with pytest.raises(RuntimeError, match="chunk_id is on meta but grad_sums is on cpu"):
        checks.check_chunk_backward_args(g, _meta(ids), torch.float32)


# ---------------------------------------------------------------------------------------
# chunk_segments


def _segments_by_hand(chunk_id: torch.Tensor, C: int):
    """The definition, one token at a time: chunk c's tokens in token order, chunk after
    chunk, then every token whose id is outside [0, C)."""
    orders, starts, ends = [], [], []
    for row in chunk_id.tolist():
        order, start, end = [], [], []
        for c in range(C):
            start.append(len(order))
            order += [t for t, i in enumerate(row) if i == c]
            end.append(len(order))
        order += [t for t, i in enumerate(row) if not 0 <= i < C]
        orders.append(order)
        starts.append(start)
        ends.append(end)
    B = chunk_id.shape[0]
    return (torch.tensor(orders, dtype=torch.int64).reshape(B, -1),
            torch.tensor(starts, dtype=torch.int64).reshape(B, C),
            torch.tensor(ends, dtype=torch.int64).reshape(B, C))


def _scattered(B, T, C, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2, C + 2, (B, T), generator=gen)  # out of range on both sides
    ids[0, :3] = ids[0, 3]  # a run of one id at the start
    return ids


@pytest.mark.parametrize("ids_kind", ["runs", "scattered", "int32", "all_invalid",
                                      "no_tokens", "no_chunks", "one_chunk"])
def test_chunk_segments_matches_its_definition(ids_kind):
    C = 7
    ids = {
        "runs": lambda: chunk_runs(3, 40, C, seed=2),
        "scattered": lambda: _scattered(3, 40, C, seed=3),
        "int32": lambda: _scattered(2, 33, C, seed=4).int(),
        "all_invalid": lambda: torch.full((2, 9), -1),
        "no_tokens": lambda: torch.zeros(2, 0, dtype=torch.long),
        "no_chunks": lambda: torch.zeros(2, 5, dtype=torch.long),
        "one_chunk": lambda: torch.zeros(2, 5, dtype=torch.long),
    }[ids_kind]()
    if ids_kind == "no_chunks":
        C = 0
    elif ids_kind == "one_chunk":
        C = 1
    ids_copy = ids.clone()
    order, starts, ends = checks.chunk_segments(ids, C)
    want_order, want_starts, want_ends = _segments_by_hand(ids, C)
    for got, want in ((order, want_order), (starts, want_starts), (ends, want_ends)):
        assert got.dtype == torch.int64 and got.shape == want.shape, (got.shape, want.shape)
        assert torch.equal(got, want), (got, want)
    assert torch.equal(ids, ids_copy)  # the input is not modified
    # The sizes the ops report are ends - starts: the count of each id.
    for b in range(ids.shape[0]):
        counts = [int((ids[b] == c).sum()) for c in range(C)]
        assert (ends - starts)[b].tolist() == counts
