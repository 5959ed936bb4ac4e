"""Triton kernels for the cross-tokenizer family, with their eager launchers.

All three kernels are gathers with a fixed summation order and no atomics, so every result
is deterministic and bitwise batch-invariant (a row's sum never depends on other rows or on
the block configuration):

* :func:`csr_gather_sum_kernel`: ``out[n, j] = sum_{k in seg(n, j)} values[n, idx[k]] * w[k]``,
  entries added in CSR order. The projection forward (segments = teacher columns) and the
  full-vocab projection backward (segments = student rows) are both this kernel.
* :func:`csr_match_sum_kernel`: the projection backward when only a column subset
  ``columns [N, K]`` was projected: for student row s, each entry's teacher id is matched
  against the token's K columns (no dense ``[N, V_t]`` gradient is built).
* :func:`chunk_sums_kernel` / :func:`chunk_gather_kernel`: the chunk segment sum (one program
  per (b, c, V-block), rows added in token order in fp32) and its backward gather.

No ``libdevice`` functions are used, so everything also runs under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def csr_gather_sum_kernel(
    values_ptr, seg_ptr, indptr_ptr, idx_ptr, w_ptr, out_ptr,
    n_rows, n_out, n_seg,
    stride_v_row, stride_v_col, stride_seg_row, stride_o_row, stride_o_col,
    HAS_SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """Program (row block, output block). Without ``HAS_SEG`` output j uses segment j.
    With ``HAS_SEG``, a segment id outside ``[0, n_seg)`` is masked: empty, output 0."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    js = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    row_ok = rows < n_rows
    j_ok = js < n_out
    mask = row_ok[:, None] & j_ok[None, :]
    rows64 = rows.to(tl.int64)
    if HAS_SEG:
        seg = tl.load(seg_ptr + rows64[:, None] * stride_seg_row + js[None, :], mask=mask, other=0)
        seg = seg.to(tl.int64)
        mask = mask & (seg >= 0) & (seg < n_seg)  # bad ids never index indptr
        start = tl.load(indptr_ptr + seg, mask=mask, other=0).to(tl.int64)
        length = tl.load(indptr_ptr + seg + 1, mask=mask, other=0).to(tl.int64) - start
    else:
        start1 = tl.load(indptr_ptr + js, mask=j_ok, other=0).to(tl.int64)
        len1 = tl.load(indptr_ptr + js + 1, mask=j_ok, other=0).to(tl.int64) - start1
        start = start1[None, :] + tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.int64)
        length = len1[None, :] + tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.int64)
    length = tl.where(mask, length, 0)
    out_mask = row_ok[:, None] & j_ok[None, :]
    max_len = tl.max(tl.max(length, axis=1), axis=0)
    acc = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    for r in range(0, max_len):
        active = r < length
        k = start + r
        idx = tl.load(idx_ptr + k, mask=active, other=0).to(tl.int64)
        w = tl.load(w_ptr + k, mask=active, other=0.0)
        v = tl.load(values_ptr + rows64[:, None] * stride_v_row + idx * stride_v_col,
                    mask=active, other=0.0)
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
    """Program (token n, student block): ``out[n, s] = sum_k w[k] * sum_{j: cols[n, j] ==
    teacher[k]} grad[n, j]`` over row s's entries in CSR order. A column outside
    ``[0, n_teacher)`` matches nothing (its position gives no gradient)."""
    n = tl.program_id(0).to(tl.int64)
    ss = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = ss < n_student
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < k_cols
    cols = tl.load(cols_ptr + n * stride_c_row + ks, mask=k_ok, other=-1).to(tl.int64)
    cols = tl.where((cols >= 0) & (cols < n_teacher), cols, -1)  # never equals a teacher id
    g = tl.load(grad_ptr + n * stride_g_row + ks, mask=k_ok, other=0.0).to(tl.float32)
    start = tl.load(indptr_ptr + ss, mask=s_ok, other=0).to(tl.int64)
    length = tl.load(indptr_ptr + ss + 1, mask=s_ok, other=0).to(tl.int64) - start
    length = tl.where(s_ok, length, 0)
    max_len = tl.max(length, axis=0)
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for r in range(0, max_len):
        active = r < length
        k = start + r
        teacher = tl.load(idx_ptr + k, mask=active, other=-2).to(tl.int64)  # -2: no match
        w = tl.load(w_ptr + k, mask=active, other=0.0)
        match = teacher[:, None] == cols[None, :]
        gsum = tl.sum(tl.where(match, g[None, :], 0.0), axis=1)
        acc += gsum * w
    tl.store(out_ptr + n * stride_o_row + ss, acc, mask=s_ok)


