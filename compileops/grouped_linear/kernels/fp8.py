"""fp8 (e4m3) kernels of the grouped linear: rowwise and blockwise quantisation, and the
launchers of the fp8 M-jagged products (:func:`.mjagged.mjagged_gemm`'s ``fp8_scales`` /
``fp8_block_scales``).

The rule is :mod:`compileops.grouped_linear.fp8`'s, bit for bit: per row or block, ``scale =
amax / 448`` and ``q = e4m3(clamp(x * (448 / amax), -448, 448))`` rounded to nearest with ties
to even; scale 1 for a group with ``amax`` below ``MIN_AMAX`` (all-zero or tiny: its values
come back as zeros, and ``448 / amax`` never overflows); a NaN kept NaN.

Compiled for a GPU, the cast rounds (``cvt.rn.satfinite``: to nearest, ties to even, one
instruction for two values). Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU
tests) values are first rounded onto the e4m3 grid in fp32 arithmetic
(:func:`round_to_e4m3_grid`), so the cast only sees values it represents exactly: the
interpreter converts fp32 to e4m3 wrongly for values that round up into the next binade
(31.9 becomes 16, not 32), and a plain cast there would test another rule than the GPU's.
The two give the same bits (``tests/grouped_linear/test_fp8_templates.py`` on a GPU).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from compileops._library import as_rows
from compileops.grouped_linear.fp8 import E4M3, MIN_AMAX, _check_float

#: Round onto the e4m3 grid before the cast: only under Triton's interpreter, which decides
#: at import as Triton does (module docstring). The compiled quantisation
#: (``compileops/lowerings/fp8_quantize.py``) follows it.
GRID_ROUNDING = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

#: :data:`compileops.grouped_linear.fp8.MIN_AMAX` for the kernels: exact in fp32 and above
#: 2^-126, so Triton makes it an fp32 constant of exactly these bits.
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def round_to_e4m3_grid(v):
    """fp32 ``v`` (``|v| <= 448`` or NaN) rounded to the nearest e4m3 value, ties to even,
    still fp32. e4m3 has 3 mantissa bits and its smallest normal is ``2^-6``, so the grid
    spacing of ``v``'s binade ``[2^e, 2^(e+1))`` is ``2^(e - 3)`` (``2^-9`` below ``2^-6``);
    ``v / spacing`` is below 16 in magnitude, and adding and subtracting ``1.5 * 2^23``
    rounds it to an integer in fp32's own round-to-nearest-even."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    spacing_exp = tl.maximum(exponent, -6) - 3
    spacing = ((spacing_exp + 127) << 23).to(tl.float32, bitcast=True)
    steps = v / spacing  # exact: spacing is a power of two
    magic = 12582912.0  # 1.5 * 2^23
    rounded = (steps + magic) - magic
    # v * 0 keeps the sign of a value that rounds to zero (-0 stays -0, as the cast has it).
    return tl.where(rounded == 0.0, v * 0.0, rounded * spacing)


@triton.jit
def quantize_to_e4m3(x, inverse):
    """fp32 ``x`` times the group's ``inverse`` (``448 / amax``, or 1:
    :func:`scale_and_inverse`), clamped to +-448 (a NaN stays NaN: Triton's clamp would turn
    it into a bound), still fp32, for the caller's cast to e4m3 to round (under the
    interpreter: rounded onto the e4m3 grid here, and the cast is exact)."""
    scaled = x * inverse
    clamped = tl.where(scaled != scaled, scaled, tl.clamp(scaled, -448.0, 448.0))
    if GRID_ROUNDING:
        clamped = round_to_e4m3_grid(clamped)
    return clamped


@triton.jit
def scale_and_inverse(amax):
    """``(scale, inverse)`` of groups with largest magnitude ``amax`` (fp32, any shape; NaN
    for a group holding a NaN): ``amax / 448`` and ``448 / amax``, both 1 for a group below
    ``MIN_AMAX`` (all-zero or tiny; a NaN compares False), so both quotients kept are finite
    and normal. ``div_rn``: correctly rounded quotients, as torch's tensor division
    (Triton's ``/`` on fp32 is an approximate division). Once per group, outside the
    quantisers' loops over values."""
    flushed = amax < _MIN_AMAX
    e4m3_max = tl.full(amax.shape, 448.0, tl.float32)
    divisor = tl.where(flushed, 448.0, amax)  # no 448 / tiny computed and thrown away
    scale = tl.where(flushed, 1.0, tl.math.div_rn(amax, e4m3_max))
    return scale, tl.math.div_rn(e4m3_max, divisor)


