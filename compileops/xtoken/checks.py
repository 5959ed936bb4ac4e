"""Input validation and index preprocessing shared by both backends of the xtoken ops.

Everything here runs before the backend is chosen (or, for :func:`chunk_segments`, feeds
both of them), so it is tested on its own in ``tests/xtoken/test_checks.py``: a
kernel-vs-reference comparison cannot catch a bug in code that both sides run.

* **Shape, dtype and device checks** (``check_*_args``): written with ``torch._check*`` so
  they hold in eager calls and in the ops' fake functions alike (never read tensor data).
* **Value checks** (:func:`check_column_values`, :func:`check_columns_in_range`,
  :func:`check_csr_values_eagerly`): read data on the host, so they run eagerly on CPU
  tensors only.
* **Preprocessing** (:func:`chunk_segments`): each chunk's tokens as a contiguous run.

Projection buffers (see :mod:`compileops.xtoken.projection`): by teacher column
``col_indptr [V_t + 1]``, ``col_student_ids [nnz]``, ``col_weights [nnz]`` fp32; by student
row ``row_indptr [V_s + 1]``, ``row_teacher_ids [nnz]``, ``row_weights [nnz]`` fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import (
    check_dim,
    check_floating,
    check_index_dtype,
    check_same_device,
)

# ---------------------------------------------------------------------------------------
# Projection


def check_csr(indptr, ids, weights, what: str, names: Optional[tuple] = None) -> None:
    """One CSR layout: ``indptr [S + 1]`` and ``ids [nnz]`` int32/int64, ``weights [nnz]``
    fp32, ``indptr`` non-empty and ``ids``/``weights`` of one length. ``what`` names the
    layout in the messages ("column CSR", "row CSR"); ``names``, the three arguments
    (e.g. ``("row_indptr", "row_teacher_ids", "row_weights")``), prefix them."""
    n_indptr, n_ids, n_weights = (f"{n}: " for n in names) if names else ("", "", "")
    check_dim(indptr, 1, f"{n_indptr}{what} indptr", "[n_segments + 1]")
    check_index_dtype(indptr, f"{n_indptr}{what} indptr")
    check_dim(ids, 1, f"{n_ids}{what} ids", "[nnz]")
    check_index_dtype(ids, f"{n_ids}{what} ids")
    check_dim(weights, 1, f"{n_weights}{what} weights", "[nnz]")
    torch._check_type(
        weights.dtype == torch.float32,
        lambda: f"{n_weights}{what} weights must be float32, got {weights.dtype}",
    )
    torch._check_value(indptr.shape[0] >= 1,
                       lambda: f"{n_indptr}{what} indptr must have >= 1 entry")
    both = f"{names[1]} and {names[2]}: " if names else ""
    torch._check_value(
        ids.shape[0] == weights.shape[0],
        lambda: f"{both}{what} ids and weights must have the same length, got "
        f"{ids.shape[0]} and {weights.shape[0]}",
    )


COL_CSR = ("col_indptr", "col_student_ids", "col_weights")
ROW_CSR = ("row_indptr", "row_teacher_ids", "row_weights")


def check_csr_values(indptr: torch.Tensor, ids: torch.Tensor, num_ids: int, what: str,
                     names: tuple, ids_range: str) -> None:
    """The values of one CSR layout: ``indptr`` starts at 0, never decreases and ends at
    ``nnz`` (``ValueError``), and every id lies in ``[0, num_ids)`` (``IndexError``; ``ids_range``
    says what ``num_ids`` is). The kernels trust both: a bad value reads out of bounds.
    Reads the buffers on the host (the ops call it for CPU tensors only)."""
    nnz = ids.shape[0]
    ptr = indptr.detach().to("cpu", torch.int64)
    if int(ptr[0]) != 0 or int(ptr[-1]) != nnz or bool((ptr[1:] < ptr[:-1]).any()):
        shown = ptr.tolist() if ptr.numel() <= 8 else ptr[:4].tolist() + ["..."] + ptr[-2:].tolist()
        raise ValueError(
            f"{names[0]}: {what} indptr must start at 0, never decrease and end at nnz = {nnz} "
            f"(the length of {names[1]}), got {shown}"
        )
    if nnz:
        bad = (ids < 0) | (ids >= num_ids)
        if bool(bad.any()):
            first = int(ids[bad][0])
            raise IndexError(
                f"{names[1]}: {what} ids holds id {first}, out of range for {ids_range} "
                f"{num_ids} (valid ids are 0..{num_ids - 1})"
            )


def check_csr_values_eagerly(indptr, ids, num_ids, what, names, ids_range) -> None:
    """:func:`check_csr_values` on CPU tensors only (free there), never while compiling, like
    :func:`check_column_values`."""
    if torch.compiler.is_compiling() or indptr.device.type != "cpu":
        return
    check_csr_values(indptr, ids, num_ids, what, names, ids_range)


def check_columns(columns, lead, what_lead: str) -> None:
    """``columns [*lead, K]`` int32/int64; ``what_lead`` names the tensor ``lead`` comes from."""
    check_index_dtype(columns, "columns")
    torch._check_value(
        columns.dim() >= 1 and tuple(columns.shape[:-1]) == tuple(lead),
        lambda: f"columns must be [*{what_lead}.shape[:-1], K] = [{', '.join(map(str, lead))}, K], "
        f"got {tuple(columns.shape)}",
    )


def check_project_args(p, col_indptr, col_student_ids, col_weights,
                       row_indptr, row_teacher_ids, row_weights, columns) -> None:
    """Preconditions of ``compileops::xtoken_project``: floating ``p [*, V_s]``, both CSR
    layouts valid and of one ``nnz``, ``V_s`` matching the row CSR, optional ``columns
    [*, K]`` with ``p``'s leading dims, everything on one device."""
    check_floating(p, "p")
    torch._check_value(p.dim() >= 1, lambda: "p must be [*, V_s], got a 0-d tensor")
    check_csr(col_indptr, col_student_ids, col_weights, "column CSR", COL_CSR)
    check_csr(row_indptr, row_teacher_ids, row_weights, "row CSR", ROW_CSR)
    torch._check_value(
        p.shape[-1] == row_indptr.shape[0] - 1,
        lambda: f"p's last dim ({p.shape[-1]}) must equal the projection's student vocab "
        f"({row_indptr.shape[0] - 1})",
    )
    torch._check_value(
        col_student_ids.shape[0] == row_teacher_ids.shape[0],
        lambda: f"col_student_ids has {col_student_ids.shape[0]} entries but row_teacher_ids "
        f"has {row_teacher_ids.shape[0]}: the column CSR and the row CSR must hold the same "
        "number of entries",
    )
    tensors = [("p", p), ("col_indptr", col_indptr), ("col_student_ids", col_student_ids),
               ("col_weights", col_weights), ("row_indptr", row_indptr),
               ("row_teacher_ids", row_teacher_ids), ("row_weights", row_weights)]
    if columns is not None:
        check_columns(columns, p.shape[:-1], "p")
        tensors.append(("columns", columns))
    check_same_device(tensors)


