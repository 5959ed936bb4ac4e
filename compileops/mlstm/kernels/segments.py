"""The chunkwise backward's scans along a row, one program per (row, segment).

A segment is a run of rows that shares nothing with the rows around it: a whole row, or one
packed document on its own chunks (:mod:`compileops.mlstm.documents`). Segments start on a
chunk boundary, and every scan here walks its segment in blocks counted from the segment's
own start (or its end, for the reverse scans). So a document's sums are computed in the same
order, with the same tree inside each block, as when the document is a row of its own: the
packed result is bitwise the document's alone, and nothing crosses a segment's edge, an Inf
or a NaN included.

Segment table (``segments``, int32 ``[K + 1]``): segment ``s`` is rows ``[segments[s],
segments[s + 1])``; without one, the row is one segment ``[0, S)``. The kernels always read
a table and never specialise on the row's length or chunk count: a document and the row it
is packed in run the same compiled code (Triton compiles another variant for a length of
1 or a multiple of 16, whose reductions may group differently).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

#: Rows per block of the row scans; chunks per block of the chunk scans (times the chunk's
#: rows, at most this many elements per tile). Constants, not functions of S: a document
#: and the row it is packed in must use the same blocks.
ROW_BLOCK = 1024
CHUNK_TILE = 4096


@triton.jit
def _segment(seg_ptr):
    seg = tl.program_id(1)
    return tl.load(seg_ptr + seg), tl.load(seg_ptr + seg + 1)


@triton.jit
def _last(x, lanes, BLOCK: tl.constexpr):
    """The last lane's value, as a scalar (a sum of zeros and it: exact)."""
    return tl.sum(tl.where(lanes == BLOCK - 1, x, tl.zeros_like(x)), axis=0)


@triton.jit(do_not_specialize=["seq_len", "num_chunks"])
def chunk_scan_kernel(x_ptr, out_ptr, seg_ptr, seq_len, num_chunks, CHUNK: tl.constexpr,
                      GROUP: tl.constexpr, REVERSE: tl.constexpr, LAST_ONLY: tl.constexpr):
    """Program (row, segment). A chunk's total is its last element (``LAST_ONLY``) or the
    sum of its elements; ``out_ptr [R, NC]`` gets, for each chunk of the segment, the sum
    of the totals of the segment's chunks before it (``REVERSE``: after it). ``x_ptr [R,
    S]`` contiguous. Groups of ``GROUP`` chunks from the segment's first chunk (``REVERSE``:
    from its last), a running carry between groups."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _segment(seg_ptr)
    first = start // CHUNK
    count = tl.cdiv(end, CHUNK) - first
    base = row * seq_len
    lanes = tl.arange(0, GROUP)
    offs = tl.arange(0, CHUNK)
    carry = tl.zeros((), dtype=out_ptr.dtype.element_ty)
    for g in range(0, tl.cdiv(count, GROUP)):
        if REVERSE:
            local = count - 1 - (g * GROUP + lanes)
        else:
            local = g * GROUP + lanes
        live = (local >= 0) & (local < count)
        chunk = first + local
        if LAST_ONLY:
            last = tl.minimum(chunk * CHUNK + CHUNK, end) - 1
            totals = tl.load(x_ptr + base + last, mask=live, other=0.0)
        else:
            rows = chunk[:, None] * CHUNK + offs[None, :]
            tile = tl.load(x_ptr + base + rows, mask=live[:, None] & (rows < end), other=0.0)
            totals = tl.sum(tile, axis=1)
        totals = tl.where(live, totals, 0.0).to(out_ptr.dtype.element_ty)
        inclusive = tl.cumsum(totals, axis=0) + carry
        tl.store(out_ptr + row * num_chunks + chunk, inclusive - totals, mask=live)
        carry = _last(inclusive, lanes, GROUP)


@triton.jit
def _argmax_combine(value_a, index_a, value_b, index_b):
    # b is the later: it wins ties, as torch.cummax's indices do.
    take_b = value_b >= value_a
    return tl.where(take_b, value_b, value_a), tl.where(take_b, index_b, index_a)


@triton.jit(do_not_specialize=["seq_len"])
def stabiliser_scan_kernel(keys_ptr, dm_ptr, argmax_ptr, prefix_ptr, seg_ptr, initial_ptr,
                           seq_len, HAS_INITIAL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, segment), rows ``[R, S]`` contiguous: ``argmax_ptr`` (int32) gets the
    running argmax of ``keys`` within the segment (the latest of equal maxima; -1 where the
    initial key ``initial_ptr [R]`` is larger, ``HAS_INITIAL``), ``prefix_ptr`` the running
    sum of ``dm`` within the segment. Blocks of ``BLOCK`` rows from the segment's start."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _segment(seg_ptr)
    base = row * seq_len
    lanes = tl.arange(0, BLOCK)
    if HAS_INITIAL:
        best = tl.load(initial_ptr + row).to(keys_ptr.dtype.element_ty)
        best_at = tl.full((), -1, dtype=tl.int32)
    else:
        # Where no key is >= -inf (NaN keys), the segment's first row: every argmax stays
        # inside its segment, so the row's argmaxes rise from segment to segment and a
        # search among them is right for every other segment.
        best = tl.full((), float("-inf"), dtype=keys_ptr.dtype.element_ty)
        best_at = tl.zeros((), dtype=tl.int32) + start
    carry = tl.zeros((), dtype=prefix_ptr.dtype.element_ty)
    for block in range(start, end, BLOCK):
        idx = block + lanes
        live = idx < end
        keys = tl.load(keys_ptr + base + idx, mask=live, other=float("-inf"))
        dm = tl.load(dm_ptr + base + idx, mask=live, other=0.0)
        value, at = tl.associative_scan((keys, idx.to(tl.int32)), 0, _argmax_combine)
        keep = ~(value >= best)  # the carried maximum wins only where it is strictly larger
        value = tl.where(keep, best, value)
        at = tl.where(keep, best_at, at)
        running = tl.cumsum(dm, axis=0) + carry
        tl.store(argmax_ptr + base + idx, at, mask=live)
        tl.store(prefix_ptr + base + idx, running, mask=live)
        best = _last(value, lanes, BLOCK)
        best_at = _last(at, lanes, BLOCK)
        carry = _last(running, lanes, BLOCK)


def _table(segments: Optional[torch.Tensor], seq: int, device) -> torch.Tensor:
    """The segment table, or the whole row's ``[0, S]`` (made on the device: no copy)."""
    if segments is not None:
        return segments.contiguous()
    return torch.arange(2, dtype=torch.int32, device=device) * seq


