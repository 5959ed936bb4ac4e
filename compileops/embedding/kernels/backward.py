"""The embedding backward kernel and its launcher.

A deterministic, batch-invariant scatter-add with no floating-point atomics and no fp32
V x D buffer. Given the ids stably sorted (``sort.py``: each distinct id is a contiguous run
of sorted positions, in token-position order; runs in id order, or longest first), ONE
kernel writes every row of ``grad_weight`` exactly once:

* Run programs, one per (block of ``RUN_BLOCK`` sorted positions, column block), each
  handle every run that *starts* in their block, finding the run's end themselves by
  comparing sorted ids (no searchsorted pass). Runs of at most ``UNROLL`` entries are summed
  together as a 2-D ``[RUN_BLOCK, BLOCK_COL]`` accumulator: step k adds every run's k-th grad
  row, all index and row loads independent of each other, so in flight together. A longer
  run (at most one per block, since ``UNROLL >= RUN_BLOCK - 1``) is walked ``TILE`` rows per
  step: the step's TILE row loads are issued before its in-order adds, and the next step's
  token positions are loaded meanwhile, so each step costs about one memory round trip
  (the latency-bound chain of a hot id).
  Either way each row is the fp32 sum (fp64 for fp64 grads) of its grad rows added one by
  one in token-position order, bitwise the reference's sum; the padding row gets zeros.
* Fill programs zero the untouched rows, ``FILL_ROWS`` whole rows each. A row is untouched
  iff a binary search for it in the sorted ids misses (``FILL == FILL_SEARCH``: one search
  over all ids brackets the program's rows, then a short search per row inside the
  bracket), or iff a touched-row map built beforehand says so (``FILL == FILL_MAP``).
* Run programs come first in the grid, so the long chains start at once and run while the
  bandwidth-bound fill proceeds. The two-stream schedule instead launches the run programs
  and the fill programs as two grids (``PROGRAMS``).

The long-run step keeps TILE rows in flight, so the kernel needs ~80 (8 warps) to ~128
(4 warps) registers per thread; the launcher caps registers with ``maxnreg``: with a cap,
ptxas hoists a step's loads above its adds, without one it interleaves them and keeps only
a few rows in flight.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import _launch
from ..._launch import cdiv
from .cast import cast_as_torch
from .config import BackwardTiles, device_options

# How the fill programs find untouched rows (the kernel's FILL).
FILL_SEARCH = tl.constexpr(0)  # binary search in the sorted ids (needs id order)
FILL_MAP = tl.constexpr(1)  # a touched-row map: int8 flags or int32 counts, nonzero = touched

# Which programs one launch runs (the kernel's PROGRAMS).
ALL_PROGRAMS = tl.constexpr(0)  # run programs, then fill programs: the one-launch schedule
RUN_PROGRAMS = tl.constexpr(1)  # run programs only (untouched rows are left as they are)
FILL_PROGRAMS = tl.constexpr(2)  # fill programs only (touched rows are left as they are)


@triton.jit
def _run_starts(sorted_ids_ptr, pos, n_tokens, num_embeddings):
    """Sorted positions ``pos`` -> ``(row, is_start)``: the id at each position (-1 past
    ``n_tokens``) and whether a run of an in-range id starts there. Out-of-range ids trip
    the device-side assert (the kernels run with ``debug=True`` on GPUs)."""
    in_n = pos < n_tokens
    row = tl.load(sorted_ids_ptr + pos, mask=in_n, other=-1)  # [RUN_BLOCK]
    prev = tl.load(sorted_ids_ptr + pos - 1, mask=in_n & (pos > 0), other=-1)  # [RUN_BLOCK]
    in_table = (row >= 0) & (row < num_embeddings)
    tl.device_assert(in_table, "compileops.embedding_backward: id out of range", mask=in_n)
    return row, in_n & in_table & (row != prev)


@triton.jit
def _longer_than(sorted_ids_ptr, pos, row, is_start, n_tokens, length):
    """Run starts (``is_start`` at sorted positions ``pos``, ids ``row``) whose run has more
    than ``length`` entries: each id's entries are contiguous, so the id ``length``
    positions on is still the run's."""
    after = pos + length
    return is_start & (tl.load(sorted_ids_ptr + after, mask=after < n_tokens, other=-1) == row)