@triton.jit
def amax_and_nans(x, AXIS: tl.constexpr):
    """The largest magnitude of fp32 ``x`` along ``AXIS``, and 1 where that slice holds a
    NaN (else 0). NaNs are counted apart: max and maximum drop a NaN operand on GPUs (and in
    newer Triton interpreters), so a NaN amax would not survive a running maximum."""
    magnitude = tl.abs(x)
    return (tl.max(magnitude, axis=AXIS),
            tl.max(tl.where(magnitude != magnitude, 1, 0), axis=AXIS))


@triton.jit
def scales_of(amax, nans):
    """:func:`scale_and_inverse` of groups with largest magnitude ``amax``, NaN where
    ``nans`` (from :func:`amax_and_nans`) says the group holds a NaN."""
    return scale_and_inverse(tl.where(nans > 0, float("nan"), amax))


@triton.jit
def rowwise_quantize_kernel(
    x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Grid ``(cdiv(M, BLOCK_M),)``: rows ``[pid * BLOCK_M, ...)`` of ``x [M, K]`` (strides
    given) to ``q [M, K]`` e4m3 (contiguous) and ``scale [M]`` fp32. ``ONE_PASS`` (``K <=
    BLOCK_K``): the rows stay in registers between their amax and their quantisation, so x
    is read once. Otherwise two passes over K, the second reading x again (from L2 when the
    concurrent programs' rows fit there, else from memory)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    cols64 = cols.to(tl.int64)  # a strided x's column offsets can pass 2^31 elements
    if ONE_PASS:
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols64[None, :] * stride_xk,
                    mask=mask, other=0.0).to(tl.float32)
        amax, nans = amax_and_nans(x, 1)
        scale, inverse = scales_of(amax, nans)
        tl.store(scale_ptr + rows64, scale, mask=row_ok)
        q = quantize_to_e4m3(x, inverse[:, None])
        tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty),
                 mask=mask)
        return
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    nan_seen = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + (k0 + cols64)[None, :] * stride_xk,
                    mask=mask, other=0.0).to(tl.float32)
        chunk_amax, chunk_nans = amax_and_nans(x, 1)
        amax, nan_seen = tl.maximum(amax, chunk_amax), tl.maximum(nan_seen, chunk_nans)
    scale, inverse = scales_of(amax, nan_seen)
    tl.store(scale_ptr + rows64, scale, mask=row_ok)
    for k0 in range(0, K, BLOCK_K):
        mask = row_ok[:, None] & ((k0 + cols) < K)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + (k0 + cols64)[None, :] * stride_xk,
                    mask=mask, other=0.0).to(tl.float32)
        q = quantize_to_e4m3(x, inverse[:, None])
        tl.store(q_ptr + rows64[:, None] * K + (k0 + cols)[None, :],
                 q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def blockwise_quantize_kernel(
    x_ptr, q_ptr, scale_ptr, R, K, stride_xb, stride_xr, stride_xk, r_blocks, k_blocks,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PER_ROW: tl.constexpr,
):
    """Grid ``(B * cdiv(R, BLOCK_R), cdiv(K, BLOCK_K))``: the ``[BLOCK_R, BLOCK_K]`` tile
    ``(program_id(0) % cdiv(R, BLOCK_R), program_id(1))`` of ``x [B, R, K]`` (strides given),
    quantised with one scale per row of the tile (``PER_ROW``: ``1 x BLOCK_K`` blocks) or one
    for the whole tile (``BLOCK_R x BLOCK_K`` blocks), to ``q [B, R, K]`` e4m3 (contiguous)
    and ``scale [B, r_blocks, k_blocks]`` fp32 (``r_blocks`` = R with ``PER_ROW``). Ragged
    edge tiles are smaller blocks (their padding is zeros, which never raise an amax)."""
    tiles_r = tl.cdiv(R, BLOCK_R)
    batch = tl.program_id(0) // tiles_r
    tile_r = tl.program_id(0) % tiles_r
    tile_k = tl.program_id(1)
    rows = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < K)[None, :]
    base = batch.to(tl.int64) * stride_xb
    x = tl.load(x_ptr + base + rows.to(tl.int64)[:, None] * stride_xr
                + cols.to(tl.int64)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax, has_nan = amax_and_nans(x, 1)  # [BLOCK_R]
    if not PER_ROW:
        has_nan = tl.max(has_nan, axis=0)
        amax = tl.max(amax, axis=0)
    scale, inverse = scales_of(amax, has_nan)
    if PER_ROW:
        q = quantize_to_e4m3(x, inverse[:, None])
        slot = (batch.to(tl.int64) * r_blocks + rows) * k_blocks + tile_k
        tl.store(scale_ptr + slot, scale, mask=row_ok)
    else:
        q = quantize_to_e4m3(x, inverse)
        tl.store(scale_ptr + (batch.to(tl.int64) * r_blocks + tile_r) * k_blocks + tile_k, scale)
    dst = batch.to(tl.int64) * R * K + rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(q_ptr + dst, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_blockwise(x: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., R, K]`` -> ``(q [..., R, K]`` e4m3 contiguous, ``scale [..., ceil(R /
    block[0]), ceil(K / block[1])]`` fp32): one Triton pass, the rule of
    :func:`compileops.grouped_linear.fp8.quantize_blockwise` bit for bit. ``block`` is ``(1,
    128)`` (activations: :data:`~compileops.grouped_linear.fp8.ACTIVATION_BLOCK`) or ``(128,
    128)`` (weights: :data:`~compileops.grouped_linear.fp8.WEIGHT_BLOCK`); each a power of
    two. ``x`` is not modified."""
    _check_float(x, "x", 2)
    block_r, block_k = (int(b) for b in block)
    if block_r < 1 or block_k < 1 or block_r & (block_r - 1) or block_k & (block_k - 1):
        raise ValueError(f"block must be two powers of two, got {block}")
    *lead, r, k = x.shape
    b = math.prod(lead)
    batched = x.reshape(b, r, k)
    r_blocks, k_blocks = triton.cdiv(r, block_r), triton.cdiv(k, block_k)
    q = torch.empty((b, r, k), dtype=E4M3, device=x.device)
    scale = torch.empty((b, r_blocks, k_blocks), dtype=torch.float32, device=x.device)
    if b and r and k:
        per_row = block_r == 1
        tile_r = (16 if x.device.type == "cpu" else 32) if per_row else block_r
        blockwise_quantize_kernel[(b * triton.cdiv(r, tile_r), k_blocks)](
            batched, q, scale, r, k, batched.stride(0), batched.stride(1), batched.stride(2),
            r_blocks, k_blocks, BLOCK_R=tile_r, BLOCK_K=block_k, PER_ROW=per_row,
            num_warps=1 if x.device.type == "cpu" else 4 if per_row else 8)
    elif scale.numel():
        scale.fill_(1.0)
    return q.reshape(x.shape), scale.reshape(*lead, r_blocks, k_blocks)


#: Elements of x a rowwise-quantiser program holds at once on a GPU, on
#: :data:`ROWWISE_WARPS` warps. Rows up to this long are read once; longer rows twice (the
#: second read mostly from L2). Timed on an H200 at the MoE layers' activations (M x K from
#: 16384 x 4096 to 65536 x 14336): 4096 elements ran at 1.6-2.3 TB/s, 8192 at 1.6-2.1 and
#: 16384 (one program a row, 166 registers a thread) at 1.1-1.5.
ROWWISE_TILE_ELEMENTS = 4096
ROWWISE_WARPS = 8


def _rowwise_blocks(k: int, cpu: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_K, num_warps)`` of the rowwise quantiser for rows of ``k``. The
    interpreter takes small tiles (its cost grows with the tile), so rows over 64 take its
    two-pass loop, which the CPU tests thereby cover as well as the one-pass form."""
    if cpu:
        return 16, min(triton.next_power_of_2(k), 64), 1
    block_k = min(triton.next_power_of_2(k), ROWWISE_TILE_ELEMENTS)
    return max(1, ROWWISE_TILE_ELEMENTS // block_k), block_k, ROWWISE_WARPS


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (16- or 32-bit float, any strides in its last two dims) -> ``(q [...,
    K]`` e4m3 contiguous, ``scale [...]`` fp32): one Triton pass per row block, the rule of
    :func:`compileops.grouped_linear.fp8.quantize_rowwise` bit for bit. ``x`` is not
    modified."""
    _check_float(x, "x", 1)
    k = x.shape[-1]
    flat = as_rows(x)  # a view where x's rows allow one (a 2-D x always)
    m = flat.shape[0]
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m and not k:
        scale.fill_(1.0)
    elif m:
        block_m, block_k, warps = _rowwise_blocks(k, x.device.type == "cpu")
        rowwise_quantize_kernel[(triton.cdiv(m, block_m),)](
            flat, q, scale, m, k, flat.stride(0), flat.stride(1),
            BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=k <= block_k, num_warps=warps)
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


def quantize_weight_rowwise(weight: torch.Tensor, *, transpose: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight ``[G, N, K]`` quantised rowwise, one scale per output channel over K, as
    ``(q, scale [G, N])``:

    * ``transpose=False`` (the forward, ``x @ W_g^T``): ``q [G, N, K]``;
    * ``transpose=True`` (dX, ``(dY_g * scale_g) @ q_g``): the same values written as ``q_g^T``,
      ``q [G, K, N]`` contiguous, so that dX's reduction over N runs along memory (e4m3
      matrix products on Hopper read both operands along their reduction dim). dX carries
      the scales on its gradient rows (:func:`compileops.grouped_linear.fp8.scale_gradient_rows`).
    """
    if weight.dim() != 3:
        raise ValueError(f"weight must be [G, N, K], got shape {tuple(weight.shape)}")
    q, scale = quantize_rowwise(weight)
    if transpose:
        q = q.transpose(1, 2).contiguous()
    return q, scale


def _check_fp8_weight(weight_q: torch.Tensor) -> tuple[int, int, int]:
    """``(G, N, K)`` of an e4m3 ``weight_q [G, N, K]``; a TypeError otherwise."""
    if weight_q.dtype != E4M3 or weight_q.dim() != 3:
        raise TypeError(f"weight_q must be e4m3 [G, N, K], got {weight_q.dtype} "
                        f"{tuple(weight_q.shape)}")
    return tuple(weight_q.shape)


def grouped_linear_fp8_rowwise(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
    offsets: torch.Tensor, *, swiglu: bool = False, out_dtype: torch.dtype,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    preact: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The rowwise fp8 grouped product: rows of group g of ``x [M, K]`` (16- or 32-bit)
    times ``W_g^T``, where ``weight_q [G, N, K]`` e4m3 and ``weight_scale [G, N]`` fp32 are
    the weight's quantisation (:func:`quantize_weight_rowwise`, made once and reused while
    the weight does not change). ``x`` is quantised per row here, in one pass, unless its
    ``(q, scale)`` come as ``x_fp8``. Each output tile is the fp32 sum of e4m3 products times
    its rows' and columns' scales, rounded once to ``out_dtype``; rows past ``offsets[-1]``
    are zeros. ``swiglu``: ``silu(gate) * up`` of the two column halves (``[M, N / 2]``),
    with ``preact [M, N]`` receiving the scaled pre-activations if given. ``row_scale [M]``
    in ``out_dtype``: row i of the rounded output times ``row_scale[i]``, rounded again (as
    :func:`.mjagged.scale_rows`). ``fast_accum``: the MMA accumulates over the whole K loop
    instead of adding each 128-wide K step into fp32 (:func:`.mjagged.tile_dot`).

    Equal, up to the order of its fp32 sums (and, with ``fast_accum``, the MMA's
    reduced-precision sums), to :func:`compileops.grouped_linear.fp8.grouped_linear_reference`
    with ``"rowwise"``.
    """
    from compileops.grouped_linear.kernels.mjagged import mjagged_gemm

    groups, n, k = _check_fp8_weight(weight_q)
    if tuple(weight_scale.shape) != (groups, n) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be fp32 [{groups}, {n}], got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if x_fp8 is None:
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [M, {k}], got shape {tuple(x.shape)}")
        x_fp8 = quantize_rowwise(x)
    xq, xs = x_fp8
    if swiglu and n % 2:
        raise ValueError(f"swiglu needs an even N (gate and up halves), got {n}")
    n_out = n // 2 if swiglu else n
    return mjagged_gemm(xq, weight_q, (weight_q.stride(0), weight_q.stride(2),
                                       weight_q.stride(1)),
                        offsets, n_out, swiglu=swiglu, out_dtype=out_dtype, preact=preact,
                        row_scale=row_scale, fp8_scales=(xs, weight_scale),
                        fp8_fast_accum=fast_accum)


def grouped_linear_fp8_blockwise(
    x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
    offsets: torch.Tensor, *, out_dtype: torch.dtype, swiglu: bool = False,
    transposed: bool = False, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    preact: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The blockwise fp8 grouped product (DeepSeek-V3's scaling): ``x [M, K']`` quantised in
    ``1 x 128`` blocks along its last dim (here, in one pass, unless ``x_fp8`` gives them),
    the weight ``weight_q [G, N, K]`` e4m3 with ``weight_scale [G, ceil(N / 128), ceil(K /
    128)]`` fp32 (:func:`quantize_blockwise` with ``(128, 128)``, made once while the weight
    does not change). Each K step's product is scaled by its blocks' scales before the fp32
    accumulator; rounded once to ``out_dtype``; rows past ``offsets[-1]`` are zeros.

    * ``transposed=False``: ``x W_g^T`` (``K' = K``, out ``[M, N]``; ``swiglu``: ``silu(gate) *
      up`` of the halves, ``[M, N / 2]``, with ``preact [M, N]`` filled if given);
    * ``transposed=True``: ``x W_g`` (dX: ``K' = N``, out ``[M, K]``), the same blocks read
      transposed: a square block's scale is its transpose's.

    ``row_scale [M]`` in ``out_dtype`` (forward only): row i of the rounded output times
    ``row_scale[i]``, rounded again (as :func:`.mjagged.scale_rows`).

    Equal, up to the order of its fp32 sums, to
    :func:`compileops.grouped_linear.fp8.grouped_linear_reference` with ``"blockwise"`` (on
    ``W_g^T`` for ``transposed``).
    """
    from compileops.grouped_linear.kernels.mjagged import mjagged_gemm

    groups, n, k = _check_fp8_weight(weight_q)
    blocks = (groups, triton.cdiv(n, 128), triton.cdiv(k, 128))
    if tuple(weight_scale.shape) != blocks or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be fp32 {list(blocks)} (128 x 128 blocks), got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if swiglu and (transposed or n % 2):
        raise ValueError("swiglu needs the forward product and an even N")
    if row_scale is not None and transposed:
        raise ValueError("row_scale scales the forward product's rows, not dX's")
    reduction = n if transposed else k
    if x_fp8 is None:
        if x.dim() != 2 or x.shape[1] != reduction:
            raise ValueError(f"x must be [M, {reduction}], got shape {tuple(x.shape)}")
        x_fp8 = quantize_blockwise(x, (1, 128))
    xq, xs = x_fp8
    sg, sn, sk = weight_scale.stride()
    if transposed:
        return mjagged_gemm(xq, weight_q, weight_q.stride(), offsets, k, out_dtype=out_dtype,
                            b_kn=True, fp8_block_scales=(xs, weight_scale, (sg, sk, sn)))
    n_out = n // 2 if swiglu else n
    return mjagged_gemm(xq, weight_q, (weight_q.stride(0), weight_q.stride(2),
                                       weight_q.stride(1)),
                        offsets, n_out, swiglu=swiglu, out_dtype=out_dtype, preact=preact,
                        row_scale=row_scale, fp8_block_scales=(xs, weight_scale, (sg, sn, sk)))
