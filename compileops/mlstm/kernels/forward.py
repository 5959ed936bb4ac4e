"""The parallel mLSTM forward with the multi-head layernorm fused: tile body, kernel, launcher.

One program owns ``BLOCK_M`` query rows of one (batch, head) and all DV columns of them. The
stabiliser comes first, from the gates alone (``m_i = logf_i + max_{j<=i} (igate_j -
logf_j)``, a running max the launcher computes beforehand, :mod:`.stabiliser`), so the key
loop accumulates the signed row sum ``b = sum_j C_ij`` and the unnormalised ``sum_j C_ij
v_j`` without FlashAttention's rescaling, in one pass over every key tile with the diagonal
ones masked (or, for gates that jump inside one tile, left of the diagonal and then the
diagonal tiles with the exact exponential). The ``S x S`` matrices never leave the tile. At
the end ``h = acc / (max(|b|, exp(-m)) + eps)``, and the per-head layernorm over DV runs on
the fp32 rows in registers, which is why a program holds whole rows.

Exponentials are ``exp2``: the gates are multiplied by ``log2(e)`` as they load, so ``logD``
and the stabiliser are in log2 units (the backward recomputes ``logD`` with the same
expression, bitwise); the public function converts ``m``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.mlstm.kernels.common import (
    LOG2E,
    accumulation_dtype,
    head_major_tile,
    head_scale,
    input_precision,
    load_tile,
    mma,
    upcast_dots,
)
from compileops.mlstm.kernels.config import ForwardConfig, choose_forward_config, head_tile
from compileops.mlstm.kernels.stabiliser import column_terms

#: The widest spread of a query tile's column terms (``high - low``, log2 units) that runs
#: the one-loop form; fp16's tighter bound keeps the column-scaled scores it feeds the second
#: MMA above its subnormals. 16-bit inputs only: factorising the diagonal tiles rounds
#: each exponent at the magnitude of the forget-gate sum, not of its differences, which cost
#: fp32's gradients their 1e-5 bound (dq 1.14e-5 on an H100 at S = 256), and its reference
#: (the tile's last row's running max) lets a later gate of the tile move the earlier rows'
#: last bits, which fp32 and fp64 promise not to do (16-bit rounds far more than that).
ONE_LOOP_SPREAD = tl.constexpr(64.0)
ONE_LOOP_SPREAD_FP16 = tl.constexpr(8.0)
#: No row: above every row index (the careful pass's first non-finite v row, none yet).
NO_ROW = tl.constexpr(2**31 - 1)


@triton.jit
def mlstm_forward_tile(
    q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, weight_ptr, bias_ptr,
    h_ptr, m_ptr, b_ptr, cstate_ptr, nstate_ptr, mstate_ptr,
    bh, start_m, seq_len, chunk_len, num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    scale, eps, norm_eps,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RESIDUAL_WEIGHT: tl.constexpr, SAVE_H: tl.constexpr, HAS_STATE: tl.constexpr,
    ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """``[BLOCK_M, BLOCK_DV]`` output rows ``start_m + arange(BLOCK_M)`` of head ``bh``: the
    normed h when ``HAS_NORM``, else the raw h, in ``ACC`` (the caller casts and stores).

    * ``q_ptr [B, NH, S, DQK]``, ``k_ptr [B, NH, S, DQK]``, ``v_ptr [B, NH, S, DV]``: any
      strides, given per dimension; ``bh = b * num_heads + head``.
    * ``igate_ptr``, ``logf_ptr``, ``term_ptr``, ``colmax_ptr``: ``[B * NH, S]`` contiguous,
      ``ACC``: the input-gate pre-activation, the cumulative log forget gate ``sum_{tau<=t}
      log sigmoid(f)``, the column terms ``(igate - logf) * log2(e)`` and their running max
      (:func:`.stabiliser.column_terms`, restarted with ``logf``).
    * ``weight_ptr``, ``bias_ptr``: ``[NH * DV]`` norm affine (read when ``HAS_WEIGHT`` /
      ``HAS_BIAS``; ``RESIDUAL_WEIGHT``: the scale is ``1 + weight``).
    * Written here: ``m_ptr`` and ``b_ptr`` ``[B * NH, S]`` ``ACC`` (the stabiliser in log2
      units, the max of the ``logD`` values up to rounding, and the signed
      row sum ``sum_j C_ij``); ``h_ptr [B * NH, S, DV]`` contiguous, the
      raw h in v's dtype, when ``SAVE_H`` (the norm's backward reads it).
    * ``scale = 1 / sqrt(DQK)``; ``eps``: the cell's; ``norm_eps``: the layernorm's.
    * Chunks (:mod:`.chunkwise`): keys are read from the start of the query rows' chunk of
      ``chunk_len`` (a multiple of ``BLOCK_M``; the parallel form passes ``chunk_len >=
      seq_len``, one chunk), and ``logf`` holds the forget-gate sums restarted at each chunk.
      With ``HAS_STATE`` the state entering the chunk adds ``q C`` (the earlier chunks):
      ``cstate_ptr [B * NH, NC, DQK, DV]`` (q's dtype), ``nstate_ptr [B * NH, NC + 1, DQK]``
      and ``mstate_ptr [B * NH, NC + 1]`` (``ACC``, m in natural-log units), contiguous.
    """
    head = bh % num_heads
    gate_off = bh.to(tl.int64) * seq_len
    scale = head_scale(scale, DQK, ACC)

    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    dv = tl.arange(0, BLOCK_DV)
    acc, row_sum, row_max = _accumulate(
        q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, cstate_ptr,
        nstate_ptr, mstate_ptr, bh, start_m, seq_len, chunk_len, num_heads,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd, scale, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_M, BLOCK_N, HAS_STATE, ACC, INPUT_PRECISION, UPCAST, False)
    # Causality under NaN and Inf. The masked columns of a diagonal tile (j > i) are selected
    # to 0 (tl.where, never a product with 0), so a non-finite k or gate there stays out of
    # the scores, the row sum and the first operand of the second MMA. That MMA still puts
    # every v row of the tile through every output row: 0 * NaN or 0 * Inf from a v row j > i
    # would reach row i, and only an MMA on a v tile without it can keep it out. So: one
    # check of the finished accumulator (a reduction over registers, once per program;
    # nothing in the key loops, whose pipelines and MMAs are as they were). Only where it
    # holds a non-finite value (a non-finite v, or any other, reached it) does the key loop
    # run again, from the start, in its careful form (:func:`_careful_pv`): the same tiles,
    # order and operations, but the masked tiles' v with its non-finite entries taken as 0,
    # and each column's first non-finite row kept ([BLOCK_DV] indices, no second
    # accumulator); then every cell (i, d) at or after column d's first non-finite v row is
    # NaN. The rows a non-finite value does not reach keep their bits (the zeros they now
    # multiply were products with 0 before); the cells it reaches are non-finite.
    # The careful pass recomputes everything from the kernel's arguments (q, the gates, the
    # state, the bases), from a program index the compiler cannot prove equal to the first
    # pass's (`zero` is 0, but opaque): merged with the first pass's values, they would stay
    # live through its loops (sm90: spills in the one-loop form's pipeline).
    not_finite = tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1))
    if not_finite != 0:
        zero = tl.minimum(not_finite, 0)
        acc, row_sum, row_max = _accumulate(
            q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, cstate_ptr,
            nstate_ptr, mstate_ptr, bh + zero, start_m + zero, seq_len, chunk_len, num_heads,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd, scale, DQK, DV, BLOCK_DQK, BLOCK_DV,
            BLOCK_M, BLOCK_N, HAS_STATE, ACC, INPUT_PRECISION, UPCAST, True)

    # h = acc / (n + eps): one reciprocal per row, and the norm takes acc with it (a
    # [BLOCK_M, DV] division and pass fewer in the epilogue, which nothing overlaps).
    normaliser = tl.maximum(tl.abs(row_sum), tl.exp2(-row_max))
    inv = 1.0 / (normaliser + eps)
    tl.store(m_ptr + gate_off + rows, row_max, mask=row_ok)
    tl.store(b_ptr + gate_off + rows, row_sum, mask=row_ok)
    if SAVE_H:
        h_rows = h_ptr + gate_off * DV + rows[:, None] * DV + dv[None, :]
        tl.store(h_rows, (acc * inv[:, None]).to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))
    if HAS_NORM:
        return _layernorm_rows(acc, inv, weight_ptr, bias_ptr, head, norm_eps, DV, BLOCK_DV,
                               HAS_WEIGHT, HAS_BIAS, RESIDUAL_WEIGHT)
    return acc * inv[:, None]


@triton.jit
def _accumulate(q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, cstate_ptr,
                nstate_ptr, mstate_ptr, bh, start_m, seq_len, chunk_len, num_heads,
                stride_qb, stride_qh, stride_qs, stride_qd,
                stride_kb, stride_kh, stride_ks, stride_kd,
                stride_vb, stride_vh, stride_vs, stride_vd, scale,
                DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_STATE: tl.constexpr, ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, CAREFUL: tl.constexpr):
    """:func:`mlstm_forward_tile`'s rows before its epilogue, ``(acc, row_sum, row_max)``: the
    unnormalised ``sum_j C_ij v_j``, the signed row sum ``b`` and the stabiliser (log2
    units) of rows ``start_m + arange(BLOCK_M)`` of head ``bh``. ``CAREFUL``: the rare second
    pass (:func:`_key_loops`)."""
    batch64 = (bh // num_heads).to(tl.int64)
    head64 = (bh % num_heads).to(tl.int64)
    q_base = q_ptr + batch64 * stride_qb + head64 * stride_qh
    k_base = k_ptr + batch64 * stride_kb + head64 * stride_kh
    v_base = v_ptr + batch64 * stride_vb + head64 * stride_vh
    gate_off = bh.to(tl.int64) * seq_len
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    dqk = tl.arange(0, BLOCK_DQK)
    q = load_tile(q_base, rows, stride_qs, dqk, stride_qd, seq_len, DQK, BLOCK_DQK, True)
    logf_i = tl.load(logf_ptr + gate_off + rows, mask=row_ok, other=0.0) * LOG2E

    window = (start_m // chunk_len) * chunk_len
    # The stabiliser comes first, from the gates alone: m_i = max_{j<=i} logD_ij = logf_i +
    # colmax_i, the running max of the column terms (igate_j - logf_j) over the row's window
    # (:mod:`.stabiliser`). Knowing m_i before the key loop means the accumulators never need
    # rescaling (FlashAttention's online max rescales a [BLOCK_M, DV] tile per key tile; here
    # DV = 256 made that a large share).
    colmax_i = tl.load(colmax_ptr + gate_off + rows, mask=row_ok, other=0.0)
    row_max = logf_i + colmax_i
    # colmax never decreases along a window, and a tile's rows share one: `low` is its first
    # row's, `high` its last live row's, >= every column term up to the tile's end.
    low = tl.load(colmax_ptr + gate_off + start_m)
    high = tl.load(colmax_ptr + gate_off + tl.minimum(start_m + BLOCK_M, seq_len) - 1)
    before = tl.load(colmax_ptr + gate_off + tl.maximum(start_m - 1, window),
                     mask=start_m > window, other=float("-inf"))
    # The decay factorises: logD_ij = logf_i + (igate_j - logf_j). A reference `ref` >= every
    # column term a loop sees splits exp2(logD_ij - m_i) = exp2(logf_i + ref - m_i) *
    # exp2(col_j - ref): the column factor (with 1/sqrt(DQK)) scales the scores in the loop,
    # the row factor is applied once after it. No per-tile max, no per-tile row exponentials,
    # no rescaling.
    if HAS_STATE:
        acc, row_sum, state_ref = _state_rows(
            q, cstate_ptr, nstate_ptr, mstate_ptr, bh, start_m // chunk_len,
            seq_len, chunk_len, DQK, DV, BLOCK_DQK, BLOCK_DV, ACC, INPUT_PRECISION, UPCAST)
        row_max = tl.maximum(row_max, logf_i + state_ref)
        low = tl.maximum(low, state_ref)
        high = tl.maximum(high, state_ref)
        before = tl.maximum(before, state_ref)
    # One loop over every key tile, the diagonal ones masked, with ref = high: then each
    # column factor is <= 1 and each row factor <= 2**(high - low), and a row's largest term
    # is >= 2**-(high - low) before its row factor. That is exact while high - low stays far
    # from the exponent range of the tiles fed to the second MMA (fp16's is narrow).
    # Otherwise (gates that jump inside one tile: strong forgetting, a spike of the input
    # gate) two loops: left of the diagonal with ref = before (>= those columns: factors
    # <= 1), then the diagonal tiles with the exact exponential.
    if v_base.dtype.element_ty == tl.float32 or v_base.dtype.element_ty == tl.float64:
        # fp32 and fp64 inputs keep the exact diagonal tiles (ONE_LOOP_SPREAD); for them the
        # one-loop form would also break causality's bits: `high` is the tile's last row's,
        # so a later gate of the tile would move the reference of the rows before it.
        one_loop = False
    elif v_base.dtype.element_ty == tl.float16:
        one_loop = high - low <= ONE_LOOP_SPREAD_FP16
    else:
        one_loop = high - low <= ONE_LOOP_SPREAD
    ref = tl.where(one_loop, high, before)
    has_ref = ref > float("-inf")
    # ref = -inf only where every column term it bounds is -inf (or there is none): then
    # every column factor must be 0, not exp2(-inf - -inf).
    col_ref = tl.where(has_ref, ref, 0.0)
    if HAS_STATE:
        state_scale = tl.where(has_ref, tl.exp2(state_ref - col_ref), 0.0) * scale
        acc = acc * state_scale
        row_sum = row_sum * state_scale
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=ACC)
        row_sum = tl.zeros((BLOCK_M,), dtype=ACC)
    row_factor = tl.where(has_ref, tl.exp2(logf_i + col_ref - row_max), 0.0)
    acc, row_sum = _key_loops(
        acc, row_sum, row_factor, one_loop, q, k_base, v_base, igate_ptr, logf_ptr, term_ptr,
        gate_off, rows, logf_i, row_max, col_ref, window, start_m, seq_len, scale,
        stride_ks, stride_kd, stride_vs, stride_vd, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M,
        BLOCK_N, ACC, INPUT_PRECISION, UPCAST, CAREFUL)
    return acc, row_sum, row_max


@triton.jit
def _key_loops(acc, row_sum, row_factor, one_loop, q, k_base, v_base, igate_ptr, logf_ptr,
               term_ptr, gate_off, rows, logf_i, row_max, col_ref, window, start_m, seq_len,
               scale, stride_ks, stride_kd, stride_vs, stride_vd, DQK: tl.constexpr,
               DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, CAREFUL: tl.constexpr):
    """:func:`mlstm_forward_tile`'s key loop, ``(acc, row_sum)`` from their starting values:
    the one-loop form when ``one_loop`` (16-bit inputs only), else the two-loop form.
    ``CAREFUL`` (the rare second pass): the masked tiles' second MMA is
    :func:`_careful_pv`'s, the loops unpipelined; the arithmetic is the fast pass's."""
    if v_base.dtype.element_ty == tl.float32 or v_base.dtype.element_ty == tl.float64:
        # fp32 and fp64 inputs keep the exact diagonal tiles (ONE_LOOP_SPREAD)
        acc, row_sum = _left_then_diagonal(
            acc, row_sum, row_factor, q, k_base, v_base, igate_ptr, logf_ptr, term_ptr,
            gate_off, rows, logf_i, row_max, col_ref, window, start_m, seq_len, scale,
            stride_ks, stride_kd, stride_vs, stride_vd, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, ACC, INPUT_PRECISION, UPCAST, 1 if CAREFUL else None, CAREFUL)
    elif one_loop:
        # One software pipeline through the diagonal tiles: against two loops (the diagonal
        # tiles' own prologue, their exact exponentials) 4-7% faster on an H100.
        dqk = tl.arange(0, BLOCK_DQK)
        dv = tl.arange(0, BLOCK_DV)
        first_bad = tl.full((BLOCK_DV,), NO_ROW, dtype=tl.int32)
        for start_n in tl.range(window, tl.minimum(start_m + BLOCK_M, seq_len), BLOCK_N,
                                num_stages=1 if CAREFUL else None):
            cols = start_n + tl.arange(0, BLOCK_N)
            col_ok = cols < seq_len
            k = load_tile(k_base, cols, stride_ks, dqk, stride_kd, seq_len, DQK, BLOCK_DQK,
                          True)
            v = load_tile(v_base, cols, stride_vs, dv, stride_vd, seq_len, DV, BLOCK_DV, True)
            col_term = tl.load(term_ptr + gate_off + cols, mask=col_ok, other=float("-inf"))
            col_scale = tl.exp2(col_term - col_ref) * scale
            scores = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC),
                         INPUT_PRECISION, UPCAST)
            c = tl.where(cols[None, :] <= rows[:, None], scores * col_scale[None, :], 0.0)
            row_sum += tl.sum(c, axis=1)
            if CAREFUL:  # every tile (the left ones too: simpler, and rare)
                acc, first_bad = _careful_pv(c, cols, v, acc, first_bad, INPUT_PRECISION,
                                             UPCAST)
            else:
                acc = mma(c.to(v.dtype), v, acc, INPUT_PRECISION, UPCAST)
        acc = acc * row_factor[:, None]
        row_sum = row_sum * row_factor
        if CAREFUL:
            acc = tl.where(rows[:, None] >= first_bad[None, :], float("nan"), acc)
    else:
        # Rare here (gates that jump inside a tile), so unpipelined: pipelined, these loops
        # made ptxas serialise every wgmma of the kernel (C7515) once S is a compile-time
        # constant (the static template), and spill more.
        acc, row_sum = _left_then_diagonal(
            acc, row_sum, row_factor, q, k_base, v_base, igate_ptr, logf_ptr, term_ptr,
            gate_off, rows, logf_i, row_max, col_ref, window, start_m, seq_len, scale,
            stride_ks, stride_kd, stride_vs, stride_vd, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, ACC, INPUT_PRECISION, UPCAST, 1, CAREFUL)
    return acc, row_sum


@triton.jit
def _careful_pv(c, cols, v, acc, first_bad, INPUT_PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """The careful form of a key tile's second MMA, ``(acc + c @ v', first_bad')``: ``c
    [BLOCK_M, BLOCK_N]`` with its masked entries (j > i) 0, ``v' = v`` with its non-finite
    entries 0 (where v is finite, bitwise the plain product: those entries' products were 0
    too), and ``first_bad [BLOCK_DV]`` lowered to the first row (of ``cols``) holding a
    non-finite v in each column: the caller sets every cell at or after it NaN."""
    finite = tl.abs(v) < float("inf")
    acc = mma(c.to(v.dtype), tl.where(finite, v, 0.0).to(v.dtype), acc, INPUT_PRECISION,
              UPCAST)
    bad_row = tl.min(tl.where(finite, NO_ROW, cols[:, None]), axis=0)
    return acc, tl.minimum(first_bad, bad_row)


@triton.jit
def _left_then_diagonal(acc, row_sum, row_factor, q, k_base, v_base, igate_ptr, logf_ptr,
                        term_ptr, gate_off, rows, logf_i, row_max, col_ref, window, start_m,
                        seq_len, scale, stride_ks, stride_kd, stride_vs, stride_vd,
                        DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr,
                        BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr, STAGES: tl.constexpr, CAREFUL: tl.constexpr):
    """The two-loop form of :func:`mlstm_forward_tile`'s key loop, ``(acc, row_sum)``: left of
    the diagonal factorised around ``col_ref`` (>= those columns' terms), then ``row_factor``
    applied, then the diagonal tiles with the exact exponential, masked (j > i, j past the
    sequence). ``STAGES``: the loops' software-pipeline depth (None: the launch's).
    ``CAREFUL``: the diagonal tiles' second MMA is :func:`_careful_pv`'s, and the cells their
    non-finite v entries reach (causally) are NaN."""
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(window, start_m, BLOCK_N, num_stages=STAGES):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, cols, stride_ks, dqk, stride_kd, seq_len, DQK, BLOCK_DQK, False)
        v = load_tile(v_base, cols, stride_vs, dv, stride_vd, seq_len, DV, BLOCK_DV, False)
        col_term = tl.load(term_ptr + gate_off + cols)
        col_scale = tl.exp2(col_term - col_ref) * scale
        scores = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC),
                     INPUT_PRECISION, UPCAST)
        c = scores * col_scale[None, :]
        row_sum += tl.sum(c, axis=1)
        acc = mma(c.to(v.dtype), v, acc, INPUT_PRECISION, UPCAST)
    acc = acc * row_factor[:, None]
    row_sum = row_sum * row_factor
    first_bad = tl.full((BLOCK_DV,), NO_ROW, dtype=tl.int32)
    for start_n in tl.range(start_m, tl.minimum(start_m + BLOCK_M, seq_len), BLOCK_N,
                            num_stages=STAGES):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < seq_len
        k = load_tile(k_base, cols, stride_ks, dqk, stride_kd, seq_len, DQK, BLOCK_DQK, True)
        v = load_tile(v_base, cols, stride_vs, dv, stride_vd, seq_len, DV, BLOCK_DV, True)
        logf_j = tl.load(logf_ptr + gate_off + cols, mask=col_ok, other=0.0) * LOG2E
        igate_j = tl.load(igate_ptr + gate_off + cols, mask=col_ok, other=0.0) * LOG2E
        scores = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC),
                     INPUT_PRECISION, UPCAST) * scale
        live = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
        # logf_i - logf_j first: it cancels exactly where the two are close, which the column
        # terms (large when the forget gates close) would not.
        # The mask selects (a masked column's product with 0 would keep a NaN score or gate).
        log_d = logf_i[:, None] - logf_j[None, :] + igate_j[None, :]
        c = tl.where(live, scores * tl.exp2(log_d - row_max[:, None]), 0.0)
        row_sum += tl.sum(c, axis=1)
        if CAREFUL:
            acc, first_bad = _careful_pv(c, cols, v, acc, first_bad, INPUT_PRECISION, UPCAST)
        else:
            acc = mma(c.to(v.dtype), v, acc, INPUT_PRECISION, UPCAST)
    if CAREFUL:
        acc = tl.where(rows[:, None] >= first_bad[None, :], float("nan"), acc)
    return acc, row_sum


@triton.jit
def num_state_chunks(seq_len, chunk_len):
    """Chunks of a row: at least one, so that an empty row still has its state slots."""
    return tl.maximum(tl.cdiv(seq_len, chunk_len), 1)


@triton.jit
def _state_rows(q, cstate_ptr, nstate_ptr, mstate_ptr, bh, chunk, seq_len, chunk_len,
                DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr,
                BLOCK_DV: tl.constexpr, ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    """The contribution of the state entering ``chunk`` to query rows ``q [BLOCK_M,
    BLOCK_DQK]``: ``(q C, q . n, m)``, unscaled (no ``1 / sqrt(DQK)``) and relative to
    ``logf_i + m`` (``m`` the state's stabiliser, log2 units). An empty state (``m = -inf``,
    C and n zero) gives zeros and ``-inf``, the start of a row with nothing before its
    chunk."""
    slots = num_state_chunks(seq_len, chunk_len)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    c_base = cstate_ptr + (bh.to(tl.int64) * slots + chunk) * DQK * DV
    c = tl.load(c_base + dqk[:, None] * DV + dv[None, :],
                mask=(dqk[:, None] < DQK) & (dv[None, :] < DV), other=0.0)
    slot = bh.to(tl.int64) * (slots + 1) + chunk
    n = tl.load(nstate_ptr + slot * DQK + dqk, mask=dqk < DQK, other=0.0)
    m = tl.load(mstate_ptr + slot)
    acc = mma(q, c.to(q.dtype), tl.zeros((q.shape[0], BLOCK_DV), dtype=ACC),
              INPUT_PRECISION, UPCAST)
    row_sum = tl.sum(q.to(ACC) * n[None, :], axis=1)
    return acc, row_sum, m * LOG2E


@triton.jit
def _layernorm_rows(acc, inv, weight_ptr, bias_ptr, head, norm_eps, DV: tl.constexpr,
                    BLOCK_DV: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    RESIDUAL_WEIGHT: tl.constexpr):
    """Layernorm of each row of ``h = acc * inv[:, None]`` (``acc [BLOCK_M, BLOCK_DV]``, ``inv
    [BLOCK_M]``) over its DV live columns, without forming h: the statistics of acc, scaled
    (h's variance is ``inv**2`` acc's), in acc's dtype; then the affine of channels ``head *
    DV + d``."""
    dv = tl.arange(0, BLOCK_DV)
    live = dv < DV
    mean = tl.sum(acc, axis=1) / DV
    centred = tl.where(live[None, :], acc - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / DV
    y = centred * (inv / tl.sqrt(var * inv * inv + norm_eps))[:, None]
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + head * DV + dv, mask=live, other=0.0).to(acc.dtype)
        if RESIDUAL_WEIGHT:
            w = w + 1.0
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + head * DV + dv, mask=live, other=0.0).to(acc.dtype)[None, :]
    return y


@triton.jit
def mlstm_forward_kernel(
    q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, weight_ptr, bias_ptr,
    h_ptr, m_ptr, b_ptr, cstate_ptr, nstate_ptr, mstate_ptr, out_ptr, seq_len, chunk_len, num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    scale, eps, norm_eps,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RESIDUAL_WEIGHT: tl.constexpr, SAVE_H: tl.constexpr, HAS_STATE: tl.constexpr,
    ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(B * NH * cdiv(S, BLOCK_M),)``, head-major (:func:`.common.head_major_tile`);
    within a head the last query tiles (the longest rows) start first. ``out_ptr``: ``[B, S,
    NH * DV]`` (normed) or ``[B, NH, S, DV]`` (raw), addressed by the strides of its
    (batch, head, seq, channel) dimensions."""
    num_tiles = tl.cdiv(seq_len, BLOCK_M)
    bh, tile = head_major_tile(num_tiles)
    start_m = (num_tiles - 1 - tile) * BLOCK_M
    out = mlstm_forward_tile(
        q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, weight_ptr, bias_ptr,
        h_ptr, m_ptr, b_ptr, cstate_ptr, nstate_ptr, mstate_ptr, bh, start_m, seq_len,
        chunk_len, num_heads,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        scale, eps, norm_eps, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N,
        HAS_NORM, HAS_WEIGHT, HAS_BIAS, RESIDUAL_WEIGHT, SAVE_H, HAS_STATE, ACC,
        INPUT_PRECISION, UPCAST,
    )
    rows = start_m + tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    base = (out_ptr + (bh // num_heads).to(tl.int64) * stride_ob
            + (bh % num_heads).to(tl.int64) * stride_oh)
    ptrs = base + rows[:, None] * stride_os + dv[None, :] * stride_od
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < seq_len) & (dv[None, :] < DV))


