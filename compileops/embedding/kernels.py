"""Triton kernels for the embedding family, with their eager launchers.

Forward: a row gather with 64-bit row offsets (tables past 2**31 elements work), upcasting
only the gathered rows. Backward: a deterministic, batch-invariant scatter-add with no
floating-point atomics: ids are stably sorted, so each distinct id is a contiguous run in
token-position order, and one program per (run, column block) sums that run in fp32 (fp64 for fp64
grads), strictly in position order, and writes the row once.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def gather_rows_tile(
    ids_ptr, weight_ptr, out_ptr,
    n_tokens, num_embeddings, dim,
    stride_w_row, stride_w_col,
    pid_tok, pid_col,
    BLOCK_TOK: tl.constexpr, BLOCK_COL: tl.constexpr,
):
    """Copy ``BLOCK_TOK`` gathered rows x ``BLOCK_COL`` columns into the contiguous ``out``."""
    toks = pid_tok * BLOCK_TOK + tl.arange(0, BLOCK_TOK)
    cols = pid_col * BLOCK_COL + tl.arange(0, BLOCK_COL)
    tok_ok = toks < n_tokens
    col_ok = cols < dim
    ids = tl.load(ids_ptr + toks, mask=tok_ok, other=0).to(tl.int64)
    # Active only when compiled with debug=True (the launcher does so on GPUs). The message
    # must be a literal: Triton kernels cannot read non-constexpr globals.
    tl.device_assert(
        (ids >= 0) & (ids < num_embeddings),
        "compileops.embedding: id out of range [0, num_embeddings)",
        mask=tok_ok,
    )
    mask = tok_ok[:, None] & col_ok[None, :]
    src = weight_ptr + ids[:, None] * stride_w_row + cols[None, :].to(tl.int64) * stride_w_col
    rows = tl.load(src, mask=mask)
    dst = out_ptr + toks[:, None].to(tl.int64) * dim + cols[None, :]
    tl.store(dst, rows.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def embedding_forward_kernel(
    ids_ptr, weight_ptr, out_ptr,
    n_tokens, num_embeddings, dim,
    stride_w_row, stride_w_col,
    BLOCK_TOK: tl.constexpr, BLOCK_COL: tl.constexpr,
):
    gather_rows_tile(
        ids_ptr, weight_ptr, out_ptr, n_tokens, num_embeddings, dim,
        stride_w_row, stride_w_col, tl.program_id(0), tl.program_id(1),
        BLOCK_TOK, BLOCK_COL,
    )


@triton.jit
def sum_sorted_runs_kernel(
    sorted_ids_ptr, order_ptr, grad_ptr, out_ptr,
    n_tokens, dim, padding_idx,
    stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, UNROLL: tl.constexpr, BLOCK_COL: tl.constexpr,
    ACC_FP64: tl.constexpr,
):
    """Program (p, c): if sorted position p starts a run of id r, out[r, c-block] = sum of the
    run's grad rows, added one by one in position order in fp32. Other programs exit.

    ``UNROLL`` contributions are loaded per step so their loads overlap; the adds stay in
    order, so the result depends only on the run itself (bitwise batch-invariant).
    """
    start = tl.program_id(0)
    row = tl.load(sorted_ids_ptr + start)
    prev = tl.load(sorted_ids_ptr + start - 1, mask=start > 0, other=-1)
    is_run_start = row != prev
    if HAS_PADDING:
        is_run_start = is_run_start & (row != padding_idx)
    if is_run_start:
        cols = tl.program_id(1) * BLOCK_COL + tl.arange(0, BLOCK_COL)
        col_ok = cols < dim
        col_off = cols.to(tl.int64) * stride_g_col
        acc_dtype = tl.float64 if ACC_FP64 else tl.float32
        acc = tl.zeros([BLOCK_COL], dtype=acc_dtype)
        pos = start
        in_run = True
        while in_run:
            for k in tl.static_range(UNROLL):
                p = pos + k
                p_ok = p < n_tokens
                same = (tl.load(sorted_ids_ptr + p, mask=p_ok, other=-1) == row) & p_ok
                tok = tl.load(order_ptr + p, mask=same, other=0).to(tl.int64)
                g = tl.load(grad_ptr + tok * stride_g_row + col_off, mask=col_ok & same, other=0.0)
                acc += g.to(acc_dtype)
            pos += UNROLL
            in_run = tl.load(sorted_ids_ptr + pos, mask=pos < n_tokens, other=-1) == row
        dst = out_ptr + row.to(tl.int64) * dim + cols
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _forward_config(dim: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_TOK, BLOCK_COL, num_warps): 16-byte accesses, ~16 KB moved per program."""
    block_col = min(triton.next_power_of_2(dim), max(16, 4096 // elem_size))
    block_tok = max(1, min(16, (16384 // elem_size) // block_col))
    return block_tok, block_col, 4


def _launch_options(device: torch.device) -> dict:
    # debug=True keeps the device-side bounds assert; integer-overflow sanitising stays off
    # (same choice Inductor makes for its own indirect-indexing asserts).
    if device.type == "cuda" and not torch.version.hip:
        return {"debug": True, "sanitize_overflow": False}
    return {}


def embedding_forward(
    ids: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
    *, config: Optional[tuple[int, int, int]] = None,
) -> torch.Tensor:
    """ids ``[*]`` int32/int64, weight ``[V, D]`` -> ``[*, D]`` in ``out_dtype or weight.dtype``."""
    num_embeddings, dim = weight.shape
    out_dtype = out_dtype or weight.dtype
    flat_ids = ids.reshape(-1)
    if not flat_ids.is_contiguous():
        flat_ids = flat_ids.contiguous()
    n_tokens = flat_ids.numel()
    out = torch.empty((n_tokens, dim), dtype=out_dtype, device=weight.device)
    if n_tokens and dim:
        block_tok, block_col, num_warps = config or _forward_config(dim, weight.element_size())
        grid = (triton.cdiv(n_tokens, block_tok), triton.cdiv(dim, block_col))
        embedding_forward_kernel[grid](
            flat_ids, weight, out, n_tokens, num_embeddings, dim,
            weight.stride(0), weight.stride(1),
            BLOCK_TOK=block_tok, BLOCK_COL=block_col, num_warps=num_warps,
            **_launch_options(weight.device),
        )
    return out.reshape(*ids.shape, dim)


def embedding_backward(
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int],
    weight_dtype: torch.dtype,
    *, unroll: int = 8,
) -> torch.Tensor:
    """grad ``[*ids.shape, D]`` -> grad_weight ``[V, D]`` in ``weight_dtype`` (see module doc)."""
    dim = grad.shape[-1]
    flat_grad = grad.reshape(-1, dim)  # a view, also for stride-0 (expanded) grads
    flat_ids = ids.reshape(-1)
    n_tokens = flat_ids.numel()
    out = torch.zeros((num_embeddings, dim), dtype=weight_dtype, device=grad.device)
    if n_tokens == 0 or dim == 0:
        return out
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    block_col = min(triton.next_power_of_2(dim), 1024)
    grid = (n_tokens, triton.cdiv(dim, block_col))
    sum_sorted_runs_kernel[grid](
        sorted_ids, order, flat_grad, out,
        n_tokens, dim, -1 if padding_idx is None else padding_idx,
        flat_grad.stride(0), flat_grad.stride(1),
        HAS_PADDING=padding_idx is not None, UNROLL=unroll, BLOCK_COL=block_col,
        ACC_FP64=grad.dtype == torch.float64,
        num_warps=4 if block_col >= 512 else 2,
    )
    return out
