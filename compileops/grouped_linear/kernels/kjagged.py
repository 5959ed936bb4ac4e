"""K-jagged grouped GEMM, the weight gradient: ``dW_g = dY_g^T @ X_g`` and, with
``with_db``, ``db_g = colsum(dY_g)`` in the same pass.

A tile space ``G x N-tiles x K-tiles``, each dW tile reducing over its group's rows in
``BLOCK_M``-row chunks in row order. No split-K, no floating-point atomics: bitwise
deterministic. Tiles go to persistent programs by a fixed stride, or with
``Config.dynamic_tiles`` by an integer ticket counter; either way each tile is computed
once, with the same code. Empty groups give exact zeros.

The Inductor lowering does not template this product: ``grouped_linear_wgrad`` stays an
extern call of :func:`grouped_linear_wgrad` (a ``[G, N, K]`` result has no pointwise
neighbours worth fusing).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.grouped_linear.kernels.config import (
    Config,
    choose_wgrad_config,
    interpreter_dot,
    grid_size,
    group_block,
    input_precision,
)
from compileops.grouped_linear.kernels.mjagged import tile_dot
from compileops.grouped_linear.kernels.stages import launch_with_stages_that_fit
from compileops.grouped_linear.kernels.tiles import (
    claim_ticket,
    group_rows,
    kjagged_program_chunks,
    kjagged_tile_coords,
    kjagged_tile_state,
    ticket_value,
)
from compileops.grouped_linear.kernels.tma import (
    RAGGED_ROWS,
    Fallback,
    fell_back,
    launch_or_fall_back,
    load_rows_below,
    ragged_rows_descriptor,
    set_tma_allocator,
    wgrad_tma_applies,
)


# ---------------------------------------------------------------------------------------
# @triton.jit bodies


@triton.jit
def kjagged_tile(
    dy_ptr, x_ptr, start, end, tile_n, tile_k, N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    WITH_DB: tl.constexpr, RAGGED_TMA: tl.constexpr = False,
    FP8_FAST_ACCUM: tl.constexpr = False,
):
    """fp32 ``dW`` tile ``[BLOCK_N, BLOCK_K] = dY[start:end, rn]^T @ X[start:end, rk]``,
    reduced over the rows in ``BLOCK_M`` chunks in row order. An empty range gives zeros.
    Returns ``(acc, db_acc)``.

    * ``dy_ptr``: dY ``[M, N]``, strides ``(stride_dym, stride_dyn)``.
    * ``x_ptr``: X ``[M, K]``, strides ``(stride_xm, stride_xk)``.

    ``WITH_DB`` (16-bit inputs): the same loop also sums dY's columns on the tensor cores,
    ``db_acc [BLOCK_N, 16] += dY_chunk^T @ ones [BLOCK_M, 16]``, from the dY chunk already
    in shared memory: every product is ``dy * 1``, exact, summed in fp32 like the dW tile,
    and every column of ``db_acc`` holds the same sums (take column 0). With ``WITH_DB``
    false, ``db_acc`` is a ``[BLOCK_N, 16]`` zero tile.

    ``USE_TMA``: whole ``BLOCK_M``-row chunks come through the ``dy_desc`` (over dY ``[M, N]``)
    and ``x_desc`` (over X ``[M, K]``) descriptors; the group's last partial chunk takes the
    masked pointer path, so rows of the next group never enter the product (not even as
    0 * x). Columns past N / K are zero-filled by the TMA unit or masked.

    ``RAGGED_TMA`` (with ``USE_TMA``): the descriptors are ragged
    (``tma.ragged_rows_descriptor``) and every chunk, the partial last one included, comes
    through them: one loop per tile instead of a TMA loop plus a masked pointer tail (its
    own, unpipelined loads). The zero-filled rows give the same products as the masked ones.

    e4m3 operands (fp8 dW): read as ``dY^T [N, M]`` and ``X^T [K, M]`` through the strides
    (``stride_dym == stride_xm == 1``), so both tiles run along the reduction in memory, as
    Hopper's e4m3 MMA reads them, and ``end - start`` must be a multiple of ``BLOCK_M``
    (whole chunks: no mask along the rows); each ``BLOCK_M`` step's partial sum goes into
    the fp32 accumulator unless ``FP8_FAST_ACCUM`` (:func:`.mjagged.tile_dot`).
    """
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    k_ok = rk < K
    rn64 = rn.to(tl.int64)
    rk64 = rk.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    # (no ones tile in dY's dtype without db: an e4m3 constant does not build in triton 3.6)
    ones_dtype = tl.float32 if INTERPRETER_DOT or not WITH_DB else dy_ptr.dtype.element_ty
    ones = tl.full((BLOCK_M, 16), 1.0, dtype=ones_dtype)
    tail = start
    if USE_TMA:
        if RAGGED_TMA:
            tail = end
        else:
            tail = start + ((end - start) // BLOCK_M) * BLOCK_M
        for m0 in range(start, tail, BLOCK_M):
            # dy [BLOCK_M, BLOCK_N], xb [BLOCK_M, BLOCK_K]
            if RAGGED_TMA:  # rows >= end read as 0
                dy = load_rows_below(dy_desc, m0, end, tile_n * BLOCK_N, BLOCK_M, BLOCK_N)
                xb = load_rows_below(x_desc, m0, end, tile_k * BLOCK_K, BLOCK_M, BLOCK_K)
            else:
                dy = dy_desc.load([m0, tile_n * BLOCK_N])
                xb = x_desc.load([m0, tile_k * BLOCK_K])
            if INTERPRETER_DOT:  # interpreter only (see config.interpreter_dot)
                dy = dy.to(tl.float32)
                xb = xb.to(tl.float32)
            acc = tile_dot(dy.T, xb, acc, INPUT_PRECISION, False, FP8_FAST_ACCUM)
            if WITH_DB:
                db_acc = tl.dot(dy.T, ones, db_acc, input_precision=INPUT_PRECISION)
    if USE_TMA and RAGGED_TMA:
        return acc, db_acc
    for m0 in range(tail, end, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        m_ok = rm < end
        rm64 = rm.to(tl.int64)
        # dyt [BLOCK_N, BLOCK_M] (dY's chunk, transposed by the addressing), xb [BLOCK_M, BLOCK_K]
        if dy_ptr.dtype.element_ty.is_fp8():
            # e4m3 dY^T and X^T: every chunk is whole (each group's span is zero-padded to a
            # multiple of BLOCK_M), so no mask runs along the rows, which are contiguous here:
            # a per-row mask would make every load a single byte (no asynchronous copy). The
            # chunk starts on a multiple of 16 codes (triton 3.6 does not see it through the
            # loop's bounds): 16-byte vectors.
            ra = tl.max_contiguous(tl.multiple_of(rm, 16), 16).to(tl.int64)
            dyt = tl.load(dy_ptr + rn64[:, None] * stride_dyn + ra[None, :] * stride_dym,
                          mask=n_ok[:, None], other=0.0)
            xb = tl.load(x_ptr + ra[:, None] * stride_xm + rk64[None, :] * stride_xk,
                         mask=k_ok[None, :], other=0.0)
        else:
            dyt = tl.load(dy_ptr + rn64[:, None] * stride_dyn + rm64[None, :] * stride_dym,
                          mask=n_ok[:, None] & m_ok[None, :], other=0.0)
            xb = tl.load(x_ptr + rm64[:, None] * stride_xm + rk64[None, :] * stride_xk,
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if INTERPRETER_DOT:
            dyt = dyt.to(tl.float32)
            xb = xb.to(tl.float32)
        acc = tile_dot(dyt, xb, acc, INPUT_PRECISION, False, FP8_FAST_ACCUM)
        if WITH_DB:
            db_acc = tl.dot(dyt, ones, db_acc, input_precision=INPUT_PRECISION)
    return acc, db_acc


@triton.jit
def column_sums(dy_ptr, start, end, tile_n, N, stride_dym, stride_dyn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``db`` partial ``[BLOCK_N]`` = fp32 column sums of ``dY[start:end, rn]`` (dY ``[M, N]``,
    strides ``(stride_dym, stride_dyn)``), in ``BLOCK_M``-row chunks in row order
    (deterministic). Zeros for an empty range. The fp32 db path: a tf32 MMA against ones
    would round dY."""
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        dy = tl.load(dy_ptr + rm.to(tl.int64)[:, None] * stride_dym
                     + rn.to(tl.int64)[None, :] * stride_dyn,
                     mask=(rm < end)[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
        db += tl.sum(dy.to(tl.float32), axis=0)
    return db


@triton.jit
def scale_dw_tile(acc, dy_scale_ptr, x_scale_ptr, g, tile_n, tile_k, N, K,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8 dW: the tile's fp32 sums of e4m3 products ``acc [BLOCK_N, BLOCK_K]`` times group
    ``g``'s column scales of dY (``dy_scale [G, N]``, one per row of the tile) and of X
    (``x_scale [G, K]``, one per column), in that order (the reference's)."""
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    g64 = tl.cast(g, tl.int64)
    dy_scale = tl.load(dy_scale_ptr + g64 * N + rn, mask=rn < N, other=1.0)
    x_scale = tl.load(x_scale_ptr + g64 * K + rk, mask=rk < K, other=1.0)
    return acc * dy_scale[:, None] * x_scale[None, :]


@triton.jit
def store_dw_tile(dw_ptr, dw_desc, acc, g, tile_n, tile_k, N, K,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA_STORE: tl.constexpr,
                  EPILOGUE_SUBTILE: tl.constexpr):
    """Writes the fp32 tile ``acc [BLOCK_N, BLOCK_K]`` as dW tile ``(g, tile_n, tile_k)`` of
    ``dw_ptr`` (dW ``[G, N, K]``, contiguous) in dW's dtype: by TMA through ``dw_desc`` (dW
    viewed as ``[G * N, K]``), whole or in two ``[BLOCK_N, BLOCK_K / 2]`` halves
    (``EPILOGUE_SUBTILE``), or by masked pointer stores."""
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
def kjagged_output_tile(
    dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, g, tile_n, tile_k, num_n, num_k,
    M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc, dw_desc,
    WITH_DB: tl.constexpr, DB_MMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    RAGGED_TMA: tl.constexpr, TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    DYNAMIC_TILES: tl.constexpr, ASM_TICKET: tl.constexpr, LANES: tl.constexpr,
    dy_scale_ptr, x_scale_ptr, FP8_SCALES: tl.constexpr, FP8_FAST_ACCUM: tl.constexpr,
):
    """Computes and stores dW tile ``(g, tile_n, tile_k)``, and ``db[g, rn]`` when this tile
    owns it (pointers and flags as in :func:`kjagged_gemm_kernel`).

    ``TMA_STORE``: the bf16/fp16 tile leaves through ``dw_desc`` (dW viewed as ``[G * N, K]``)
    as an async bulk copy, so the next tile's loads and MMAs run while it drains, instead of
    ``BLOCK_N x BLOCK_K`` pointer stores from registers. Rows are ``g * N + rn``: the host
    only sets it when ``N % BLOCK_N == 0``, so a tile never reaches into group ``g + 1``'s
    rows; columns past K are dropped by the TMA unit.

    ``DYNAMIC_TILES``: claims the program's next tile (``tiles.claim_ticket``) once the
    reduction is done and returns the handle, so the claim's round trip overlaps the
    epilogue (and a program asks for more work only when its current tile is nearly
    finished).

    ``FP8_SCALES`` (e4m3 operands): the tile is scaled by :func:`scale_dw_tile` before it is
    stored (no db)."""
    start, end = group_rows(offs_ptr, g, G, M)
    if FP8_SCALES:  # spans padded to whole BLOCK_M chunks (at least 16 codes): 16-byte vectors
        start = tl.multiple_of(start, 16)
        end = tl.multiple_of(end, 16)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    owns_db = tile_k == (g * num_n + tile_n) % num_k
    if WITH_DB & DB_MMA & owns_db:
        acc, db_acc = kjagged_tile(
            dy_ptr, x_ptr, start, end, tile_n, tile_k, N, K,
            stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc, x_desc,
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INTERPRETER_DOT, USE_TMA,
            WITH_DB & DB_MMA,  # True wherever this branch runs; a constant for the compiler
            RAGGED_TMA, FP8_FAST_ACCUM,
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
            BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INTERPRETER_DOT, USE_TMA, False,
            RAGGED_TMA, FP8_FAST_ACCUM,
        )
        if WITH_DB & (not DB_MMA) & owns_db:
            db = column_sums(dy_ptr, start, end, tile_n, N, stride_dym, stride_dyn,
                             BLOCK_M, BLOCK_N)
            tl.store(db_ptr + tl.cast(g, tl.int64) * N + rn, db.to(db_ptr.dtype.element_ty),
                     mask=n_ok)
    ticket = claim_ticket(ticket_ptr, DYNAMIC_TILES, ASM_TICKET, LANES)
    if FP8_SCALES:
        acc = scale_dw_tile(acc, dy_scale_ptr, x_scale_ptr, g, tile_n, tile_k, N, K,
                            BLOCK_N, BLOCK_K)
    store_dw_tile(dw_ptr, dw_desc, acc, g, tile_n, tile_k, N, K, BLOCK_N, BLOCK_K, TMA_STORE,
                  EPILOGUE_SUBTILE)
    return ticket


@triton.jit
def kjagged_flat_loop(
    dy_desc, x_desc, dw_desc, offs_ptr, dw_ptr, per_group, num_n, num_k, M, N, K, G,
    NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr,
    TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, GROUP_N: tl.constexpr,
    G_BLOCK: tl.constexpr,
):
    """The static schedule's dW tiles (no db) as ONE loop over all the program's row chunks
    (ragged TMA loads through ``dy_desc`` / ``x_desc``), so the software pipeliner issues the
    next tile's first loads before this tile's last MMAs and its epilogue, where the tile
    loop drains and refills the pipeline at every tile. Triton's ``flatten`` cannot build
    this loop: it fuses only inner loops whose trip count is the same in every outer
    iteration.

    Per chunk the loop only selects between the current tile's state and the next tile's,
    which is worked out once per tile, in a branch ahead of the MMA (integer divisions and
    offsets loads in every chunk would make the loop instruction-bound). The epilogue runs
    in a second branch after the MMA, in the chunk that ends a tile. Every tile reduces the
    same chunks in the same order as :func:`kjagged_tile`: the same bits."""
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
        # dy [BLOCK_M, BLOCK_N], xb [BLOCK_M, BLOCK_K]; rows >= end read as 0
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
        if INTERPRETER_DOT:  # interpreter only (see config.interpreter_dot)
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
    WITH_DB: tl.constexpr, DB_MMA: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    RAGGED_TMA: tl.constexpr, TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr,
    GROUP_N: tl.constexpr, ASM_TICKET: tl.constexpr, LANES: tl.constexpr,
    dy_scale_ptr, x_scale_ptr, FP8_SCALES: tl.constexpr, FP8_FAST_ACCUM: tl.constexpr,
):
    """Dynamic schedule step: computes and stores flat dW tile ``t`` (group order) and
    returns the next tile this program claimed, ``NUM_PROGS + ticket``."""
    tile_n, tile_k = kjagged_tile_coords(t % per_group, num_n, num_k, GROUP_N)
    ticket = kjagged_output_tile(
        dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, t // per_group, tile_n, tile_k,
        num_n, num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc,
        x_desc, dw_desc, WITH_DB, DB_MMA, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION,
        INTERPRETER_DOT, USE_TMA, RAGGED_TMA, TMA_STORE, EPILOGUE_SUBTILE, True, ASM_TICKET, LANES,
        dy_scale_ptr, x_scale_ptr, FP8_SCALES, FP8_FAST_ACCUM,
    )
    return NUM_PROGS + ticket_value(ticket, ASM_TICKET)


# ---------------------------------------------------------------------------------------
# Eager kernel


@triton.jit
def kjagged_gemm_kernel(
    dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr,
    M, N, K, G,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    WITH_DB: tl.constexpr, DB_MMA: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr, USE_TMA: tl.constexpr,
    RAGGED_TMA: tl.constexpr = False, TMA_STORE: tl.constexpr = False,
    EPILOGUE_SUBTILE: tl.constexpr = False, GROUP_N: tl.constexpr = 1,
    DYNAMIC_TILES: tl.constexpr = False, ASM_TICKET: tl.constexpr = False,
    LANES: tl.constexpr = 128, FLATTEN: tl.constexpr = False, G_BLOCK: tl.constexpr = 2,
    dy_scale_ptr=None, x_scale_ptr=None, FP8_SCALES: tl.constexpr = False,
    FP8_FAST_ACCUM: tl.constexpr = False,
):
    """Persistent K-jagged grouped GEMM.

    * ``dy_ptr``: dY ``[M, N]``, strides ``(stride_dym, stride_dyn)``.
    * ``x_ptr``: X ``[M, K]``, strides ``(stride_xm, stride_xk)``.
    * ``offs_ptr``: int32 ``[G]``, contiguous, the cumulative end row of each group.
    * ``dw_ptr``: dW ``[G, N, K]``, contiguous.
    * ``db_ptr`` (``WITH_DB``): db ``[G, N]``, contiguous.
    * ``ticket_ptr`` (``DYNAMIC_TILES``): int32 ``[1]``, zero at launch.

    Tiles ``(g, tile_n, tile_k)``, group by group. ``GROUP_N == 1``: K-tiles fastest, so
    concurrent programs share dY's column block and sweep all of ``X_g``'s column blocks;
    ``GROUP_N > 1``: within a group, super-blocks of ``GROUP_N`` N-tiles are swept N-tile
    fastest (``tiles.kjagged_tile_coords``), so concurrent programs share X's column blocks
    as well. Which order keeps more of a large group's ``dY_g`` and ``X_g`` in L2 depends
    on N and K; the order never changes any tile's value.

    ``WITH_DB``: one K-tile per ``(g, tile_n)`` also produces ``db[g, rn]``: with ``DB_MMA``
    (16-bit inputs) inside its main loop (:func:`kjagged_tile`'s ``WITH_DB``), else (fp32,
    where tf32 would round dY) by an extra pass of exact fp32 column sums. Which K-tile owns
    db rotates with ``(g, tile_n)``: with a fixed one, the owners all land on the few
    programs whose stride hits that K-tile, and the slowest program sets the kernel time.

    Static schedule: program p takes tiles ``p, p + NUM_PROGS, ...`` in group order. A tile
    costs a fixed prologue/epilogue plus one step per ``BLOCK_M`` rows of its group, so with
    skewed groups the programs' shares differ. ``DYNAMIC_TILES``: program p starts on tile
    p, then takes ``NUM_PROGS + ticket`` from the counter each time it finishes one, still
    in group order, so programs that drew small groups take more tiles. Either way each
    tile is computed by exactly one program with the same code: the same dW and db bits.

    ``USE_TMA``: chunks loaded through descriptors over dY and X (``RAGGED_TMA``: ragged
    ones, see :func:`kjagged_tile`); ``TMA_STORE`` / ``EPILOGUE_SUBTILE``: see
    :func:`kjagged_output_tile`. ``FLATTEN`` (the launcher sets it only with ``RAGGED_TMA``,
    the static schedule and no db): :func:`kjagged_flat_loop`.

    ``FP8_SCALES`` (fp8 dW, :func:`grouped_linear_wgrad_fp8`): ``dy_ptr`` and ``x_ptr`` are
    e4m3 ``dY^T`` and ``X^T`` (``stride_dym == stride_xm == 1``) with every group's span a
    whole number of ``BLOCK_M`` chunks (a multiple of 16) from a multiple of it
    (``offs_ptr`` holds the padded spans' ends, M their buffer's width), each tile scaled by
    ``dy_scale_ptr`` ``[G, N]`` and ``x_scale_ptr`` ``[G, K]`` (fp32) before it is stored;
    pointer loads, no db, no ``FLATTEN``. ``FP8_FAST_ACCUM``: the MMA accumulates over the
    whole reduction."""
    pid = tl.program_id(0)
    dy_desc = None
    x_desc = None
    if USE_TMA and RAGGED_TMA:
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
    if FLATTEN:
        kjagged_flat_loop(
            dy_desc, x_desc, dw_desc, offs_ptr, dw_ptr, per_group, num_n, num_k, M, N, K, G,
            NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, INTERPRETER_DOT,
            TMA_STORE, EPILOGUE_SUBTILE, GROUP_N, G_BLOCK,
        )
    elif DYNAMIC_TILES:
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
                    x_desc, dw_desc, WITH_DB, DB_MMA, NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K,
                    INPUT_PRECISION, INTERPRETER_DOT, USE_TMA, RAGGED_TMA, TMA_STORE,
                    EPILOGUE_SUBTILE, GROUP_N, ASM_TICKET, LANES,
                    dy_scale_ptr, x_scale_ptr, FP8_SCALES, FP8_FAST_ACCUM,
                )
        while t < total:
            t = kjagged_claimed_tile(
                t, per_group, dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, num_n,
                num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm, stride_xk, dy_desc,
                x_desc, dw_desc, WITH_DB, DB_MMA, NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K,
                INPUT_PRECISION, INTERPRETER_DOT, USE_TMA, RAGGED_TMA, TMA_STORE,
                EPILOGUE_SUBTILE, GROUP_N, ASM_TICKET, LANES,
                dy_scale_ptr, x_scale_ptr, FP8_SCALES, FP8_FAST_ACCUM,
            )
    else:
        for t in range(pid, total, NUM_PROGS):
            tile_n, tile_k = kjagged_tile_coords(t % per_group, num_n, num_k, GROUP_N)
            kjagged_output_tile(
                dy_ptr, x_ptr, offs_ptr, dw_ptr, db_ptr, ticket_ptr, t // per_group, tile_n,
                tile_k, num_n, num_k, M, N, K, G, stride_dym, stride_dyn, stride_xm,
                stride_xk, dy_desc, x_desc, dw_desc, WITH_DB, DB_MMA, BLOCK_M, BLOCK_N,
                BLOCK_K, INPUT_PRECISION, INTERPRETER_DOT, USE_TMA, RAGGED_TMA, TMA_STORE,
                EPILOGUE_SUBTILE, False, ASM_TICKET, LANES,
                dy_scale_ptr, x_scale_ptr, FP8_SCALES, FP8_FAST_ACCUM,
            )


# ---------------------------------------------------------------------------------------
# Launcher


def is_wgrad_variant(cfg: Config) -> bool:
    """The config asks for a dW TMA variant (``ragged_tma``, ``tma_store`` or
    ``epilogue_subtile``)."""
    return cfg.ragged_tma or cfg.tma_store or cfg.epilogue_subtile


def check_wgrad_variant(cfg: Config) -> None:
    """Reject variant combinations that mean nothing, before compiling."""
    if cfg.epilogue_subtile and not cfg.tma_store:
        raise ValueError("Config.epilogue_subtile only applies with tma_store")


def wgrad_variant_flags(cfg: Config, tma: bool, m: int, n: int, k: int,
                        dw: torch.Tensor, with_db: bool = True) -> dict:
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
    flatten = ragged and cfg.flatten and not cfg.dynamic_tiles and not with_db
    return dict(RAGGED_TMA=ragged, TMA_STORE=store,
                EPILOGUE_SUBTILE=store and cfg.epilogue_subtile, FLATTEN=flatten)


def grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype, *,
                         config: Optional[Config] = None, use_tma: Optional[bool] = None,
                         with_db: bool = True):
    """``(dW [G, N, K] = dY_g^T X_g, db [G, N] = colsum(dY_g))``, deterministic.

    grad (dY) ``[M, N]``, x ``[M, K]``, offsets int32 ``[G]``. ``with_db=False`` (no
    trainable bias) skips the column sums and returns ``(dW, None)``. ``config=None`` takes
    :func:`~.config.choose_wgrad_config`'s pick; ``use_tma=None`` picks TMA when
    ``tma.wgrad_tma_applies``. If a TMA launch fails: with a default config's variant flags
    the plain TMA kernel is tried next, and a plain TMA failure falls back to the pointer
    kernel, per device (see ``kernels/tma.py``); a variant asked for by an explicit
    ``config`` raises instead."""
    m, n = grad.shape
    k = x.shape[1]
    offsets = offsets.contiguous()  # the kernel reads offsets[g] at offs_ptr + g
    groups = offsets.shape[0]
    dw = torch.empty((groups, n, k), dtype=weight_dtype, device=grad.device)
    db = torch.empty((groups, n), dtype=bias_dtype, device=grad.device)
    if groups == 0 or n == 0:
        return dw, db if with_db else None
    if k == 0:
        if not with_db:
            return dw, None
        return dw, db.zero_() if m == 0 else _column_sums_only(grad, offsets, db)
    cfg = config or choose_wgrad_config(m, groups, n, k, x.dtype, x.device)
    check_wgrad_variant(cfg)
    progs = grid_size(x.device, cfg)
    if use_tma is None:
        use_tma = wgrad_tma_applies(grad, x, cfg)

    # The variant constexprs this launch can take (all False where none applies).
    flags = wgrad_variant_flags(cfg, bool(use_tma), m, n, k, dw, with_db)
    plain = dict.fromkeys(flags, False)

    def launch(tma: bool, variants: bool = True) -> None:
        # What sets the kernel's shared memory besides the config: a retry's key.
        key = ("K-jagged", cfg, x.dtype, grad.dtype, weight_dtype, with_db, tma,
               tuple(flags.values()) if variants else ())
        launch_with_stages_that_fit(lambda stages: launch_stages(tma, variants, stages),
                                    cfg.num_stages, x.device, explicit=config is not None,
                                    key=key, what="the dW kernel", config=cfg)

    def launch_stages(tma: bool, variants: bool, stages: int) -> None:
        if tma:
            set_tma_allocator(x.device)
        # The dynamic schedule's ticket counter starts at 0 in every launch (stream-ordered;
        # a memset node under CUDA graph capture). The static one never reads it.
        ticket = (torch.zeros(1, dtype=torch.int32, device=x.device) if cfg.dynamic_tiles
                  else offsets)
        kjagged_gemm_kernel[(progs,)](
            grad, x, offsets, dw, db, ticket, m, n, k, groups,
            grad.stride(0), grad.stride(1), x.stride(0), x.stride(1),
            WITH_DB=with_db, DB_MMA=x.dtype != torch.float32, NUM_PROGS=progs,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            INPUT_PRECISION=input_precision(x.dtype), INTERPRETER_DOT=interpreter_dot(x), USE_TMA=tma,
            GROUP_N=cfg.group_n, DYNAMIC_TILES=cfg.dynamic_tiles,
            ASM_TICKET=x.device.type == "cuda" and not torch.version.hip,
            LANES=32 * cfg.num_warps, num_warps=cfg.num_warps, num_stages=stages,
            G_BLOCK=group_block(groups),
            **(flags if tma and variants else plain),
        )

    if use_tma and x.device.type == "cuda":
        explicit = config is not None
        variants_ok = explicit or not fell_back(Fallback.WGRAD_VARIANTS, x.device)
        if any(flags.values()) and variants_ok:
            if launch_or_fall_back(lambda: launch(True), Fallback.WGRAD_VARIANTS, x.device,
                                   explicit=explicit, what="dW kernel with ragged TMA / TMA store",
                                   instead="the plain TMA kernel"):
                return dw, db if with_db else None
        if launch_or_fall_back(lambda: launch(True, variants=False), Fallback.TMA, x.device,
                               explicit=explicit, what="TMA dW kernel",
                               instead="the pointer-based kernels"):
            return dw, db if with_db else None
    launch(bool(use_tma) and x.device.type != "cuda")
    return dw, db if with_db else None


def _column_sums_only(grad, offsets, db):
    # K == 0: no dW tiles exist to carry the bias sums; use a 1-column dummy x of zeros.
    x = grad.new_zeros((grad.shape[0], 1))
    _, db_of_dummy = grouped_linear_wgrad(grad, x, offsets, grad.dtype, db.dtype)
    return db.copy_(db_of_dummy)
