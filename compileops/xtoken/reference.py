"""Ground truth for the cross-tokenizer distillation family, in plain PyTorch.

What the Triton kernels are tested against and what the ``reference`` backend runs. Every
reduction here is written as an explicit sequential sum in a fixed order (fp32), so the
reference itself is deterministic and bitwise batch-invariant. Keep it obvious.

Only the math lives here. Input checks, and the chunk index preprocessing both backends
share (:func:`compileops.xtoken.checks.chunk_segments`), are in
:mod:`compileops.xtoken.checks` and are tested on their own.

Projection buffers (see :mod:`compileops.xtoken.projection`):

* by teacher column (forward): ``col_indptr [V_t + 1]``, ``col_student_ids [nnz]``,
  ``col_weights [nnz]`` fp32; column ``j`` holds entries ``col_indptr[j]:col_indptr[j+1]``.
* by student row (backward): ``row_indptr [V_s + 1]``, ``row_teacher_ids [nnz]``,
  ``row_weights [nnz]`` fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import as_rows

from compileops.xtoken.checks import chunk_segments


def _segment_gather_sum(
    values: torch.Tensor,  # [N, X] fp32: what each entry reads from (per row)
    segments: torch.Tensor,  # [N, J] int64: which CSR segment each output uses
    indptr: torch.Tensor,  # [S + 1]
    entry_index: torch.Tensor,  # [nnz]: column of ``values`` an entry reads
    entry_weight: torch.Tensor,  # [nnz] fp32
) -> torch.Tensor:
    """``out[n, j] = sum_{k in segment segments[n, j]} values[n, entry_index[k]] * w[k]``,
    summed sequentially in CSR order (entry r of every segment is added at step r)."""
    indptr = indptr.long()
    n_segments = indptr.numel() - 1
    valid = (segments >= 0) & (segments < n_segments)  # out of range: empty (0 output)
    safe = torch.where(valid, segments, torch.zeros_like(segments))
    if n_segments == 0:
        starts = torch.zeros_like(segments)
        lengths = torch.zeros_like(segments)
    else:
        starts = indptr[safe]
        lengths = torch.where(valid, indptr[safe + 1] - starts, torch.zeros_like(starts))
    out = torch.zeros(segments.shape, dtype=torch.float32, device=values.device)
    steps = int(lengths.max()) if lengths.numel() else 0
    for r in range(steps):
        active = lengths > r
        k = torch.where(active, starts + r, torch.zeros_like(starts))
        idx = entry_index.long()[k]
        w = entry_weight[k]
        term = torch.gather(values, 1, idx) * w
        out = torch.where(active, out + term, out)
    return out


def project_forward(
    p: torch.Tensor,
    col_indptr: torch.Tensor,
    col_student_ids: torch.Tensor,
    col_weights: torch.Tensor,
    columns: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``p [*, V_s]`` -> ``p @ M`` ``[*, V_t]`` fp32, or with ``columns [*, K]`` only those
    teacher columns: ``out[*, j] = (p @ M)[*, columns[*, j]]`` ``[*, K]``.

    An out-of-range column (``< 0`` or ``>= V_t``) gives 0, as in the Triton kernel (the op
    raises ``IndexError`` for them on CPU before getting here, see
    :func:`compileops.xtoken.checks.check_column_values`)."""
    lead = p.shape[:-1]
    flat = as_rows(p).float()
    n_cols = col_indptr.numel() - 1
    if columns is None:
        segments = torch.arange(n_cols, device=p.device).expand(flat.shape[0], n_cols)
    else:
        segments = as_rows(columns).long()
    out = _segment_gather_sum(flat, segments, col_indptr, col_student_ids, col_weights)
    return out.reshape(*lead, segments.shape[-1])


