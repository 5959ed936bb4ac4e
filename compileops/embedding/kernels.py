"""Triton kernels for the embedding family, with their eager launchers.

Forward: a row gather with 64-bit row offsets (tables past 2**31 elements work), upcasting
only the gathered rows.

Backward: a deterministic, batch-invariant scatter-add with no floating-point atomics and no
fp32 V x D buffer. The ids are stably sorted on the device (on CUDA up to 65536 ids: two
Triton launches, ``sort.py``; else ``torch.sort``, int32 keys when the table allows), so each
distinct id is a contiguous run of sorted positions in token-position order (on CUDA the
runs are ordered by decreasing length, ``hot_first``; else by id). Then ONE kernel
writes every row of ``grad_weight`` exactly once:

* Run programs, one per (block of ``RUN_BLOCK`` sorted positions, column block), each
  handle every run that *starts* in their block, finding the run's end themselves by
  comparing sorted ids (no searchsorted pass). Runs of at most ``UNROLL`` entries are summed
  together as a 2-D ``[RUN_BLOCK, BLOCK_COL]`` accumulator: step k adds every run's k-th grad
  row, all index and row loads independent of each other, so in flight together. A longer
  run (at most one per block, since ``UNROLL >= RUN_BLOCK - 1``) is walked ``TILE`` rows per
  step: the step's TILE row loads are issued before its in-order adds, and the next step's
  token positions are loaded meanwhile, so each step costs about one memory round trip
  (this is the latency-bound chain of a hot id: 2081 rows in the Zipf benchmark case).
  Either way each row is the fp32 sum (fp64 for fp64 grads) of its grad rows added one by
  one in token-position order, bitwise the reference's sum; the padding row gets zeros.
* Fill programs zero the untouched rows, ``FILL_ROWS`` whole rows each (16-byte stores). A
  row is untouched iff a binary search for it in the sorted ids (64 KB for 16K tokens,
  cache-resident) misses: one search over all ids brackets the program's rows, then a
  short search per row inside the bracket. No touched-row map is built before the launch.
* Run programs come first in the grid (``runs_per_fill`` interleaves fill programs among
  them), so the long chains start at once and run while the bandwidth-bound fill proceeds.
  On an H100 the first sweep suggests a hot id's chain makes little progress while the fill
  saturates memory, so it can still end after the fill (see the sweep's diagnostics).
* Optionally (``long_kernel=True``) the runs of more than ``long_min`` entries go to a
  second launch, ``embedding_long_runs_kernel``, issued right after the sort and before the
  run programs, which then skip them (``LONG_SPLIT``). It finds a run's end first, so its
  loop over steps of ``long_tile`` rows has plain integer bounds and Triton
  software-pipelines it: the gathers of the next ``long_stages - 1`` steps are in flight
  in shared memory (cp.async), where the main kernel's long path waits one memory round
  trip per register-resident step. Same additions, same order: bitwise the same rows.

The long-run step keeps TILE rows in flight, so the kernel needs ~80 (8 warps) to ~128
(4 warps) registers per thread; the launcher caps registers with ``maxnreg``: with a cap,
ptxas hoists a step's loads above its adds, without one it interleaves them and keeps only
~3 rows in flight (seen in the sm_90 SASS; the first H100 sweep: 0.633 ms without a cap,
0.594 ms with one).

The previous design (one program per sorted position, searchsorted run ends, a touched map
built by two extra launches, a 2-D tile plus masked-sum row extraction for long runs) stays
available as ``impl="legacy"`` for comparison.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _launch
from .._launch import cdiv, next_power_of_2
from . import sort as id_sort


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
def legacy_embedding_backward_kernel(
    sorted_ids_ptr, order_ptr, run_end_ptr, touched_ptr, grad_ptr, out_ptr,
    n_tokens, num_embeddings, dim, padding_idx,
    stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, UNROLL: tl.constexpr, BLOCK_COL: tl.constexpr,
    ZERO_ROWS: tl.constexpr, ACC_FP64: tl.constexpr, TILE: tl.constexpr,
):
    """The previous backward kernel (``impl="legacy"``), kept for comparison.

    Writes every row of ``out [V, D]`` exactly once, in one launch.
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


# Long-run strategies of ``embedding_backward_kernel`` (``LONG_MODE``; see ``_LONG_MODES``).
LONG_ROWS = 0  # TILE independent [BLOCK_COL] row loads per step, next step's indices prefetched
LONG_TILE = 1  # one 2-D [TILE, BLOCK_COL] gather per step, rows selected exactly

