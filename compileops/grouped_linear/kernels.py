"""Triton kernels for the grouped linear family, with their eager launchers.

Three grouped products, all persistent (a fixed grid of ``NUM_PROGS`` programs that walk
the tiles), all reading the group offsets on the device (no host sync, CUDA-graph safe):

* **M-jagged** ``out[rows_g] = A[rows_g] @ B_g (+ bias_g)``: the forward
  (``A = x``, ``B_g = W_g^T``), ``dX`` (``A = dY``, ``B_g = W_g``) and the fused SwiGLU
  forward (gate and up halves of N in one tile). The rows past ``offsets[-1]`` form a
  virtual group ``G`` whose tiles are written as exact zeros.
* **K-jagged** ``dW_g = dY_g^T @ X_g`` with ``db_g = colsum(dY_g)`` in the same pass: a
  tile space ``G x N-tiles x K-tiles``, each tile reducing over its group's rows in row
  order. No split-K, no floating-point atomics: bitwise deterministic. (Tiles go to
  programs by a fixed stride, or with ``Config.dynamic_tiles`` by an integer ticket
  counter; either way each tile is computed once, with the same code.) Empty groups give
  exact zeros.

The ``@triton.jit`` bodies (:func:`group_rows`, :func:`mjagged_tile` (single tile, or the
gate/up tile pair sharing one A load), :func:`swiglu`,
:func:`kjagged_tile`) are shared with the Inductor template
(``lowerings/templates/grouped_linear.py.jinja``), so no kernel math is written twice.

Offsets are clamped per group (``start = clamp(offs[g-1], 0, M)``, ``end = clamp(offs[g],
start, M)``): bad offsets never cause an out-of-bounds access; the result for them is
unspecified (see :mod:`compileops.grouped_linear.op` for the opt-in eager check).

TMA: on sm90+ the eager M-jagged kernel (forward, SwiGLU, dX) loads A and W tiles through
device-side tensor descriptors when strides/alignment allow (:func:`tma_applies`;
``COMPILEOPS_GROUPED_TMA=0`` turns it off); with ``Config.tma_store`` it also stores the
output tiles by TMA, through a ragged descriptor that drops the next group's rows
(:func:`store_rows_below`; not in the default configs). The dW kernel loads whole row
chunks by TMA too (:func:`wgrad_tma_applies`), with the ``Config`` variants ``ragged_tma``,
``tma_store`` and ``epilogue_subtile`` (see :func:`choose_wgrad_config` for the defaults).
``tl.range(warp_specialize=True)`` on the dW chunk loop compiled for sm_90 with Triton 3.6
(only with 4 warps, no runtime branches in the tile body and no masked tail loop) but
produced wrong dW on an H200, so it is not offered. The Inductor template stores through
masked pointers (its loads take TMA where ``lowerings/grouped_linear.py`` allows). Tile
shapes are chosen on the host from ``M / G`` (the mean group size; no device read) by
:func:`choose_config`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl


# ---------------------------------------------------------------------------------------
# Shared @triton.jit bodies (also called by the Inductor template)


@triton.jit
def group_rows(offs_ptr, g, G, M):
    """Rows ``[start, end)`` of group ``g`` (``g == G``: the tail ``[offs[G-1], M)``), clamped."""
    prev = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    start = tl.minimum(tl.maximum(prev, 0), M)
    raw = tl.load(offs_ptr + g, mask=g < G, other=M)
    end = tl.minimum(tl.maximum(raw, start), M)
    return start, end


@triton.jit
def group_bounds(offs_ptr, G, M, G_BLOCK: tl.constexpr):
    """:func:`group_rows` for every lane at once: ``(lanes, start, end)``, each ``[G_BLOCK]``;
    lane ``G`` is the tail ``[offs[G-1], M)``; lanes past it hold no group (callers mask them)."""
    lanes = tl.arange(0, G_BLOCK)
    prev = tl.load(offs_ptr + lanes - 1, mask=(lanes > 0) & (lanes <= G), other=0)
    start = tl.minimum(tl.maximum(prev, 0), M)
    raw = tl.load(offs_ptr + lanes, mask=lanes < G, other=M)
    end = tl.minimum(tl.maximum(raw, start), M)
    return lanes, start, end


@triton.jit
def group_tile_table(offs_ptr, G, M, BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Per-group M-tile prefix sums, read once per program from the device offsets.

    Lane ``g < G`` is group g, lane ``G`` the tail rows past ``offs[G-1]`` (written as zeros),
    lanes past ``G`` are empty. Returns ``(tile_end [G_BLOCK], total_m)``: ``tile_end[g]`` is
    the number of M-tiles in groups ``0..g`` (inclusive prefix sum), ``total_m`` the total.
    ``G_BLOCK`` is a power of two > G.
    """
    lanes, start, end = group_bounds(offs_ptr, G, M, G_BLOCK)
    m_tiles = tl.where(lanes <= G, tl.cdiv(end - start, BLOCK_M), 0)
    tile_end = tl.cumsum(m_tiles, axis=0)
    return tile_end, tl.sum(m_tiles, axis=0)