def project_backward(
    grad: torch.Tensor,
    row_indptr: torch.Tensor,
    row_teacher_ids: torch.Tensor,
    row_weights: torch.Tensor,
    num_teacher: int,
    columns: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``grad [*, V_t]`` (or ``[*, K]`` with ``columns [*, K]``) -> ``grad @ M^T`` ``[*, V_s]`` fp32.

    With ``columns``, the gradient of a teacher column is the sum of the grads of every
    position ``j`` with ``columns[*, j]`` equal to it (duplicates add), in position order.
    Positions with an out-of-range column (``< 0`` or ``>= num_teacher``) contribute nothing,
    as in the Triton kernel.
    """
    lead = grad.shape[:-1]
    flat = as_rows(grad).float()
    if columns is not None:
        cols = as_rows(columns).long()
        dense = torch.zeros(flat.shape[0], num_teacher, dtype=torch.float32, device=grad.device)
        valid = (cols >= 0) & (cols < num_teacher)
        safe = torch.where(valid, cols, torch.zeros_like(cols))
        contrib = torch.where(valid, flat, torch.zeros_like(flat))
        for j in range(cols.shape[1] if num_teacher > 0 else 0):  # position order
            c = safe[:, j:j + 1]
            dense.scatter_(1, c, dense.gather(1, c) + contrib[:, j:j + 1])
        flat = dense
    n_rows = row_indptr.numel() - 1
    segments = torch.arange(n_rows, device=grad.device).expand(flat.shape[0], n_rows)
    out = _segment_gather_sum(flat, segments, row_indptr, row_teacher_ids, row_weights)
    return out.reshape(*lead, n_rows)


def chunk_sums(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs [B, T, V]``, ``chunk_id [B, T]`` -> ``sums [B, C, V]`` fp32, ``sizes [B, C]`` fp32.

    ``sums[b, c]`` is the sum of the rows ``t`` with ``chunk_id[b, t] == c``, added one by one
    in token order in fp32; ``sizes[b, c]`` counts them. Ids outside ``[0, C)`` (``-1``)
    contribute nowhere; empty chunks give zero.
    """
    B, T, V = log_probs.shape
    order, starts, ends = chunk_segments(chunk_id, max_chunks)
    lengths = ends - starts
    sums = torch.zeros(B, max_chunks, V, dtype=torch.float32, device=log_probs.device)
    steps = int(lengths.max()) if lengths.numel() else 0
    for r in range(steps):  # step r adds the r-th token (in token order) of every chunk
        active = lengths > r
        pos = torch.where(active, starts + r, torch.zeros_like(starts))
        tok = torch.gather(order, 1, pos)
        rows = torch.gather(log_probs, 1, tok[..., None].expand(B, max_chunks, V)).float()
        sums = torch.where(active[..., None], sums + rows, sums)
    return sums, lengths.float()


def chunk_sums_backward(
    grad_sums: torch.Tensor, chunk_id: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``grad_sums [B, C, V]``, ``chunk_id [B, T]`` -> ``grad [B, T, V]`` in ``dtype``: each
    token gets its chunk's grad row; tokens outside ``[0, C)`` get zero."""
    C = grad_sums.shape[1]
    if C == 0:  # no chunk: every token's gradient is zero (nothing to gather from)
        return grad_sums.new_zeros((*chunk_id.shape, grad_sums.shape[2]), dtype=dtype)
    ids = chunk_id.long()
    valid = (ids >= 0) & (ids < C)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    rows = torch.gather(grad_sums, 1, safe[..., None].expand(-1, -1, grad_sums.shape[2]))
    return torch.where(valid[..., None], rows, torch.zeros_like(rows)).to(dtype)


def chunk_average_one_hot_bmm(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The anchor this family replaces (NeMo-RL style): one-hot ``[B, T, C]`` then bmm.
    O(B*C*T*V) FLOPs; kept for tests and benchmarks only."""
    ids = chunk_id.long()
    valid = (ids >= 0) & (ids < max_chunks)
    one_hot = torch.nn.functional.one_hot(torch.where(valid, ids, 0), max_chunks)
    one_hot = (one_hot * valid[..., None]).to(log_probs.dtype)  # [B, T, C]
    sums = torch.bmm(one_hot.transpose(1, 2), log_probs)
    sizes = one_hot.sum(1)
    return sums / sizes.clamp(min=1)[..., None], sizes
