"""fp8 (e4m3) weight gradient of the grouped linear, ``dW_g = dY_g^T X_g``
(:mod:`compileops.grouped_linear.fp8`, "dW in fp8"):

* :func:`quantize_group_columns`: ``dY [M, N]`` and ``X [M, K]`` quantised with one scale per
  group and column over the group's rows, the codes written transposed (``[C, W]``) with
  each group's rows in a zero-padded span of whole row chunks;
* :func:`grouped_linear_wgrad_fp8`: the K-jagged product
  (:func:`.kjagged.kjagged_gemm_kernel` with ``FP8_SCALES``) on those codes, the scales in its
  epilogue.

The quantisation rule and its scalars are the rowwise quantiser's (:mod:`.fp8`); the product
is the 16-bit dW's kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.grouped_linear.fp8 import E4M3, _check_float
from compileops.grouped_linear.kernels.config import (
    Config,
    choose_fp8_wgrad_config,
    grid_size,
    group_block,
    interpreter_dot,
)
from compileops.grouped_linear.kernels.fp8 import amax_and_nans, quantize_to_e4m3, scales_of
from compileops.grouped_linear.kernels.kjagged import kjagged_gemm_kernel
from compileops.grouped_linear.kernels.tiles import group_rows


#: A group's column amax merged across row chunks by an integer ``atomic_max`` on its bits
#: (non-negative floats order as their bit patterns, +inf's is 0x7F800000); a chunk that saw
#: a NaN contributes this code, above every float's. The merge is order-free: deterministic.
NAN_SEEN = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _chunk_tile(x_ptr, offs_ptr, dst_offs_ptr, chunk, cols, M, C, G, stride_xm, stride_xc,
                BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Destination columns ``[chunk, chunk + BLOCK_M)`` of the padded layout: ``(g, x, dst,
    real)``, the group whose span holds them (``G``: past every span), its source rows there
    as ``x [BLOCK_M, BLOCK_C]`` fp32 (zeros at padding and at columns ``>= C``), the
    destination columns, and which of them hold a row (not padding). A chunk never straddles
    two spans: every span starts on a multiple of ``BLOCK_M``."""
    lanes = tl.arange(0, G_BLOCK)
    ends = tl.load(dst_offs_ptr + lanes, mask=lanes < G, other=2147483647)
    g = tl.sum((ends <= chunk).to(tl.int32), axis=0)  # spans ending at or before the chunk
    start, end = group_rows(offs_ptr, g, G, M)
    dst_start = tl.load(dst_offs_ptr + g - 1, mask=g > 0, other=0)
    dst = chunk + tl.arange(0, BLOCK_M)
    rows = start + (dst - dst_start)
    end = tl.where(g < G, end, start)  # past every span: no rows (g == G is the tail's lane)
    mask = (rows < end)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm
                + cols.to(tl.int64)[None, :] * stride_xc, mask=mask, other=0.0)
    return g, x.to(tl.float32), dst, rows < end


@triton.jit
def _scales_of_bits(bits):
    """``(scale, inverse)`` (:func:`.fp8.scales_of`) from merged amax bits (:data:`NAN_SEEN`)."""
    nans = bits > 0x7F800000
    amax = tl.where(nans, 0, bits).to(tl.float32, bitcast=True)
    return scales_of(amax, nans.to(tl.int32))


