"""The kernels' column terms and their running max, from which the stabiliser comes.

``term_j = (igate_j - logf_j) * log2(e)`` and ``colmax_i = max_{w <= j <= i} term_j``, ``w``
the start of i's window (the row's start, or its chunk's in the chunkwise form). Since
``logD_ij = logf_i + term_j`` (log2 units) and the stabiliser is ``m_i = logf_i + colmax_i``,
every stabilised exponent the kernels take is a difference of these two arrays,
``logD_ij - m_i = term_j - colmax_i``, and the forget-gate sums ``logf`` drop out.

Precision: ``term`` and ``colmax`` are as large as the forget-gate sums (about 1.4 * S in
log2 units for gates around 0), while the exponents that count are small. Each is computed
in fp64 from fp64 sums and kept as an unevaluated sum ``hi + lo`` of two fp32 numbers; the
kernels take ``(term_hi_j - ref) + (term_lo_j - ref_lo)``, where the first difference is
exact whenever the two are within a factor of two (Sterbenz), so an exponent is rounded at
its own size, not at the sums'. With one fp32 array each, an exponent carried the rounding
of ``|logf|`` (6e-5 relative at S = 1024), which reached h and every gradient.

The forward reads, per query tile, its rows' ``colmax`` and the two ends of the tile's range
of it (the key loops' references); the key loops read the two ``term`` arrays. Computing them
in the tile itself (a scan of every gate left of it and a masked ``[BLOCK_M, BLOCK_M]`` max)
cost about 0.2 ms of a 1.65 ms forward at S = 1024 on an H100: one program per SM, nothing
overlaps a program's prologue. The backward reads the same arrays (its launcher computes
them again: one pass over ``[B, NH, S]``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compileops.mlstm.kernels.common import LOG2E

BLOCK = 1024


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def split_sum(x, OUT: tl.constexpr):
    """``x`` (fp64) as ``(hi, lo)`` in ``OUT``: the rounded value and the rounded remainder
    (0 where ``hi`` is infinite)."""
    hi = x.to(OUT)
    finite = (hi == hi) & (tl.abs(hi) < float("inf"))
    return hi, tl.where(finite, x - hi.to(tl.float64), 0.0).to(OUT)


@triton.jit
def column_terms_kernel(igate_ptr, logf_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr,
                        colmax_lo_ptr, seq_len, BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of the contiguous ``[R, S]`` gates (``logf`` fp64 or igate's
    dtype) -> the four ``[R, S]`` outputs in igate's dtype: :func:`column_terms_span` over
    the whole row."""
    column_terms_span(igate_ptr, logf_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr,
                      colmax_lo_ptr, tl.program_id(0).to(tl.int64) * seq_len, 0, seq_len, BLOCK)


@triton.jit
def column_terms_span(igate_ptr, logf_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr,
                      colmax_lo_ptr, base, first, end, BLOCK: tl.constexpr):
    """Elements ``[first, end)`` of the row at offset ``base``, the running max from
    ``first``: block by block with a carry, in fp64, each result stored as its ``hi`` and
    ``lo`` parts (:func:`split_sum`). The parallel form's whole row
    (:func:`column_terms_kernel`), the chunkwise form's chunk of a document
    (:mod:`.chunk_gates`)."""
    lanes = tl.arange(0, BLOCK)
    carry = tl.full((1,), float("-inf"), dtype=tl.float64)
    for start in range(first, end, BLOCK):
        idx = start + lanes
        live = idx < end
        term = (tl.load(igate_ptr + base + idx, mask=live, other=0.0).to(tl.float64)
                - tl.load(logf_ptr + base + idx, mask=live, other=0.0).to(tl.float64)) * LOG2E
        hi, lo = split_sum(term, term_hi_ptr.dtype.element_ty)
        tl.store(term_hi_ptr + base + idx, hi, mask=live)
        tl.store(term_lo_ptr + base + idx, lo, mask=live)
        term = tl.where(live, term, float("-inf"))
        running = tl.maximum(tl.associative_scan(term, 0, _larger), carry)
        hi, lo = split_sum(running, term_hi_ptr.dtype.element_ty)
        tl.store(colmax_hi_ptr + base + idx, hi, mask=live)
        tl.store(colmax_lo_ptr + base + idx, lo, mask=live)
        carry = tl.max(running, axis=0, keep_dims=True)