def check_project_backward_args(grad, row_indptr, row_teacher_ids, row_weights,
                                num_teacher, columns) -> None:
    """Preconditions of ``compileops::xtoken_project_backward``: floating ``grad [*, V_t]``
    (``V_t = num_teacher``), or ``grad [*, K]`` with ``columns [*, K]``; a valid row CSR;
    everything on one device."""
    check_floating(grad, "grad")
    torch._check_value(grad.dim() >= 1, lambda: "grad must be [*, V_t] or [*, K]")
    check_csr(row_indptr, row_teacher_ids, row_weights, "row CSR", ROW_CSR)
    torch._check_value(num_teacher >= 0, lambda: "num_teacher must be >= 0")
    tensors = [("grad", grad), ("row_indptr", row_indptr),
               ("row_teacher_ids", row_teacher_ids), ("row_weights", row_weights)]
    if columns is None:
        torch._check_value(
            grad.shape[-1] == num_teacher,
            lambda: f"grad's last dim ({grad.shape[-1]}) must equal num_teacher ({num_teacher})",
        )
    else:
        check_columns(columns, grad.shape[:-1], "grad")
        torch._check_value(
            columns.shape[-1] == grad.shape[-1],
            lambda: f"columns [*, K] and grad [*, K] disagree on K: "
            f"{columns.shape[-1]} vs {grad.shape[-1]}",
        )
        tensors.append(("columns", columns))
    check_same_device(tensors)


def check_columns_in_range(columns: torch.Tensor, num_teacher: int) -> None:
    """Raise ``IndexError`` naming the first teacher column outside ``[0, num_teacher)``.
    Reads ``columns`` on the host (a sync on GPU: the ops call it for CPU tensors only)."""
    if columns.numel() == 0:
        return
    bad = (columns < 0) | (columns >= num_teacher)
    if bool(bad.any()):
        first = int(columns.reshape(-1)[bad.reshape(-1)][0])
        raise IndexError(
            f"columns holds teacher id {first}, out of range for a projection with "
            f"{num_teacher} teacher columns (valid ids are 0..{num_teacher - 1})"
        )