@triton.jit
def group_columns_amax_kernel(
    x_ptr, amax_ptr, offs_ptr, dst_offs_ptr, M, C, G, stride_xm, stride_xc,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, G_BLOCK: tl.constexpr,
):
    """Grid ``(W // BLOCK_M, cdiv(C, BLOCK_C))``, one program per destination row chunk and
    column block (:func:`_chunk_tile`): the chunk's column amax merged into ``amax [G, C]``
    int32 (zero-filled beforehand) as bits, :data:`NAN_SEEN` for a NaN. Every program reads
    one tile, whatever the groups' sizes, so skewed groups keep every SM busy."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    g, x, _, _ = _chunk_tile(x_ptr, offs_ptr, dst_offs_ptr, tl.program_id(0) * BLOCK_M,
                             cols, M, C, G, stride_xm, stride_xc, BLOCK_M, G_BLOCK)
    if g < G:
        amax, nans = amax_and_nans(x, 0)
        bits = tl.where(nans > 0, NAN_SEEN, amax.to(tl.int32, bitcast=True))
        tl.atomic_max(amax_ptr + tl.cast(g, tl.int64) * C + cols, bits, mask=cols < C,
                      sem="relaxed")


@triton.jit
def group_columns_codes_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr, offs_ptr, dst_offs_ptr, M, C, G, W, stride_xm,
    stride_xc, stride_qc, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    G_BLOCK: tl.constexpr,
):
    """Grid ``(W // BLOCK_M + G, cdiv(C, BLOCK_C))``, after :func:`group_columns_amax_kernel`.
    The first ``W // BLOCK_M`` rows of programs: a destination chunk's codes, quantised with
    its group's column scales and written transposed to ``q_t [C, W]`` e4m3 (row stride
    ``stride_qc``), padding included (zero codes). The last ``G``: group ``pid0 - W //
    BLOCK_M``'s scales to ``scale [G, C]`` fp32 (a group of no rows too: scale 1). Nothing
    is written at or past column ``W``."""
    pid = tl.program_id(0)
    chunks = W // BLOCK_M
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    cols64 = cols.to(tl.int64)
    if pid < chunks:
        g, x, dst, real = _chunk_tile(x_ptr, offs_ptr, dst_offs_ptr, pid * BLOCK_M, cols, M,
                                      C, G, stride_xm, stride_xc, BLOCK_M, G_BLOCK)
        if g < G:
            bits = tl.load(amax_ptr + tl.cast(g, tl.int64) * C + cols, mask=col_ok, other=0)
            _, inverse = _scales_of_bits(bits)
            # padding is zero codes, also under a NaN scale (0 times NaN is not zero)
            q = tl.where(real[:, None], quantize_to_e4m3(x, inverse[None, :]), 0.0)
            tl.store(q_ptr + cols64[None, :] * stride_qc + dst.to(tl.int64)[:, None],
                     q.to(q_ptr.dtype.element_ty), mask=col_ok[None, :] & (dst < W)[:, None])
    else:
        g = pid - chunks
        bits = tl.load(amax_ptr + tl.cast(g, tl.int64) * C + cols, mask=col_ok, other=0)
        scale, _ = _scales_of_bits(bits)
        tl.store(scale_ptr + tl.cast(g, tl.int64) * C + cols64, scale, mask=col_ok)


#: fp8 dW's e4m3 operands keep each group's rows in a column span that starts and ends on a
#: multiple of this many codes (16 bytes) or more (the product's row chunk), padded with zero
#: codes: every chunk the product loads is then whole and 16-byte aligned, so its loads are
#: 16-byte vectors (asynchronous copies on Hopper) with no mask along the rows, instead of
#: single bytes under a per-row mask.
GROUP_ALIGN = 16


def padded_group_offsets(offsets: torch.Tensor, rows: int,
                         align: int = GROUP_ALIGN) -> torch.Tensor:
    """int32 ``[G]``: the cumulative ends of the groups' spans, each group's row count (as
    the kernels clamp it to ``rows``: ``tiles.group_rows``) rounded up to a multiple of
    ``align``. Device ops, no host sync."""
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]]).clamp(0, rows)
    ends = torch.maximum(offsets.clamp(max=rows), starts)
    counts = ends - starts
    return torch.cumsum((counts + align - 1) // align * align, 0, dtype=torch.int32)


#: The quantiser's tiles on a GPU, ``(rows, columns, warps)``, rows capped by the span
#: alignment. From a sweep on an H100 over the bench layers' dW operands ([65536, 1536] to
#: [16384, 28672] bf16): the amax pass reads at 2.2-2.5 TB/s with 128 x 64 tiles (1.5-1.7
#: with 64 x 128); the codes pass, whose transposed stores bound it, at 1.6-1.8 TB/s with 64
#: x 32 (1.2-1.3 with 64 x 128). 30% less time for the two passes than one 64 x 128 tile.
#: Spans aligned to 64 rows (the 16-bit dW pick's chunk) cap the amax tile at 64 x 64: 1.35-1.5
#: TB/s there, about 10% under 64 x 128, which the codes pass's gain outweighs (15% less in
#: all at Qwen3-30B-A3B's [65536, 1536]).
AMAX_TILE = (128, 64, 4)
CODES_TILE = (64, 32, 4)
#: Under Triton's interpreter (CPU): small tiles, one warp.
INTERPRETER_TILE = (64, 32, 1)


def quantiser_tiles(device: torch.device) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The amax and codes passes' ``(rows, columns, warps)`` on ``device``."""
    return (INTERPRETER_TILE,) * 2 if device.type == "cpu" else (AMAX_TILE, CODES_TILE)