def mlstm_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor,
    norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    normed: bool, norm_eps: float, eps: float, residual_weight: bool, save_h: bool,
    config: Optional[ForwardConfig] = None, chunk: int = 0,
    states: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Eager launch: ``(out, h_raw or None, m_log2 [B, NH, S], b [B, NH, S])``.

    ``chunk`` > 0: the chunkwise form's within-chunk part, plus the ``states`` entering each
    chunk (``(C, n, m)`` as :func:`.chunkwise.chunk_states` returns them); ``logf`` then holds
    the sums restarted at each chunk. ``chunk`` must be a multiple of the config's ``block_m``.

    ``igate``, ``logf``: ``[B, NH, S]`` contiguous in the accumulation dtype (the input gate
    and the cumulative log forget gate; the column terms and their running max are computed
    from them here, :func:`.stabiliser.column_terms`). ``out`` is ``[B, S, NH * DV]`` when
    ``normed`` else ``[B, NH, S, DV]``, in v's dtype; ``h_raw [B, NH, S, DV]`` (v's dtype)
    only when ``save_h``.
    """
    batch, heads, seq, dqk = q.shape
    dv = v.shape[-1]
    acc_dtype = logf.dtype
    cfg = config or choose_forward_config(q, dqk, dv, with_state=states is not None,
                                          max_block_m=chunk)
    if normed:
        out = v.new_empty((batch, seq, heads * dv))
        so_b, so_s, so_c = out.stride()
        out_strides = (so_b, dv * so_c, so_s, so_c)
    else:
        out = v.new_empty((batch, heads, seq, dv))
        so_b, so_h, so_s, so_d = out.stride()
        out_strides = (so_b, so_h, so_s, so_d)
    h_raw = v.new_empty((batch, heads, seq, dv)) if save_h else None
    m = torch.empty((batch, heads, seq), dtype=acc_dtype, device=q.device)
    b = torch.empty_like(m)
    if batch * heads == 0 or seq == 0:
        return out, h_raw, m, b
    if chunk and chunk % cfg.block_m:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_m ({cfg.block_m})")
    cstates, nstates, mstates = states if states is not None else (m, m, m)
    terms, colmax = column_terms(igate, logf, chunk)
    grid = (batch * heads * triton.cdiv(seq, cfg.block_m),)
    mlstm_forward_kernel[grid](
        q, k, v, igate, logf, terms, colmax,
        norm_weight if norm_weight is not None else m,
        norm_bias if norm_bias is not None else m,
        h_raw if save_h else m, m, b, cstates, nstates, mstates, out, seq,
        chunk if chunk else seq, heads,
        *q.stride(), *k.stride(), *v.stride(), *out_strides,
        1.0 / math.sqrt(dqk), eps, norm_eps,
        DQK=dqk, DV=dv, BLOCK_DQK=head_tile(dqk),
        BLOCK_DV=head_tile(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_NORM=normed, HAS_WEIGHT=norm_weight is not None, HAS_BIAS=norm_bias is not None,
        RESIDUAL_WEIGHT=residual_weight, SAVE_H=save_h, HAS_STATE=states is not None,
        ACC=accumulation_dtype(q.dtype), INPUT_PRECISION=input_precision(q.dtype),
        UPCAST=upcast_dots(q), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, h_raw, m, b
