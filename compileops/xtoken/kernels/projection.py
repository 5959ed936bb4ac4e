"""Triton kernels of the sparse projection ``p @ M`` and its backward, with their launchers.

The public side (the CSR buffers, ``project``, :class:`~compileops.xtoken.SparseProjection`)
is :mod:`compileops.xtoken.projection`; the op that calls these launchers is
:mod:`compileops.xtoken.op`. Both kernels are gathers over a CSR layout with a fixed
summation order and no atomics, so their results are deterministic and bitwise
batch-invariant (a row's sum never depends on other rows or on the block configuration):

* :func:`csr_gather_sum_kernel`: ``out[n, j] = sum_{k in seg(n, j)} values[n, idx[k]] * w[k]``,
  entries added in CSR order. The projection forward (segments = teacher columns, read from
  the column CSR) and the full-vocab projection backward (segments = student rows, read from
  the row CSR) are both this kernel.
* :func:`csr_match_sum_kernel`: the projection backward when only a column subset
  ``columns [N, K]`` was projected: for student row s, each entry's teacher id is matched
  against the token's K columns (no dense ``[N, V_t]`` gradient is built).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def csr_gather_sum_kernel(
    values_ptr, segments_ptr, indptr_ptr, idx_ptr, w_ptr, out_ptr,
    n_rows, n_out, n_seg,
    stride_v_row, stride_v_col, stride_seg_row, stride_o_row, stride_o_col,
    HAS_SEGMENTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """``out[n, j] = sum_{k in segment(n, j)} values[n, idx[k]] * w[k]``, added in CSR order.

    Grid ``(cdiv(N, BLOCK_N), cdiv(J, BLOCK_J))``: one program per (row block, output
    block). ``N = n_rows``, ``J = n_out``, ``S = n_seg`` segments, ``nnz`` CSR entries.

    * ``values_ptr``: ``values [N, X]``, any float dtype; element ``(n, x)`` at
      ``n * stride_v_row + x * stride_v_col``.
    * ``segments_ptr``: ``segments [N, J]`` int32/int64, row stride ``stride_seg_row``, unit
      column stride: the segment output ``(n, j)`` sums. Read only with ``HAS_SEGMENTS``.
    * ``indptr_ptr``: ``indptr [S + 1]`` int32/int64, contiguous: segment ``s`` holds
      entries ``indptr[s]:indptr[s + 1]``.
    * ``idx_ptr``: ``idx [nnz]`` int32/int64, contiguous: the column of ``values`` that
      entry ``k`` reads (must lie in ``[0, X)``).
    * ``w_ptr``: ``w [nnz]`` fp32, contiguous: entry weights.
    * ``out_ptr``: ``out [N, J]`` fp32; element ``(n, j)`` at
      ``n * stride_o_row + j * stride_o_col``.

    ``HAS_SEGMENTS``: output ``(n, j)`` uses segment ``segments[n, j]``, and an id outside
    ``[0, S)`` is masked (an empty segment: output 0, ``indptr`` never read there). Without
    it output ``j`` of every row uses segment ``j`` (``J == S``).
    """
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    js = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    row_ok = rows < n_rows
    j_ok = js < n_out
    mask = row_ok[:, None] & j_ok[None, :]
    rows64 = rows.to(tl.int64)
    if HAS_SEGMENTS:
        seg = tl.load(segments_ptr + rows64[:, None] * stride_seg_row + js[None, :], mask=mask,
                      other=0)  # [BLOCK_N, BLOCK_J]
        seg = seg.to(tl.int64)
        mask = mask & (seg >= 0) & (seg < n_seg)  # bad ids never index indptr
        start = tl.load(indptr_ptr + seg, mask=mask, other=0).to(tl.int64)  # [BLOCK_N, BLOCK_J]
        length = tl.load(indptr_ptr + seg + 1, mask=mask,
                         other=0).to(tl.int64) - start  # [BLOCK_N, BLOCK_J]
    else:
        start1 = tl.load(indptr_ptr + js, mask=j_ok, other=0).to(tl.int64)  # [BLOCK_J]
        len1 = tl.load(indptr_ptr + js + 1, mask=j_ok, other=0).to(tl.int64) - start1  # [BLOCK_J]
        start = start1[None, :] + tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.int64)
        length = len1[None, :] + tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.int64)
    length = tl.where(mask, length, 0)
    out_mask = row_ok[:, None] & j_ok[None, :]
    max_len = tl.max(tl.max(length, axis=1), axis=0)
    acc = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    for r in range(0, max_len):  # step r adds entry r of every segment
        active = r < length
        k = start + r
        idx = tl.load(idx_ptr + k, mask=active, other=0).to(tl.int64)  # [BLOCK_N, BLOCK_J]
        w = tl.load(w_ptr + k, mask=active, other=0.0)  # [BLOCK_N, BLOCK_J]
        v = tl.load(values_ptr + rows64[:, None] * stride_v_row + idx * stride_v_col,
                    mask=active, other=0.0)  # [BLOCK_N, BLOCK_J]
        acc += v.to(tl.float32) * w
    dst = out_ptr + rows64[:, None] * stride_o_row + js[None, :].to(tl.int64) * stride_o_col
    tl.store(dst, acc, mask=out_mask)


@triton.jit
def csr_match_sum_kernel(
    grad_ptr, cols_ptr, indptr_ptr, idx_ptr, w_ptr, out_ptr,
    n_rows, n_student, n_teacher, k_cols,
    stride_g_row, stride_c_row, stride_o_row,
    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """``out[n, s] = sum_k w[k] * sum_{j: cols[n, j] == idx[k]} grad[n, j]`` over student
    row ``s``'s entries ``k`` in CSR order.

    Grid ``(N, cdiv(V_s, BLOCK_S))``: one program per (token n, student block). ``N =
    n_rows``, ``K = k_cols`` (``BLOCK_K >= K``: all of a token's columns in one block),
    ``V_s = n_student``, ``V_t = n_teacher``.

    * ``grad_ptr``: ``grad [N, K]``, any float dtype, row stride ``stride_g_row``, unit
      column stride: the gradient of each projected column.
    * ``cols_ptr``: ``columns [N, K]`` int32/int64, row stride ``stride_c_row``, unit column
      stride: the teacher id each position projected. An id outside ``[0, V_t)`` matches
      nothing (its position gives no gradient).
    * ``indptr_ptr``: row CSR ``indptr [V_s + 1]``, contiguous: student ``s`` holds entries
      ``indptr[s]:indptr[s + 1]``.
    * ``idx_ptr``: ``teacher_ids [nnz]`` int32/int64, contiguous: entry ``k``'s teacher id.
    * ``w_ptr``: ``w [nnz]`` fp32, contiguous: entry weights.
    * ``out_ptr``: ``out [N, V_s]`` fp32, row stride ``stride_o_row``, unit column stride.
    """
    n = tl.program_id(0).to(tl.int64)
    ss = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = ss < n_student
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < k_cols
    cols = tl.load(cols_ptr + n * stride_c_row + ks, mask=k_ok, other=-1).to(tl.int64)  # [BLOCK_K]
    cols = tl.where((cols >= 0) & (cols < n_teacher), cols, -1)  # never equals a teacher id
    g = tl.load(grad_ptr + n * stride_g_row + ks, mask=k_ok,
                other=0.0).to(tl.float32)  # [BLOCK_K]
    start = tl.load(indptr_ptr + ss, mask=s_ok, other=0).to(tl.int64)  # [BLOCK_S]
    length = tl.load(indptr_ptr + ss + 1, mask=s_ok, other=0).to(tl.int64) - start  # [BLOCK_S]
    length = tl.where(s_ok, length, 0)
    max_len = tl.max(length, axis=0)
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for r in range(0, max_len):  # step r adds entry r of every student row
        active = r < length
        k = start + r
        # -2 where inactive: matches no column (those are >= 0 or -1).
        teacher = tl.load(idx_ptr + k, mask=active, other=-2).to(tl.int64)  # [BLOCK_S]
        w = tl.load(w_ptr + k, mask=active, other=0.0)  # [BLOCK_S]
        match = teacher[:, None] == cols[None, :]  # [BLOCK_S, BLOCK_K]
        gsum = tl.sum(tl.where(match, g[None, :], 0.0), axis=1)
        acc += gsum * w
    tl.store(out_ptr + n * stride_o_row + ss, acc, mask=s_ok)


# ---------------------------------------------------------------------------------------
# Launchers


def csr_gather_sum(
    values: torch.Tensor,  # [N, X]
    indptr: torch.Tensor,  # [S + 1]
    idx: torch.Tensor,  # [nnz]
    w: torch.Tensor,  # [nnz] fp32
    segments: Optional[torch.Tensor] = None,  # [N, J] or None (J = S)
) -> torch.Tensor:
    """``[N, J]`` fp32: ``out[n, j] = sum_{k in segment} values[n, idx[k]] * w[k]``.
    A segment id outside ``[0, S)`` gives 0 (masked in the kernel, nothing read)."""
    n_rows = values.shape[0]
    n_seg = indptr.numel() - 1
    n_out = n_seg if segments is None else segments.shape[1]
    out = torch.empty((n_rows, n_out), dtype=torch.float32, device=values.device)
    if n_rows == 0 or n_out == 0:
        return out
    # The kernel indexes the CSR buffers as ``ptr + k`` (unit stride): make strided views dense.
    indptr, idx, w = indptr.contiguous(), idx.contiguous(), w.contiguous()
    if segments is None:
        # Every token reads the same entries: lay tokens out contiguously, so one gathered
        # vocab entry is a contiguous run of tokens (coalesced), and tile tokens widely.
        values = values.t().contiguous().t()
        block_n, block_j = 64, 16
        seg, stride_seg = values, 0  # not read without HAS_SEGMENTS
    else:
        segments = segments.contiguous()
        block_n, block_j = 16, max(2, triton.next_power_of_2(min(n_out, 64)))
        seg, stride_seg = segments, segments.stride(0)
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_out, block_j))
    csr_gather_sum_kernel[grid](
        values, seg, indptr, idx, w, out,
        n_rows, n_out, n_seg,
        values.stride(0), values.stride(1), stride_seg, out.stride(0), out.stride(1),
        HAS_SEGMENTS=segments is not None, BLOCK_N=block_n, BLOCK_J=block_j, num_warps=4,
    )
    return out


def csr_match_sum(
    grad: torch.Tensor,  # [N, K]
    columns: torch.Tensor,  # [N, K]
    indptr: torch.Tensor,  # [V_s + 1]
    teacher_ids: torch.Tensor,  # [nnz]
    w: torch.Tensor,  # [nnz]
    num_teacher: int,
) -> torch.Tensor:
    """``[N, V_s]`` fp32: the projection backward for a projected column subset. Positions
    whose column is outside ``[0, num_teacher)`` contribute nothing."""
    n_rows, k_cols = grad.shape
    n_student = indptr.numel() - 1
    out = torch.empty((n_rows, n_student), dtype=torch.float32, device=grad.device)
    if n_rows == 0 or n_student == 0:
        return out
    grad, columns = grad.contiguous(), columns.contiguous()
    # The kernel indexes the CSR buffers as ``ptr + k`` (unit stride): make strided views dense.
    indptr, teacher_ids, w = indptr.contiguous(), teacher_ids.contiguous(), w.contiguous()
    block_s = 256
    grid = (n_rows, triton.cdiv(n_student, block_s))
    csr_match_sum_kernel[grid](
        grad, columns, indptr, teacher_ids, w, out,
        n_rows, n_student, num_teacher, k_cols,
        grad.stride(0), columns.stride(0), out.stride(0),
        BLOCK_K=max(2, triton.next_power_of_2(k_cols)), BLOCK_S=block_s, num_warps=4,
    )
    return out