@triton.jit
def decay_exponent(term_hi, term_lo, ref_hi, ref_lo):
    """``(term_hi + term_lo) - (ref_hi + ref_lo)`` (any broadcastable shapes), the hi parts
    first: their difference is exact where they are within a factor of two, so the result
    is rounded at its own size."""
    return (term_hi - ref_hi) + (term_lo - ref_lo)


@triton.jit
def column_factor(term_hi_ptr, term_lo_ptr, cols, col_ok, ref, MASKED: tl.constexpr):
    """``exp2(term_j - ref)`` ``[BLOCK_N]`` for the columns ``cols`` of one row's terms at
    ``term_hi_ptr``, ``term_lo_ptr``: the column factor of a factorised decay. ``ref`` is a
    scalar of the terms' dtype (a hi part alone: the row factor takes the row's lo part).
    ``MASKED``: columns where ``col_ok`` is false read as ``-inf`` (factor 0)."""
    if MASKED:
        hi = tl.load(term_hi_ptr + cols, mask=col_ok, other=float("-inf"))
        lo = tl.load(term_lo_ptr + cols, mask=col_ok, other=0.0)
    else:
        hi = tl.load(term_hi_ptr + cols)
        lo = tl.load(term_lo_ptr + cols)
    return tl.exp2((hi - ref) + lo)


@triton.jit
def row_factor(ref, row_ref_hi, row_ref_lo, has_ref):
    """``exp2(ref - colmax_i)`` ``[BLOCK_M]``, the row factor of a factorised decay
    (:func:`column_factor`), 0 where there is no reference (``has_ref`` false)."""
    return tl.where(has_ref, tl.exp2((ref - row_ref_hi) - row_ref_lo), 0.0)


@triton.jit
def with_state_ref(row_ref_hi, row_ref_lo, state_ref):
    """The rows' reference ``colmax_i`` joined with the state entering the chunk, a column
    before the chunk whose term is ``state_ref`` (the chunkwise form, log2 units)."""
    from_state = state_ref > row_ref_hi
    return (tl.where(from_state, state_ref, row_ref_hi),
            tl.where(from_state, 0.0, row_ref_lo))


@triton.jit
def stabiliser_rows(logf_ptr, rows, row_ok, row_ref_hi, row_ref_lo, ACC: tl.constexpr):
    """``m_i = logf_i * log2(e) + colmax_i`` ``[BLOCK_M]`` in ``ACC``, summed in fp64 from
    the row's forget-gate sum at ``logf_ptr`` (fp64 or ``ACC``) and its reference pair."""
    logf = tl.load(logf_ptr + rows, mask=row_ok, other=0.0).to(tl.float64)
    return ((logf * LOG2E + row_ref_hi.to(tl.float64)) + row_ref_lo.to(tl.float64)).to(ACC)


def column_terms(igate: torch.Tensor, logf: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``igate`` (the accumulation dtype), ``logf`` (fp64 or igate's dtype) ``[B, NH, S]``,
    contiguous -> ``(term_hi, term_lo, colmax_hi, colmax_lo)``, each ``[B, NH, S]`` in
    igate's dtype, the running max along the whole row (the chunkwise form's, restarted at
    each chunk of each document: :func:`.chunk_gates.column_terms`)."""
    outs = tuple(torch.empty_like(igate) for _ in range(4))
    seq = logf.shape[-1]
    if logf.numel() == 0:
        return outs
    column_terms_kernel[(logf.numel() // seq,)](
        igate, logf, *outs, seq, BLOCK=min(BLOCK, max(16, triton.next_power_of_2(seq))))
    return outs