@triton.jit
def _load_positions(order_ptr, p, n_tokens, TILE: tl.constexpr):
    """Token positions of sorted positions ``[p, p + TILE)`` (0 past the end), as a tuple of
    TILE int32 scalars (``order_ptr``: int64 positions viewed as int32 pairs)."""
    toks = ()
    for k in tl.static_range(TILE):
        q = p + k
        toks = toks + (tl.load(order_ptr + q.to(tl.int64) * 2, mask=q < n_tokens, other=0),)
    return toks


@triton.jit
def _long_run_sum(
    sorted_ids_ptr, order_ptr, grad_ptr, start, row, n_tokens, col_off, col_ok, stride_g_row,
    ACC_DTYPE: tl.constexpr, BLOCK_COL: tl.constexpr, TILE: tl.constexpr,
):
    """``[BLOCK_COL]`` fp32/fp64 sum, in position order, of the grad rows of the run of
    ``row`` that starts at sorted position ``start``, TILE rows per step.

    The run's end is found on the way: one sorted id (position p + TILE - 1, loaded during the
    previous step) says whether a whole step lies inside the run (each id's entries are
    contiguous in the sorted order, in id or hot-first order alike). Such a full step loads
    its TILE rows with no per-row predicate, so (with a register cap, see ``maxnreg``) the
    compiler issues them all before the first add; the last, partial step checks every row.
    The next step's token positions are loaded during the current step (a loop-carried
    tuple), which leaves one memory round trip per step.

    Rows past the run's end are loaded as +0.0; ``acc`` starts at +0.0 so it is never -0.0,
    and ``acc + 0.0`` is ``acc`` bitwise.
    """
    acc = tl.zeros([BLOCK_COL], dtype=ACC_DTYPE)
    p = start
    last = p + TILE - 1
    full = tl.load(sorted_ids_ptr + last, mask=last < n_tokens, other=-1) == row
    more = start < n_tokens
    toks = _load_positions(order_ptr, p, n_tokens, TILE)
    while more:
        if full:
            for k in tl.static_range(TILE):
                g = tl.load(grad_ptr + toks[k].to(tl.int64) * stride_g_row + col_off,
                            mask=col_ok, other=0.0)  # [BLOCK_COL]
                acc += g.to(ACC_DTYPE)
            p += TILE
            toks = _load_positions(order_ptr, p, n_tokens, TILE)
            last = p + TILE - 1
            full = tl.load(sorted_ids_ptr + last, mask=last < n_tokens, other=-1) == row
            more = tl.load(sorted_ids_ptr + p, mask=p < n_tokens, other=-1) == row
        else:
            for k in tl.static_range(TILE):
                q = p + k
                in_run = tl.load(sorted_ids_ptr + q, mask=q < n_tokens, other=-1) == row
                # tl.where, not col_ok & in_run: a scalar joined to a block mask with & is
                # widened to int32 by triton 3.9's interpreter, whose loads take bool masks.
                g = tl.load(grad_ptr + toks[k].to(tl.int64) * stride_g_row + col_off,
                            mask=tl.where(in_run, col_ok, False), other=0.0)  # [BLOCK_COL]
                acc += g.to(ACC_DTYPE)
            more = full  # false: that was the run's last step
    return acc


