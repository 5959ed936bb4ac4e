"""Triton kernels of the chunk segment sum and its backward gather, with their launchers.

The public side (``chunk_sums``, ``chunk_average``) is :mod:`compileops.xtoken.chunks`; the
op that calls these launchers is :mod:`compileops.xtoken.op`, after
:func:`compileops.xtoken.checks.chunk_segments` has laid each chunk's tokens out as a run.

* :func:`chunk_sums_kernel`: one program per (b, c, V-block) adds the chunk's rows in token
  order in fp32: deterministic and bitwise batch-invariant, no atomics.
* :func:`chunk_gather_kernel`: the backward, each token's row of the chunk gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def chunk_sums_kernel(
    lp_ptr, order_ptr, starts_ptr, ends_ptr, sums_ptr,
    n_tokens, n_chunks, vocab,
    stride_lp_b, stride_lp_t, stride_lp_v,
    UNROLL: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """``sums[b, c] = sum of log_probs[b, t]`` over chunk ``c``'s tokens ``t``, in token order.

    Grid ``(B * C, cdiv(V, BLOCK_V))``: one program per (b * C + c, V-block). ``T =
    n_tokens``, ``C = n_chunks``, ``V = vocab``.

    * ``lp_ptr``: ``log_probs [B, T, V]``, any float dtype; element ``(b, t, v)`` at
      ``b * stride_lp_b + t * stride_lp_t + v * stride_lp_v``.
    * ``order_ptr``: ``order [B, T]`` int64, contiguous: token positions sorted by chunk id,
      token order inside each chunk.
    * ``starts_ptr``, ``ends_ptr``: ``[B, C]`` int64, contiguous: chunk ``(b, c)`` is
      ``order[b, starts[b, c]:ends[b, c]]``.
    * ``sums_ptr``: ``sums [B, C, V]`` fp32, contiguous.

    ``UNROLL``: rows loaded per loop step; they are still added one by one in order.
    """
    bc = tl.program_id(0).to(tl.int64)
    b = bc // n_chunks
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vs < vocab
    v_off = vs.to(tl.int64) * stride_lp_v
    start = tl.load(starts_ptr + bc)  # scalar
    end = tl.load(ends_ptr + bc)  # scalar
    base = lp_ptr + b * stride_lp_b
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for i in range(start, end, UNROLL):
        for u in tl.static_range(UNROLL):
            ok = i + u < end
            # Scalar conditions join block masks through tl.where: & widens the scalar to
            # int32 under triton 3.9's interpreter, whose loads take bool masks only.
            tok = tl.load(order_ptr + b * n_tokens + i + u, mask=ok,
                          other=0).to(tl.int64)  # scalar
            row = tl.load(base + tok * stride_lp_t + v_off, mask=tl.where(ok, v_ok, False),
                          other=0.0)  # [BLOCK_V]
            acc += row.to(tl.float32)
    tl.store(sums_ptr + bc * vocab + vs, acc, mask=v_ok)


@triton.jit
def chunk_gather_kernel(
    grad_ptr, ids_ptr, out_ptr,
    n_tokens, n_chunks, vocab,
    stride_g_b, stride_g_c, stride_g_v,
    BLOCK_V: tl.constexpr,
):
    """``out[b, t] = grad_sums[b, chunk_id[b, t]]``, or 0 for an id outside ``[0, C)``.

    Grid ``(B * T, cdiv(V, BLOCK_V))``: one program per (b * T + t, V-block). ``T =
    n_tokens``, ``C = n_chunks``, ``V = vocab``.

    * ``grad_ptr``: ``grad_sums [B, C, V]``, any float dtype; element ``(b, c, v)`` at
      ``b * stride_g_b + c * stride_g_c + v * stride_g_v``.
    * ``ids_ptr``: ``chunk_id [B, T]`` int32/int64, contiguous.
    * ``out_ptr``: ``out [B, T, V]``, contiguous, in the dtype the gradient is wanted in.
    """
    bt = tl.program_id(0).to(tl.int64)
    b = bt // n_tokens
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vs < vocab
    c = tl.load(ids_ptr + bt).to(tl.int64)  # scalar
    valid = (c >= 0) & (c < n_chunks)
    src = grad_ptr + b * stride_g_b + c * stride_g_c + vs.to(tl.int64) * stride_g_v
    row = tl.load(src, mask=tl.where(valid, v_ok, False), other=0.0)  # [BLOCK_V]
    tl.store(out_ptr + bt * vocab + vs, row.to(out_ptr.dtype.element_ty), mask=v_ok)


# ---------------------------------------------------------------------------------------
# Launchers


def chunk_sums(
    log_probs: torch.Tensor,  # [B, T, V]
    order: torch.Tensor,  # [B, T] int64
    starts: torch.Tensor,  # [B, C] int64
    ends: torch.Tensor,  # [B, C] int64
) -> torch.Tensor:
    """``sums [B, C, V]`` fp32 from the chunk runs given by
    :func:`compileops.xtoken.checks.chunk_segments`."""
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
