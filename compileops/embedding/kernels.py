"""Triton kernels for the embedding family, with their eager launchers.

Forward: a row gather with 64-bit row offsets (tables past 2**31 elements work), upcasting
only the gathered rows. Backward: a deterministic, batch-invariant scatter-add with no
floating-point atomics and no fp32 V x D buffer: ids are stably sorted, so each distinct id
is a contiguous run in token-position order; one program per (run, column block) sums that
run in fp32 (fp64 for fp64 grads) strictly in position order, and later programs of the same
launch zero the untouched rows, so every row is written exactly once.
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
def embedding_backward_kernel(
    sorted_ids_ptr, order_ptr, run_end_ptr, touched_ptr, grad_ptr, out_ptr,
    n_tokens, num_embeddings, dim, padding_idx,
    stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, UNROLL: tl.constexpr, BLOCK_COL: tl.constexpr,
    ZERO_ROWS: tl.constexpr, ACC_FP64: tl.constexpr, TILE: tl.constexpr,
):
    """Writes every row of ``out [V, D]`` exactly once, in one launch.

    Programs ``[0, n_tokens * col_blocks)``: program (p, c), if sorted position p starts the
    run of id r, writes out[r, c-block] = the run's grad rows added one by one in position
    order (fp32, or fp64 for fp64 grads); the padding row gets zeros. Other programs exit.
    These come first in the grid so the long, latency-bound runs start at once.
    Programs after them zero-fill ``ZERO_ROWS``-row blocks of rows no token touched, which
    overlaps the bandwidth-bound fill with the runs (no separate memset, no row written twice).

    The order of additions depends only on the run itself: bitwise batch-invariant.
    """
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(dim, BLOCK_COL)
    run_programs = n_tokens * col_blocks
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    if pid < run_programs:
        start = pid // col_blocks
        cols = (pid % col_blocks) * BLOCK_COL + tl.arange(0, BLOCK_COL)
        col_ok = cols < dim
        row = tl.load(sorted_ids_ptr + start).to(tl.int64)
        prev = tl.load(sorted_ids_ptr + start - 1, mask=start > 0, other=-1).to(tl.int64)
        in_table = (row >= 0) & (row < num_embeddings)
        tl.device_assert(in_table, "compileops.embedding_backward: id out of range")
        if (row != prev) & in_table:
            acc = tl.zeros([BLOCK_COL], dtype=acc_dtype)
            skip = False
            if HAS_PADDING:
                skip = row == padding_idx
            if not skip:
                end = tl.load(run_end_ptr + start)
                col_off = cols.to(tl.int64) * stride_g_col
                if end - start <= UNROLL:
                    # Short run (the common case): UNROLL independent loads in flight.
                    for k in tl.static_range(UNROLL):
                        p = start + k
                        in_run = p < end
                        tok = tl.load(order_ptr + p, mask=in_run, other=0).to(tl.int64)
                        g = tl.load(grad_ptr + tok * stride_g_row + col_off,
                                    mask=col_ok & in_run, other=0.0)
                        acc += g.to(acc_dtype)
                else:
                    # Long run: gather TILE rows in one 2-D load (one memory round trip
                    # instead of TILE dependent ones), then add them in position order.
                    # Row k is extracted by a masked sum whose other terms are exact zeros,
                    # so the result is bitwise the sequential sum.
                    lanes = tl.arange(0, TILE)
                    for chunk in range(start, end, TILE):
                        lane_in_run = chunk + lanes < end
                        lane_toks = tl.load(order_ptr + chunk + lanes, mask=lane_in_run,
                                            other=0).to(tl.int64)
                        tile = tl.load(
                            grad_ptr + lane_toks[:, None] * stride_g_row + col_off[None, :],
                            mask=lane_in_run[:, None] & col_ok[None, :], other=0.0,
                        ).to(acc_dtype)
                        for k in tl.static_range(TILE):
                            if chunk + k < end:
                                acc += tl.sum(tl.where(lanes[:, None] == k, tile, 0.0), axis=0)
            tl.store(out_ptr + row * dim + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        zero_pid = pid - run_programs
        rows = (zero_pid // col_blocks) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        cols = (zero_pid % col_blocks) * BLOCK_COL + tl.arange(0, BLOCK_COL)
        row_ok = rows < num_embeddings
        untouched = tl.load(touched_ptr + rows, mask=row_ok, other=1) == 0
        mask = (untouched & row_ok)[:, None] & (cols < dim)[None, :]
        zeros = tl.zeros([ZERO_ROWS, BLOCK_COL], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * dim + cols[None, :], zeros, mask=mask)


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
    *, unroll: int = 8, tile: int = 8, block_col: int = 1024, zero_rows: int = 8,
    num_warps: Optional[int] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """grad ``[*ids.shape, D]`` -> grad_weight ``[V, D]`` in ``weight_dtype`` (see module doc).

    Defaults measured on an H100 (benchmarks/RESULTS.md): 1024-column blocks, 8-row tiles
    for long runs, 8 loads in flight for short runs; narrower blocks, more warps and a
    software-prefetched tile loop were slower or no faster.

    Device-side preparation, no host sync: a stable sort of the ids (int32 keys when the
    table allows: half the radix passes), each sorted position's run end (searchsorted),
    and a touched-row map. Then one kernel writes every row once. ``out`` (``[V, D]``,
    ``weight_dtype``) may be given as the destination; its prior contents never matter.
    """
    dim = grad.shape[-1]
    flat_grad = grad.reshape(-1, dim)  # a view, also for stride-0 (expanded) grads
    flat_ids = ids.reshape(-1)
    n_tokens = flat_ids.numel()
    if out is None:
        out = torch.empty((num_embeddings, dim), dtype=weight_dtype, device=grad.device)
    if num_embeddings == 0 or dim == 0:
        return out
    if n_tokens == 0:
        return out.zero_()
    keys = flat_ids.to(torch.int32) if num_embeddings <= 2**31 - 1 else flat_ids
    sorted_ids, order = torch.sort(keys, stable=True)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    touched = torch.zeros(num_embeddings, dtype=torch.int8, device=grad.device)
    touched.index_fill_(0, flat_ids.long(), 1)  # every write stores the same value: deterministic
    block_col = min(triton.next_power_of_2(dim), block_col)
    col_blocks = triton.cdiv(dim, block_col)
    grid = (n_tokens * col_blocks + triton.cdiv(num_embeddings, zero_rows) * col_blocks,)
    embedding_backward_kernel[grid](
        sorted_ids, order, run_end, touched, flat_grad, out,
        n_tokens, num_embeddings, dim, -1 if padding_idx is None else padding_idx,
        flat_grad.stride(0), flat_grad.stride(1),
        HAS_PADDING=padding_idx is not None, UNROLL=unroll, BLOCK_COL=block_col,
        ZERO_ROWS=zero_rows, ACC_FP64=grad.dtype == torch.float64, TILE=tile,
        num_warps=num_warps or (4 if block_col >= 512 else 2),
        **_launch_options(grad.device),
    )
    return out