def check_column_values(columns: Optional[torch.Tensor], num_teacher: int) -> None:
    """Eager value check of ``columns``: on CPU tensors only (free there), never while
    compiling. On CUDA nothing is read on the host: the kernels mask out-of-range columns
    (0 output, no gradient) so they never access memory out of bounds."""
    if columns is None or torch.compiler.is_compiling():
        return
    if columns.device.type == "cpu":
        check_columns_in_range(columns, num_teacher)


# ---------------------------------------------------------------------------------------
# Chunk sums


def check_chunk_id(chunk_id) -> None:
    """``chunk_id [B, T]`` int32/int64."""
    check_dim(chunk_id, 2, "chunk_id", "[B, T]")
    check_index_dtype(chunk_id, "chunk_id")


def check_chunk_args(log_probs, chunk_id, max_chunks) -> None:
    """Preconditions of ``compileops::xtoken_chunk_sums``: floating ``log_probs [B, T, V]``,
    ``chunk_id [B, T]``, ``max_chunks >= 0``, one device."""
    check_dim(log_probs, 3, "log_probs", "[B, T, V]")
    check_floating(log_probs, "log_probs")
    check_chunk_id(chunk_id)
    torch._check_value(
        tuple(chunk_id.shape) == tuple(log_probs.shape[:2]),
        lambda: f"chunk_id must be [B, T] = {tuple(log_probs.shape[:2])}, "
        f"got {tuple(chunk_id.shape)}",
    )
    torch._check_value(max_chunks >= 0, lambda: f"max_chunks must be >= 0, got {max_chunks}")
    check_same_device([("log_probs", log_probs), ("chunk_id", chunk_id)])


def check_chunk_backward_args(grad_sums, chunk_id, dtype) -> None:
    """Preconditions of ``compileops::xtoken_chunk_sums_backward``: floating ``grad_sums
    [B, C, V]``, ``chunk_id [B, T]`` with the same ``B``, a floating ``dtype``, one device."""
    check_dim(grad_sums, 3, "grad_sums", "[B, C, V]")
    check_floating(grad_sums, "grad_sums")
    check_chunk_id(chunk_id)
    torch._check_value(
        chunk_id.shape[0] == grad_sums.shape[0],
        lambda: f"chunk_id [B, T] and grad_sums [B, C, V] disagree on B: "
        f"{chunk_id.shape[0]} vs {grad_sums.shape[0]}",
    )
    torch._check_type(dtype.is_floating_point,
                      lambda: f"dtype must be a floating-point dtype, got {dtype}")
    check_same_device([("grad_sums", grad_sums), ("chunk_id", chunk_id)])


def check_valid_chunk_mask_args(student_sizes, teacher_sizes, pair_valid) -> None:
    """``valid_chunk_mask``: three ``[B, C]`` tensors of one shape (no broadcasting), one
    device. Plain raises, not ``torch._check``: this runs in traced code, where Dynamo refuses
    a ``torch._check`` whose message closes over a tensor."""
    if student_sizes.dim() != 2:
        raise RuntimeError(
            f"student_sizes must be 2-D [B, C], got shape {tuple(student_sizes.shape)}")
    for name, t in (("teacher_sizes", teacher_sizes), ("pair_valid", pair_valid)):
        if tuple(t.shape) != tuple(student_sizes.shape):
            raise ValueError(f"{name} must be [B, C] = {tuple(student_sizes.shape)} like "
                             f"student_sizes, got {tuple(t.shape)}")
        if t.device != student_sizes.device:
            raise RuntimeError(f"{name} is on {t.device} but student_sizes is on "
                               f"{student_sizes.device}; move them to the same device")


def chunk_segments(chunk_id: torch.Tensor, max_chunks: int):
    """Each chunk's tokens as a contiguous run, without a host sync.

    ``chunk_id [B, T]`` -> ``order [B, T]`` (token positions stably sorted by chunk id, ids
    outside ``[0, C)`` last), ``starts [B, C]``, ``ends [B, C]`` (int64, into ``order``).
    The stable sort keeps token order inside each chunk, so ids need not be contiguous.
    """
    ids = chunk_id.long()
    valid = (ids >= 0) & (ids < max_chunks)
    key = torch.where(valid, ids, torch.full_like(ids, max_chunks))
    sorted_key, order = torch.sort(key, dim=1, stable=True)
    wanted = torch.arange(max_chunks, device=ids.device).expand(ids.shape[0], max_chunks)
    wanted = wanted.contiguous()
    starts = torch.searchsorted(sorted_key, wanted)
    ends = torch.searchsorted(sorted_key, wanted, right=True)
    return order, starts, ends
