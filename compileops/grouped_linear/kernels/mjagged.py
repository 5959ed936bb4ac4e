"""M-jagged grouped GEMM: ``out[rows_g] = A[rows_g] @ B_g (+ bias_g)``, the forward
(``A = x``, ``B_g = W_g^T``), dX (``A = dY``, ``B_g = W_g``) and the fused SwiGLU forward
(gate and up halves of N in one tile).

Persistent: a fixed grid of ``NUM_PROGS`` programs walks one flat tile space over all
groups (``tiles.group_tile_table`` / ``tiles.locate_tile``), reading the offsets on the
device (no host sync, CUDA-graph safe), so load balance does not depend on how the rows
split into groups. The rows past ``offsets[-1]`` form a virtual group ``G`` whose tiles are
written as exact zeros.

:func:`mjagged_tile` and :func:`swiglu` are shared with the Inductor template
(``lowerings/templates/grouped_linear.py.jinja``), which stores through ``store_output``
so that pointwise consumers fuse as its epilogue.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.grouped_linear.kernels.config import (
    Config,
    choose_config,
    interpreter_dot,
    grid_size,
    group_block,
    input_precision,
)
from compileops.grouped_linear.kernels.stages import launch_with_stages_that_fit
from compileops.grouped_linear.kernels.tiles import group_tile_table, locate_tile
from compileops.grouped_linear.kernels.tma import (
    Fallback,
    fell_back,
    launch_or_fall_back,
    load_b_tile,
    make_descriptors,
    mjagged_tma_store,
    ragged_rows_descriptor,
    weight_descriptor,
    set_tma_allocator,
    store_rows_below,
    tma_applies,
    tma_compatible,
    trailing_columns_descriptor,
)


# ---------------------------------------------------------------------------------------
# Shared @triton.jit bodies (also called by the Inductor template)


@triton.jit
def tile_dot(a, b, acc, INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr,
             FP8_FAST_ACCUM: tl.constexpr = False):
    """``acc + a @ b`` in fp32: a ``[BLOCK_M, BLOCK_K]``, b ``[BLOCK_K, BLOCK_N]``, acc
    ``[BLOCK_M, BLOCK_N]``.

    e4m3 tiles on a GPU: by default each call's partial sum (one ``BLOCK_K`` step) is added
    into the fp32 accumulator, because Hopper's fp8 MMA adds its products at reduced
    precision. ``FP8_FAST_ACCUM``: the MMA accumulates into ``acc`` itself over the whole K
    loop (Triton's default for fp8), which lets consecutive steps' MMAs overlap; the cost is
    that reduced-precision sum over all of K (:mod:`compileops.grouped_linear.fp8_op`).

    ``INTERPRETER_DOT`` (CPU tensors, Triton's interpreter; see ``config.interpreter_dot``):
    an explicit product-and-sum over K in fp32, so every output element is summed in the same
    order wherever its row sits in the tile (numpy's matmul does not promise that, and bf16
    tiles would be multiplied as raw bits). On GPUs: the tensor-core MMA (fp8 tiles: e4m3
    products, exact in fp32).
    """
    if INTERPRETER_DOT:
        products = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [M, K, N]
        return acc + tl.sum(products, axis=1)
    if a.dtype.is_fp8():
        if FP8_FAST_ACCUM:
            out = tl.dot(a, b, acc)
        else:
            # Promote each BLOCK_K slice's partial sum into the fp32 accumulator.
            out = tl.dot(a, b, acc, max_num_imprecise_acc=a.shape[1])
    else:
        out = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return out


@triton.jit
def fp8_block_product(a, b, INTERPRETER_DOT: tl.constexpr):
    """The fp32 ``a @ b`` of one e4m3 K step (at most 128 wide, within one scale block), on
    its own accumulator: the caller scales it and adds it to the fp32 one, so the MMA's
    reduced-precision sums never run past one block."""
    if INTERPRETER_DOT:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b)


@triton.jit
def weight_block_scale(scale_ptr, g, cols, col_ok, k0, stride_g, stride_n, stride_k):
    """``[BLOCK_N]`` fp32: the scales of the 128 x 128 weight blocks holding columns ``cols``
    of group ``g`` at K offset ``k0`` (masked columns read 0: their products are 0 too)."""
    return tl.load(scale_ptr + tl.cast(g, tl.int64) * stride_g + (cols // 128) * stride_n
                   + k0 // 128 * stride_k, mask=col_ok, other=0.0)


@triton.jit
def mjagged_tile(
    a_ptr, b_ptr, bias_ptr, g, active, row_start, m_size, tile_m, tile_n,
    n_size, pair_offset, K,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_biasg, stride_biasn,
    a_desc, b_desc,
    HAS_BIAS: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr,
    USE_TMA: tl.constexpr, B_KN: tl.constexpr,
    a_block_scale_ptr=None, b_block_scale_ptr=None, stride_asm=0, stride_bsg=0,
    stride_bsn=0, stride_bsk=0, FP8_BLOCKWISE: tl.constexpr = False,
    FP8_FAST_ACCUM: tl.constexpr = False,
    b2_ptr=None, b2_desc=None, a2_desc=None, K2=0, SECOND_WEIGHT: tl.constexpr = False,
):
    """fp32 ``[BLOCK_M, BLOCK_N]`` tile of ``A[row_start + rm] @ B_g[:, rn] (+ bias_g[rn])``.

    * ``a_ptr``: A ``[M, K]``, strides ``(stride_am, stride_ak)``.
    * ``b_ptr``: B ``[G, K, N]`` as addressed: ``B_g[k, n]`` at ``g * stride_bg + k *
      stride_bk + n * stride_bn`` (the forward passes the weight ``[G, N, K]`` with its last
      two strides swapped: ``B_g = W_g^T``).
    * ``bias_ptr`` (``HAS_BIAS``): bias ``[G, N]``, strides ``(stride_biasg, stride_biasn)``.

    ``rm = tile_m * BLOCK_M + arange`` (valid below ``m_size``), ``rn = tile_n * BLOCK_N +
    arange`` (valid below ``n_size``). Returns ``(tile, tile2)``: with ``PAIR`` the second
    is the tile at columns ``rn + pair_offset`` (the up half of a fused gate/up weight),
    computed in the same K loop so the A tile is loaded once; otherwise ``tile2 is tile``.
    ``active == False`` (the tail past the last group) gives exact zeros: its pointer loads
    are masked off, its TMA loads of the out-of-range group ``G`` are zero-filled, and the
    accumulator is replaced by zeros (tail rows of A may hold anything, even inf). The K
    loop always runs in the same BLOCK_K order: a row's value does not depend on the other
    rows of its tile.

    ``USE_TMA``: A and B tiles come through the tensor descriptors ``a_desc`` / ``b_desc``
    (``tma.make_descriptors``). Rows of A past the group (other groups' rows) only reach
    output rows that are masked at the store; columns and K past the tensor's bounds are
    zero-filled by the TMA unit. ``B_KN``: the weight is stored ``[G, K, N]`` (dX: ``W_g``
    untransposed), else ``[G, N, K]``.

    ``FP8_BLOCKWISE`` (A and B in e4m3, ``BLOCK_K`` dividing 128): each K step's product is
    scaled by its 128-wide K block's scales before it joins the fp32 accumulator: A's at
    ``a_block_scale[row, k // 128]`` (``stride_asm`` per row, unit per block) and B's at
    ``b_block_scale[g, n // 128, k // 128]`` (strides ``stride_bsg, stride_bsn,
    stride_bsk``: the 128 x 128 blocks of ``W_g``, read transposed for dX).
    ``FP8_FAST_ACCUM`` (e4m3 without blocks): see :func:`tile_dot`.

    ``SECOND_WEIGHT`` (16-bit and fp32 products; no bias, no fp8): a second weight ``B2``
    at ``b2_ptr``, with B's strides (``b2_desc`` its descriptor), for a gate/up pair kept as
    two tensors. With ``PAIR`` the up tile is ``A @ B2_g[:, rn]`` (``pair_offset`` unused).
    Without, the reduction goes on over ``K2`` more columns of A, ``A[:, K + k] @ B2_g[k]``
    (dX of the pair: ``dH_gate @ W_gate + dH_up @ W_up``; ``a2_desc`` addresses A from
    column ``K``): a second K loop after the first, into the same fp32 accumulator, so when
    ``BLOCK_K`` divides ``K`` the sums are those of one loop over the concatenated weight.
    """
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # An inactive tile loads nothing. The scalar joins the block masks through tl.where:
    # ``block & scalar`` widens the scalar to int32 under triton 3.9's interpreter, whose
    # loads take bool masks only.
    row_ok = tl.where(active, rm < m_size, False)
    col_ok = tl.where(active, rn < n_size, False)
    rows = (row_start + rm).to(tl.int64)
    cols = rn.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = (b_ptr + tl.cast(g, tl.int64) * stride_bg + rk[:, None] * stride_bk
              + cols[None, :] * stride_bn)
    if SECOND_WEIGHT:
        b2_ptrs = (b2_ptr + tl.cast(g, tl.int64) * stride_bg + rk[:, None] * stride_bk
                   + cols[None, :] * stride_bn)
    else:
        b2_ptrs = b_ptrs + tl.cast(pair_offset, tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A loop-invariant trip count (K, not "0 when inactive") lets tl.range(flatten=True) fuse
    # this loop with the persistent tile loop; inactive tiles are zeroed after it instead.
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        # a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N]
        if USE_TMA:
            a = a_desc.load([(row_start + tile_m * BLOCK_M).to(tl.int32), k0])
            b = load_b_tile(b_desc, g, tile_n * BLOCK_N, k0, BLOCK_N, BLOCK_K, B_KN)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8_BLOCKWISE:
            a_scale = tl.load(a_block_scale_ptr + rows * stride_asm + k0 // 128, mask=row_ok,
                              other=0.0)
            acc = acc + fp8_block_product(a, b, INTERPRETER_DOT) * a_scale[:, None] * \
                weight_block_scale(b_block_scale_ptr, g, cols, col_ok, k0, stride_bsg,
                                   stride_bsn, stride_bsk)[None, :]
        else:
            acc = tile_dot(a, b, acc, INPUT_PRECISION, INTERPRETER_DOT, FP8_FAST_ACCUM)
        if PAIR:  # b2 [BLOCK_K, BLOCK_N]: the up half's columns
            if USE_TMA and SECOND_WEIGHT:
                b2 = load_b_tile(b2_desc, g, tile_n * BLOCK_N, k0, BLOCK_N, BLOCK_K, B_KN)
            elif USE_TMA:
                b2 = load_b_tile(b_desc, g, tile_n * BLOCK_N + pair_offset, k0,
                                 BLOCK_N, BLOCK_K, B_KN)
            else:
                b2 = tl.load(b2_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FP8_BLOCKWISE:
                acc2 = acc2 + fp8_block_product(a, b2, INTERPRETER_DOT) * a_scale[:, None] * \
                    weight_block_scale(b_block_scale_ptr, g, cols + pair_offset, col_ok, k0,
                                       stride_bsg, stride_bsn, stride_bsk)[None, :]
            else:
                acc2 = tile_dot(a, b2, acc2, INPUT_PRECISION, INTERPRETER_DOT, FP8_FAST_ACCUM)
            b2_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SECOND_WEIGHT and not PAIR:
        # The rest of the reduction: A's columns [K, K + K2) against the second weight.
        a2_ptrs = a_ptr + rows[:, None] * stride_am + (K + rk)[None, :] * stride_ak
        for k0 in range(0, K2, BLOCK_K):
            k_ok = (k0 + rk) < K2
            if USE_TMA:
                a = a2_desc.load([(row_start + tile_m * BLOCK_M).to(tl.int32), k0])
                b = load_b_tile(b2_desc, g, tile_n * BLOCK_N, k0, BLOCK_N, BLOCK_K, B_KN)
            else:
                a = tl.load(a2_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b2_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tile_dot(a, b, acc, INPUT_PRECISION, INTERPRETER_DOT, FP8_FAST_ACCUM)
            a2_ptrs += BLOCK_K * stride_ak
            b2_ptrs += BLOCK_K * stride_bk
    acc = tl.where(active, acc, 0.0)
    acc2 = tl.where(active, acc2, 0.0)
    if HAS_BIAS:
        bias_ptrs = bias_ptr + tl.cast(g, tl.int64) * stride_biasg + cols * stride_biasn
        bias = tl.load(bias_ptrs, mask=col_ok, other=0.0)  # [BLOCK_N]
        acc += bias.to(tl.float32)[None, :]
        if PAIR:
            bias2 = tl.load(bias_ptrs + tl.cast(pair_offset, tl.int64) * stride_biasn,
                            mask=col_ok, other=0.0)  # [BLOCK_N]
            acc2 += bias2.to(tl.float32)[None, :]
    if PAIR:
        return acc, acc2
    return acc, acc


@triton.jit
def swiglu(gate, up):
    """``silu(gate) * up`` in fp32 (``tl.sigmoid``: no libdevice, runs in the interpreter)."""
    return gate * tl.sigmoid(gate) * up


@triton.jit
def scale_rows(acc, scale_ptr, row_start, m_size, tile_m, BLOCK_M: tl.constexpr,
               OUT_DTYPE: tl.constexpr):
    """The row-scaled tile, fp32 ``[BLOCK_M, BLOCK_N]``: ``acc`` rounded to ``OUT_DTYPE``,
    times ``scale[row_start + rm]`` (``scale_ptr``: ``[M]`` in ``OUT_DTYPE``, contiguous;
    rows at or past ``m_size`` read 1).

    The caller's store rounds the product to ``OUT_DTYPE``, so the bits are those of the
    product written out, ``y.to(dtype) * scale`` (PyTorch multiplies 16-bit tensors in fp32
    and rounds once). One ``[BLOCK_M]`` load per tile: the scale is per row, so it costs
    nothing beside the tile's GEMM (as a fused Inductor epilogue it was loaded per element).
    """
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = (row_start + rm).to(tl.int64)
    scale = tl.load(scale_ptr + rows, mask=rm < m_size, other=1.0).to(tl.float32)
    return acc.to(OUT_DTYPE).to(tl.float32) * scale[:, None]


@triton.jit
def fp8_rowwise_scales(acc, a_scale_ptr, b_scale_ptr, g, active, row_start, m_size, tile_m,
                       tile_n, col_offset, n_size, stride_bsg,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fp32 tile of an fp8 product, ``acc [BLOCK_M, BLOCK_N]`` (sums of e4m3 products),
    times its rows' and columns' scales: ``a_scale[row_start + rm]`` (``a_scale_ptr``: fp32
    ``[M]``, contiguous) and ``b_scale[g, col_offset + rn]`` (``b_scale_ptr``: fp32 ``[G,
    N]``, unit column stride, ``stride_bsg`` between groups). Masked rows and columns, and
    the tail's inactive tiles, read scale 1 (their accumulators are zeros)."""
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (row_start + rm).to(tl.int64)
    cols = (col_offset + rn).to(tl.int64)
    row_scale = tl.load(a_scale_ptr + rows, mask=tl.where(active, rm < m_size, False),
                        other=1.0)
    col_scale = tl.load(b_scale_ptr + tl.cast(g, tl.int64) * stride_bsg + cols,
                        mask=tl.where(active, rn < n_size, False), other=1.0)
    return acc * row_scale[:, None] * col_scale[None, :]


@triton.jit
def store_tile(out_ptr, stride_om, stride_on, row_start, m_size, tile_m, tile_n, col_offset,
               n_size, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Masked pointer store of the fp32 ``tile [BLOCK_M, BLOCK_N]`` (rows ``tile_m * BLOCK_M +
    arange`` below ``m_size``, columns ``tile_n * BLOCK_N + arange`` below ``n_size``) to
    ``out[row_start + row, col_offset + column]``, cast to out's dtype; strides
    ``(stride_om, stride_on)``."""
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < m_size)[:, None] & (rn < n_size)[None, :]
    rows = (row_start + rm).to(tl.int64)
    cols = (col_offset + rn).to(tl.int64)
    dst = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on  # [BLOCK_M, BLOCK_N]
    tl.store(dst, tile.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------
# Eager kernel


@triton.jit
def mjagged_gemm_kernel(
    a_ptr, b_ptr, bias_ptr, offs_ptr, out_ptr,
    M, N_OUT, K, G,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_biasg, stride_biasn,
    stride_om, stride_on, pre_ptr, stride_pm, stride_pn, scale_ptr,
    a_scale_ptr, b_scale_ptr, stride_bsg, stride_asm, stride_bsn, stride_bsk,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, NUM_PROGS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, INTERPRETER_DOT: tl.constexpr,
    USE_TMA: tl.constexpr, B_KN: tl.constexpr, G_BLOCK: tl.constexpr, FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr = False, SAVE_PREACT: tl.constexpr = False,
    ROW_SCALE: tl.constexpr = False, FP8_ROWWISE: tl.constexpr = False,
    FP8_BLOCKWISE: tl.constexpr = False, FP8_FAST_ACCUM: tl.constexpr = False,
    b2_ptr=None, K2=0, SECOND_WEIGHT: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """Persistent M-jagged grouped GEMM.

    * ``a_ptr``: A ``[M, K]``, strides ``(stride_am, stride_ak)``.
    * ``b_ptr``: the weight, addressed as B ``[G, K, N]`` through ``(stride_bg, stride_bk,
      stride_bn)`` (see :func:`mjagged_tile`); ``N = 2 * N_OUT`` with ``SWIGLU`` (gate
      columns ``[0, N_OUT)``, up columns ``[N_OUT, 2 * N_OUT)``), else ``N_OUT``.
    * ``bias_ptr`` (``HAS_BIAS``): bias ``[G, N]``, strides ``(stride_biasg, stride_biasn)``.
    * ``offs_ptr``: int32 ``[G]``, contiguous, the cumulative end row of each group.
    * ``out_ptr``: out ``[M, N_OUT]``, strides ``(stride_om, stride_on)``; rows past
      ``offs[G-1]`` are written as zeros.
    * ``pre_ptr`` (``SAVE_PREACT``, with ``SWIGLU``): the pre-activations ``[M, 2 * N_OUT]``
      (gate, then up), strides ``(stride_pm, stride_pn)``, stored beside ``silu(gate) * up``
      for the backward; tail rows are zeros too. Unused otherwise.
    * ``scale_ptr`` (``ROW_SCALE``): ``[M]`` in out's dtype, contiguous: row i of the output
      is multiplied by ``scale[i]`` after rounding (:func:`scale_rows`).
    * ``a_scale_ptr``, ``b_scale_ptr``, ``stride_bsg`` (``FP8_ROWWISE``: A and B in e4m3, no
      bias): the rowwise scales of A ``[M]`` and of B's columns ``[G, N]`` (N = ``2 *
      N_OUT`` with ``SWIGLU``), applied to the fp32 tile before anything else
      (:func:`fp8_rowwise_scales`). ``FP8_FAST_ACCUM``: the MMA accumulates over the whole K
      loop (:func:`tile_dot`).
    * ``FP8_BLOCKWISE`` (A and B in e4m3, no bias): ``a_scale_ptr`` A's ``[M, K / 128]``
      block scales (row stride ``stride_asm``), ``b_scale_ptr`` the weight's 128 x 128 block
      scales (strides ``stride_bsg``, ``stride_bsn`` per block of output columns,
      ``stride_bsk`` per block of K), applied per K step (:func:`mjagged_tile`).
    * ``b2_ptr`` (``SECOND_WEIGHT``, no bias, no fp8): a second weight with B's strides.
      With ``SWIGLU`` it holds the up rows (``N = N_OUT`` in each weight); with ``B_KN``
      (dX) A has ``K + K2`` columns and the product is ``A[:, :K] @ B_g + A[:, K:] @ B2_g``
      (B2 ``[G, K2, N_OUT]``).

    Every program strides through the flat tile space by ``NUM_PROGS``. ``FLATTEN`` lets
    Triton pipeline across consecutive tiles. ``USE_TMA``: loads through descriptors
    (``tma.make_descriptors``; ``B_KN`` as in :func:`mjagged_tile`).

    ``TMA_STORE`` (with ``USE_TMA``; ``out`` with unit column stride, 16-byte aligned base
    and row stride, ``M < RAGGED_ROWS``): each output tile leaves as an async bulk copy
    through a ragged descriptor (``tma.store_rows_below``), so the next tile's loads and
    MMAs run while it drains, instead of masked pointer stores from registers. A group's
    last partial tile covers rows of the next group (written by another program): the
    ragged bound ``end`` drops them, as the pointer store's row mask does."""
    pid = tl.program_id(0)
    a_desc = None
    b_desc = None
    if USE_TMA:
        if B_KN:
            a_desc, b_desc = make_descriptors(a_ptr, b_ptr, M, K, G, N_OUT, stride_am, stride_bg,
                                              stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
        else:
            b_n = N_OUT * 2 if SWIGLU and not SECOND_WEIGHT else N_OUT
            a_desc, b_desc = make_descriptors(a_ptr, b_ptr, M, K, G, b_n, stride_am, stride_bg,
                                              stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, B_KN)
    a2_desc = None
    b2_desc = None
    if USE_TMA and SECOND_WEIGHT:
        if B_KN:
            b2_desc = weight_descriptor(b2_ptr, G, K2, N_OUT, stride_bg, stride_bk,
                                               BLOCK_N, BLOCK_K, B_KN)
            a2_desc = trailing_columns_descriptor(a_ptr, M, K, K2, stride_am, BLOCK_M, BLOCK_K)
        else:
            b2_desc = weight_descriptor(b2_ptr, G, K, N_OUT, stride_bg, stride_bn,
                                               BLOCK_N, BLOCK_K, B_KN)
    out_desc = None
    if USE_TMA and TMA_STORE:
        out_desc = ragged_rows_descriptor(out_ptr, N_OUT, stride_om, BLOCK_M, BLOCK_N)
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    tile_end, total_m = group_tile_table(offs_ptr, G, M, BLOCK_M, G_BLOCK)
    for t in tl.range(pid, total_m * num_n, NUM_PROGS, flatten=FLATTEN,
                      warp_specialize=WARP_SPECIALIZE):
        g, start, end, tile_m, tile_n = locate_tile(t, tile_end, total_m, num_n, offs_ptr, G, M,
                                                    GROUP_M, G_BLOCK)
        acc, up = mjagged_tile(
            a_ptr, b_ptr, bias_ptr, g, g < G, start, end - start, tile_m, tile_n,
            N_OUT, N_OUT, K, stride_am, stride_ak, stride_bg, stride_bk, stride_bn,
            stride_biasg, stride_biasn, a_desc, b_desc, HAS_BIAS, SWIGLU, BLOCK_M, BLOCK_N,
            BLOCK_K, INPUT_PRECISION, INTERPRETER_DOT, USE_TMA, B_KN,
            a_scale_ptr, b_scale_ptr, stride_asm, stride_bsg, stride_bsn, stride_bsk,
            FP8_BLOCKWISE, FP8_FAST_ACCUM, b2_ptr, b2_desc, a2_desc, K2, SECOND_WEIGHT,
        )  # [BLOCK_M, BLOCK_N] each, fp32
        if FP8_ROWWISE:
            acc = fp8_rowwise_scales(acc, a_scale_ptr, b_scale_ptr, g, g < G, start, end - start,
                                     tile_m, tile_n, 0, N_OUT, stride_bsg, BLOCK_M, BLOCK_N)
            if SWIGLU:
                up = fp8_rowwise_scales(up, a_scale_ptr, b_scale_ptr, g, g < G, start,
                                        end - start, tile_m, tile_n, N_OUT, N_OUT, stride_bsg,
                                        BLOCK_M, BLOCK_N)
        if SWIGLU:
            if SAVE_PREACT:
                store_tile(pre_ptr, stride_pm, stride_pn, start, end - start, tile_m, tile_n, 0,
                           N_OUT, acc, BLOCK_M, BLOCK_N)
                store_tile(pre_ptr, stride_pm, stride_pn, start, end - start, tile_m, tile_n,
                           N_OUT, N_OUT, up, BLOCK_M, BLOCK_N)
            acc = swiglu(acc, up)
        if ROW_SCALE:
            acc = scale_rows(acc, scale_ptr, start, end - start, tile_m, BLOCK_M,
                             out_ptr.dtype.element_ty)
        if USE_TMA and TMA_STORE:
            store_rows_below(out_desc, start + tile_m * BLOCK_M, end, tile_n * BLOCK_N,
                             acc.to(out_ptr.dtype.element_ty), BLOCK_M, BLOCK_N)
        else:
            store_tile(out_ptr, stride_om, stride_on, start, end - start, tile_m, tile_n, 0,
                       N_OUT, acc, BLOCK_M, BLOCK_N)


# ---------------------------------------------------------------------------------------
# Launchers


def mjagged_gemm(a: torch.Tensor, b: torch.Tensor, b_strides: tuple[int, int, int],
                 offsets: torch.Tensor, n_out: int, *, bias: Optional[torch.Tensor] = None,
                 swiglu: bool = False, out_dtype: torch.dtype,
                 config: Optional[Config] = None, batch_invariant: bool = False,
                 b_kn: bool = False, use_tma: Optional[bool] = None,
                 preact: Optional[torch.Tensor] = None,
                 row_scale: Optional[torch.Tensor] = None,
                 fp8_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 fp8_block_scales: Optional[tuple[torch.Tensor, torch.Tensor,
                                                  tuple[int, int, int]]] = None,
                 fp8_fast_accum: bool = False,
                 second_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out [M, n_out]``: rows of group g are ``A_g @ B_g`` (B addressed through
    ``b_strides = (stride_g, stride_k, stride_n)``), tail rows zero.

    ``b`` is the weight ``[G, N, K]``; ``b_kn`` says B_g is ``W_g`` itself (dX) rather than
    ``W_g^T``; ``swiglu``: ``silu(gate) * up`` of the two column halves (``n_out = N / 2``).
    ``config=None`` takes :func:`~.config.choose_config`'s pick. ``use_tma=None`` picks TMA
    when ``tma.tma_applies`` (never in batch-invariant mode: one code path per row).
    ``Config.tma_store`` adds TMA stores of the output tiles where ``tma.mjagged_tma_store``
    allows. Failed TMA launches fall back per device (see ``kernels/tma.py``).
    ``preact`` (with ``swiglu``): an ``[M, N]`` tensor that receives the pre-activations
    (gate and up, rounded to its dtype) beside the SwiGLU output. ``row_scale`` ``[M]`` in
    ``out_dtype``: row i of the output times ``row_scale[i]``, after rounding
    (:func:`scale_rows`). ``fp8_scales = (a_scale [M], b_scale [G, N])`` (fp32) with ``a``
    and ``b`` in e4m3 (no bias): the rowwise fp8 product, each fp32 tile times its rows' and
    columns' scales (:func:`fp8_rowwise_scales`). ``fp8_block_scales = (a_scale [M, K /
    128], b_scale, (stride_g, stride_n, stride_k))`` (fp32) with ``a`` and ``b`` in e4m3 (no
    bias): the blockwise fp8 product, each K step scaled by its blocks' scales
    (:func:`mjagged_tile`); ``b_scale``'s strides address the block of output columns and of
    K (for dX, W's own ``[G, N / 128, K / 128]`` scales with the last two strides swapped).
    ``fp8_fast_accum`` (with ``fp8_scales`` only): the MMA accumulates over the whole K loop
    instead of adding each K step into fp32 (:func:`tile_dot`); the interpreter's exact
    sums ignore it. ``second_weight`` (no bias, no fp8; the strides of ``b``): the up
    weight of a gate/up pair with ``swiglu`` (``n_out = N`` of each), or with ``b_kn`` (dX)
    the second half of the reduction, ``A[:, :N1] @ W_g + A[:, N1:] @ W2_g`` (``mjagged_tile``'s
    ``SECOND_WEIGHT``).
    """
    if fp8_fast_accum and fp8_scales is None:
        raise ValueError("fp8_fast_accum applies to the rowwise fp8 product (fp8_scales): the "
                         "blockwise product scales each K step apart by construction")
    m, k = a.shape
    k_first, k_second = k, 0
    if second_weight is not None:
        if bias is not None or fp8_scales is not None or fp8_block_scales is not None:
            raise ValueError("a second weight takes no bias and no fp8 scales")
        if not (swiglu or b_kn):
            raise ValueError("a second weight is the up half of a SwiGLU pair, or dX's")
        if b_kn:  # dX: A's columns split between the two weights' rows
            k_first, k_second = b.shape[1], second_weight.shape[1]
    offsets = offsets.contiguous()  # the kernel reads offsets[g] at offs_ptr + g
    groups = offsets.shape[0]
    if row_scale is not None:
        row_scale = row_scale.contiguous()  # the kernel reads scale[i] at scale_ptr + i
    a_scale = b_scale = None
    block_strides = (0, 0, 0)
    if (fp8_scales is not None or fp8_block_scales is not None) and bias is not None:
        raise ValueError("the fp8 grouped product takes no bias")
    if fp8_scales is not None:
        a_scale = fp8_scales[0].contiguous()
        b_scale = fp8_scales[1] if fp8_scales[1].stride(-1) == 1 else fp8_scales[1].contiguous()
        block_strides = (b_scale.stride(0), 0, 0)
    elif fp8_block_scales is not None:
        a_scale, b_scale, block_strides = fp8_block_scales
        a_scale = a_scale.contiguous()
    out = torch.empty((m, n_out), dtype=out_dtype, device=a.device)
    if m == 0 or n_out == 0:
        return out
    cfg = config or choose_config(m, groups, n_out, k, a.dtype, a.device,
                                  batch_invariant=batch_invariant, swiglu=swiglu,
                                  fp8_fast_accum=fp8_fast_accum, out_dtype=out_dtype)
    if fp8_block_scales is not None:
        if 128 % cfg.block_k:
            raise ValueError(f"the blockwise fp8 product needs a block_k dividing 128, got "
                             f"{cfg.block_k}")
        if config is None:
            # Pipelined across tiles, the per-step block product and its scaling keep too
            # much live: 128 x 128 x 128 on 8 warps spills 1.8 KB a thread with flatten, none
            # without (237 registers; sm90, triton 3.6).
            cfg = dataclasses.replace(cfg, flatten=False)
    if k_second and config is None:
        # dX of a pair runs two K loops per tile; the persistent loop is flattened only over
        # a single inner loop.
        cfg = dataclasses.replace(cfg, flatten=False)
    progs = grid_size(a.device, cfg)
    if use_tma is None:
        use_tma = not batch_invariant and tma_applies(a, b, cfg)
        if second_weight is not None:
            # dX's second A descriptor starts k_first elements into each row.
            use_tma = (use_tma and tma_compatible(second_weight)
                       and (k_first * a.element_size()) % 16 == 0)
    store = mjagged_tma_store(out, cfg, bool(use_tma))

    def launch(tma: bool, tma_store: bool = False) -> None:
        # What sets the kernel's shared memory besides the config: a retry's key.
        key = ("M-jagged", cfg, a.dtype, out_dtype, swiglu, b_kn, tma, tma_store,
               preact is not None, row_scale is not None, second_weight is not None,
               fp8_scales is not None, fp8_block_scales is not None)
        launch_with_stages_that_fit(lambda stages: launch_stages(tma, tma_store, stages),
                                    cfg.num_stages, a.device, explicit=config is not None,
                                    key=key, what="the M-jagged kernel", config=cfg)

    def launch_stages(tma: bool, tma_store: bool, stages: int) -> None:
        if tma:
            set_tma_allocator(a.device)
        mjagged_gemm_kernel[(progs,)](
            a, b, bias if bias is not None else a, offsets, out,
            m, n_out, k_first, groups,
            a.stride(0), a.stride(1), *b_strides,
            bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
            out.stride(0), out.stride(1),
            preact if preact is not None else out,
            preact.stride(0) if preact is not None else 0,
            preact.stride(1) if preact is not None else 0,
            row_scale if row_scale is not None else out,
            a_scale if a_scale is not None else out, b_scale if b_scale is not None else out,
            block_strides[0], a_scale.stride(0) if a_scale is not None and a_scale.dim() == 2
            else 0, block_strides[1], block_strides[2],
            HAS_BIAS=bias is not None, SWIGLU=swiglu, NUM_PROGS=progs, GROUP_M=cfg.group_m,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            INPUT_PRECISION=input_precision(a.dtype), INTERPRETER_DOT=interpreter_dot(a),
            USE_TMA=tma, B_KN=b_kn, G_BLOCK=group_block(groups), FLATTEN=cfg.flatten,
            TMA_STORE=tma and tma_store, SAVE_PREACT=preact is not None,
            ROW_SCALE=row_scale is not None, FP8_ROWWISE=fp8_scales is not None,
            FP8_BLOCKWISE=fp8_block_scales is not None, FP8_FAST_ACCUM=fp8_fast_accum,
            b2_ptr=second_weight if second_weight is not None else a, K2=k_second,
            SECOND_WEIGHT=second_weight is not None, WARP_SPECIALIZE=cfg.warp_specialize,
            num_warps=cfg.num_warps, num_stages=stages,
        )

    if use_tma and a.device.type == "cuda":
        explicit = config is not None
        if store and (explicit or not fell_back(Fallback.MJAGGED_TMA_STORE, a.device)):
            if launch_or_fall_back(lambda: launch(True, tma_store=True),
                                   Fallback.MJAGGED_TMA_STORE, a.device, explicit=explicit,
                                   what="M-jagged kernel with TMA store",
                                   instead="pointer stores"):
                return out
        # An explicit config that does not fit raises: it must neither be timed as the
        # pointer kernel nor turn TMA off for every later default launch on the device.
        if launch_or_fall_back(lambda: launch(True), Fallback.TMA, a.device, explicit=explicit,
                               what="TMA kernel", instead="the pointer-based kernels"):
            return out
    interpreted = bool(use_tma) and a.device.type != "cuda"
    launch(interpreted, tma_store=interpreted and store)
    return out


def grouped_linear_forward(x, weight, offsets, bias=None, *, batch_invariant=False, use_tma=None,
                           row_scale=None):
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, bias ``[G, N]`` -> ``[M, N]``;
    ``row_scale`` ``[M]`` in x's dtype multiplies each row after rounding (:func:`scale_rows`)."""
    n = weight.shape[1]
    return mjagged_gemm(x, weight, (weight.stride(0), weight.stride(2), weight.stride(1)),
                        offsets, n, bias=bias, out_dtype=x.dtype, batch_invariant=batch_invariant,
                        use_tma=use_tma, row_scale=row_scale)


def grouped_linear_swiglu_forward(x, weight, offsets, bias=None, *, batch_invariant=False,
                                  use_tma=None, preact=None):
    """weight ``[G, 2H, K]`` (gate rows first, then up) -> ``silu(x W_gate^T) * (x W_up^T)``
    ``[M, H]``; ``preact [M, 2H]``, if given, receives ``x W^T (+ b)`` in its dtype."""
    h = weight.shape[1] // 2
    return mjagged_gemm(x, weight, (weight.stride(0), weight.stride(2), weight.stride(1)),
                        offsets, h, bias=bias, swiglu=True, out_dtype=x.dtype,
                        batch_invariant=batch_invariant, use_tma=use_tma, preact=preact)


def grouped_linear_dx(grad, weight, offsets, *, batch_invariant=False, use_tma=None):
    """grad ``[M, N]`` (any strides, stride 0 included) -> ``dX [M, K] = dY_g @ W_g``."""
    k = weight.shape[2]
    return mjagged_gemm(grad, weight, (weight.stride(0), weight.stride(1), weight.stride(2)),
                        offsets, k, out_dtype=grad.dtype, batch_invariant=batch_invariant,
                        b_kn=True, use_tma=use_tma)