# Bodies of embedding_long_runs_kernel (its LONG_BODY).
LONG_PIPELINED = 0  # tl.range software pipeline: LONG_STAGES - 1 tiles in flight in shared memory
LONG_REGISTERS = 1  # _long_run_sum (LONG_ROWS): LONG_TILE rows per step in registers


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
def _prefetch_rows_l2(
    sorted_ids_ptr, order_ptr, grad_ptr, p, row, n_tokens, dim, col_start,
    stride_g_row, stride_g_col, ROWS: tl.constexpr, BLOCK_COL: tl.constexpr,
):
    """Hint only (no effect on results): ``prefetch.global.L2`` the 128-byte lines of columns
    ``[col_start, +BLOCK_COL)`` of the grad rows of sorted positions ``[p, p + ROWS)`` that
    belong to the run of ``row`` (rows outside it prefetch row 0). CUDA only: the Triton
    interpreter has no inline assembly."""
    line_elems: tl.constexpr = max(1, 128 // (grad_ptr.dtype.element_ty.primitive_bitwidth // 8))
    lines: tl.constexpr = max(1, BLOCK_COL // line_elems)
    q = p + tl.arange(0, ROWS)
    q_ok = q < n_tokens
    in_run = q_ok & (tl.load(sorted_ids_ptr + q, mask=q_ok, other=-1) == row)
    toks = tl.load(order_ptr + q.to(tl.int64) * 2, mask=in_run, other=0).to(tl.int64)
    cols = tl.minimum(col_start + tl.arange(0, lines) * line_elems, dim - 1).to(tl.int64)
    ptrs = grad_ptr + toks[:, None] * stride_g_row + cols[None, :] * stride_g_col
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _long_run_sum(
    sorted_ids_ptr, order_ptr, grad_ptr, start, row, n_tokens, dim, col_start,
    col_off, col_ok, stride_g_row, stride_g_col,
    ACC_DTYPE: tl.constexpr, BLOCK_COL: tl.constexpr, TILE: tl.constexpr,
    LONG_MODE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """fp32/fp64 sum, in position order, of the grad rows of the run of ``row`` that starts at
    sorted position ``start``, TILE rows per step.

    The run's end is found on the way: one sorted id (position p + TILE - 1, loaded during the
    previous step) says whether a whole step lies inside the run (each id's entries are
    contiguous in the sorted order, in id or hot-first order alike).
    Such a full step loads its TILE rows with no per-row predicate, so (with a register cap,
    see ``maxnreg``) the compiler issues them all before the first add; the last, partial
    step checks every row. ``LONG_ROWS`` also loads the next step's token positions during
    the current step (a loop-carried tuple), which leaves one memory round trip per step.
    ``PREFETCH`` > 0 (``LONG_ROWS`` on CUDA only): L2-prefetch the run's rows that far ahead
    of the step being summed (a window of PREFETCH rows, TILE more per step).

    Every strategy adds the same values in the same order. Rows past the run's end are
    loaded as +0.0; ``acc`` starts at +0.0 so it is never -0.0, and ``acc + 0.0`` is ``acc``
    bitwise. ``LONG_TILE`` selects row k of its 2-D tile by a sum whose other terms are -0.0:
    exact for every value (x + -0.0 == x, also for x = -0.0), and folded away by the compiler
    when each thread holds whole tile columns (``BLOCK_COL == 256 * num_warps`` for 16-bit
    grads); with other shapes the sum crosses threads and is slow.
    """
    acc = tl.zeros([BLOCK_COL], dtype=ACC_DTYPE)
    p = start
    last = p + TILE - 1
    full = tl.load(sorted_ids_ptr + last, mask=last < n_tokens, other=-1) == row
    more = start < n_tokens
    if LONG_MODE == 0:
        if PREFETCH > 0:
            for j in tl.static_range(PREFETCH // min(PREFETCH, 64)):
                _prefetch_rows_l2(sorted_ids_ptr, order_ptr, grad_ptr, p + j * min(PREFETCH, 64),
                                  row, n_tokens, dim, col_start, stride_g_row, stride_g_col,
                                  min(PREFETCH, 64), BLOCK_COL)
        toks = _load_positions(order_ptr, p, n_tokens, TILE)
        while more:
            if full:
                for k in tl.static_range(TILE):
                    g = tl.load(grad_ptr + toks[k].to(tl.int64) * stride_g_row + col_off,
                                mask=col_ok, other=0.0)
                    acc += g.to(ACC_DTYPE)
                if PREFETCH > 0:
                    _prefetch_rows_l2(sorted_ids_ptr, order_ptr, grad_ptr, p + PREFETCH, row,
                                      n_tokens, dim, col_start, stride_g_row, stride_g_col,
                                      TILE, BLOCK_COL)
                p += TILE
                toks = _load_positions(order_ptr, p, n_tokens, TILE)
                last = p + TILE - 1
                full = tl.load(sorted_ids_ptr + last, mask=last < n_tokens, other=-1) == row
                more = tl.load(sorted_ids_ptr + p, mask=p < n_tokens, other=-1) == row
            else:
                for k in tl.static_range(TILE):
                    q = p + k
                    in_run = tl.load(sorted_ids_ptr + q, mask=q < n_tokens, other=-1) == row
                    g = tl.load(grad_ptr + toks[k].to(tl.int64) * stride_g_row + col_off,
                                mask=col_ok & in_run, other=0.0)
                    acc += g.to(ACC_DTYPE)
                more = full  # false: that was the run's last step
    else:
        lanes = tl.arange(0, TILE)
        while more:
            q = p + lanes
            q_ok = q < n_tokens
            toks = tl.load(order_ptr + q.to(tl.int64) * 2, mask=q_ok, other=0).to(tl.int64)
            if full:
                tile = tl.load(grad_ptr + toks[:, None] * stride_g_row + col_off[None, :],
                               mask=col_ok[None, :], other=0.0)
            else:
                in_run = tl.load(sorted_ids_ptr + q, mask=q_ok, other=-1) == row
                tile = tl.load(grad_ptr + toks[:, None] * stride_g_row + col_off[None, :],
                               mask=in_run[:, None] & col_ok[None, :], other=0.0)
            for k in tl.static_range(TILE):
                acc += tl.sum(tl.where(lanes[:, None] == k, tile, -0.0), axis=0).to(ACC_DTYPE)
            p += TILE
            more = full & (tl.load(sorted_ids_ptr + p, mask=p < n_tokens, other=-1) == row)
            last = p + TILE - 1
            full = tl.load(sorted_ids_ptr + last, mask=last < n_tokens, other=-1) == row
    return acc


@triton.jit
def _fill_untouched_rows(
    sorted_ids_ptr, touched_ptr, out_ptr, fill_pid,
    n_tokens, num_embeddings, dim, search_top, search_steps,
    FILL_ROWS: tl.constexpr, FILL_CHUNK: tl.constexpr, FILL_COL: tl.constexpr,
    FILL_SEARCH: tl.constexpr, FILL_EVICT: tl.constexpr,
):
    """Zero rows ``[fill_pid * FILL_ROWS, +FILL_ROWS)`` that no token touched, all columns,
    ``FILL_CHUNK`` rows x ``FILL_COL`` columns per store (bounded registers).

    ``FILL_SEARCH``: one pair of binary searches over all sorted ids brackets the positions
    ``[lo, hi)`` holding this program's rows (``search_top``: the largest power of two <=
    n_tokens, ``search_steps`` its bit count); each chunk then binary-searches its rows in
    that bracket only (a few steps: it is usually tiny). Stores do not block, so a chunk's
    search overlaps with the previous chunk's stores draining.
    """
    r0 = fill_pid.to(tl.int64) * FILL_ROWS
    if FILL_SEARCH:
        below_lo = fill_pid * 0 - 1  # last positions holding an id < r0, < r0 + FILL_ROWS
        below_hi = fill_pid * 0 - 1
        for i in range(search_steps):
            step = search_top >> i
            cand_lo = below_lo + step
            cand_hi = below_hi + step
            id_lo = tl.load(sorted_ids_ptr + cand_lo, mask=cand_lo < n_tokens, other=0)
            id_hi = tl.load(sorted_ids_ptr + cand_hi, mask=cand_hi < n_tokens, other=0)
            below_lo = tl.where((cand_lo < n_tokens) & (id_lo < r0), cand_lo, below_lo)
            below_hi = tl.where((cand_hi < n_tokens) & (id_hi < r0 + FILL_ROWS), cand_hi, below_hi)
        lo = below_lo + 1
        hi = below_hi + 1
        top = hi * 0 + 1  # largest power of two <= hi - lo (1 when the bracket is empty)
        while top * 2 <= hi - lo:
            top *= 2
    for chunk in range(FILL_ROWS // FILL_CHUNK):
        rows = r0 + chunk * FILL_CHUNK + tl.arange(0, FILL_CHUNK)
        row_ok = rows < num_embeddings
        if FILL_SEARCH:
            last = tl.zeros([FILL_CHUNK], dtype=tl.int32) + (lo - 1)
            step = top
            while step > 0:
                cand = last + step
                cand_ok = cand < hi
                below = tl.load(sorted_ids_ptr + cand, mask=cand_ok, other=0) < rows
                last = tl.where(cand_ok & below, cand, last)
                step = step // 2
            first = last + 1
            found = tl.load(sorted_ids_ptr + first, mask=first < hi, other=-1) == rows
            untouched = row_ok & (found == 0)
        else:
            untouched = row_ok & (tl.load(touched_ptr + rows, mask=row_ok, other=1) == 0)
        zeros = tl.zeros([FILL_CHUNK, FILL_COL], dtype=out_ptr.dtype.element_ty)
        row_base = out_ptr + rows[:, None] * dim
        for c in range(0, dim, FILL_COL):
            cols = c + tl.arange(0, FILL_COL)
            tl.store(row_base + cols[None, :], zeros,
                     mask=untouched[:, None] & (cols < dim)[None, :], eviction_policy=FILL_EVICT)


@triton.jit
def _run_starts(sorted_ids_ptr, pos, n_tokens, num_embeddings):
    """Sorted positions ``pos`` -> ``(row, is_start)``: the id at each position (-1 past
    ``n_tokens``) and whether a run of an in-range id starts there. Out-of-range ids trip
    the device-side assert (the kernels run with ``debug=True``)."""
    in_n = pos < n_tokens
    row = tl.load(sorted_ids_ptr + pos, mask=in_n, other=-1)
    prev = tl.load(sorted_ids_ptr + pos - 1, mask=in_n & (pos > 0), other=-1)
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


@triton.jit(do_not_specialize=["search_top", "search_steps", "runs_per_fill", "mixed_groups"])
def embedding_backward_kernel(
    sorted_ids_ptr, order_ptr, touched_ptr, grad_ptr, out_ptr,
    n_tokens, num_embeddings, dim, padding_idx, search_top, search_steps,
    runs_per_fill, mixed_groups, stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_COL: tl.constexpr,
    RUN_BLOCK: tl.constexpr, UNROLL: tl.constexpr, TILE: tl.constexpr,
    LONG_MODE: tl.constexpr, LONG_PREFETCH: tl.constexpr, FILL_ROWS: tl.constexpr,
    FILL_CHUNK: tl.constexpr, FILL_COL: tl.constexpr, FILL_SEARCH: tl.constexpr,
    FILL_EVICT: tl.constexpr, LONG_SPLIT: tl.constexpr, DIAG: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    """Writes every row of ``out [V, D]`` exactly once, in one launch (see the module doc).

    ``PROGRAMS``: 0 = run and fill programs in one grid; 1 = run programs only, 2 = fill
    programs only (the two-stream schedule launches these two grids concurrently).

    ``order_ptr``: the int64 token positions viewed as int32 pairs; the low words are read.

    Run program (b, c) sums, for column block c, every run that starts at a sorted position
    in ``[b * RUN_BLOCK, +RUN_BLOCK)``; fill program f zeroes the untouched rows among
    ``[f * FILL_ROWS, +FILL_ROWS)`` (``FILL_SEARCH``: found by binary search in the sorted
    ids; else read from the ``touched_ptr`` int8 map). Run programs come early in the grid,
    so that the long, latency-bound runs start at once; ``runs_per_fill`` > 0 interleaves
    one fill program after every ``runs_per_fill`` run programs (``mixed_groups`` times), so
    that the latency-bound short runs share the machine with bandwidth-bound stores.

    The order of additions depends only on the run itself: bitwise batch-invariant.

    ``LONG_SPLIT`` (0: off, else >= ``UNROLL``): the run programs leave the rows of the runs
    of more than ``LONG_SPLIT`` entries (padding row excluded) alone, for
    ``embedding_long_runs_kernel`` (its ``LONG_MIN``) to write; ``LONG_SPLIT == UNROLL``
    compiles the long path out.

    ``DIAG`` (benchmarks only; the output is then WRONG): 2 skips the fill, 3 the run
    programs, to time the parts of this one launch (the launcher's ``diag=1``, long runs
    skipped, is ``LONG_SPLIT=UNROLL`` without the long-run kernel).
    """
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(dim, BLOCK_COL)
    run_programs = tl.cdiv(n_tokens, RUN_BLOCK) * col_blocks
    acc_dtype: tl.constexpr = tl.float64 if ACC_FP64 else tl.float32
    # Program order: ``mixed_groups`` groups of (``runs_per_fill`` run programs, 1 fill
    # program), then the remaining run programs, then the remaining fill programs.
    group = runs_per_fill + 1
    mixed = mixed_groups * group
    rest = pid - mixed
    left_runs = run_programs - mixed_groups * runs_per_fill
    if PROGRAMS == 1:
        is_run = pid >= 0
        run_pid = pid
        fill_pid = pid
    elif PROGRAMS == 2:
        is_run = pid < 0
        run_pid = pid
        fill_pid = pid
    elif pid < mixed:
        g = pid // group
        is_run = pid - g * group < runs_per_fill
        run_pid = pid - g
        fill_pid = g
    else:
        is_run = rest < left_runs
        run_pid = rest + mixed_groups * runs_per_fill
        fill_pid = rest - left_runs + mixed_groups
    if is_run & (DIAG != 3):
        col_start = (run_pid % col_blocks) * BLOCK_COL
        cols = col_start + tl.arange(0, BLOCK_COL)
        col_ok = cols < dim
        col_off = cols.to(tl.int64) * stride_g_col
        pos = (run_pid // col_blocks) * RUN_BLOCK + tl.arange(0, RUN_BLOCK)
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
            tok = tl.load(order_ptr + q.to(tl.int64) * 2, mask=q_ok, other=0).to(tl.int64)
            g = tl.load(grad_ptr + tok[:, None] * stride_g_row + col_off[None, :],
                        mask=live[:, None] & col_ok[None, :], other=0.0)
            acc += g.to(acc_dtype)
        written = is_start & (is_long == 0)  # short runs, and the padding row (zeros)
        tl.store(out_ptr + row.to(tl.int64)[:, None] * dim + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=written[:, None] & col_ok[None, :])

        if LONG_SPLIT != UNROLL:  # else the long-run kernel owns every long run
            long_start = tl.max(tl.where(is_long, pos, -1), axis=0)
            if long_start >= 0:
                long_row = tl.load(sorted_ids_ptr + long_start)
                mine = True
                if LONG_SPLIT > 0:  # runs of more than LONG_SPLIT entries: the other kernel's
                    split = long_start + LONG_SPLIT
                    mine = tl.load(sorted_ids_ptr + split, mask=split < n_tokens,
                                   other=-1) != long_row
                if mine:
                    long_acc = _long_run_sum(
                        sorted_ids_ptr, order_ptr, grad_ptr, long_start, long_row, n_tokens,
                        dim, col_start, col_off, col_ok, stride_g_row, stride_g_col, acc_dtype,
                        BLOCK_COL, TILE, LONG_MODE, LONG_PREFETCH,
                    )
                    tl.store(out_ptr + long_row.to(tl.int64) * dim + cols,
                             long_acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    elif (is_run == 0) & (DIAG != 2):
        _fill_untouched_rows(
            sorted_ids_ptr, touched_ptr, out_ptr, fill_pid,
            n_tokens, num_embeddings, dim, search_top, search_steps,
            FILL_ROWS, FILL_CHUNK, FILL_COL, FILL_SEARCH, FILL_EVICT,
        )


@triton.jit
def _run_end(sorted_ids_ptr, start, row, n_tokens, SEARCH: tl.constexpr):
    """End (exclusive) of the run of ``row`` that starts at sorted position ``start``.

    Each id's entries are contiguous in the sorted order (id or hot-first order), so the
    run's positions among any samples form a prefix. Each
    coarse step loads SEARCH samples SEARCH positions apart (one round trip covers SEARCH**2
    positions, 4096 for SEARCH=64: any run of the 16K-token benchmark) and moves on only if
    all of them are in the run; one fine load of SEARCH consecutive positions then finds the
    end. ``base`` is always in the run, and so is sample ``c`` of the last coarse step
    (c = 0: ``base`` itself) while sample ``c + 1`` is not: the end is in
    ``(base + c * SEARCH, base + (c + 1) * SEARCH]``.
    """
    lanes = tl.arange(0, SEARCH)
    base = start
    matched = SEARCH
    while matched == SEARCH:
        cpos = base + (lanes + 1) * SEARCH
        matched = tl.sum((tl.load(sorted_ids_ptr + cpos, mask=cpos < n_tokens, other=-1)
                          == row).to(tl.int32), axis=0)
        if matched == SEARCH:
            base += SEARCH * SEARCH
    fine = base + matched * SEARCH
    fpos = fine + lanes
    in_run = tl.load(sorted_ids_ptr + fpos, mask=fpos < n_tokens, other=-1) == row
    return fine + tl.sum(in_run.to(tl.int32), axis=0)


@triton.jit
def embedding_long_runs_kernel(
    sorted_ids_ptr, order_ptr, grad_ptr, out_ptr,
    n_tokens, num_embeddings, dim, padding_idx, stride_g_row, stride_g_col,
    HAS_PADDING: tl.constexpr, ACC_FP64: tl.constexpr, LONG_MIN: tl.constexpr,
    LONG_BLOCK: tl.constexpr, LONG_TILE: tl.constexpr, LONG_BLOCK_COL: tl.constexpr,
    LONG_STAGES: tl.constexpr, SEARCH: tl.constexpr, LONG_BODY: tl.constexpr,
    LONG_PREFETCH: tl.constexpr,
):
    """The rows of the runs of more than ``LONG_MIN`` entries (padding row excluded) of the
    backward; ``embedding_backward_kernel`` launched with ``LONG_SPLIT=LONG_MIN`` writes every
    other row of ``out [V, D]``, so each row is written exactly once.

    Program (b, c) (pid = b * col_blocks + c) looks at sorted positions ``[b * LONG_BLOCK,
    +LONG_BLOCK)`` as the run programs do (a run starts where the sorted id changes; it is
    long when the id at start + LONG_MIN is still its id) and exits unless a long run starts
    there; since ``LONG_BLOCK <= LONG_MIN + 1``, at most one does. It then writes that run's
    row for columns ``[c * LONG_BLOCK_COL, +LONG_BLOCK_COL)``.

    The run's end is found first (``_run_end``, a few vector loads), so the sum is a
    ``tl.range`` loop with plain integer bounds over steps of ``LONG_TILE`` sorted positions,
    which Triton software-pipelines: the token positions and then the ``[LONG_TILE,
    LONG_BLOCK_COL]`` grad gather of the next ``LONG_STAGES - 1`` steps are copied into
    shared memory asynchronously (cp.async on sm_80+) while the current step is added. That
    keeps ``(LONG_STAGES - 1) * LONG_TILE`` rows of the chain in flight in shared memory, not
    registers; the main kernel's long path has one step (TILE rows) per memory round trip.

    The adds are the reference's (fp32, fp64 for fp64 grads, one row at a time in position
    order): row k of a tile is selected by a sum whose other terms are -0.0 (exact for every
    value, folded away when each thread holds whole tile columns: ``LONG_BLOCK_COL == 256 *
    num_warps`` for 16-bit grads, 128 / 64 for 32- / 64-bit ones). Positions past the run's
    end load as +0.0; ``acc`` starts at +0.0 and so is never -0.0: adding them is exact.

    ``LONG_BODY`` selects how the chain is summed: ``LONG_PIPELINED`` as above, or
    ``LONG_REGISTERS``: the main kernel's register-resident ``_long_run_sum`` (``LONG_TILE``
    straight-line row loads per step, next step's positions loaded meanwhile, the end found
    on the way), here in narrow column blocks (e.g. 32 columns on one warp, 64 rows per step:
    one element per thread and row) so that the many programs of one chain each stream few
    bytes. ``LONG_PREFETCH`` (registers body, CUDA only): L2-prefetch the run's rows that far
    ahead (the first ``LONG_PREFETCH`` rows at once), a hint that does not change results.
    """
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(dim, LONG_BLOCK_COL)
    acc_dtype: tl.constexpr = tl.float64 if ACC_FP64 else tl.float32
    pos = (pid // col_blocks) * LONG_BLOCK + tl.arange(0, LONG_BLOCK)
    row, is_start = _run_starts(sorted_ids_ptr, pos, n_tokens, num_embeddings)
    is_long = _longer_than(sorted_ids_ptr, pos, row, is_start, n_tokens, LONG_MIN)
    if HAS_PADDING:
        is_long = is_long & (row != padding_idx)  # the run programs write its zeros
    long_start = tl.max(tl.where(is_long, pos, -1), axis=0)
    if LONG_BODY == 1:  # LONG_REGISTERS
        if long_start >= 0:
            long_row = tl.load(sorted_ids_ptr + long_start)
            col_start = (pid % col_blocks) * LONG_BLOCK_COL
            cols = col_start + tl.arange(0, LONG_BLOCK_COL)
            col_ok = cols < dim
            acc = _long_run_sum(
                sorted_ids_ptr, order_ptr, grad_ptr, long_start, long_row, n_tokens, dim,
                col_start, cols.to(tl.int64) * stride_g_col, col_ok, stride_g_row, stride_g_col,
                acc_dtype, LONG_BLOCK_COL, LONG_TILE, 0, LONG_PREFETCH,  # 0: LONG_ROWS
            )
            tl.store(out_ptr + long_row.to(tl.int64) * dim + cols,
                     acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:  # LONG_PIPELINED
        if long_start >= 0:
            long_row = tl.load(sorted_ids_ptr + long_start)
            end = _run_end(sorted_ids_ptr, long_start, long_row, n_tokens, SEARCH)
            cols = (pid % col_blocks) * LONG_BLOCK_COL + tl.arange(0, LONG_BLOCK_COL)
            col_ok = cols < dim
            col_off = cols.to(tl.int64) * stride_g_col
            lanes = tl.arange(0, LONG_TILE)
            acc = tl.zeros([LONG_BLOCK_COL], dtype=acc_dtype)
            for s in tl.range(0, tl.cdiv(end - long_start, LONG_TILE), num_stages=LONG_STAGES):
                q = long_start + s * LONG_TILE + lanes
                in_run = q < end
                # order_ptr: the int64 token positions viewed as int32 pairs, low words read.
                toks = tl.load(order_ptr + q.to(tl.int64) * 2, mask=in_run, other=0)
                tile = tl.load(
                    grad_ptr + toks.to(tl.int64)[:, None] * stride_g_row + col_off[None, :],
                    mask=in_run[:, None] & col_ok[None, :], other=0.0)
                for k in tl.static_range(LONG_TILE):
                    acc += tl.sum(tl.where(lanes[:, None] == k, tile, -0.0), axis=0).to(acc_dtype)
            tl.store(out_ptr + long_row.to(tl.int64) * dim + cols,
                     acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def _forward_config(dim: int, elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_TOK, BLOCK_COL, num_warps): 16-byte accesses, ~16 KB moved per program."""
    block_col = min(next_power_of_2(dim), max(16, 4096 // elem_size))
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
        grid = (cdiv(n_tokens, block_tok), cdiv(dim, block_col))
        _launch.launch(
            embedding_forward_kernel, grid,
            (flat_ids, weight, out, n_tokens, num_embeddings, dim,
             weight.stride(0), weight.stride(1)),
            dict(BLOCK_TOK=block_tok, BLOCK_COL=block_col),
            dict(num_warps=num_warps, **_launch_options(weight.device)),
        )
    return out.reshape(*ids.shape, dim)


_LONG_MODES = {"rows": LONG_ROWS, "tile": LONG_TILE}
_LONG_BODIES = {"pipelined": LONG_PIPELINED, "registers": LONG_REGISTERS}


_SORTS = ("auto", "triton", "torch")


def _resolve_sort(sort: str, flat_ids: torch.Tensor, num_embeddings: int) -> str:
    """``"auto"``: the Triton sort on CUDA up to ``sort.MAX_TOKENS`` ids (fewer launches: the
    hot-id chains start sooner), else ``torch.sort`` (also on CPU, where the interpreted
    bitonic network is slow)."""
    if sort not in _SORTS:
        raise ValueError(f"unknown sort {sort!r}: expected one of {_SORTS}")
    if sort == "auto":
        fits = flat_ids.numel() <= id_sort.MAX_TOKENS and num_embeddings <= 2**31 - 1
        sort = "triton" if fits and flat_ids.device.type == "cuda" else "torch"
    return sort


def _sort_ids(flat_ids: torch.Tensor, num_embeddings: int, sort: str = "auto",
              counts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable device sort: (sorted ids, token positions). ``sort="triton"``: two Triton
    launches (``compileops/embedding/sort.py``); ``"torch"``: ``torch.sort`` with int32 keys
    when the table allows (half the radix passes of int64; int32 ids are not copied).
    ``counts`` (``_id_counts``; Triton sort only): hot-first order (``sort.py``)."""
    if _resolve_sort(sort, flat_ids, num_embeddings) == "triton":
        return id_sort.stable_sort_ids(flat_ids, counts=counts)
    if counts is not None:
        raise ValueError("hot-first order needs the Triton sort")
    keys = flat_ids
    if keys.dtype != torch.int32 and num_embeddings <= 2**31 - 1:
        keys = keys.to(torch.int32)
    return torch.sort(keys, stable=True)


def _touched_map(flat_ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """int8 [V]: 1 where some token has that id (every write stores 1: deterministic)."""
    touched = torch.zeros(num_embeddings, dtype=torch.int8, device=flat_ids.device)
    touched.index_fill_(0, flat_ids.long(), 1)
    return touched


@triton.jit
def id_counts_kernel(ids_ptr, counts_ptr, n_tokens, num_embeddings, BLOCK: tl.constexpr):
    """``counts[id] += 1`` for each in-range id of this block (integer atomics: the final
    counts do not depend on their order). Out-of-range ids are skipped: the run programs
    assert on them."""
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_n = pos < n_tokens
    ids = tl.load(ids_ptr + pos, mask=in_n, other=-1).to(tl.int64)
    ok = in_n & (ids >= 0) & (ids < num_embeddings)
    tl.atomic_add(counts_ptr + ids, tl.full([BLOCK], 1, tl.int32), mask=ok, sem="relaxed")


_COUNTS_BLOCK = 1024  # ids per id_counts_kernel program


def _id_counts(flat_ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """int32 [V]: the number of tokens of each id. Two launches (zeros, counts); it serves as
    the touched map (nonzero = touched) and orders the hot-first sort."""
    counts = torch.zeros(num_embeddings, dtype=torch.int32, device=flat_ids.device)
    n_tokens = flat_ids.numel()
    if n_tokens:
        _launch.launch(id_counts_kernel, (cdiv(n_tokens, _COUNTS_BLOCK),),
                       (flat_ids, counts, n_tokens, num_embeddings),
                       dict(BLOCK=_COUNTS_BLOCK), dict(num_warps=4))
    return counts


def embedding_backward(
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int],
    weight_dtype: torch.dtype,
    *, impl: str = "runs", run_block: Optional[int] = None, unroll: Optional[int] = None,
    tile: Optional[int] = None,
    long_mode: str = "rows", block_col: int = 512, fill_rows: Optional[int] = None,
    fill_col: int = 1024, fill: str = "search", runs_per_fill: int = 0, prefetch: int = 0,
    fill_evict: str = "", num_warps: Optional[int] = None, maxnreg: Optional[int] = 128,
    long_kernel: bool = False, long_tile: Optional[int] = None,
    long_block_col: Optional[int] = None, long_stages: int = 3,
    long_warps: Optional[int] = None, long_min: Optional[int] = None,
    long_block: Optional[int] = None, long_fork: bool = False, long_body: str = "pipelined",
    long_prefetch: int = 0,
    streams: Optional[bool] = None, sort: str = "auto", hot_first: Optional[bool] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """grad ``[*ids.shape, D]`` -> grad_weight ``[V, D]`` in ``weight_dtype`` (see module doc).

    ``out`` (``[V, D]``, ``weight_dtype``) may be given as the destination; its prior contents
    never matter. Device-side work only, no host sync (CUDA-graph capturable): a stable sort
    (``sort``), then one kernel launch (``fill="map"`` adds two launches, ``long_kernel``
    one); the two-stream schedule instead builds the touched map and launches the run and
    fill programs separately.

    Tuning (``impl="runs"``, the default). The defaults follow the H100 sweeps
    (benchmarks/results/sweep_embedding_bw_h100_2026-11-21*.log): 512 columns per run
    program (4 warps) and 32-row long-run steps for 16-bit grads were the fastest on the
    benchmark's Zipf ids, and 2-row (16 KB) fill programs beat 4, 8, 16 and 32 rows (sweep
    g: 0.536 ms against 0.546-0.551, uniform ids 0.512 against 0.519-0.525);
    benchmarks/sweep_embedding_bw.py times the alternatives:

    * ``run_block``: sorted positions per run program (power of two); ``unroll``: longest run
      summed by the 2-D short-run path (``>= run_block - 1``; default ``max(4, run_block -
      1)``), longer runs take the long path; ``tile``: rows per long-path step. The defaults
      scale with the grad's element size so that no variant spills registers on sm_90:
      ``run_block`` 4/2/1 and ``tile`` 32/8/4 for 2/4/8-byte grads (1 and 4 when the grad's
      columns are not contiguous).
    * ``long_mode``: ``"rows"`` (``tile`` straight-line row loads per step) or ``"tile"`` (one
      2-D ``[tile, block_col]`` gather per step; fast only when ``block_col == 256 *
      num_warps`` for 16-bit grads, so that each thread holds whole tile columns).
    * ``prefetch`` (CUDA, ``long_mode="rows"``; ignored elsewhere): L2-prefetch a long run's
      rows that many rows ahead of the step being summed (0: off). A hint, results unchanged.
    * ``block_col``: columns per run program (default 512); ``num_warps`` (default 8 for 1024+ columns,
      4 for 512, else 2).
    * ``fill_rows`` x ``fill_col``: rows per fill program (default ~16 KB of rows: 2 rows at
      D=4096 bf16) and columns per store; ``fill="search"`` (binary search in the sorted ids)
      or ``"map"`` (a touched-row map built by two extra launches); ``fill_evict``: the
      fill stores' eviction policy ("" = default, "evict_first", "evict_last");
      ``runs_per_fill``: at the start of the grid, one fill program after every that many
      run programs (0: all run programs first).
    * ``maxnreg`` (CUDA only; None: the compiler's default): a register cap for the kernel.
      Setting one also makes ptxas hoist all of a long-run step's loads above its adds (with
      no cap it interleaves them, keeping only ~3 rows in flight), at the cost of occupancy.

    * ``long_kernel`` (default off until timed on a GPU): the runs of more than ``long_min``
      entries (default ``unroll``: every long run) are summed by a separate,
      software-pipelined launch (``embedding_long_runs_kernel``, started right after the
      sort, before the run programs) and skipped by the main kernel, whose long path keeps
      the runs of ``unroll + 1 .. long_min`` entries. Its knobs: ``long_tile`` sorted
      positions per pipelined step (default: ``tile``'s default); ``long_block_col``
      columns per program (default ``2048 // element size``: 1024 for 16-bit grads, capped
      at the dim); ``long_stages`` (``tl.range`` ``num_stages``: ``long_stages - 1`` steps
      in flight, in ``(long_stages - 1) * long_tile * long_block_col * element size`` bytes
      of shared memory); ``long_warps`` (default: one warp per 512 bytes of columns, so that
      each thread holds whole tile columns, at most 8); ``long_block`` sorted positions
      looked at per program (a power of two <= ``long_min + 1``, default the largest:
      programs that find no long run exit at once, fewer of them launch faster);
      ``long_fork`` (two-stream schedule only): the long-run kernel gets its own
      high-priority stream, so that the run programs need not wait for the hot-id chains.
      ``long_body``: ``"pipelined"`` (the shared-memory software pipeline above) or
      ``"registers"`` (the main kernel's register-resident long path, meant for narrow
      ``long_block_col``, e.g. 32 columns on one warp with 64-row ``long_tile``);
      ``long_prefetch`` (``"registers"`` on CUDA): L2-prefetch distance in rows.
    * ``streams`` (default: on for CUDA tensors): the two-stream schedule. The fill cannot
      wait for the sort, so it uses the touched map (built from the unsorted ids, two small
      launches) and runs on the current stream while a high-priority side stream sorts the
      ids and then runs the run programs; the current stream then waits for the side stream.
      The sort leaves the critical path, and the latency-bound hot-id chains are scheduled
      ahead of the remaining fill blocks. Each row is still written by exactly one program;
      the result is bitwise that of ``streams=False``.
    * ``hot_first`` (default: on in the two-stream schedule with the Triton sort): sort the
      ids by decreasing count (then id, then position; ``sort.py``), so that the run
      programs, launched in sorted order, start the longest chains first. The touched map is
      then the id counts (``_id_counts``: zeros + one Triton launch, like the int8 map's
      zeros + ``index_fill_``), which also feed the sort. Needs a touched map: with
      ``streams=False`` only together with ``fill="map"`` (the binary-search fill needs id
      order). An in-kernel trace (H100, benchmarks/results/trace_embedding_bw_h100_*) showed
      why: the high-priority run programs take the SMs first, so the run phase (~180 us)
      and the fill (~390 us) run nearly one after the other, and in id order the run phase
      ended with chains whose ids sort late (a 673-entry chain at 92% of the order started
      at 167 us and ended at 228 us). Hot first, the run phase ends at ~178 us, when the
      last short-run program is dispatched. Sweep s: Zipf 0.5133-0.5142 ms against
      0.5305-0.5319 in id order; uniform ids 0.5094 against 0.5056.
    * ``sort``: ``"auto"`` (default: the two-launch Triton sort of ``sort.py`` on CUDA up to
      65536 ids, else ``torch.sort``), ``"triton"`` or ``"torch"``; the same sorted order
      either way. H100, Zipf ids (sweep i/j): 0.529 ms against 0.534 with ``torch.sort``,
      whose cub radix sort is several launches; the hot-id chains start sooner.

    ``impl="legacy"`` runs the previous kernel (one program per sorted position, searchsorted
    run ends, touched map, 2-D tiles with masked-sum extraction; ``unroll``, ``tile``,
    ``block_col``, ``fill_rows`` and ``num_warps`` apply, defaulting to its measured H100
    settings: unroll 8, tile 8, block_col 1024, 8 rows per zero-fill program, 4 warps).
    """
    dim = grad.shape[-1]
    flat_grad = grad.reshape(-1, dim)  # a view, also for stride-0 (expanded) grads
    # The sort and fill kernels index the ids as a dense vector; a strided 1-D view
    # (``ids[::2]``) reshapes to itself, so make it dense (a no-op when it already is).
    flat_ids = ids.reshape(-1).contiguous()
    n_tokens = flat_ids.numel()
    if out is None:
        out = torch.empty((num_embeddings, dim), dtype=weight_dtype, device=grad.device)
    if num_embeddings == 0 or dim == 0:
        return out
    if n_tokens == 0:
        return out.zero_()
    if impl == "legacy":
        return _legacy_embedding_backward(
            flat_grad, flat_ids, num_embeddings, padding_idx, out, unroll=unroll or 8,
            tile=tile or 8, block_col=block_col, zero_rows=fill_rows or 8, num_warps=num_warps,
        )
    if impl != "runs":
        raise ValueError(f"unknown impl {impl!r}: expected 'runs' or 'legacy'")
    if fill not in ("search", "map"):
        raise ValueError(f"unknown fill {fill!r}: expected 'search' or 'map'")
    config = backward_config(
        flat_grad, run_block=run_block, unroll=unroll, tile=tile, long_mode=long_mode,
        block_col=block_col, fill_rows=fill_rows, fill_col=fill_col,
        runs_per_fill=runs_per_fill, prefetch=prefetch, fill_evict=fill_evict,
        num_warps=num_warps, maxnreg=maxnreg, long_kernel=long_kernel, long_tile=long_tile,
        long_block_col=long_block_col, long_stages=long_stages, long_warps=long_warps,
        long_min=long_min, long_block=long_block, long_fork=long_fork, long_body=long_body,
        long_prefetch=long_prefetch,
    )
    sort = _resolve_sort(sort, flat_ids, num_embeddings)
    if streams is None:
        streams = grad.device.type == "cuda"
    streams = streams and grad.device.type == "cuda"
    fits = sort == "triton" and id_sort.hot_first_fits(n_tokens, num_embeddings)
    if hot_first is None:  # the two-stream schedule's default, where the keys fit
        hot_first = streams and fits
    if hot_first and not (fits and (streams or fill == "map")):
        raise ValueError("hot_first needs the Triton sort (sort='triton', or 'auto' on CUDA), "
                         "keys that fit (sort.hot_first_fits) and a touched map (the two-stream "
                         "schedule or fill='map'): the fill's binary search needs id order")
    if streams:
        _two_stream_backward(flat_ids, num_embeddings, flat_grad, out, padding_idx, config,
                             sort, hot_first)
        return out
    counts = _id_counts(flat_ids, num_embeddings) if hot_first else None
    sorted_ids, order = _sort_ids(flat_ids, num_embeddings, sort, counts)
    if hot_first:
        touched = counts  # nonzero on touched rows: the fill reads it as its map
    else:
        touched = _touched_map(flat_ids, num_embeddings) if fill == "map" else None
    launch_backward_kernel(sorted_ids, order, touched, flat_grad, out, padding_idx, **config)
    return out


_SIDE_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device, slot: int = 0) -> "torch.cuda.Stream":
    """High-priority streams per CUDA device (``slot`` 0: sort and run programs, 1: the
    forked long-run kernel), created on first use and kept."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get((index, slot))
    if stream is None:
        _, highest = torch.cuda.Stream.priority_range()
        stream = _SIDE_STREAMS[index, slot] = torch.cuda.Stream(device=index, priority=highest)
    return stream


def _two_stream_backward(flat_ids: torch.Tensor, num_embeddings: int, flat_grad: torch.Tensor,
                         out: torch.Tensor, padding_idx: Optional[int], config: dict,
                         sort: str, hot_first: bool = False) -> None:
    """The ``streams=True`` schedule (see ``embedding_backward``). Fork and join are stream
    waits on events, so CUDA graph capture records both branches. Every tensor the side
    stream touches is allocated on the current stream before the fork, or on the side stream
    itself, and the current stream joins the side stream before returning: no block can be
    freed and reused while the side stream still reads or writes it."""
    main = torch.cuda.current_stream(flat_grad.device)
    side = _side_stream(flat_grad.device)
    # The touched map; hot_first: the id counts, which also order the sort.
    touched = _id_counts(flat_ids, num_embeddings) if hot_first else \
        _touched_map(flat_ids, num_embeddings)
    # The fill launch reads no sorted ids (it has the touched map), but takes an int32
    # pointer there: a one-element stand-in keeps one compiled variant for any ids dtype.
    no_ids = torch.empty(1, dtype=torch.int32, device=flat_ids.device)
    side.wait_stream(main)
    fork = config["long_kernel"] and config["long_fork"]
    with torch.cuda.stream(side):
        sorted_ids, order = _sort_ids(flat_ids, num_embeddings, sort,
                                      touched if hot_first else None)
        if fork:
            # The long runs on a third stream, concurrent with the run programs (on one
            # stream the run programs would wait for the longest hot-id chain to end).
            hot = _side_stream(flat_grad.device, 1)
            hot.wait_stream(side)
            with torch.cuda.stream(hot):
                launch_long_runs_kernel(sorted_ids, order, flat_grad, out, padding_idx,
                                        **_long_launch_args(config))
        # Without the fork this launches the long-run kernel first, then the run programs.
        launch_backward_kernel(sorted_ids, order, None, flat_grad, out, padding_idx,
                               programs=1, launch_long=not fork, **config)
        if fork:
            # Joined into the side stream, whose pool owns sorted_ids and order: memory freed
            # there below is reused only after the third stream's reads.
            side.wait_stream(hot)
    launch_backward_kernel(no_ids, no_ids, touched, flat_grad, out, padding_idx, programs=2,
                           **config)
    main.wait_stream(side)
    # The side stream's own allocations (sorted ids, positions) go back to its pool when
    # these names are dropped; later side-stream work is ordered after this launch.
    del sorted_ids, order


def backward_config(
    flat_grad: torch.Tensor, *, run_block: Optional[int] = None, unroll: Optional[int] = None,
    tile: Optional[int] = None, long_mode: str = "rows", block_col: int = 512,
    fill_rows: Optional[int] = None, fill_col: int = 1024, runs_per_fill: int = 0,
    prefetch: int = 0, fill_evict: str = "", num_warps: Optional[int] = None,
    maxnreg: Optional[int] = 128, long_kernel: bool = False, long_tile: Optional[int] = None,
    long_block_col: Optional[int] = None, long_stages: int = 3, long_warps: Optional[int] = None,
    long_min: Optional[int] = None, long_block: Optional[int] = None, long_fork: bool = False,
    long_body: str = "pipelined", long_prefetch: int = 0,
) -> dict:
    """Checked keyword arguments of ``launch_backward_kernel`` for a ``[n_tokens, D]`` grad,
    the ``None`` defaults resolved (see ``embedding_backward``)."""
    n_tokens, dim = flat_grad.shape
    if long_body not in _LONG_BODIES:
        raise ValueError(f"unknown long_body {long_body!r}: expected one of {sorted(_LONG_BODIES)}")
    if long_prefetch < 0 or long_prefetch & (long_prefetch - 1):
        raise ValueError(f"long_prefetch must be 0 or a power of two, got {long_prefetch}")
    if long_mode not in _LONG_MODES:
        raise ValueError(f"unknown long_mode {long_mode!r}: expected one of {sorted(_LONG_MODES)}")
    elem = flat_grad.element_size()
    unit_cols = flat_grad.stride(1) == 1 or dim == 1
    run_block = run_block or (max(1, 8 // elem) if unit_cols else 1)
    # 32 rows per step for 16-bit grads (H100 sweeps: with 512 columns per program, the
    # fastest on Zipf ids in two runs, 0.549-0.552 ms against 0.561-0.570 for 16 x 1024).
    tile = tile or ((32 if elem == 2 else max(1, 32 // elem)) if unit_cols else 4)
    unroll = unroll or max(4, run_block - 1)
    if unroll < max(1, run_block - 1):
        raise ValueError(f"unroll ({unroll}) must be >= max(1, run_block - 1) ({run_block - 1})")
    # The long-run kernel: the same tile default (the same bytes per step), 2 KB of columns
    # per program, one warp per 512 bytes of them (16 bytes x 32 lanes: whole tile columns
    # per thread, so the in-order row selection folds away).
    long_tile = long_tile or tile
    long_block_col = long_block_col or max(16, 2048 // elem)
    long_min = long_min or unroll
    if long_min < unroll:
        raise ValueError(f"long_min ({long_min}) must be >= unroll ({unroll})")
    long_block = long_block or _long_block_default(long_min)
    if long_block > long_min + 1:  # else two long runs could start in one block
        raise ValueError(f"long_block ({long_block}) must be <= long_min + 1 ({long_min + 1})")
    long_cols = min(next_power_of_2(dim), long_block_col)
    long_warps = long_warps or max(1, min(8, long_cols * elem // 512))
    for name, value in (("run_block", run_block), ("tile", tile), ("fill_rows", fill_rows or 1),
                        ("block_col", block_col), ("fill_col", fill_col),
                        ("long_tile", long_tile), ("long_block_col", long_block_col),
                        ("long_block", long_block), ("long_warps", long_warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if long_stages < 1:
        raise ValueError(f"long_stages must be >= 1, got {long_stages}")
    # Triton's pipeliner allocates long_stages - 1 tile buffers (sm_90 compile: 65664 bytes
    # for 3 stages of 16 x 1024 bf16).
    smem = max(1, long_stages - 1) * long_tile * long_cols * elem
    if long_kernel and long_body == "pipelined" and smem > _LONG_SMEM_BYTES:
        raise ValueError(
            f"(long_stages - 1) * long_tile * long_block_col * element size = {smem} bytes of "
            f"shared memory: more than {_LONG_SMEM_BYTES} (an H100 SM has 227 KB)")
    if n_tokens >= 2**31 - 2 * max(tile, long_min, long_tile) - _RUN_END_SEARCH**2:
        raise ValueError(f"embedding_backward supports < 2**31 tokens, got {n_tokens}")
    if runs_per_fill < 0:
        raise ValueError(f"runs_per_fill must be >= 0, got {runs_per_fill}")
    if prefetch < 0 or prefetch & (prefetch - 1):
        raise ValueError(f"prefetch must be 0 or a power of two, got {prefetch}")
    if fill_evict not in ("", "evict_first", "evict_last"):
        raise ValueError(f"fill_evict must be '', 'evict_first' or 'evict_last', got {fill_evict!r}")
    return dict(run_block=run_block, unroll=unroll, tile=tile, long_mode=long_mode,
                block_col=block_col, fill_rows=fill_rows, fill_col=fill_col,
                runs_per_fill=runs_per_fill, prefetch=prefetch, fill_evict=fill_evict,
                num_warps=num_warps, maxnreg=maxnreg, long_kernel=bool(long_kernel),
                long_tile=long_tile, long_block_col=long_block_col, long_stages=long_stages,
                long_warps=long_warps, long_min=long_min, long_block=long_block,
                long_fork=bool(long_fork), long_body=long_body, long_prefetch=long_prefetch)


def launch_backward_kernel(
    sorted_ids: torch.Tensor, order: torch.Tensor, touched: Optional[torch.Tensor],
    flat_grad: torch.Tensor, out: torch.Tensor, padding_idx: Optional[int], *,
    run_block: int, unroll: int, tile: int, long_mode: str, block_col: int,
    fill_rows: Optional[int], fill_col: int, runs_per_fill: int, prefetch: int,
    fill_evict: str, num_warps: Optional[int], maxnreg: Optional[int],
    long_kernel: bool = False, long_tile: int = 16, long_block_col: int = 1024,
    long_stages: int = 3, long_warps: Optional[int] = None, long_min: Optional[int] = None,
    long_block: Optional[int] = None, long_fork: bool = False, long_body: str = "pipelined",
    long_prefetch: int = 0, diag: int = 0, programs: int = 0, launch_long: bool = True,
) -> None:
    """The single kernel launch of ``embedding_backward`` (``impl="runs"``), given the
    prepared ``sorted_ids``/``order`` (``_sort_ids``) and, for ``fill="map"``, the touched
    map (None: the fill programs binary-search the sorted ids). Exposed for benchmarks;
    ``diag`` != 0 skips part of the work (see the kernel) and leaves ``out`` WRONG.
    ``programs``: 0 launches run and fill programs together, 1 only the run programs (the
    untouched rows are left as they are), 2 only the fill programs (the touched rows are
    left as they are). ``long_kernel``: the main kernel skips the runs of more than
    ``long_min`` entries and, when it launches run programs (``programs`` 0 or 1) and
    ``launch_long``, the long-run kernel is launched first, on the same stream, to sum them
    (``long_fork`` is ``_two_stream_backward``'s). ``diag=1`` skips the long runs in both."""
    n_tokens, dim = flat_grad.shape
    num_embeddings = out.shape[0]
    on_cuda = flat_grad.device.type == "cuda" and not torch.version.hip
    block_col = min(next_power_of_2(dim), block_col)
    fill_col = min(next_power_of_2(dim), fill_col)
    if fill_rows is None:  # ~16 KB of rows per fill program: 2 rows at D=4096 bf16
        row_bytes = dim * out.element_size()
        fill_rows = max(1, min(64, next_power_of_2(cdiv(1 << 14, row_bytes))))
    # Rows per store: at most 8192 elements (64 per thread with 4 warps): no register spills.
    fill_chunk = min(fill_rows, max(1, next_power_of_2(8192 // fill_col)))
    col_blocks = cdiv(dim, block_col)
    run_programs = cdiv(n_tokens, run_block) * col_blocks
    fill_programs = cdiv(num_embeddings, fill_rows)
    mixed_groups = min(fill_programs, run_programs // runs_per_fill) if runs_per_fill else 0
    if programs not in (0, 1, 2):
        raise ValueError(f"programs must be 0, 1 or 2, got {programs}")
    if programs:
        mixed_groups = 0
    grid = ((run_programs + fill_programs, run_programs, fill_programs)[programs],)
    search_steps = n_tokens.bit_length()
    options = _launch_options(flat_grad.device)
    if maxnreg and on_cuda:
        options["maxnreg"] = maxnreg
    long_min = long_min or unroll
    if long_kernel and launch_long and programs != 2 and diag not in (1, 3):
        # Before the run programs: the hot-id chains are the critical path, start them first.
        launch_long_runs_kernel(
            sorted_ids, order, flat_grad, out, padding_idx, long_min=long_min,
            long_tile=long_tile, long_block_col=long_block_col, long_stages=long_stages,
            long_warps=long_warps, long_block=long_block, long_body=long_body,
            long_prefetch=long_prefetch)
    _launch.launch(embedding_backward_kernel, grid, (
        # The kernel reads the low 32-bit word of each int64 token position (little-endian,
        # positions < 2**31): half the registers per in-flight index.
        sorted_ids, order.view(torch.int32), sorted_ids if touched is None else touched,
        flat_grad, out,
        n_tokens, num_embeddings, dim, -1 if padding_idx is None else padding_idx,
        1 << (search_steps - 1), search_steps, runs_per_fill, mixed_groups,
        flat_grad.stride(0), flat_grad.stride(1),
    ), dict(
        HAS_PADDING=padding_idx is not None, ACC_FP64=flat_grad.dtype == torch.float64,
        BLOCK_COL=block_col, RUN_BLOCK=run_block, UNROLL=unroll, TILE=tile,
        LONG_MODE=_LONG_MODES[long_mode],
        LONG_PREFETCH=prefetch if on_cuda and long_mode == "rows" else 0,
        FILL_ROWS=fill_rows, FILL_CHUNK=fill_chunk, FILL_COL=fill_col,
        FILL_SEARCH=touched is None, FILL_EVICT=fill_evict,
        LONG_SPLIT=unroll if diag == 1 else long_min if long_kernel else 0, DIAG=diag,
        PROGRAMS=programs,
    ), dict(
        num_warps=num_warps or (8 if block_col >= 1024 else 4 if block_col >= 512 else 2),
        **options,
    ))


# Run-end search width of the long-run kernel: one coarse load covers 64 * 64 positions.
_RUN_END_SEARCH = 64
# Shared memory the long-run kernel's pipeline buffers may take (an H100 SM has 227 KB; the
# token-position buffers and the reduction scratch need a little besides).
_LONG_SMEM_BYTES = 200 * 1024


def _long_block_default(long_min: int) -> int:
    """The largest power of two <= long_min + 1: the most sorted positions a long-run program
    may look at with at most one run of more than ``long_min`` entries starting among them."""
    return 1 << ((long_min + 1).bit_length() - 1)


def _long_launch_args(config: dict) -> dict:
    """``launch_long_runs_kernel``'s keyword arguments out of a ``backward_config`` dict."""
    return {k: config[k] for k in ("long_min", "long_tile", "long_block_col", "long_stages",
                                   "long_warps", "long_block", "long_body", "long_prefetch")}


def launch_long_runs_kernel(
    sorted_ids: torch.Tensor, order: torch.Tensor, flat_grad: torch.Tensor, out: torch.Tensor,
    padding_idx: Optional[int], *, long_min: int, long_tile: int, long_block_col: int,
    long_stages: int, long_warps: Optional[int], long_block: Optional[int],
    long_body: str = "pipelined", long_prefetch: int = 0,
) -> None:
    """Write the rows of the runs of more than ``long_min`` sorted entries (not the padding
    row) of ``out [V, D]`` from ``flat_grad [n_tokens, D]``, given ``_sort_ids``' outputs;
    the main kernel's ``LONG_SPLIT=long_min`` launch writes the other rows."""
    n_tokens, dim = flat_grad.shape
    long_block_col = min(next_power_of_2(dim), long_block_col)
    elem = flat_grad.element_size()
    long_block = long_block or _long_block_default(long_min)
    grid = (cdiv(n_tokens, long_block) * cdiv(dim, long_block_col),)
    on_cuda = flat_grad.device.type == "cuda" and not torch.version.hip
    options = _launch_options(flat_grad.device)
    registers = _LONG_BODIES[long_body] == LONG_REGISTERS
    if registers and on_cuda:
        # As for the main kernel's long path: a cap makes ptxas issue a step's row loads
        # before its adds; past 32 rows per step the rows and the next step's positions need
        # more than 128 registers.
        options["maxnreg"] = 255 if long_tile > 32 else 128
    embedding_long_runs_kernel[grid](
        sorted_ids, order.view(torch.int32), flat_grad, out,
        n_tokens, out.shape[0], dim, -1 if padding_idx is None else padding_idx,
        flat_grad.stride(0), flat_grad.stride(1),
        HAS_PADDING=padding_idx is not None, ACC_FP64=flat_grad.dtype == torch.float64,
        LONG_MIN=long_min, LONG_BLOCK=long_block, LONG_TILE=long_tile,
        LONG_BLOCK_COL=long_block_col, LONG_STAGES=long_stages, SEARCH=_RUN_END_SEARCH,
        LONG_BODY=_LONG_BODIES[long_body],
        LONG_PREFETCH=long_prefetch if registers and on_cuda else 0,
        num_warps=long_warps or max(1, min(8, long_block_col * elem // 512)),
        **options,
    )


def _legacy_embedding_backward(
    flat_grad: torch.Tensor, flat_ids: torch.Tensor, num_embeddings: int,
    padding_idx: Optional[int], out: torch.Tensor, *, unroll: int, tile: int, block_col: int,
    zero_rows: int, num_warps: Optional[int],
) -> torch.Tensor:
    """The previous launcher: sort, searchsorted run ends, touched map, legacy kernel."""
    n_tokens, dim = flat_grad.shape
    sorted_ids, order = _sort_ids(flat_ids, num_embeddings)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    touched = _touched_map(flat_ids, num_embeddings)
    block_col = min(next_power_of_2(dim), block_col)
    col_blocks = cdiv(dim, block_col)
    grid = (n_tokens * col_blocks + cdiv(num_embeddings, zero_rows) * col_blocks,)
    legacy_embedding_backward_kernel[grid](
        sorted_ids, order, run_end, touched, flat_grad, out,
        n_tokens, num_embeddings, dim, -1 if padding_idx is None else padding_idx,
        flat_grad.stride(0), flat_grad.stride(1),
        HAS_PADDING=padding_idx is not None, UNROLL=unroll, BLOCK_COL=block_col,
        ZERO_ROWS=zero_rows, ACC_FP64=flat_grad.dtype == torch.float64, TILE=tile,
        num_warps=num_warps or (4 if block_col >= 512 else 2),
        **_launch_options(flat_grad.device),
    )
    return out