@triton.jit
def chunk_sums_kernel(
    lp_ptr, order_ptr, starts_ptr, ends_ptr, sums_ptr,
    n_tokens, n_chunks, vocab,
    stride_lp_b, stride_lp_t, stride_lp_v,
    UNROLL: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (b * C + c, V-block): the rows of chunk c (positions ``order[b, start:end]``,
    token order) are loaded ``UNROLL`` at a time and added one by one in fp32."""
    bc = tl.program_id(0).to(tl.int64)
    b = bc // n_chunks
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vs < vocab
    v_off = vs.to(tl.int64) * stride_lp_v
    start = tl.load(starts_ptr + bc)
    end = tl.load(ends_ptr + bc)
    base = lp_ptr + b * stride_lp_b
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for i in range(start, end, UNROLL):
        for u in tl.static_range(UNROLL):
            ok = i + u < end
            tok = tl.load(order_ptr + b * n_tokens + i + u, mask=ok, other=0).to(tl.int64)
            row = tl.load(base + tok * stride_lp_t + v_off, mask=v_ok & ok, other=0.0)
            acc += row.to(tl.float32)
    tl.store(sums_ptr + bc * vocab + vs, acc, mask=v_ok)


@triton.jit
def chunk_gather_kernel(
    grad_ptr, ids_ptr, out_ptr,
    n_tokens, n_chunks, vocab,
    stride_g_b, stride_g_c, stride_g_v,
    BLOCK_V: tl.constexpr,
):
    """Program (b * T + t, V-block): ``out[b, t] = grad[b, chunk_id[b, t]]`` or 0."""
    bt = tl.program_id(0).to(tl.int64)
    b = bt // n_tokens
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vs < vocab
    c = tl.load(ids_ptr + bt).to(tl.int64)
    valid = (c >= 0) & (c < n_chunks)
    src = grad_ptr + b * stride_g_b + c * stride_g_c + vs.to(tl.int64) * stride_g_v
    row = tl.load(src, mask=v_ok & valid, other=0.0)
    tl.store(out_ptr + bt * vocab + vs, row.to(out_ptr.dtype.element_ty), mask=v_ok)


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
        seg, stride_seg = values, 0  # unused
    else:
        segments = segments.contiguous()
        block_n, block_j = 16, max(2, triton.next_power_of_2(min(n_out, 64)))
        seg, stride_seg = segments, segments.stride(0)
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(n_out, block_j))
    csr_gather_sum_kernel[grid](
        values, seg, indptr, idx, w, out,
        n_rows, n_out, n_seg,
        values.stride(0), values.stride(1), stride_seg, out.stride(0), out.stride(1),
        HAS_SEG=segments is not None, BLOCK_N=block_n, BLOCK_J=block_j, num_warps=4,
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


def chunk_sums(
    log_probs: torch.Tensor,  # [B, T, V]
    order: torch.Tensor,  # [B, T] int64
    starts: torch.Tensor,  # [B, C] int64
    ends: torch.Tensor,  # [B, C] int64
) -> torch.Tensor:
    """``sums [B, C, V]`` fp32 from the chunk runs given by :func:`reference.chunk_segments`."""
    B, T, V = log_probs.shape
    C = starts.shape[1]
    sums = torch.empty((B, C, V), dtype=torch.float32, device=log_probs.device)
    if B == 0 or C == 0 or V == 0:
        return sums
    block_v = min(triton.next_power_of_2(V), 1024)
    grid = (B * C, triton.cdiv(V, block_v))
    chunk_sums_kernel[grid](
        log_probs, order.contiguous(), starts.contiguous(), ends.contiguous(), sums,
        T, C, V,
        log_probs.stride(0), log_probs.stride(1), log_probs.stride(2),
        UNROLL=4, BLOCK_V=block_v, num_warps=4,
    )
    return sums


def chunk_sums_backward(
    grad_sums: torch.Tensor, chunk_id: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``grad_sums [B, C, V]``, ``chunk_id [B, T]`` -> ``[B, T, V]`` in ``dtype``."""
    B, C, V = grad_sums.shape
    T = chunk_id.shape[1]
    out = torch.empty((B, T, V), dtype=dtype, device=grad_sums.device)
    if B == 0 or T == 0 or V == 0:
        return out
    block_v = min(triton.next_power_of_2(V), 1024)
    grid = (B * T, triton.cdiv(V, block_v))
    chunk_gather_kernel[grid](
        grad_sums, chunk_id.contiguous(), out,
        T, C, V,
        grad_sums.stride(0), grad_sums.stride(1), grad_sums.stride(2),
        BLOCK_V=block_v, num_warps=4,
    )
    return out