@triton.jit
def _sum_runs(
    sorted_ids_ptr, order_ptr, grad_ptr, out_ptr, run_pid,
    n_tokens, num_embeddings, dim, padding_idx, stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_COL: tl.constexpr,
    RUN_BLOCK: tl.constexpr, UNROLL: tl.constexpr, TILE: tl.constexpr,
):
    """Run program ``run_pid`` = (b, c): writes, for columns ``[c * BLOCK_COL, +BLOCK_COL)``,
    the row of every run that starts at a sorted position in ``[b * RUN_BLOCK, +RUN_BLOCK)``
    (zeros for the padding row)."""
    acc_dtype: tl.constexpr = tl.float64 if ACC_FP64 else tl.float32
    col_blocks = tl.cdiv(dim, BLOCK_COL)
    col_start = (run_pid % col_blocks) * BLOCK_COL
    cols = col_start + tl.arange(0, BLOCK_COL)
    col_ok = cols < dim
    col_off = cols.to(tl.int64) * stride_g_col
    pos = (run_pid // col_blocks) * RUN_BLOCK + tl.arange(0, RUN_BLOCK)  # [RUN_BLOCK]
    row, is_start = _run_starts(sorted_ids_ptr, pos, n_tokens, num_embeddings)
    # A run is long when it has more than UNROLL entries. Since UNROLL >= RUN_BLOCK - 1,
    # a long run covers the rest of the block: at most one per block, its last start.
    is_long = _longer_than(sorted_ids_ptr, pos, row, is_start, n_tokens, UNROLL)
    if HAS_PADDING:
        is_long = is_long & (row != padding_idx)
        summed = is_start & (is_long == 0) & (row != padding_idx)
    else:
        summed = is_start & (is_long == 0)

    # Short runs: step k adds the k-th grad row of every short run of the block.
    acc = tl.zeros([RUN_BLOCK, BLOCK_COL], dtype=acc_dtype)
    for k in tl.static_range(UNROLL):
        q = pos + k
        q_ok = q < n_tokens  # the index loads depend on no other load: all in flight
        if k == 0:
            live = summed
        else:
            live = summed & (tl.load(sorted_ids_ptr + q, mask=q_ok, other=-1) == row)
        # [RUN_BLOCK] token positions (low words of order)
        tok = tl.load(order_ptr + q.to(tl.int64) * 2, mask=q_ok, other=0).to(tl.int64)
        g = tl.load(grad_ptr + tok[:, None] * stride_g_row + col_off[None, :],
                    mask=live[:, None] & col_ok[None, :], other=0.0)  # [RUN_BLOCK, BLOCK_COL]
        acc += g.to(acc_dtype)
    written = is_start & (is_long == 0)  # short runs, and the padding row (zeros)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * dim + cols[None, :],
             cast_as_torch(acc, out_ptr.dtype.element_ty), mask=written[:, None] & col_ok[None, :])

    long_start = tl.max(tl.where(is_long, pos, -1), axis=0)
    if long_start >= 0:
        long_row = tl.load(sorted_ids_ptr + long_start)
        long_acc = _long_run_sum(
            sorted_ids_ptr, order_ptr, grad_ptr, long_start, long_row, n_tokens,
            col_off, col_ok, stride_g_row, acc_dtype, BLOCK_COL, TILE,
        )
        tl.store(out_ptr + long_row.to(tl.int64) * dim + cols,
                 cast_as_torch(long_acc, out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _fill_untouched_rows(
    sorted_ids_ptr, touched_ptr, out_ptr, fill_pid,
    n_tokens, num_embeddings, dim, search_top, search_steps,
    FILL_ROWS: tl.constexpr, FILL_CHUNK: tl.constexpr, FILL_COL: tl.constexpr,
    FILL: tl.constexpr,
):
    """Fill program ``fill_pid``: zero the rows of ``[fill_pid * FILL_ROWS, +FILL_ROWS)``
    that no token touched, all columns, ``FILL_CHUNK`` rows x ``FILL_COL`` columns per
    store (bounded registers).

    ``FILL_SEARCH``: one pair of binary searches over all sorted ids brackets the positions
    ``[lo, hi)`` holding this program's rows (``search_top``: the largest power of two <=
    n_tokens, ``search_steps`` its bit count); each chunk then binary-searches its rows in
    that bracket only (a few steps: it is usually tiny). Stores do not block, so a chunk's
    search overlaps with the previous chunk's stores draining. ``FILL_MAP``: the rows'
    entries of ``touched_ptr`` say which are touched.
    """
    r0 = fill_pid.to(tl.int64) * FILL_ROWS
    if FILL == FILL_SEARCH:
        below_lo = fill_pid * 0 - 1  # last positions holding an id < r0, < r0 + FILL_ROWS
        below_hi = fill_pid * 0 - 1
        for i in range(search_steps):
            step = search_top >> i
            cand_lo = below_lo + step
            cand_hi = below_hi + step
            id_lo = tl.load(sorted_ids_ptr + cand_lo, mask=cand_lo < n_tokens, other=0)  # scalar
            id_hi = tl.load(sorted_ids_ptr + cand_hi, mask=cand_hi < n_tokens, other=0)
            below_lo = tl.where((cand_lo < n_tokens) & (id_lo < r0), cand_lo, below_lo)
            below_hi = tl.where((cand_hi < n_tokens) & (id_hi < r0 + FILL_ROWS), cand_hi, below_hi)
        lo = below_lo + 1
        hi = below_hi + 1
        top = hi * 0 + 1  # largest power of two <= hi - lo (1 when the bracket is empty)
        while top * 2 <= hi - lo:
            top *= 2
    for chunk in range(FILL_ROWS // FILL_CHUNK):
        rows = r0 + chunk * FILL_CHUNK + tl.arange(0, FILL_CHUNK)  # [FILL_CHUNK]
        row_ok = rows < num_embeddings
        if FILL == FILL_SEARCH:
            last = tl.zeros([FILL_CHUNK], dtype=tl.int32) + (lo - 1)
            step = top
            while step > 0:
                cand = last + step
                cand_ok = cand < hi
                below = tl.load(sorted_ids_ptr + cand, mask=cand_ok, other=0) < rows  # [FILL_CHUNK]
                last = tl.where(cand_ok & below, cand, last)
                step = step // 2
            first = last + 1
            found = tl.load(sorted_ids_ptr + first, mask=first < hi, other=-1) == rows  # [FILL_CHUNK]
            untouched = row_ok & (found == 0)
        else:
            flags = tl.load(touched_ptr + rows, mask=row_ok, other=1)  # [FILL_CHUNK]
            untouched = row_ok & (flags == 0)
        zeros = tl.zeros([FILL_CHUNK, FILL_COL], dtype=out_ptr.dtype.element_ty)
        row_base = out_ptr + rows[:, None] * dim
        for c in range(0, dim, FILL_COL):
            cols = c + tl.arange(0, FILL_COL)
            tl.store(row_base + cols[None, :], zeros,
                     mask=untouched[:, None] & (cols < dim)[None, :])


@triton.jit(do_not_specialize=["search_top", "search_steps"])
def embedding_backward_kernel(
    sorted_ids_ptr, order_ptr, touched_ptr, grad_ptr, out_ptr,
    n_tokens, num_embeddings, dim, padding_idx, search_top, search_steps,
    stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_COL: tl.constexpr,
    RUN_BLOCK: tl.constexpr, UNROLL: tl.constexpr, TILE: tl.constexpr,
    FILL_ROWS: tl.constexpr, FILL_CHUNK: tl.constexpr, FILL_COL: tl.constexpr,
    FILL: tl.constexpr, PROGRAMS: tl.constexpr,
):
    """``out [num_embeddings, dim]`` = the gradient of the table, every row written once
    (see the module docstring).

    * ``sorted_ids_ptr``: int32 or int64 ``[n_tokens]``, the ids stably sorted.
    * ``order_ptr``: int64 ``[n_tokens]`` token position of each sorted entry, viewed as
      int32 pairs ``[2 * n_tokens]``; the low words are read (positions < 2**31).
    * ``touched_ptr``: ``FILL_MAP`` only, ``[num_embeddings]`` int8 flags or int32 counts
      (nonzero = touched); else any pointer, unread.
    * ``grad_ptr``: ``[n_tokens, dim]`` in token order, row stride ``stride_g_row`` (0 for an
      expanded grad), column stride ``stride_g_col``.
    * ``out_ptr``: ``[num_embeddings, dim]`` contiguous; prior contents never matter.
    * ``padding_idx``: the row that gets zeros (``HAS_PADDING``); ``ACC_FP64``: sum in fp64
      (fp64 grads), else fp32.

    Grid (``PROGRAMS``): ``ALL_PROGRAMS``: ``cdiv(n_tokens, RUN_BLOCK) * cdiv(dim,
    BLOCK_COL)`` run programs (``_sum_runs``) then ``cdiv(num_embeddings, FILL_ROWS)``
    fill programs (``_fill_untouched_rows``); ``RUN_PROGRAMS`` / ``FILL_PROGRAMS``: one
    kind only. The order of additions depends only on the run itself: bitwise
    batch-invariant.
    """
    pid = tl.program_id(0)
    run_programs = tl.cdiv(n_tokens, RUN_BLOCK) * tl.cdiv(dim, BLOCK_COL)
    if PROGRAMS == RUN_PROGRAMS:
        is_run = pid >= 0
        fill_pid = pid
    elif PROGRAMS == FILL_PROGRAMS:
        is_run = pid < 0
        fill_pid = pid
    else:
        is_run = pid < run_programs
        fill_pid = pid - run_programs
    if is_run:
        _sum_runs(
            sorted_ids_ptr, order_ptr, grad_ptr, out_ptr, pid,
            n_tokens, num_embeddings, dim, padding_idx, stride_g_row, stride_g_col,
            HAS_PADDING, ACC_FP64, BLOCK_COL, RUN_BLOCK, UNROLL, TILE,
        )
    else:
        _fill_untouched_rows(
            sorted_ids_ptr, touched_ptr, out_ptr, fill_pid,
            n_tokens, num_embeddings, dim, search_top, search_steps,
            FILL_ROWS, FILL_CHUNK, FILL_COL, FILL,
        )


def launch_backward_kernel(
    sorted_ids: torch.Tensor, order: torch.Tensor, touched: Optional[torch.Tensor],
    flat_grad: torch.Tensor, out: torch.Tensor, padding_idx: Optional[int],
    tiles: BackwardTiles, programs=ALL_PROGRAMS,
) -> None:
    """One launch of ``embedding_backward_kernel``: write ``out [V, D]`` from ``flat_grad
    [n_tokens, D]``, given ``sort_ids``' outputs and the tiles (``BackwardConfig.resolve``).

    ``touched`` (``touched_map`` or ``id_counts``): the fill programs read it; None: they
    binary-search the sorted ids (id order only). ``programs``: ``ALL_PROGRAMS`` (every
    row), ``RUN_PROGRAMS`` (the touched rows) or ``FILL_PROGRAMS`` (the untouched rows).
    """
    programs = operator.index(programs)
    if programs not in (0, 1, 2):
        raise ValueError(f"programs must be ALL_PROGRAMS, RUN_PROGRAMS or FILL_PROGRAMS, "
                         f"got {programs}")
    n_tokens, dim = flat_grad.shape
    num_embeddings = out.shape[0]
    run_programs = cdiv(n_tokens, tiles.run_block) * cdiv(dim, tiles.block_col)
    fill_programs = cdiv(num_embeddings, tiles.fill_rows)
    grid = ((run_programs + fill_programs, run_programs, fill_programs)[programs],)
    search_steps = n_tokens.bit_length()
    options = device_options(flat_grad.device)
    if tiles.maxnreg and flat_grad.device.type == "cuda" and not torch.version.hip:
        options["maxnreg"] = tiles.maxnreg
    _launch.launch(embedding_backward_kernel, grid, (
        sorted_ids, _unit_stride(order).view(torch.int32), sorted_ids if touched is None else touched,
        flat_grad, out,
        n_tokens, num_embeddings, dim, -1 if padding_idx is None else padding_idx,
        1 << (search_steps - 1), search_steps, flat_grad.stride(0), flat_grad.stride(1),
    ), dict(
        HAS_PADDING=padding_idx is not None, ACC_FP64=flat_grad.dtype == torch.float64,
        BLOCK_COL=tiles.block_col, RUN_BLOCK=tiles.run_block, UNROLL=tiles.unroll,
        TILE=tiles.tile, FILL_ROWS=tiles.fill_rows, FILL_CHUNK=tiles.fill_chunk,
        FILL_COL=tiles.fill_col, FILL=(FILL_SEARCH if touched is None else FILL_MAP).value,
        PROGRAMS=programs,
    ), dict(num_warps=tiles.num_warps, **options))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 (a dtype view needs it; a one-element view of a strided tensor
    counts as contiguous but keeps its stride)."""
    return t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)