def chunk_scan(x: torch.Tensor, chunk: int, segments: Optional[torch.Tensor], *,
               reverse: bool, last_only: bool) -> torch.Tensor:
    """``[..., S]`` -> ``[..., NC]`` (NC = cdiv(S, chunk), at least 1): for each chunk the
    sum of the totals of the chunks before it in its segment (``reverse``: after it). A
    chunk's total: its last element (``last_only``) or the sum of its elements. Computed
    in ``x``'s dtype."""
    x = x.contiguous()
    seq = x.shape[-1]
    nc = max(1, -(-seq // chunk))
    out = torch.zeros((*x.shape[:-1], nc), dtype=x.dtype, device=x.device)
    rows = x.numel() // max(seq, 1)
    if seq and rows:
        table = _table(segments, seq, x.device)
        chunk_scan_kernel[(rows, table.shape[0] - 1)](
            x, out, table, seq, nc, CHUNK=chunk, GROUP=max(1, CHUNK_TILE // chunk),
            REVERSE=reverse, LAST_ONLY=last_only)
    return out


def stabiliser_scan(keys: torch.Tensor, dm: torch.Tensor, segments: Optional[torch.Tensor],
                    initial: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax int32, prefix)``, both ``[..., S]``, for ``keys``, ``dm [..., S]`` (the
    same dtype) and an optional initial key ``[...]``: see :func:`stabiliser_scan_kernel`."""
    keys, dm = keys.contiguous(), dm.contiguous()
    seq = keys.shape[-1]
    argmax = torch.empty(keys.shape, dtype=torch.int32, device=keys.device)
    prefix = torch.empty_like(dm)
    rows = keys.numel() // max(seq, 1)
    if seq and rows:
        table = _table(segments, seq, keys.device)
        stabiliser_scan_kernel[(rows, table.shape[0] - 1)](
            keys, dm, argmax, prefix, table,
            initial.contiguous() if initial is not None else keys, seq,
            HAS_INITIAL=initial is not None, BLOCK=ROW_BLOCK)
    return argmax, prefix


def stabiliser_shares(keys: torch.Tensor, dm: torch.Tensor, starts: Optional[torch.Tensor],
                      initial_key: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the stabiliser's gradient ``dm [..., S]`` lands among the columns, per segment
    (``starts``: the segments' first rows, then S; None: one segment): ``(shares [..., S],
    initial [...])``, ``initial`` the share of the initial state's key (a column before the
    first; zeros without one).

    Row i's maximal column is the running argmax of ``keys`` within its segment (the latest
    of equal maxima); it never decreases, so the rows sharing a column are a contiguous run
    and a column's share is the difference of the segment's running sums of ``dm`` at the
    run's two ends. Both scans are Triton kernels in blocks from the segment's start
    (:func:`stabiliser_scan`): no scatter, and a segment's shares do not
    depend on any other row or segment."""
    seq = keys.shape[-1]
    if seq == 0:
        return torch.zeros_like(dm), dm.new_zeros(dm.shape[:-1])
    argmax, prefix = stabiliser_scan(keys, dm, starts, initial_key)
    columns = torch.arange(seq, device=keys.device, dtype=torch.int32)
    if starts is None:
        column_start = torch.zeros_like(columns, dtype=torch.int64)
    else:
        first = starts.long()
        column_start = first[torch.searchsorted(first, columns.long(), right=True) - 1]
    # rows_upto[j]: the rows whose maximal column is <= j (every earlier segment's rows too).
    rows_upto = torch.searchsorted(argmax, columns.expand_as(argmax).contiguous(), right=True)
    below = torch.where(rows_upto > column_start,
                        prefix.gather(-1, (rows_upto - 1).clamp(min=0)),
                        torch.zeros_like(prefix))
    if initial_key is not None:
        # The rows reading the initial state come first in the row: argmax -1.
        reading = (argmax < 0).sum(dim=-1, keepdim=True)
        initial = torch.where(reading > 0, prefix.gather(-1, (reading - 1).clamp(min=0)),
                              torch.zeros_like(prefix[..., :1]))
    else:
        initial = torch.zeros_like(prefix[..., :1])
    previous = torch.cat([initial, below[..., :-1]], dim=-1)
    previous = torch.where(columns == column_start, initial, previous)
    return below - previous, initial[..., 0]