def tile_within_spans(tile: tuple[int, int, int], align: int) -> tuple[int, int, int]:
    """A quantiser ``(rows, columns, warps)`` tile with its rows cut to ``align`` (both powers
    of two), so that no row chunk straddles two spans."""
    rows, cols, warps = tile
    return min(rows, align), cols, warps


def quantize_group_columns(x: torch.Tensor, offsets: torch.Tensor, align: int = GROUP_ALIGN,
                           padded: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, C]`` (16- or 32-bit float, any strides), int32 ``offsets [G]`` -> ``(q_t [C,
    W]`` e4m3, ``scale [G, C]`` fp32, ``padded_offsets [G]`` int32): one scale per group and
    column over the group's rows, the rule of
    :func:`compileops.grouped_linear.fp8.quantize_group_columns` bit for bit, with the codes
    transposed and each group's span padded with zero codes to a multiple of ``align`` (a
    power of two, at least :data:`GROUP_ALIGN`; :func:`padded_group_offsets`; ``W = M + G *
    (align - 1)`` rounded up to ``align``, the columns past ``padded_offsets[-1]``
    unwritten). Rows of no group are not read. ``x`` is not modified. ``padded``: that
    layout's ends, :func:`padded_group_offsets` ``(offsets, M, align)``, where the caller has
    them already (two operands of one product share them).

    Two launches over the padded layout's row chunks, every program one tile whatever the
    groups' sizes: :func:`group_columns_amax_kernel` (the column amax of each group, merged
    across its chunks by an integer atomic maximum, deterministic), then
    :func:`group_columns_codes_kernel` (codes and scales). x is read twice, the codes written
    once."""
    _check_float(x, "x", 2)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, C], got shape {tuple(x.shape)}")
    if align < GROUP_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two >= {GROUP_ALIGN}, got {align}")
    m, c = x.shape
    groups = offsets.shape[0]
    offsets = offsets.contiguous()
    width = padded_width(m, groups, align)
    q_t = torch.empty((c, width), dtype=E4M3, device=x.device)
    scale = torch.empty((groups, c), dtype=torch.float32, device=x.device)
    if padded is None:
        padded = padded_group_offsets(offsets, m, align)
    if c and groups:
        amax_tile, codes_tile = (tile_within_spans(tile, align)
                                 for tile in quantiser_tiles(x.device))
        amax_bits = torch.zeros((groups, c), dtype=torch.int32, device=x.device)
        launch_group_columns_amax(x, amax_bits, offsets, padded, width, amax_tile)
        launch_group_columns_codes(x, q_t, scale, amax_bits, offsets, padded, codes_tile)
    return q_t, scale, padded


def padded_width(rows: int, groups: int, align: int) -> int:
    """The padded layout's width ``W`` for ``rows`` rows in ``groups`` spans, each padded to
    a multiple of ``align``: room for the worst case, rounded up to ``align``."""
    return -(-(rows + groups * (align - 1)) // align) * align


def launch_group_columns_amax(x, amax_bits, offsets, padded, width, tile) -> None:
    """:func:`group_columns_amax_kernel` over ``x [M, C]`` into zero-filled ``amax_bits [G,
    C]`` int32, with ``tile = (rows, columns, warps)`` (rows dividing the spans' alignment)."""
    rows, cols, warps = tile
    m, c = x.shape
    groups = offsets.shape[0]
    group_columns_amax_kernel[(width // rows, triton.cdiv(c, cols))](
        x, amax_bits, offsets, padded, m, c, groups, x.stride(0), x.stride(1),
        BLOCK_M=rows, BLOCK_C=cols, G_BLOCK=group_block(groups), num_warps=warps)


def launch_group_columns_codes(x, q_t, scale, amax_bits, offsets, padded, tile) -> None:
    """:func:`group_columns_codes_kernel`: ``x``'s codes into ``q_t [C, W]`` and the scales
    into ``scale [G, C]`` from the merged ``amax_bits``, with ``tile`` as above."""
    rows, cols, warps = tile
    m, c = x.shape
    groups = offsets.shape[0]
    width = q_t.shape[1]
    group_columns_codes_kernel[(width // rows + groups, triton.cdiv(c, cols))](
        x, q_t, scale, amax_bits, offsets, padded, m, c, groups, width, x.stride(0),
        x.stride(1), q_t.stride(0), BLOCK_M=rows, BLOCK_C=cols,
        G_BLOCK=group_block(groups), num_warps=warps)


def grouped_linear_wgrad_fp8(grad, x, offsets, weight_dtype, *, fast_accum: bool = False,
                             config: Optional[Config] = None):
    """fp8 ``dW [G, N, K] = dY_g^T X_g`` in ``weight_dtype``, deterministic: grad (dY) ``[M,
    N]`` and x ``[M, K]`` (16- or 32-bit) quantised to e4m3 with one scale per group and
    column (:func:`quantize_group_columns`: two kernels each, the amax then the codes, codes
    written transposed, each group's span zero-padded to whole ``BLOCK_M``-column chunks), then the
    K-jagged product on the e4m3 codes over those spans, with the scales in its epilogue.
    Equal, up to the order of its fp32 sums, to
    :func:`compileops.grouped_linear.fp8.grouped_linear_wgrad_reference`. ``fast_accum``: the
    MMA accumulates over each group's whole reduction instead of one ``BLOCK_M`` step at a
    time into fp32. Empty groups give zeros.

    ``config=None``: :func:`~.config.choose_fp8_wgrad_config`'s tiles and schedule, on the
    pointer path (the transposed operands have no TMA descriptor path here; the TMA variant
    flags are not used)."""
    m, n = grad.shape
    k = x.shape[1]
    offsets = offsets.contiguous()
    groups = offsets.shape[0]
    dw = torch.empty((groups, n, k), dtype=weight_dtype, device=grad.device)
    if dw.numel() == 0:
        return dw
    cfg = config or choose_fp8_wgrad_config(m, groups, n, k, x.device,
                                            fast_accum=bool(fast_accum))
    # [N, W], [G, N] and [K, W], [G, K]: each group's rows in a span of whole BLOCK_M chunks.
    align = max(cfg.block_m, GROUP_ALIGN)
    dy_q, dy_scale, padded = quantize_group_columns(grad, offsets, align)
    x_q, x_scale, _ = quantize_group_columns(x, offsets, align, padded)
    width = dy_q.shape[1]
    progs = grid_size(x.device, cfg)
    # The dynamic schedule's ticket counter (as in grouped_linear_wgrad).
    ticket = (torch.zeros(1, dtype=torch.int32, device=x.device) if cfg.dynamic_tiles
              else offsets)
    kjagged_gemm_kernel[(progs,)](
        dy_q, x_q, padded, dw, dw, ticket, width, n, k, groups,
        1, dy_q.stride(0), 1, x_q.stride(0),
        WITH_DB=False, DB_MMA=False, NUM_PROGS=progs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        INPUT_PRECISION="tf32", INTERPRETER_DOT=interpreter_dot(x), USE_TMA=False,
        GROUP_N=cfg.group_n, DYNAMIC_TILES=cfg.dynamic_tiles,
        ASM_TICKET=x.device.type == "cuda" and not torch.version.hip,
        LANES=32 * cfg.num_warps, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        G_BLOCK=group_block(groups), RAGGED_TMA=False, TMA_STORE=False,
        EPILOGUE_SUBTILE=False, FLATTEN=False,
        dy_scale_ptr=dy_scale, x_scale_ptr=x_scale, FP8_SCALES=True,
        FP8_FAST_ACCUM=bool(fast_accum),
    )
    return dw