@triton.jit
def locate_tile(t, tile_end, total_m, num_n, offs_ptr, G, M,
                GROUP_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Flat tile ``t`` of the ``total_m x num_n`` tile space -> ``(g, start, end, tile_m,
    tile_n)``: group g's rows ``[start, end)`` and the tile's place in that group.

    M-tiles are numbered group after group (``group_tile_table``), then ``GROUP_M`` M-tiles
    are swept across all N-tiles before moving on (L2 reuse of A rows and of B_g). Finding
    the group is a compare-and-count over the G lanes: no per-group loop, no extra launch.
    """
    per_super = GROUP_M * num_n
    first_m = (t // per_super) * GROUP_M
    rows_here = tl.minimum(total_m - first_m, GROUP_M)
    m_idx = first_m + (t % per_super) % rows_here
    tile_n = (t % per_super) // rows_here
    g = tl.sum((tile_end <= m_idx).to(tl.int32), axis=0)
    lanes = tl.arange(0, G_BLOCK)
    group_first = tl.sum(tl.where(lanes == g - 1, tile_end, 0), axis=0)
    start, end = group_rows(offs_ptr, g, G, M)
    return g, start, end, m_idx - group_first, tile_n


@triton.jit
def _desc_b_tile(b_desc, g, n0, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 B_KN: tl.constexpr):
    """``[BLOCK_K, BLOCK_N]`` tile of B_g at ``(k0, n0)`` through the 3-D weight descriptor."""
    if B_KN:
        return b_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        return b_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T


@triton.jit
def make_descriptors(a_ptr, b_ptr, M, K, G, B_N, stride_am, stride_bg, stride_b1,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     B_KN: tl.constexpr):
    """Device-side TMA descriptors: A ``[M, K]`` (unit column stride) and the weight
    ``[G, K, B_N]`` (``B_KN``) or ``[G, B_N, K]`` (unit last stride)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    if B_KN:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, K, B_N],
                                           strides=[stride_bg, stride_b1, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[G, B_N, K],
                                           strides=[stride_bg, stride_b1, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    return a_desc, b_desc


@triton.jit
def mjagged_tile(
    a_ptr, b_ptr, bias_ptr, g, active, row_start, m_size, tile_m, tile_n,
    n_size, pair_offset, K,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_biasg, stride_biasn,
    a_desc, b_desc,
    HAS_BIAS: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr, B_KN: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_N]`` tile of ``A[row_start + rm] @ B_g[:, rn] (+ bias_g[rn])``.

    ``rm = tile_m * BLOCK_M + arange`` (valid below ``m_size``), ``rn = tile_n * BLOCK_N +
    arange`` (valid below ``n_size``). Returns ``(tile, tile2)``: with ``PAIR`` the second
    is the tile at columns ``rn + pair_offset`` (the up half of a fused gate/up weight),
    computed in the same K loop so the A tile is loaded once; otherwise ``tile2 is tile``.
    ``active == False`` (the tail past the last group) gives exact zeros: its pointer loads
    are masked off, its TMA loads of the out-of-range group ``G`` are zero-filled, and the
    accumulator is replaced by zeros (tail rows of A may hold anything, even inf). The K
    loop always runs in the same
    BLOCK_K order: a row's value does not depend on the other rows of its tile.

    ``USE_TMA``: A and B tiles come through tensor descriptors (``a_desc`` over A ``[M, K]``,
    ``b_desc`` over the weight ``[G, *, *]``; :func:`make_descriptors`). Rows of A past the
    group (other groups' rows) only reach output rows that are masked at the store; columns
    and K past the tensor's bounds are zero-filled by the TMA unit.
    ``B_KN``: B_g is stored ``[K, N]`` (dX: ``W_g`` untransposed), else ``[N, K]``.
    """
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < m_size
    col_ok = rn < n_size
    rows = (row_start + rm).to(tl.int64)
    cols = rn.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = (b_ptr + tl.cast(g, tl.int64) * stride_bg + rk[:, None] * stride_bk
              + cols[None, :] * stride_bn)
    b2_ptrs = b_ptrs + tl.cast(pair_offset, tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A loop-invariant trip count (K, not "0 when inactive") lets tl.range(flatten=True) fuse
    # this loop with the persistent tile loop; inactive tiles are zeroed after it instead.
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        if USE_TMA:
            a = a_desc.load([(row_start + tile_m * BLOCK_M).to(tl.int32), k0])
            b = _desc_b_tile(b_desc, g, tile_n * BLOCK_N, k0, BLOCK_N, BLOCK_K, B_KN)
        else:
            a = tl.load(a_ptrs, mask=(row_ok & active)[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (col_ok & active)[None, :], other=0.0)
        if DOT_UPCAST:  # interpreter only: its tl.dot mishandles bf16 (raw bits)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if PAIR:
            if USE_TMA:
                b2 = _desc_b_tile(b_desc, g, tile_n * BLOCK_N + pair_offset, k0,
                                  BLOCK_N, BLOCK_K, B_KN)
            else:
                b2 = tl.load(b2_ptrs, mask=k_ok[:, None] & (col_ok & active)[None, :], other=0.0)
            if DOT_UPCAST:
                b2 = b2.to(tl.float32)
            acc2 = tl.dot(a, b2, acc2, input_precision=INPUT_PRECISION)
            b2_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = tl.where(active, acc, 0.0)
    acc2 = tl.where(active, acc2, 0.0)
    if HAS_BIAS:
        bias_ptrs = bias_ptr + tl.cast(g, tl.int64) * stride_biasg + cols * stride_biasn
        bias = tl.load(bias_ptrs, mask=col_ok & active, other=0.0)
        acc += bias.to(tl.float32)[None, :]
        if PAIR:
            bias2 = tl.load(bias_ptrs + tl.cast(pair_offset, tl.int64) * stride_biasn,
                            mask=col_ok & active, other=0.0)
            acc2 += bias2.to(tl.float32)[None, :]
    if PAIR:
        return acc, acc2
    return acc, acc


@triton.jit
def swiglu(gate, up):
    """``silu(gate) * up`` in fp32 (``tl.sigmoid``: no libdevice, runs in the interpreter)."""
    return gate * tl.sigmoid(gate) * up


# Ragged row descriptors (the construction of triton.tools.ragged_tma, built on the device):
# a 4-D view [RAGGED_MAX, RAGGED_MAX, RAGGED_ROWS, cols] of a row-major [rows, cols] matrix
# with strides [2**34 - s, s, s, 1] (s: row stride). Coordinates (RAGGED_ROWS, end,
# RAGGED_ROWS - end + r, c) address row r (the first two terms cancel modulo 2**64), and the
# bound RAGGED_ROWS on the third makes the TMA unit zero-fill every row >= end: a group's
# last partial chunk needs no masked pointer path and never reads the next group's rows.
RAGGED_MAX = tl.constexpr(0x7FFF0000)
RAGGED_ROWS = tl.constexpr(0x40000000)  # rows of the matrix must stay below this


@triton.jit
def ragged_rows_descriptor(ptr, cols, stride_row, BLOCK_ROWS: tl.constexpr,
                           BLOCK_COLS: tl.constexpr):
    """Descriptor for :func:`load_rows_below`: ``[BLOCK_ROWS, BLOCK_COLS]`` boxes of a
    ``[rows, cols]`` matrix with unit column stride."""
    stride = tl.cast(stride_row, tl.int64)  # an i32 argument when small: 2**34 needs i64
    return tl.make_tensor_descriptor(
        ptr, shape=[RAGGED_MAX, RAGGED_MAX, RAGGED_ROWS, cols],
        strides=[2**34 - stride, stride, stride, 1],
        block_shape=[1, 1, BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def load_rows_below(desc, row, end, col, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Rows ``[row, row + BLOCK_ROWS)`` x columns ``[col, col + BLOCK_COLS)`` through a
    :func:`ragged_rows_descriptor`; rows ``>= end`` (and columns past the matrix) read 0."""
    box = desc.load([RAGGED_ROWS, end, RAGGED_ROWS - end + row, col])
    return box.reshape(BLOCK_ROWS, BLOCK_COLS)


@triton.jit
def store_rows_below(desc, row, end, col, tile, BLOCK_ROWS: tl.constexpr,
                     BLOCK_COLS: tl.constexpr):
    """Writes ``tile [BLOCK_ROWS, BLOCK_COLS]`` to rows ``[row, row + BLOCK_ROWS)`` x columns
    ``[col, col + BLOCK_COLS)`` through a :func:`ragged_rows_descriptor` (the mirror of
    :func:`load_rows_below`): the TMA unit drops the elements of rows ``>= end`` and of
    columns past the matrix, so another program's rows past ``end`` are never written."""
    desc.store([RAGGED_ROWS, end, RAGGED_ROWS - end + row, col],
               tile.reshape(1, 1, BLOCK_ROWS, BLOCK_COLS))


@triton.jit
def kjagged_tile(
    dy_ptr, x_ptr, start, end, tile_n, tile_k, N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    WITH_DB: tl.constexpr, RAGGED: tl.constexpr = False,
):
    """fp32 ``dW`` tile ``[BLOCK_N, BLOCK_K] = dY[start:end, rn]^T @ X[start:end, rk]``,
    reduced over the rows in ``BLOCK_M`` chunks in row order. An empty range gives zeros.
    Returns ``(acc, db_acc)``.

    ``WITH_DB`` (16-bit inputs): the same loop also sums dY's columns on the tensor cores,
    ``db_acc [BLOCK_N, 16] += dY_chunk^T @ ones [BLOCK_M, 16]``, from the dY chunk already
    in shared memory: every product is ``dy * 1``, exact, summed in fp32 like the dW tile,
    and every column of ``db_acc`` holds the same sums (take column 0). A second pass over
    dY (``column_sums``) re-reads the whole group's column block with plain loads; on an
    H100 that made dW+db up to 1.5x slower than dW alone. With ``WITH_DB`` false,
    ``db_acc`` is a ``[BLOCK_N, 16]`` zero tile.

    ``USE_TMA``: whole ``BLOCK_M``-row chunks come through the ``dy_desc`` (over dY ``[M, N]``)
    and ``x_desc`` (over X ``[M, K]``) descriptors; the group's last partial chunk takes the
    masked pointer path, so rows of the next group never enter the product (not even as
    0 * x). Columns past N / K are zero-filled by the TMA unit or masked.

    ``RAGGED`` (with ``USE_TMA``): the descriptors are ragged
    (:func:`ragged_rows_descriptor`) and every chunk, the partial last one included, comes
    through them: one loop per tile instead of a TMA loop plus a masked pointer tail (its
    own, unpipelined loads). The zero-filled rows give the same products as the masked ones.
    """
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_ok = rk < K
    rn64 = rn.to(tl.int64)
    rk64 = rk.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    ones_dtype = tl.float32 if DOT_UPCAST else dy_ptr.dtype.element_ty
    ones = tl.full((BLOCK_M, 16), 1.0, dtype=ones_dtype)
    tail = start
    if USE_TMA:
        if RAGGED:
            tail = end
        else:
            tail = start + ((end - start) // BLOCK_M) * BLOCK_M
        for m0 in range(start, tail, BLOCK_M):
            if RAGGED:
                dy = load_rows_below(dy_desc, m0, end, tile_n * BLOCK_N, BLOCK_M, BLOCK_N)
                xb = load_rows_below(x_desc, m0, end, tile_k * BLOCK_K, BLOCK_M, BLOCK_K)
            else:
                dy = dy_desc.load([m0, tile_n * BLOCK_N])
                xb = x_desc.load([m0, tile_k * BLOCK_K])
            if DOT_UPCAST:  # interpreter only (see dot_upcast)
                dy = dy.to(tl.float32)
                xb = xb.to(tl.float32)
            acc = tl.dot(dy.T, xb, acc, input_precision=INPUT_PRECISION)
            if WITH_DB:
                db_acc = tl.dot(dy.T, ones, db_acc, input_precision=INPUT_PRECISION)
    if USE_TMA and RAGGED:
        return acc, db_acc
    for m0 in range(tail, end, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        m_ok = rm < end
        rm64 = rm.to(tl.int64)
        dyt = tl.load(dy_ptr + rn64[:, None] * stride_dyn + rm64[None, :] * stride_dym,
                      mask=n_ok[:, None] & m_ok[None, :], other=0.0)
        xb = tl.load(x_ptr + rm64[:, None] * stride_xm + rk64[None, :] * stride_xk,
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_UPCAST:
            dyt = dyt.to(tl.float32)
            xb = xb.to(tl.float32)
        acc = tl.dot(dyt, xb, acc, input_precision=INPUT_PRECISION)
        if WITH_DB:
            db_acc = tl.dot(dyt, ones, db_acc, input_precision=INPUT_PRECISION)
    return acc, db_acc


@triton.jit
def column_sums(dy_ptr, start, end, tile_n, N, stride_dym, stride_dyn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``db`` partial ``[BLOCK_N]`` = fp32 column sums of ``dY[start:end, rn]``, in
    ``BLOCK_M``-row chunks in row order (deterministic). Zeros for an empty range."""
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        dy = tl.load(dy_ptr + rm.to(tl.int64)[:, None] * stride_dym
                     + rn.to(tl.int64)[None, :] * stride_dyn,
                     mask=(rm < end)[:, None] & n_ok[None, :], other=0.0)
        db += tl.sum(dy.to(tl.float32), axis=0)
    return db


# ---------------------------------------------------------------------------------------
# Dynamic tile schedule (dW): an int32 ticket counter, zeroed per launch


@triton.jit
def claim_ticket(ticket_ptr, DYNAMIC: tl.constexpr, ASM_TICKET: tl.constexpr,
                 LANES: tl.constexpr):
    """Issues ``atomicAdd(ticket_ptr, 1)`` for this program's next tile; read the ticket with
    :func:`ticket_value`. A relaxed integer atomic: it only hands out tile numbers, and
    which program computes a tile never changes the tile's bits.

    ``ASM_TICKET`` (NVIDIA GPUs): one thread issues the atomic through inline PTX into a
    ``[LANES]`` tensor (one lane per thread, ``LANES = 32 * num_warps``; the other lanes
    hold 0), and the value is only gathered (``tl.max``) where it is needed, so its round
    trip to L2 overlaps the work in between (the dW epilogue). ``tl.atomic_add`` on a
    scalar would broadcast the result through shared memory behind a barrier right away,
    stalling every warp for the round trip once per tile. The interpreter (no inline asm)
    takes ``tl.atomic_add``. ``DYNAMIC`` false: no atomic, returns 0."""
    ticket = 0
    if DYNAMIC:
        if ASM_TICKET:
            lane = tl.arange(0, LANES)
            ticket = tl.inline_asm_elementwise(
                "{ .reg .pred leader; setp.eq.s32 leader, $2, 0; mov.u32 $0, 0; "
                "@leader atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }",
                "=r,l,r", [ticket_ptr + lane * 0, lane], dtype=tl.int32, is_pure=False,
                pack=1)
        else:
            ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    return ticket


@triton.jit
def ticket_value(ticket, ASM_TICKET: tl.constexpr):
    """The counter value a :func:`claim_ticket` handle received (a scalar)."""
    value = ticket
    if ASM_TICKET:
        value = tl.max(ticket, axis=0)
    return value


# ---------------------------------------------------------------------------------------
# Eager kernels: persistent schedules around the bodies


@triton.jit
def mjagged_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, offs_ptr, out_ptr,
    M, N_OUT, K, G,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_biasg, stride_biasn,
    stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NUM_PROGS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr, B_KN: tl.constexpr, G_BLOCK: tl.constexpr, FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr = False,
):
    """Persistent M-jagged grouped GEMM; ``N_OUT`` output columns (``N / 2`` with SWIGLU).

    One flat tile space over all groups (``group_tile_table`` / ``locate_tile``): every
    program strides through it by ``NUM_PROGS``, so load balance does not depend on how the
    rows split into groups. ``FLATTEN`` lets Triton pipeline across consecutive tiles.

    ``TMA_STORE`` (with ``USE_TMA``; ``out [M, N_OUT]`` with unit column stride, 16-byte
    aligned base and row stride, ``M < RAGGED_ROWS``): each output tile leaves as an async
    bulk copy through a ragged descriptor (:func:`store_rows_below`), so the next tile's
    loads and MMAs run while it drains, instead of masked pointer stores from registers. A
    group's last partial tile covers rows of the next group (written by another program): the
    ragged bound ``end`` drops them, as the pointer store's row mask does."""
    pid = tl.program_id(0)
    a_desc = None
    b_desc = None
    if USE_TMA:
        if B_KN:
            a_desc, b_desc = make_descriptors(a_ptr, b_ptr, M, K, G, N_OUT, stride_am, stride_bg,
                                              stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
        else:
            b_n = N_OUT * 2 if SWIGLU else N_OUT
            a_desc, b_desc = make_descriptors(a_ptr, b_ptr, M, K, G, b_n, stride_am, stride_bg,
                                              stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
    out_desc = None
    if USE_TMA and TMA_STORE:
        out_desc = ragged_rows_descriptor(out_ptr, N_OUT, stride_om, BLOCK_M, BLOCK_N)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    tile_end, total_m = group_tile_table(offs_ptr, G, M, BLOCK_M, G_BLOCK)
    for t in tl.range(pid, total_m * num_n, NUM_PROGS, flatten=FLATTEN):
        g, start, end, tile_m, tile_n = locate_tile(t, tile_end, total_m, num_n, offs_ptr, G, M,
                                                    GROUP_M, G_BLOCK)
        acc, up = mjagged_tile(
            a_ptr, b_ptr, bias_ptr, g, g < G, start, end - start, tile_m, tile_n,
            N_OUT, N_OUT, K, stride_am, stride_ak, stride_bg, stride_bk, stride_bn,
            stride_biasg, stride_biasn, a_desc, b_desc, HAS_BIAS, SWIGLU, BLOCK_M, BLOCK_N,
            BLOCK_K, INPUT_PRECISION, DOT_UPCAST, USE_TMA, B_KN,
        )
        if SWIGLU:
            acc = swiglu(acc, up)
        if USE_TMA and TMA_STORE:
            store_rows_below(out_desc, start + tile_m * BLOCK_M, end, tile_n * BLOCK_N,
                             acc.to(out_ptr.dtype.element_ty), BLOCK_M, BLOCK_N)
        else:
            rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rm < end - start)[:, None] & (rn < N_OUT)[None, :]
            rows = (start + rm).to(tl.int64)
            dst = out_ptr + rows[:, None] * stride_om + rn[None, :].to(tl.int64) * stride_on
            tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kjagged_output_tile(
    dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, g, tile_n, tile_k, num_n, num_k,
    M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc, dw_desc,
    HAS_DB: tl.constexpr, DB_MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    RAGGED: tl.constexpr, TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    DYNAMIC: tl.constexpr, ASM_TICKET: tl.constexpr, LANES: tl.constexpr,
):
    """Computes and stores dW tile ``(g, tile_n, tile_k)``, and ``db[g, rn]`` when this tile
    owns it (see :func:`kjagged_gemm_kernel`).

    ``TMA_STORE``: the bf16/fp16 tile leaves through ``dw_desc`` (dW viewed as ``[G * N, K]``)
    as an async bulk copy, so the next tile's loads and MMAs run while it drains, instead of
    ``BLOCK_N x BLOCK_K`` pointer stores from registers. Rows are ``g * N + rn``: the host
    only sets it when ``N % BLOCK_N == 0``, so a tile never reaches into group ``g + 1``'s
    rows; columns past K are dropped by the TMA unit. ``EPILOGUE_SUBTILE``: stored as two
    ``[BLOCK_N, BLOCK_K / 2]`` halves (half the shared-memory staging buffer).

    ``DYNAMIC``: claims the program's next tile (:func:`claim_ticket`) once the reduction
    is done and returns the handle, so the claim's round trip overlaps the epilogue (and
    a program asks for more work only when its current tile is nearly finished)."""
    start, end = group_rows(offs_ptr, g, G, M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    owns_db = tile_k == (g * num_n + tile_n) % num_k
    if HAS_DB & DB_MMA & owns_db:
        acc, db_acc = kjagged_tile(
            dy_ptr, x_ptr, start, end, tile_n, tile_k, N, K,
            stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, DOT_UPCAST, USE_TMA, True,
            RAGGED,
        )
        # Column 0 of db_acc; adding -0.0 to the other lanes' values is exact.
        first = tl.arange(0, 16)[None, :] == 0
        db = tl.sum(tl.where(first, db_acc, -0.0), axis=1)
        tl.store(db_ptr + tl.cast(g, tl.int64) * N + rn, db.to(db_ptr.dtype.element_ty),
                 mask=n_ok)
    else:
        acc, _ = kjagged_tile(
            dy_ptr, x_ptr, start, end, tile_n, tile_k, N, K,
            stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, DOT_UPCAST, USE_TMA, False,
            RAGGED,
        )
        if HAS_DB & (DB_MMA == 0) & owns_db:
            db = column_sums(dy_ptr, start, end, tile_n, N, stride_dym, stride_dyn,
                             BLOCK_M, BLOCK_N)
            tl.store(db_ptr + tl.cast(g, tl.int64) * N + rn, db.to(db_ptr.dtype.element_ty),
                     mask=n_ok)
    ticket = claim_ticket(ticket_ptr, DYNAMIC, ASM_TICKET, LANES)
    store_dw_tile(dw_ptr, dw_desc, acc, g, tile_n, tile_k, N, K, BLOCK_N, BLOCK_K, TMA_STORE,
                  EPILOGUE_SUBTILE)
    return ticket


@triton.jit
def store_dw_tile(dw_ptr, dw_desc, acc, g, tile_n, tile_k, N, K,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA_STORE: tl.constexpr,
                  EPILOGUE_SUBTILE: tl.constexpr):
    """Writes the fp32 tile ``acc [BLOCK_N, BLOCK_K]`` as dW tile ``(g, tile_n, tile_k)`` in
    dW's dtype: by TMA, whole or in two halves (see :func:`kjagged_output_tile`), or by
    masked pointer stores."""
    if TMA_STORE:
        tile = acc.to(dw_ptr.dtype.element_ty)
        row = g * N + tile_n * BLOCK_N
        col = tile_k * BLOCK_K
        if EPILOGUE_SUBTILE:
            halves = tl.permute(tl.reshape(tile, (BLOCK_N, 2, BLOCK_K // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            dw_desc.store([row, col], left)
            dw_desc.store([row, col + BLOCK_K // 2], right)
        else:
            dw_desc.store([row, col], tile)
    else:
        rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
        dst = dw_ptr + tl.cast(g, tl.int64) * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
        tl.store(dst, acc.to(dw_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (rk < K)[None, :])


@triton.jit
def kjagged_tile_coords(rest, num_n, num_k, GROUP_N: tl.constexpr):
    """Index ``rest`` in ``[0, num_n * num_k)`` of a group's dW tiles -> ``(tile_n, tile_k)``:
    K-tile fastest for ``GROUP_N == 1``; else super-blocks of ``GROUP_N`` N-tiles (the last
    one may be narrower), N-tile fastest inside each. A bijection either way."""
    if GROUP_N == 1:
        return rest // num_k, rest % num_k
    per_super = GROUP_N * num_k
    first_n = (rest // per_super) * GROUP_N
    n_here = tl.minimum(num_n - first_n, GROUP_N)
    within = rest % per_super
    return first_n + within % n_here, within // n_here


@triton.jit
def kjagged_program_chunks(offs_ptr, pid, per_group, G, M, NUM_PROGS: tl.constexpr,
                           BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Row chunks program ``pid`` reduces under the static schedule (tiles ``pid, pid +
    NUM_PROGS, ...``; a tile of an empty group counts one chunk): one vector pass over the
    G groups, no loop over the tiles."""
    lanes, start, end = group_bounds(offs_ptr, G, M, G_BLOCK)
    first_tile = lanes * per_group
    # The program's first tile in group g: the least t >= first_tile with t % NUM_PROGS == pid.
    mine = first_tile + (pid - first_tile % NUM_PROGS + NUM_PROGS) % NUM_PROGS
    tiles = tl.maximum(tl.cdiv(first_tile + per_group - mine, NUM_PROGS), 0)
    chunks = tl.maximum(tl.cdiv(end - start, BLOCK_M), 1)
    return tl.sum(tl.where(lanes < G, tiles * chunks, 0), axis=0)


@triton.jit
def kjagged_tile_state(t, per_group, num_n, num_k, offs_ptr, G, M, GROUP_N: tl.constexpr):
    """Static-schedule tile ``t`` -> ``(g, tile_n, tile_k, start, end)``; past the last tile
    the group index is clamped (its state is never used)."""
    g = tl.minimum(t // per_group, G - 1)
    tile_n, tile_k = kjagged_tile_coords(t % per_group, num_n, num_k, GROUP_N)
    start, end = group_rows(offs_ptr, g, G, M)
    return g, tile_n, tile_k, start, end


@triton.jit
def kjagged_flat_loop(
    dy_desc, x_desc, dw_desc, offs_ptr, dw_ptr, per_group, num_n, num_k, M, N, K, G,
    NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, GROUP_N: tl.constexpr,
    G_BLOCK: tl.constexpr,
):
    """The static schedule's dW tiles (no db) as ONE loop over all the program's row chunks
    (ragged TMA loads), so the software pipeliner issues the next tile's first loads before
    this tile's last MMAs and its epilogue, where the tile loop drains and refills the
    pipeline at every tile. Triton's ``flatten`` cannot build this loop: it fuses only inner
    loops whose trip count is the same in every outer iteration.

    Per chunk the loop only selects between the current tile's state and the next tile's,
    which is worked out once per tile, in a branch ahead of the MMA (the integer divisions
    and the offsets loads, done in every chunk, left an earlier version of this loop
    instruction-bound at 0.8x of the tile loop). The epilogue runs in a second branch after
    the MMA, in the chunk that ends a tile. Every tile reduces the same chunks in the same
    order as :func:`kjagged_tile`: the same bits."""
    pid = tl.program_id(0)
    n_chunks = kjagged_program_chunks(offs_ptr, pid, per_group, G, M, NUM_PROGS, BLOCK_M,
                                      G_BLOCK)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    t = pid
    g, tile_n, tile_k, m0, end = kjagged_tile_state(t, per_group, num_n, num_k, offs_ptr, G,
                                                    M, GROUP_N)
    next_g, next_n, next_k, next_start, next_end = kjagged_tile_state(
        t + NUM_PROGS, per_group, num_n, num_k, offs_ptr, G, M, GROUP_N)
    for _ in range(0, n_chunks):
        dy = load_rows_below(dy_desc, m0, end, tile_n * BLOCK_N, BLOCK_M, BLOCK_N)
        xb = load_rows_below(x_desc, m0, end, tile_k * BLOCK_K, BLOCK_M, BLOCK_K)
        last = m0 + BLOCK_M >= end
        tile_g = g  # this chunk's tile, for the epilogue
        tile_n_here = tile_n
        tile_k_here = tile_k
        g = tl.where(last, next_g, g)
        tile_n = tl.where(last, next_n, tile_n)
        tile_k = tl.where(last, next_k, tile_k)
        end = tl.where(last, next_end, end)
        m0 = tl.where(last, next_start, m0 + BLOCK_M)
        if last:
            t += NUM_PROGS
            next_g, next_n, next_k, next_start, next_end = kjagged_tile_state(
                t + NUM_PROGS, per_group, num_n, num_k, offs_ptr, G, M, GROUP_N)
        if DOT_UPCAST:  # interpreter only (see dot_upcast)
            dy = dy.to(tl.float32)
            xb = xb.to(tl.float32)
        acc = tl.dot(dy.T, xb, acc, input_precision=INPUT_PRECISION)
        if last:
            store_dw_tile(dw_ptr, dw_desc, acc, tile_g, tile_n_here, tile_k_here, N, K,
                          BLOCK_N, BLOCK_K, TMA_STORE, EPILOGUE_SUBTILE)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def kjagged_claimed_tile(
    t, per_group, dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, num_n, num_k,
    M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc, dw_desc,
    HAS_DB: tl.constexpr, DB_MMA: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    RAGGED: tl.constexpr, TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    GROUP_N: tl.constexpr, ASM_TICKET: tl.constexpr, LANES: tl.constexpr,
):
    """Dynamic schedule step: computes and stores flat dW tile ``t`` (group order) and
    returns the next tile this program claimed, ``NUM_PROGS + ticket``."""
    tile_n, tile_k = kjagged_tile_coords(t % per_group, num_n, num_k, GROUP_N)
    ticket = kjagged_output_tile(
        dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, t // per_group, tile_n, tile_k,
        num_n, num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc,
        x_desc, dw_desc, HAS_DB, DB_MMA, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
        DOT_UPCAST, USE_TMA, RAGGED, TMA_STORE, EPILOGUE_SUBTILE, True, ASM_TICKET, LANES,
    )
    return NUM_PROGS + ticket_value(ticket, ASM_TICKET)


@triton.jit
def kjagged_gemm_kernel(
    dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr,
    M, N, K, G,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    HAS_DB: tl.constexpr, DB_MMA: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    RAGGED: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
    EPILOGUE_SUBTILE: tl.constexpr = False, GROUP_N: tl.constexpr = 1,
    DYNAMIC: tl.constexpr = False, ASM_TICKET: tl.constexpr = False, LANES: tl.constexpr = 128,
    FLAT: tl.constexpr = False, G_BLOCK: tl.constexpr = 2,
):
    """Persistent K-jagged grouped GEMM: ``dw [G, N, K]``, ``db [G, N]`` (both contiguous).

    Tiles ``(g, tile_n, tile_k)``, group by group. ``GROUP_N == 1``: K-tiles fastest, so
    concurrent programs share dY's column block and sweep all of ``X_g``'s column blocks;
    ``GROUP_N > 1``: within a group, super-blocks of ``GROUP_N`` N-tiles are swept N-tile
    fastest (``kjagged_tile_coords``), so concurrent programs share X's column blocks as
    well. Which order keeps more of a large group's ``dY_g`` and ``X_g`` in L2 depends on N
    and K; the order never changes any tile's value. One K-tile per ``(g, tile_n)`` also
    produces ``db[g, rn]``: with ``DB_MMA``
    (16-bit inputs) inside its main loop (``kjagged_tile``'s ``WITH_DB``), else (fp32,
    where tf32 would round dY) by an extra pass of exact fp32 column sums. Which K-tile owns
    db rotates with ``(g, tile_n)``: with a fixed one, the owners all land on the few
    programs whose stride hits that K-tile, and the slowest program sets the kernel time.

    Static schedule: program p takes tiles ``p, p + NUM_PROGS, ...`` in group order. A tile
    costs a fixed prologue/epilogue plus one step per ``BLOCK_M`` rows of its group, so with
    skewed groups the programs' fixed shares differ (the Dirichlet(1) benchmark splits: the
    busiest program has 3-14% more than the mean, by a cost model of the schedule).
    ``DYNAMIC``: program p starts on tile p, then takes ``NUM_PROGS + ticket`` from an int32
    counter (``ticket_ptr``, zero at launch) each time it finishes one, still in group order,
    so programs that drew small groups take more tiles. Either way each tile is computed by
    exactly one program with the same code: the same dW and db bits."""
    pid = tl.program_id(0)
    dy_desc = None
    x_desc = None
    if USE_TMA and RAGGED:
        dy_desc = ragged_rows_descriptor(dy_ptr, N, stride_dym, BLOCK_M, BLOCK_N)
        x_desc = ragged_rows_descriptor(x_ptr, K, stride_xm, BLOCK_M, BLOCK_K)
    elif USE_TMA:
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[M, N], strides=[stride_dym, 1],
                                            block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    dw_desc = None
    if TMA_STORE:
        dw_desc = tl.make_tensor_descriptor(
            dw_ptr, shape=[G * N, K], strides=[K, 1],
            block_shape=[BLOCK_N, BLOCK_K // 2 if EPILOGUE_SUBTILE else BLOCK_K])
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    per_group = num_n * num_k
    total = G * per_group
    if FLAT:  # (the launcher sets it only with RAGGED, without db)
        kjagged_flat_loop(
            dy_desc, x_desc, dw_desc, offs_ptr, dw_ptr, per_group, num_n, num_k, M, N, K, G,
            NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, DOT_UPCAST,
            TMA_STORE, EPILOGUE_SUBTILE, GROUP_N, G_BLOCK,
        )
    elif DYNAMIC:
        # A for loop, not a while: Triton pipelines TMA stores across the iterations of an
        # scf.for only (its staging buffer is hoisted and the wait moves before the next
        # store); in an scf.while every dW tile store would be waited for at once. A
        # program's share stays near total / NUM_PROGS (every program draws tiles of every
        # group), so a quarter more rounds covers it; a rare remainder runs in the while.
        t = pid
        rounds = tl.cdiv(total, NUM_PROGS) + tl.cdiv(total, 4 * NUM_PROGS) + 4
        for _ in range(0, rounds):
            if t < total:
                t = kjagged_claimed_tile(
                    t, per_group, dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, num_n,
                    num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc,
                    x_desc, dw_desc, HAS_DB, DB_MMA, NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K,
                    INPUT_PRECISION, DOT_UPCAST, USE_TMA, RAGGED, TMA_STORE, EPILOGUE_SUBTILE,
                    GROUP_N, ASM_TICKET, LANES,
                )
        while t < total:
            t = kjagged_claimed_tile(
                t, per_group, dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, num_n,
                num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc,
                x_desc, dw_desc, HAS_DB, DB_MMA, NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K,
                INPUT_PRECISION, DOT_UPCAST, USE_TMA, RAGGED, TMA_STORE, EPILOGUE_SUBTILE,
                GROUP_N, ASM_TICKET, LANES,
            )
    else:
        for t in range(pid, total, NUM_PROGS):
            tile_n, tile_k = kjagged_tile_coords(t % per_group, num_n, num_k, GROUP_N)
            kjagged_output_tile(
                dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, t // per_group, tile_n,
                tile_k, num_n, num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm,
                stride_xk, dy_desc, x_desc, dw_desc, HAS_DB, DB_MMA, BLOCK_M, BLOCK_N,
                BLOCK_K, INPUT_PRECISION, DOT_UPCAST, USE_TMA, RAGGED, TMA_STORE,
                EPILOGUE_SUBTILE, False, ASM_TICKET, LANES,
            )


# ---------------------------------------------------------------------------------------
# Configs (host-side heuristics; no device reads)


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # Pipeline across consecutive tiles. M-jagged: tl.range(flatten=True). dW (with
    # ragged_tma, static schedule, no db): one loop over the program's row chunks.
    flatten: bool = False
    programs_per_sm: int = 1  # >1: co-resident programs hide each other's prologue/epilogue
    group_m: int = 8  # M-tiles per L2 super-group (locate_tile)
    group_n: int = 1  # dW: N-tiles per super-block, N-tile fastest (1: K-tile fastest)
    # Variants; all only on the eager TMA path (sm90+, TMA-able strides) and ignored on the
    # pointer path and by the Inductor template (they fall back per launch, see
    # _wgrad_variant_flags / _mjagged_tma_store). Same bits as without them.
    # tma_store (both kernels): output tiles stored by TMA (async bulk copy). dW: when
    # N % block_n == 0; M-jagged (forward, dX, SwiGLU): through a ragged descriptor that
    # drops the rows past the tile's group, when the output's rows are 16-byte aligned.
    # dW only: ragged_tma: partial last chunks through zero-filling ragged descriptors
    # instead of a masked pointer tail loop; epilogue_subtile: the TMA store in two
    # [block_n, block_k / 2] halves.
    ragged_tma: bool = False
    tma_store: bool = False
    epilogue_subtile: bool = False
    # dW only, any path: tiles handed out by an atomic ticket counter (kjagged_gemm_kernel's
    # DYNAMIC) instead of the fixed stride. Same bits either way.
    dynamic_tiles: bool = False


# Rows of tiles per L2 super-group in the M-jagged schedule (locate_tile).
GROUP_M = 8


def group_block(groups: int) -> int:
    """Lanes of the per-group tile table: a power of two above ``groups`` (the tail lane)."""
    return triton.next_power_of_2(groups + 1)

# Batch-invariant mode: one fixed config for the M-jagged products, whatever the group sizes.
BATCH_INVARIANT_CONFIG = Config(64, 64, 32, num_warps=4, num_stages=3)
# Interpreter (CPU) configs stay small: it runs one numpy op per tile statement.
_INTERPRET_CONFIG = Config(16, 32, 32, num_warps=1, num_stages=1)


def _interpreting(device: torch.device) -> bool:
    return device.type == "cpu"


def choose_config(m_total: int, groups: int, n: int, k: int, dtype: torch.dtype,
                  device: torch.device, *, batch_invariant: bool = False,
                  swiglu: bool = False) -> Config:
    """M-jagged tile config from the mean group size ``M / G`` (host ints only).

    Small groups (decode-like MoE, many experts) get short M tiles so little work is
    masked. Larger groups in 16-bit get 128 x 256 tiles (the intensity Hopper's wgmma needs
    to stay off the L2-bandwidth limit) with the persistent loop flattened, so the next
    tile's loads overlap this tile's epilogue, and four operand stages (192 KB of shared
    memory); SwiGLU holds two accumulators, so its tiles are 128 x 128 and not flattened
    (flattening measured slower there). Measured on an H100: benchmarks/RESULTS.md
    (sweep_grouped_linear.py). ``batch_invariant`` returns the fixed config.
    """
    if batch_invariant:
        return BATCH_INVARIANT_CONFIG if not _interpreting(device) else _INTERPRET_CONFIG
    if _interpreting(device):
        return _INTERPRET_CONFIG
    mean = m_total / max(groups, 1)
    small = dtype == torch.float32
    if mean <= 16:
        return Config(16, 128, 64 if not small else 32, num_warps=4, num_stages=4)
    if mean <= 64:
        return Config(64, 128, 64 if not small else 32, num_warps=4, num_stages=4)
    if small:
        return Config(128, 128 if n >= 128 else 64, 32, num_warps=8, num_stages=2)
    if swiglu:
        return Config(128, 128, 64, num_warps=8, num_stages=3)
    if n <= 128:
        return Config(128, 128, 64, num_warps=8, num_stages=3, flatten=True)
    # Four stages rather than three: H100 sweeps of forward and dX on the four MoE shapes
    # (benchmarks/results/sweep_grouped_linear_h100_2026-11-22_{i,j}_s4.log), ratio to
    # torch._grouped_mm, s4 against s3, balanced / skewed: Qwen3-up fwd 1.04 / 0.99 against
    # 0.93 / 0.97, dX 1.08 / 1.18 against 1.02 / 1.15; Qwen3-down dX 1.08 / 1.14 against
    # 0.97 / 1.00, and fwd 1.17 / 1.13 against 1.12 / 1.09 for the 128 x 128, two programs
    # per SM tile it replaces (K <= 1024); DeepSeek dX skewed 1.16 against 1.08, the other
    # DeepSeek cases within 0.01; Mixtral within noise (fwd 1.10 / 0.97 against 1.09 / 1.00,
    # dX 0.98 / 1.04 against 1.00 / 0.95).
    return Config(128, 256, 64, num_warps=8, num_stages=4, flatten=True)


# dW defaults, 16-bit inputs. Long groups (M / G >= 512): 64 x 128 x 256, 8 warps, 3 stages,
# with ragged_tma and tma_store. H200 sweep (torch 2.11, Triton 3.6, ratio = torch._grouped_mm
# time / ours, balanced / skewed split; Mixtral, DeepSeek, Qwen3-up, Qwen3-down):
#   plain      1.00/0.94  0.98/0.82  0.99/0.82  0.89/0.85
#   ragged     1.02/0.96  1.07/0.83  1.13/0.78  0.91/0.92
#   tma-store  1.02/1.00  1.06/0.83  1.18/0.79  0.92/0.92
#   tma-store/2 (epilogue_subtile) 1.02/0.98  1.06/0.83  1.19/0.83  0.92/0.93
# ragged and tma-store each beat plain on 7 of 8 cases (both lose on Qwen3-up skewed),
# tma-store/2 on all 8; whole vs halved store differ by <= 0.04. The pair, timed afterwards on
# an H100 (benchmarks/results/sweep_grouped_linear_dw_h100_2026-11-21_e.log), beats either
# alone, e.g. Mixtral skewed, DeepSeek skewed, Qwen3-up and Qwen3-down balanced on this long
# tile: 0.94, 0.80, 0.97, 0.94 against at most 0.93, 0.77, 0.86, 0.88. The same sweep moved
# the long/short boundary from 1024 to 512 rows per group: on the Qwen3 shapes (512 rows per
# group) the pair on the long tile beat the short default in 3 of 4 cases (up 0.97 / 0.96
# against 0.91 / 0.87, down balanced 0.94 against 0.91; down skewed 1.06 against 1.11).
# It uses 216064 B of shared memory on sm_90 (limit 232448; 3 x 48 KB operand stages, a
# 64 KB dW staging tile), so the whole-tile store fits and no subtiling is needed.
# Short groups: 64 x 128 x 128, 4 warps, 3 stages, two programs per SM, with ragged_tma
# (100608 B each): plain 0.83/0.89 0.98/0.79 1.13/0.82 0.97/0.95, ragged 0.85/0.87 1.00/0.84
# 1.20/0.90 0.96/1.01 (s2 x2/SM with tma-store/2 was much worse everywhere: 0.65-1.04).
# Where a flag does not apply (no TMA: pre-sm90 GPUs, COMPILEOPS_GROUPED_TMA=0, unaligned
# strides; for tma_store also N % block_n != 0, a non-16-bit or unaligned dW) the launch
# drops it (_wgrad_variant_flags); fp32 and the interpreter get configs without flags.
# Tile order (group_n): the H100 dW sweep of 2026-11-22
# (benchmarks/results/sweep_grouped_linear_dw_h100_2026-11-22_g_group_n.log) timed super-blocks
# of 4 / 8 / 16 N-tiles swept N-tile fastest against the K-tile-fastest order, in one process.
# Ratios to torch._grouped_mm, balanced / skewed, group_n 1 -> 8:
#   Mixtral 1.00/0.89 -> 1.08/1.01, DeepSeek 0.95/0.84 -> 1.02/0.98,
#   Qwen3-up 1.24/0.93 -> 1.25/0.96, Qwen3-down 0.97/1.03 -> 0.97/1.00.
# A large group's X_g (DeepSeek skewed: up to 3832 x 7168 bf16, 55 MB) no longer fits the
# 50 MB L2: K-fastest streams all of it once per wave of N-tiles, the super-blocks share
# its column blocks across 8 N-tiles. 16 (all of DeepSeek's N-tiles) lost on Mixtral skewed
# (0.77), 4 was between.
# Without db (a layer with no trainable bias, as in the Mixtral / DeepSeek-V3 / Qwen3 MoE
# experts) both long configs run the flattened chunk loop (flatten, kjagged_flat_loop); with db
# the tile loop. H100 probe of 2026-11-22, no db, ratio to torch._grouped_mm, tile loop ->
# flattened, balanced / skewed: Mixtral 1.08 / 0.98 -> 1.05 / 1.05, DeepSeek 0.94 / 0.96 ->
# 1.01 / 1.04, Qwen3-up 0.99 / 1.01 -> 1.17 / 1.16, Qwen3-down 1.00 / 1.05 -> 1.18 / 1.16
# (benchmarks/results/probe_grouped_linear_dw_h100_2026-11-22_h_flat.log).
WGRAD_LONG_CONFIG = Config(64, 128, 256, num_warps=8, num_stages=3, flatten=True,
                           ragged_tma=True, tma_store=True, group_n=8)
# Mid groups (512 <= M / G < 1024; the Qwen3 shapes): the long tile with a fourth operand
# stage, its dW tile stored in two halves (32 KB staging; 231712 B in all). Five H100 dW sweeps
# of 2026-11-22 (benchmarks/results/sweep_grouped_linear_dw_h100_2026-11-22_{o1,o2,o3,o4a,o4b}
# logs), ratio to torch._grouped_mm, this config against WGRAD_LONG_CONFIG:
#   Qwen3-up balanced    1.02 1.02 1.08 1.01 1.00  against 1.01 1.01 1.04 0.99 0.99
#   Qwen3-up skewed      0.98 0.99 0.98 0.95 0.99  against 0.98 0.98 0.99 0.95 0.98
#   Qwen3-down balanced  1.05 1.03 0.99 0.98 0.98  against 1.02 1.00 0.99 0.97 0.98
#   Qwen3-down skewed    1.04 1.05 1.04 1.04 1.01  against 1.00 1.00 0.99 0.99 0.98
# On Mixtral and DeepSeek (M / G >= 1024) it was slower (Mixtral balanced 1.02 / 1.00 / 1.04
# against 1.07 / 1.08 / 1.10 in o1-o3), so the long config keeps three stages there.
WGRAD_MID_CONFIG = Config(64, 128, 256, num_warps=8, num_stages=4, flatten=True,
                          ragged_tma=True, tma_store=True, epilogue_subtile=True, group_n=8)
WGRAD_SHORT_CONFIG = Config(64, 128, 128, num_warps=4, num_stages=3, programs_per_sm=2,
                            ragged_tma=True)


def choose_wgrad_config(m_total: int, groups: int, n: int, k: int, dtype: torch.dtype,
                        device: torch.device) -> Config:
    """K-jagged config: ``block_m`` is the row chunk each dW tile reduces over; the output
    tile is ``block_n x block_k``. Long groups (mean ``M / G >= 512``): 128 x 256 output
    tiles (each warpgroup issues 64 x 256 wgmma), walked in super-blocks of 8 N-tiles; below
    1024 rows per group with four operand stages and the dW store in halves.
    Short groups (few chunks per tile):
    128 x 128 tiles, two programs per SM so one's prologue and epilogue overlap the other's
    loop. Both with ragged TMA loads (no masked tail loop), the long one with TMA stores of
    dW too (see the comment above for the measurements)."""
    if _interpreting(device):
        return Config(16, 32, 32, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return Config(32, 128, 64, num_warps=8, num_stages=3)
    mean = m_total / max(groups, 1)
    if mean >= 1024:
        return WGRAD_LONG_CONFIG
    if mean >= 512:
        return WGRAD_MID_CONFIG
    return WGRAD_SHORT_CONFIG


def input_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 unless ``torch.backends.cuda.matmul.allow_tf32``; tf32 is ignored for
    16-bit inputs (they use the tensor cores' native precision)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def dot_upcast(t: torch.Tensor) -> bool:
    """Upcast bf16 tiles to fp32 before ``tl.dot`` on CPU only: triton 3.6's interpreter
    multiplies bf16 tiles as raw integer bits. On GPUs the native bf16 MMA runs."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def num_programs(device_index: Optional[int], device_type: str) -> int:
    """Persistent grid size: one program per SM on GPUs, 4 in the interpreter."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 4


def _grid_size(device: torch.device) -> int:
    return num_programs(device.index if device.type == "cuda" else None, device.type)


# ---------------------------------------------------------------------------------------
# Launchers


_tma_failed = False
_mjagged_store_failed = False  # an M-jagged TMA-store launch raised: TMA loads, pointer stores
_wgrad_variant_failed = False  # a dW ragged-TMA / TMA-store launch raised: plain TMA


def _tma_env_enabled() -> bool:
    return os.environ.get("COMPILEOPS_GROUPED_TMA", "1") not in ("0", "")


def _tma_device_ok(device: torch.device) -> bool:
    """TMA is on (not disabled, no earlier failure), Triton has device-side descriptors and
    the device is an sm90+ CUDA GPU."""
    if _tma_failed or not _tma_env_enabled() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if device.type != "cuda" or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _tma_compatible(t: torch.Tensor) -> bool:
    """A tensor a TMA descriptor can address: unit last stride, 16-byte aligned base and
    outer strides (host metadata only)."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((stride * es) % 16 == 0 for stride in t.stride()[:-1]))


def tma_applies(a: torch.Tensor, w: torch.Tensor, cfg: Config) -> bool:
    """TMA descriptors need a unit inner stride, 16-byte aligned bases and outer strides, and
    a GPU with the TMA unit (sm90+). Host metadata only: no device read."""
    if not _tma_device_ok(a.device):
        return False
    return _tma_compatible(a) and _tma_compatible(w) and cfg.block_k * a.element_size() >= 16


def _mjagged_tma_store(out: torch.Tensor, cfg: Config, tma: bool) -> bool:
    """``TMA_STORE`` for an M-jagged launch: ``cfg.tma_store`` on the TMA path, when ``out
    [M, N_OUT]`` is TMA-storable (unit column stride, 16-byte aligned base and row stride,
    a box row of at least 16 bytes) and its rows fit the ragged descriptor (``M <
    RAGGED_ROWS``). Otherwise the launch keeps the masked pointer store."""
    return (tma and cfg.tma_store and _tma_compatible(out)
            and cfg.block_n * out.element_size() >= 16 and out.shape[0] < RAGGED_ROWS.value)


def _variant_launched(launch, explicit: bool, what: str, instead: str) -> bool:
    """Runs a launch with TMA variant flags; False if it raised. A variant asked for by an
    explicit ``config`` re-raises (a sweep must not time a fallback); a default one warns,
    and the caller records the failure and launches without the variant from then on."""
    try:
        launch()
        return True
    except Exception as exc:
        if explicit:
            raise
        warnings.warn(f"compileops.grouped_linear: {what} failed ({type(exc).__name__}: "
                      f"{exc}); using {instead} from now on")
        return False


def _set_tma_allocator(device: torch.device) -> None:
    # Device-side descriptors need a small global scratch per launch; take it from torch's
    # caching allocator (stream-ordered, so CUDA graph capture works).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def mjagged_gemm(a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int],
                 offsets: torch.Tensor, n_out: int, *, bias: Optional[torch.Tensor] = None,
                 swiglu_out: bool = False, out_dtype: torch.dtype,
                 config: Optional[Config] = None, batch_invariant: bool = False,
                 b_kn: bool = False, use_tma: Optional[bool] = None) -> torch.Tensor:
    """``out [M, n_out]``: rows of group g are ``A_g @ B_g`` (B addressed through
    ``b_strides = (stride_g, stride_k, stride_n)``), tail rows zero.

    ``b`` is the weight ``[G, N, K]``; ``b_kn`` says B_g is ``W_g`` itself (dX) rather than
    ``W_g^T``. ``use_tma=None`` picks TMA when :func:`tma_applies` (never in batch-invariant
    mode: one code path per row). ``Config.tma_store`` adds TMA stores of the output tiles
    where :func:`_mjagged_tma_store` allows. If a TMA launch raises (e.g. an older driver), a
    warning is printed once and the pointer path is used from then on; a failing TMA store
    from a default config falls back to TMA loads with pointer stores the same way, one
    asked for by an explicit ``config`` raises (a sweep must not time a fallback).
    """
    global _tma_failed, _mjagged_store_failed
    m, k = a.shape
    offsets = offsets.contiguous()  # the kernel reads offsets[g] at offs_ptr + g
    groups = offsets.shape[0]
    out = torch.empty((m, n_out), dtype=out_dtype, device=a.device)
    if m == 0 or n_out == 0:
        return out
    cfg = config or choose_config(m, groups, n_out, k, a.dtype, a.device,
                                  batch_invariant=batch_invariant, swiglu=swiglu_out)
    progs = _grid_size(a.device) * cfg.programs_per_sm
    if use_tma is None:
        use_tma = not batch_invariant and tma_applies(a, b, cfg)
    store = _mjagged_tma_store(out, cfg, bool(use_tma))

    def launch(tma: bool, tma_store: bool = False) -> None:
        if tma:
            _set_tma_allocator(a.device)
        mjagged_gemm_kernel[(progs,)](
            a, b, bias if bias is not None else a, offsets, out,
            m, n_out, k, groups,
            a.stride(0), a.stride(1), *b_strides,
            bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
            out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, SWIGLU=swiglu_out, NUM_PROGS=progs, GROUP_M=cfg.group_m,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            INPUT_PRECISION=input_precision(a.dtype), DOT_UPCAST=dot_upcast(a),
            USE_TMA=tma, B_KN=b_kn, G_BLOCK=group_block(groups), FLATTEN=cfg.flatten,
            TMA_STORE=tma and tma_store, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    if use_tma and a.device.type == "cuda":
        if store and (config is not None or not _mjagged_store_failed):
            if _variant_launched(lambda: launch(True, tma_store=True), config is not None,
                                 "M-jagged kernel with TMA store", "pointer stores"):
                return out
            _mjagged_store_failed = True
        try:
            launch(True)
            return out
        except Exception as exc:  # compile/launch error: fall back once, loudly
            _tma_failed = True
            warnings.warn(f"compileops.grouped_linear: TMA kernel failed ({type(exc).__name__}: "
                          f"{exc}); using the pointer-based kernel from now on")
    interpreted = bool(use_tma) and a.device.type != "cuda"
    launch(interpreted, tma_store=interpreted and store)
    return out


def grouped_linear_forward(x, weight, offsets, bias=None, *, batch_invariant=False, use_tma=None):
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, bias ``[G, N]`` -> ``[M, N]``."""
    n = weight.shape[1]
    return mjagged_gemm(x, weight, (weight.stride(0), weight.stride(2), weight.stride(1)),
                        offsets, n, bias=bias, out_dtype=x.dtype, batch_invariant=batch_invariant,
                        use_tma=use_tma)


def grouped_linear_swiglu_forward(x, weight, offsets, bias=None, *, batch_invariant=False,
                                  use_tma=None):
    """weight ``[G, 2H, K]`` (gate rows first, then up) -> ``silu(x W_gate^T) * (x W_up^T)`` ``[M, H]``."""
    h = weight.shape[1] // 2
    return mjagged_gemm(x, weight, (weight.stride(0), weight.stride(2), weight.stride(1)),
                        offsets, h, bias=bias, swiglu_out=True, out_dtype=x.dtype,
                        batch_invariant=batch_invariant, use_tma=use_tma)


def grouped_linear_dx(grad, weight, offsets, *, batch_invariant=False, use_tma=None):
    """grad ``[M, N]`` (any strides, stride 0 included) -> ``dX [M, K] = dY_g @ W_g``."""
    k = weight.shape[2]
    return mjagged_gemm(grad, weight, (weight.stride(0), weight.stride(1), weight.stride(2)),
                        offsets, k, out_dtype=grad.dtype, batch_invariant=batch_invariant,
                        b_kn=True, use_tma=use_tma)


def wgrad_tma_applies(grad: torch.Tensor, x: torch.Tensor, cfg: Config) -> bool:
    """TMA for the dW kernel: dY and X with unit inner strides and 16-byte aligned bases and
    row strides on an sm90+ GPU (a stride-0 or transposed dY takes the pointer path)."""
    if not _tma_device_ok(x.device):
        return False
    es = x.element_size()
    return (all(_tma_compatible(t) and t.stride(0) > 0 for t in (grad, x))
            and cfg.block_k * es >= 16 and cfg.block_n * es >= 16)


def grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype, *,
                         config: Optional[Config] = None, use_tma: Optional[bool] = None,
                         compute_db: bool = True):
    """``(dW [G, N, K] = dY_g^T X_g, db [G, N] = colsum(dY_g))``, deterministic.

    ``compute_db=False`` (the op's ``with_db=False``: no trainable bias) skips the column
    sums and returns ``(dW, None)``. If a TMA launch raises: with the default config's variant flags
    (``ragged_tma`` / ``tma_store``), a warning is printed once and the plain TMA kernel is
    tried; a plain TMA failure falls back to the pointer kernel (as in :func:`mjagged_gemm`).
    A variant asked for by an explicit ``config`` raises instead (a sweep must not time a
    fallback)."""
    global _tma_failed, _wgrad_variant_failed
    m, n = grad.shape
    k = x.shape[1]
    offsets = offsets.contiguous()  # the kernel reads offsets[g] at offs_ptr + g
    groups = offsets.shape[0]
    dw = torch.empty((groups, n, k), dtype=weight_dtype, device=grad.device)
    db = torch.empty((groups, n), dtype=bias_dtype, device=grad.device)
    if groups == 0 or n == 0:
        return dw, db if compute_db else None
    if k == 0:
        if not compute_db:
            return dw, None
        return dw, db.zero_() if m == 0 else _colsum_only(grad, offsets, db)
    cfg = config or choose_wgrad_config(m, groups, n, k, x.dtype, x.device)
    _check_wgrad_variant(cfg)
    progs = _grid_size(x.device) * cfg.programs_per_sm
    if use_tma is None:
        use_tma = wgrad_tma_applies(grad, x, cfg)

    # The variant constexprs this launch can take (all False where none applies).
    flags = _wgrad_variant_flags(cfg, bool(use_tma), m, n, k, dw, compute_db)
    plain = dict.fromkeys(flags, False)

    def launch(tma: bool, variants: bool = True) -> None:
        if tma:
            _set_tma_allocator(x.device)
        # The dynamic schedule's ticket counter starts at 0 in every launch (stream-ordered;
        # a memset node under CUDA graph capture). The static one never reads it.
        ticket = (torch.zeros(1, dtype=torch.int32, device=x.device) if cfg.dynamic_tiles
                  else offsets)
        kjagged_gemm_kernel[(progs,)](
            grad, x, offsets, dw, db, ticket, m, n, k, groups,
            grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
            HAS_DB=compute_db, DB_MMA=x.dtype != torch.float32, NUM_PROGS=progs,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            INPUT_PRECISION=input_precision(x.dtype), DOT_UPCAST=dot_upcast(x), USE_TMA=tma,
            GROUP_N=cfg.group_n, DYNAMIC=cfg.dynamic_tiles,
            ASM_TICKET=x.device.type == "cuda" and not torch.version.hip,
            LANES=32 * cfg.num_warps, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            G_BLOCK=group_block(groups),
            **(flags if tma and variants else plain),
        )

    if use_tma and x.device.type == "cuda":
        if any(flags.values()) and (config is not None or not _wgrad_variant_failed):
            if _variant_launched(lambda: launch(True), config is not None,
                                 "dW kernel with ragged TMA / TMA store", "the plain TMA kernel"):
                return dw, db if compute_db else None
            _wgrad_variant_failed = True
        try:
            launch(True, variants=False)
            return dw, db if compute_db else None
        except Exception as exc:  # compile/launch error: fall back once, loudly
            _tma_failed = True
            warnings.warn(f"compileops.grouped_linear: TMA wgrad kernel failed "
                          f"({type(exc).__name__}: {exc}); using the pointer-based kernel")
    launch(bool(use_tma) and x.device.type != "cuda")
    return dw, db if compute_db else None


def _is_wgrad_variant(cfg: Config) -> bool:
    return cfg.ragged_tma or cfg.tma_store or cfg.epilogue_subtile


def _check_wgrad_variant(cfg: Config) -> None:
    """Reject variant combinations that mean nothing, before compiling."""
    if cfg.epilogue_subtile and not cfg.tma_store:
        raise ValueError("Config.epilogue_subtile only applies with tma_store")


def _wgrad_variant_flags(cfg: Config, tma: bool, m: int, n: int, k: int,
                         dw: torch.Tensor, compute_db: bool = True) -> dict:
    """Constexprs of the dW variants (all False for a config without them: the kernel
    compiles exactly as without them). All need the TMA path; where a flag does not apply
    it is dropped for this launch (the kernel then takes the plain TMA / pointer code).

    TMA store writes whole ``[block_n, block_k]`` boxes of dW viewed as ``[G * N, K]``: only
    when ``N % block_n == 0`` (else a group's last N-tile would write into the next group's
    rows), dW's row stride is 16-byte aligned and dW is 16-bit (an fp32 staging tile of
    128 x 256 would not fit next to the operand buffers); otherwise pointer stores.
    ``flatten`` (one loop over the program's chunks, :func:`kjagged_flat_loop`) needs the
    ragged loads, the static schedule and no db; otherwise the tile loop runs."""
    ragged = tma and cfg.ragged_tma and m < RAGGED_ROWS.value
    store = (tma and cfg.tma_store and n % cfg.block_n == 0 and dw.element_size() == 2
             and (k * dw.element_size()) % 16 == 0 and dw.data_ptr() % 16 == 0
             and dw.shape[0] * n < 2**31)  # the kernel's i32 row g * N + n0
    flat = ragged and cfg.flatten and not cfg.dynamic_tiles and not compute_db
    return dict(RAGGED=ragged, TMA_STORE=store, EPILOGUE_SUBTILE=store and cfg.epilogue_subtile,
                FLAT=flat)


def _colsum_only(grad, offsets, db):
    # K == 0: no dW tiles exist to carry the bias sums; use a 1-column dummy x of zeros.
    x = grad.new_zeros((grad.shape[0], 1))
    dw_dummy, db2 = grouped_linear_wgrad(grad, x, offsets, grad.dtype, db.dtype)
    return db.copy_(db2)
