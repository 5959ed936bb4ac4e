"""The mLSTM backward: norm preprocess, dQ and dK/dV tile bodies (the parallel form's
programs here, the chunkwise form's per document in :mod:`.chunk_tiles`), launcher.

With ``r_i = 1 / (n_i + eps)`` and the upstream gradient ``dh`` of the raw h, the cell's
gradient is, per (batch, head), for ``j <= i`` (the stabiliser ``m`` held constant):

* ``dC_ij = r_i (dh_i . v_j) + beta_i``, where ``beta_i = -r_i (dh_i . h_i) sign(b_i)`` when
  the normaliser took ``|b_i|`` (``b_i = sum_j C_ij``), else 0: the normaliser's gradient,
  one scalar per row;
* ``dS = dC * exp(logD - m)`` gives ``dq = dS k / sqrt(DQK)`` and ``dk = dS^T q / sqrt(DQK)``;
  ``dv = (C * r)^T dh``;
* ``dlogD = dS * S``: its row sums and column sums give the gate gradients (the op finishes
  them: ``digate = colsum``, ``dF = rowsum - colsum``, ``dfgate = sigmoid(-f) revcumsum(dF)``).

The forget gates' reverse sum cancels: ``revcumsum(dF)_t`` is the sum of ``dlogD_ij`` over the
pairs ``j < t <= i`` only, while each row and column sum carries its own diagonal, the
largest entry when the gates forget. Row sums taken as ``q_i . dq_i`` (no ``q k^T`` in the dQ
programs) are exact up to ``eps |q_i| |dq_i|``, and that error, summed over S rows, cost the
forget gates' gradient 1e-5 relative at S = 1024 (DQK 128). So the pairs are split by blocks
of ``BLOCK_N`` keys (the dK/dV programs' tile): the pairs of one block ("near") are summed
directly by the dK/dV program that owns that block, from one ``dlogD`` tile, into its column
sums and into the within-block reverse sum ``near_cross_t = sum_{j < t <= i, i, j in t's
block} dlogD_ij``; the other ("far") pairs go through ``q . dq`` and ``k . dk``, read before
the near tiles join the accumulators. :func:`dlogd_sums` puts the parts together.

No atomics: dQ programs walk the key tiles of their query rows, dK/dV programs the query
tiles of their key rows, each in a fixed order, so the backward is bitwise reproducible.
The multi-head layernorm's backward (and its weight/bias partial sums) runs first in a row
preprocess that also forms the per-row terms ``r``, ``beta`` and the stabiliser's gradient.
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
    input_precision,
    load_tile,
    mma,
    upcast_dots,
)
from compileops.mlstm.kernels.stabiliser import (
    column_factor,
    column_terms,
    decay_exponent,
    row_factor,
    with_state_ref,
)
from compileops.mlstm.kernels.config import (
    BackwardConfig,
    choose_backward_config,
    head_tile,
    norm_rows_per_program,
)


@triton.jit
def norm_backward_rows(
    grad_ptr, h_ptr, weight_ptr, dh_ptr, m2_ptr, rowsum_ptr, r_ptr, beta_ptr, dm_ptr,
    bh, start_s, seq_len, num_heads,
    stride_gb, stride_gh, stride_gs, stride_gd,
    norm_eps, eps,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, RESIDUAL_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Rows ``start_s + arange(BLOCK_ROWS)`` of head ``bh``; returns their sums of ``dy *
    yhat`` and ``dy`` per channel (``[BLOCK_DV]`` ``ACC``; zeros without ``HAS_NORM``), the
    norm's weight and bias gradients over these rows.

    * ``grad_ptr``: the output's gradient, (batch, head, seq, channel) strides given.
    * ``h_ptr [B * NH, S, DV]``: contiguous raw h (or, without a norm, the output itself).
    * Reads the forward's stabiliser ``m2_ptr`` (log2 units) and row sum ``rowsum_ptr``
      ``[B * NH, S]``, and writes the cell backward's per-row terms (module docstring):
      ``r_ptr`` (``1 / (n + eps)``), ``beta_ptr`` (the normaliser's share of ``dC``) and
      ``dm_ptr`` (the stabiliser's gradient), all ``[B * NH, S]`` ``ACC``. Computed here, one
      row at a time, so they are bitwise batch-invariant.
    * With ``HAS_NORM`` also ``dh_ptr [B * NH, S, DV]`` contiguous (h's dtype), the gradient
      of the raw h.
    """
    batch = bh // num_heads
    head = bh % num_heads
    rows = start_s + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < seq_len
    dv = tl.arange(0, BLOCK_DV)
    live = dv < DV
    mask = row_ok[:, None] & live[None, :]
    h_off = bh.to(tl.int64) * seq_len * DV
    h = tl.load(h_ptr + h_off + rows[:, None] * DV + dv[None, :], mask=mask, other=0.0).to(ACC)
    g_base = grad_ptr + batch.to(tl.int64) * stride_gb + head.to(tl.int64) * stride_gh
    dy = tl.load(g_base + rows[:, None] * stride_gs + dv[None, :] * stride_gd, mask=mask,
                 other=0.0).to(ACC)
    if HAS_NORM:
        mean = tl.sum(h, axis=1) / DV
        centred = tl.where(live[None, :], h - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / DV + norm_eps)
        y_hat = centred * rstd[:, None]
        g = dy
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + head * DV + dv, mask=live, other=0.0).to(ACC)
            if RESIDUAL_WEIGHT:
                w = w + 1.0
            g = dy * w[None, :]
        g_mean = tl.sum(g, axis=1) / DV
        gy_mean = tl.sum(g * y_hat, axis=1) / DV
        dh = tl.where(live[None, :],
                      (g - g_mean[:, None] - y_hat * gy_mean[:, None]) * rstd[:, None], 0.0)
        tl.store(dh_ptr + h_off + rows[:, None] * DV + dv[None, :],
                 dh.to(dh_ptr.dtype.element_ty), mask=mask)
        dweight = tl.sum(dy * y_hat, axis=0)
        dbias = tl.sum(dy, axis=0)
    else:
        dh = dy
        dweight = tl.zeros((BLOCK_DV,), dtype=ACC)
        dbias = tl.zeros((BLOCK_DV,), dtype=ACC)
    hdot = tl.sum(dh * h, axis=1)
    row_off = bh.to(tl.int64) * seq_len + rows
    m2 = tl.load(m2_ptr + row_off, mask=row_ok, other=0.0)
    row_sum = tl.load(rowsum_ptr + row_off, mask=row_ok, other=0.0)
    floor = tl.exp2(-m2)
    r = 1.0 / (tl.maximum(tl.abs(row_sum), floor) + eps)
    sign = tl.where(row_sum > 0, 1.0, tl.where(row_sum < 0, -1.0, 0.0))
    beta = tl.where(tl.abs(row_sum) > floor, -r * hdot * sign, 0.0)
    tl.store(r_ptr + row_off, r, mask=row_ok)
    tl.store(beta_ptr + row_off, beta, mask=row_ok)
    tl.store(dm_ptr + row_off, -eps * r * hdot, mask=row_ok)
    return dweight, dbias


@triton.jit
def norm_backward_kernel(
    grad_ptr, h_ptr, weight_ptr, dh_ptr, m2_ptr, rowsum_ptr, r_ptr, beta_ptr, dm_ptr,
    dweight_ptr, dbias_ptr, seq_len, num_heads, rows_per_program,
    stride_gb, stride_gh, stride_gs, stride_gd, norm_eps, eps,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, RESIDUAL_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(B * NH, cdiv(S, rows_per_program))``: rows ``[p * rows_per_program, (p + 1) *
    rows_per_program)`` of head ``bh`` (``p = program_id(1)``, ``bh = program_id(0)``) in
    blocks of ``BLOCK_ROWS`` (:func:`norm_backward_rows`; ``rows_per_program`` a multiple of
    it). With ``HAS_NORM``, the program's partial sums of the weight and bias gradients, in
    row order, go to slot ``[p, bh]`` of ``dweight_ptr``/``dbias_ptr [R, B * NH, DV]``
    (``ACC``; the op sums over R and B): small tiles for bandwidth, one slot per program
    for little partial-sum traffic."""
    bh = tl.program_id(0)
    first = tl.program_id(1) * rows_per_program
    last = tl.minimum(first + rows_per_program, seq_len)
    dweight = tl.zeros((BLOCK_DV,), dtype=ACC)
    dbias = tl.zeros((BLOCK_DV,), dtype=ACC)
    for start_s in range(first, last, BLOCK_ROWS):
        rows_dweight, rows_dbias = norm_backward_rows(
            grad_ptr, h_ptr, weight_ptr, dh_ptr, m2_ptr, rowsum_ptr, r_ptr, beta_ptr, dm_ptr,
            bh, start_s, seq_len, num_heads, stride_gb, stride_gh, stride_gs, stride_gd,
            norm_eps, eps, DV, BLOCK_DV, BLOCK_ROWS, HAS_NORM, HAS_WEIGHT, RESIDUAL_WEIGHT, ACC,
        )
        dweight += rows_dweight
        dbias += rows_dbias
    if HAS_NORM:
        dv = tl.arange(0, BLOCK_DV)
        part = (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + bh) * DV + dv
        tl.store(dweight_ptr + part, dweight, mask=dv < DV)
        tl.store(dbias_ptr + part, dbias, mask=dv < DV)


@triton.jit
def _dq_step(
    dq, dh, row_ref_hi, row_ref_lo, r_i, beta_i, col_ref, rows, start_n, k_base, v_base,
    term_hi_ptr, term_lo_ptr, seq_len, stride_ks, stride_kd, stride_vs, stride_vd,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Key tile ``[start_n, start_n + BLOCK_N)`` into the unscaled dQ accumulator
    ``[BLOCK_M, BLOCK_DQK]`` (``MASKED``: causal and bounds masks). No ``q k^T``: dQ needs
    only ``dS = dC * decay``; the row sums of ``dlogD = dS * S`` come from ``q . dq`` at
    the end. Masked tiles take the exact decay ``exp2(term_j - colmax_i)``; unmasked tiles
    only its column factor ``exp2(term_j - col_ref)``: the caller applies the row factor
    once (see the forward)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(k_base, cols, stride_ks, dqk, stride_kd, seq_len, DQK, BLOCK_DQK, MASKED)
    v = load_tile(v_base, cols, stride_vs, dv, stride_vd, seq_len, DV, BLOCK_DV, MASKED)
    if MASKED:
        col_ok = cols < seq_len
        term_hi = tl.load(term_hi_ptr + cols, mask=col_ok, other=0.0)
        term_lo = tl.load(term_lo_ptr + cols, mask=col_ok, other=0.0)
        live = (cols[None, :] <= rows[:, None]) & col_ok[None, :] & (rows[:, None] < seq_len)
        exponent = decay_exponent(term_hi[None, :], term_lo[None, :], row_ref_hi[:, None],
                                  row_ref_lo[:, None])
        decay = tl.exp2(tl.where(live, exponent, float("-inf")))
    else:
        decay = column_factor(term_hi_ptr, term_lo_ptr, cols, cols, col_ref, False)[None, :]
    d_c = mma(dh, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC),
              INPUT_PRECISION, UPCAST) * r_i[:, None] + beta_i[:, None]
    d_s = d_c * decay
    return mma(d_s.to(k.dtype), k, dq, INPUT_PRECISION, UPCAST)


@triton.jit
def mlstm_dq_kernel(
    q_ptr, k_ptr, v_ptr, dh_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr, colmax_lo_ptr,
    r_ptr, beta_ptr, dq_ptr, far_row_ptr, seq_len, num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEAR: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(B * NH * cdiv(S, BLOCK_M),)``, head-major (:func:`.common.head_major_tile`),
    within a head the longest rows first: :func:`mlstm_dq_tile` over whole rows, no
    states."""
    num_tiles = tl.cdiv(seq_len, BLOCK_M)
    bh, tile = head_major_tile(num_tiles)
    mlstm_dq_tile(
        q_ptr, k_ptr, v_ptr, dh_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr, colmax_lo_ptr,
        r_ptr, beta_ptr, r_ptr, r_ptr, r_ptr, dq_ptr, far_row_ptr, bh,
        (num_tiles - 1 - tile) * BLOCK_M, seq_len, seq_len, num_heads,
        stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd, stride_hb, stride_hh, stride_hs, stride_hd,
        scale, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, NEAR, False, ACC,
        INPUT_PRECISION, UPCAST)


@triton.jit
def mlstm_dq_tile(
    q_ptr, k_ptr, v_ptr, dh_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr, colmax_lo_ptr,
    r_ptr, beta_ptr, cstate_ptr, nstate_ptr, mstate_ptr, dq_ptr, far_row_ptr, bh, start_m,
    seq_len, chunk_len, num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NEAR: tl.constexpr,
    HAS_STATE: tl.constexpr, ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Query rows ``start_m + arange(BLOCK_M)`` of head ``bh`` (the parallel form's program,
    :func:`mlstm_dq_kernel`, and the chunkwise form's per document, :mod:`.chunk_tiles`).
    Writes their rows of ``dq_ptr [B, NH, S, DQK]`` contiguous and of ``far_row_ptr [B *
    NH, S]``: ``sum_j dlogD_ij`` over the keys outside the row's block of ``NEAR`` (the
    dK/dV programs' key tile; a multiple of ``BLOCK_N``, dividing ``BLOCK_M``): ``q_i .
    dq_i`` read before that block's tiles, plus ``q_i`` dotted with the share of dq of the
    state entering the chunk.

    ``dh_ptr``: the raw h's gradient, (batch, head, seq, channel) strides given;
    ``term_hi_ptr``, ``term_lo_ptr``, ``colmax_hi_ptr``, ``colmax_lo_ptr`` (the forward's
    column terms and their running max, :func:`.stabiliser.column_terms`), ``r_ptr``,
    ``beta_ptr``: ``[B * NH, S]`` contiguous, ``ACC``. Chunks of ``chunk_len`` rows (keys
    from the start of the rows' chunk) and ``HAS_STATE`` (the states entering each chunk,
    ``cstate_ptr``, ``nstate_ptr``, ``mstate_ptr``) as in the forward tile: the state's
    share of dq is ``a_i (C (r_i dh_i) + beta_i n)`` with ``a_i = exp(logf_i + m - m_i) =
    exp2(m * log2(e) - colmax_i)``."""
    window = (start_m // chunk_len) * chunk_len
    batch64 = (bh // num_heads).to(tl.int64)
    head64 = (bh % num_heads).to(tl.int64)
    gate_off = bh.to(tl.int64) * seq_len
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    dh = load_tile(dh_ptr + batch64 * stride_hb + head64 * stride_hh, rows, stride_hs, dv,
                   stride_hd, seq_len, DV, BLOCK_DV, True).to(k_ptr.dtype.element_ty)
    row_ref_hi = tl.load(colmax_hi_ptr + gate_off + rows, mask=row_ok, other=0.0)
    row_ref_lo = tl.load(colmax_lo_ptr + gate_off + rows, mask=row_ok, other=0.0)
    r_i = tl.load(r_ptr + gate_off + rows, mask=row_ok, other=0.0)
    beta_i = tl.load(beta_ptr + gate_off + rows, mask=row_ok, other=0.0)
    if HAS_STATE:
        chunk = start_m // chunk_len
        slots = tl.maximum(tl.cdiv(seq_len, chunk_len), 1)
        slot = bh.to(tl.int64) * (slots + 1) + chunk
        state_ref = tl.load(mstate_ptr + slot) * LOG2E
        # The forward's reference, the state's column included (its m_i = logf_i + this).
        row_ref_hi, row_ref_lo = with_state_ref(row_ref_hi, row_ref_lo, state_ref)
    k_base = k_ptr + batch64 * stride_kb + head64 * stride_kh
    v_base = v_ptr + batch64 * stride_vb + head64 * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=ACC)
    # One reference for the key tiles left of the diagonal, >= each of their column terms
    # (the running max just before the tile): both factors of the decay are <= 1 (the
    # forward's argument), and the row factor is applied once after the loop.
    ref = tl.load(colmax_hi_ptr + gate_off + tl.maximum(start_m - 1, window),
                  mask=start_m > window, other=float("-inf"))
    has_ref = ref > float("-inf")
    col_ref = tl.where(has_ref, ref, 0.0)
    for start_n in range(window, start_m, BLOCK_N):
        dq = _dq_step(
            dq, dh, row_ref_hi, row_ref_lo, r_i, beta_i, col_ref, rows, start_n, k_base,
            v_base, term_hi_ptr + gate_off, term_lo_ptr + gate_off, seq_len,
            stride_ks, stride_kd, stride_vs, stride_vd,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, False, ACC, INPUT_PRECISION, UPCAST)
    rows_scale = row_factor(col_ref, row_ref_hi, row_ref_lo, has_ref)
    dq = dq * tl.where(row_ok, rows_scale, 0.0)[:, None]
    q_base = q_ptr + batch64 * stride_qb + head64 * stride_qh
    far_row = tl.zeros((BLOCK_M,), dtype=ACC)
    # The diagonal tiles, not software-pipelined: a second pipelined loop makes ptxas
    # serialise the kernel's wgmma (its warning C7515: the accumulator defined by non-wgmma
    # instructions inside a pipeline stage). H100, dQ: 3.31 / 10.64 ms at S = 1024 / 4096
    # against 3.55 / 11.65 with both loops pipelined.
    for start_n in tl.range(start_m, tl.minimum(start_m + BLOCK_M, seq_len), BLOCK_N,
                            num_stages=1):
        if start_n % NEAR == 0:
            # The rows of the block starting here have every key left of it in dq now.
            q = load_tile(q_base, rows, stride_qs, dqk, stride_qd, seq_len, DQK, BLOCK_DQK,
                          True)
            block_rows = (rows >= start_n) & (rows < start_n + NEAR)
            far_row = tl.where(block_rows, tl.sum(q.to(ACC) * dq, axis=1), far_row)
        dq = _dq_step(
            dq, dh, row_ref_hi, row_ref_lo, r_i, beta_i, col_ref, rows, start_n, k_base,
            v_base, term_hi_ptr + gate_off, term_lo_ptr + gate_off, seq_len,
            stride_ks, stride_kd, stride_vs, stride_vd,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, True, ACC, INPUT_PRECISION, UPCAST)
    if HAS_STATE:
        # The state entering the chunk: a far term (module docstring), so its own q . dq
        # joins far_row. Added after the diagonal tiles, not before them: there its fp32
        # [DQK, DV] tile took shared memory next to the diagonal loop's (256 KB at DQK 128,
        # DV 256, past the H100's 227 KB); here 192 KB, as before the near/far split.
        c = tl.load(cstate_ptr + (bh.to(tl.int64) * slots + chunk) * DQK * DV
                    + dqk[:, None] * DV + dv[None, :],
                    mask=(dqk[:, None] < DQK) & (dv[None, :] < DV), other=0.0)
        n = tl.load(nstate_ptr + slot * DQK + dqk, mask=dqk < DQK, other=0.0)
        a = tl.where(row_ok, tl.exp2(decay_exponent(state_ref, 0.0, row_ref_hi, row_ref_lo)),
                     0.0)
        weighted = (dh.to(ACC) * (a * r_i)[:, None]).to(dh.dtype)
        dq_state = mma(weighted, tl.trans(c.to(dh.dtype)),
                       tl.zeros((BLOCK_M, BLOCK_DQK), dtype=ACC), INPUT_PRECISION, UPCAST)
        dq_state = dq_state + (a * beta_i)[:, None] * n[None, :]
        q = load_tile(q_base, rows, stride_qs, dqk, stride_qd, seq_len, DQK, BLOCK_DQK, True)
        far_row += tl.sum(q.to(ACC) * dq_state, axis=1)
        dq = dq + dq_state
    dq = dq * scale
    out = dq_ptr + gate_off * DQK + rows[:, None] * DQK + dqk[None, :]
    tl.store(out, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & (dqk[None, :] < DQK))
    tl.store(far_row_ptr + gate_off + rows, far_row * scale, mask=row_ok)


@triton.jit
def _dkv_step(
    dk, dv_acc, k, v, col_scale, tile_ref, cols, start_m, q_base, h_base,
    colmax_hi_ptr, colmax_lo_ptr, r_ptr, beta_ptr, seq_len, term_hi_j, term_lo_j, state_ref,
    stride_qs, stride_qd, stride_hs, stride_hd, scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    WANT_D_LOG_D: tl.constexpr, HAS_STATE: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Query tile ``[start_m, start_m + BLOCK_M)`` into the dK ``[BLOCK_N, BLOCK_DQK]`` and
    the dV ``[BLOCK_N, BLOCK_DV]`` accumulators (``MASKED``: the causal and bounds masks, on
    the transposed ``[BLOCK_N, BLOCK_M]`` tile); returns ``(dk, dv, dlogD^T)``, the last the
    tile ``[BLOCK_N, BLOCK_M]`` when ``WANT_D_LOG_D`` (else 0). Masked tiles take the exact
    decay ``exp2(term_j - colmax_i)``; unmasked ones the factorised one: ``col_scale =
    exp2(term_j - tile_ref)`` (log2 units, ``tile_ref`` the largest column term of the key
    tile) times a per-row factor. ``state_ref`` (``HAS_STATE``): the term of the state
    entering the chunk, which joins the rows' references as in the forward."""
    rows = start_m + tl.arange(0, BLOCK_M)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(q_base, rows, stride_qs, dqk, stride_qd, seq_len, DQK, BLOCK_DQK, MASKED)
    dh = load_tile(h_base, rows, stride_hs, dv, stride_hd, seq_len, DV, BLOCK_DV,
                   MASKED).to(q.dtype)
    if MASKED:
        row_ok = rows < seq_len
        row_ref_hi = tl.load(colmax_hi_ptr + rows, mask=row_ok, other=0.0)
        row_ref_lo = tl.load(colmax_lo_ptr + rows, mask=row_ok, other=0.0)
        r_i = tl.load(r_ptr + rows, mask=row_ok, other=0.0)
        beta_i = tl.load(beta_ptr + rows, mask=row_ok, other=0.0)
    else:
        row_ref_hi = tl.load(colmax_hi_ptr + rows)
        row_ref_lo = tl.load(colmax_lo_ptr + rows)
        r_i = tl.load(r_ptr + rows)
        beta_i = tl.load(beta_ptr + rows)
    if HAS_STATE:
        row_ref_hi, row_ref_lo = with_state_ref(row_ref_hi, row_ref_lo, state_ref)
    if MASKED:
        live = (cols[:, None] <= rows[None, :]) & row_ok[None, :] & (cols[:, None] < seq_len)
        exponent = decay_exponent(term_hi_j[:, None], term_lo_j[:, None], row_ref_hi[None, :],
                                  row_ref_lo[None, :])
        decay = tl.exp2(tl.where(live, exponent, float("-inf")))  # [BLOCK_N, BLOCK_M]
    else:
        decay = col_scale[:, None] * row_factor(tile_ref, row_ref_hi, row_ref_lo, True)[None, :]
    raw_scores = mma(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC),
                     INPUT_PRECISION, UPCAST)
    c_scaled = raw_scores * scale * decay * r_i[None, :]
    dv_acc = mma(c_scaled.to(dh.dtype), dh, dv_acc, INPUT_PRECISION, UPCAST)
    # dC with 1/sqrt(DQK) folded into the row terms: dk accumulates scaled, so that k . dk
    # can be read between query tiles.
    d_c = (mma(v, tl.trans(dh), tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC),
               INPUT_PRECISION, UPCAST) * (r_i * scale)[None, :] + (beta_i * scale)[None, :])
    d_s = d_c * decay
    dk = mma(d_s.to(q.dtype), q, dk, INPUT_PRECISION, UPCAST)
    if WANT_D_LOG_D:
        d_log_d = d_s * raw_scores
    else:
        d_log_d = 0.0
    return dk, dv_acc, d_log_d


@triton.jit
def _near_block_sums(d_log_d, cols, rows, start_n, BLOCK_N: tl.constexpr):
    """From the diagonal query tile's ``dlogD^T [BLOCK_N, BLOCK_M]`` (keys ``cols`` =
    ``start_n + arange(BLOCK_N)``, the block; rows ``rows``): ``(far_col, near_col,
    near_cross)``: per key, the sums over the rows past the block and over the block's rows
    (``[BLOCK_N]``), and per row ``t`` of the block (``[BLOCK_M]``, 0 elsewhere) ``sum_{j < t
    <= i} dlogD_ij`` over the block's pairs: an exclusive prefix sum of column sums less row
    sums, both without the diagonal ``i = j``, which they share (it cancels exactly, and it
    is the largest entry where the gates forget). At the block's first row it is 0 by
    construction, not ``step - step``: the row before the block reads it (its reverse sum
    telescopes to it), and across a document boundary of packed documents it must not carry
    a NaN or Inf of the next document's."""
    block_rows = (rows >= start_n) & (rows < start_n + BLOCK_N)
    below = tl.where(rows[None, :] > cols[:, None], d_log_d, 0.0)  # i > j
    below_col = tl.sum(tl.where(block_rows[None, :], below, 0.0), axis=1)
    diagonal = tl.sum(tl.where(rows[None, :] == cols[:, None], d_log_d, 0.0), axis=1)
    far_col = tl.sum(tl.where(rows[None, :] >= start_n + BLOCK_N, d_log_d, 0.0), axis=1)
    left_row = tl.sum(below, axis=0)  # the block's rows: their keys here are the block's
    below_col_by_row = tl.sum(tl.where(cols[:, None] == rows[None, :], below_col[:, None], 0.0),
                              axis=0)
    step = tl.where(block_rows, below_col_by_row - left_row, 0.0)
    cross = tl.where(rows == start_n, 0.0, tl.cumsum(step, axis=0) - step)
    return far_col, below_col + diagonal, cross


@triton.jit
def mlstm_dkv_kernel(
    q_ptr, k_ptr, v_ptr, dh_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr, colmax_lo_ptr,
    r_ptr, beta_ptr, dk_ptr, dv_ptr, far_col_ptr, near_col_ptr, near_cross_ptr, seq_len,
    num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(B * NH * cdiv(S, BLOCK_N),)``, head-major (:func:`.common.head_major_tile`),
    within a head the earliest keys (most query tiles) first: :func:`mlstm_dkv_tile` over
    whole rows, no states."""
    bh, tile = head_major_tile(tl.cdiv(seq_len, BLOCK_N))
    mlstm_dkv_tile(
        q_ptr, k_ptr, v_ptr, dh_ptr, r_ptr, r_ptr, term_hi_ptr, term_lo_ptr, colmax_hi_ptr,
        colmax_lo_ptr, r_ptr, beta_ptr, r_ptr, r_ptr, r_ptr, dk_ptr, dv_ptr, far_col_ptr,
        near_col_ptr, near_cross_ptr, bh, tile * BLOCK_N, seq_len, seq_len, num_heads,
        stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd, stride_hb, stride_hh, stride_hs, stride_hd,
        scale, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, False, ACC, INPUT_PRECISION,
        UPCAST)


@triton.jit
def mlstm_dkv_tile(
    q_ptr, k_ptr, v_ptr, dh_ptr, igate_ptr, logf_ptr, term_hi_ptr, term_lo_ptr,
    colmax_hi_ptr, colmax_lo_ptr, r_ptr, beta_ptr, dcstate_ptr, dnstate_ptr, mstate_ptr,
    dk_ptr, dv_ptr, far_col_ptr, near_col_ptr, near_cross_ptr, bh, start_n, seq_len,
    chunk_len, num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_STATE: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Key rows ``start_n + arange(BLOCK_N)`` of head ``bh`` (the parallel form's program,
    :func:`mlstm_dkv_kernel`, and the chunkwise form's per document, :mod:`.chunk_tiles`).
    Writes their rows of ``dk_ptr [B, NH, S, DQK]``, ``dv_ptr [B, NH, S, DV]`` contiguous
    and, ``[B * NH, S]`` (module docstring): ``far_col_ptr`` (``sum_i dlogD_ij`` over the
    rows past the key's block: ``k_j . dk_j`` before the diagonal query tile joins, plus
    that tile's rows past the block, summed directly), ``near_col_ptr`` (over the block's
    rows) and ``near_cross_ptr`` (the within-block reverse sum, 0 at the block's first
    row). Query tiles run to the end of the keys' chunk of ``chunk_len`` rows, the diagonal
    one last; with ``HAS_STATE`` the gradient of the state leaving the chunk
    (``dcstate_ptr [B * NH, NC, DQK, DV]`` in k's dtype, ``dnstate_ptr [B * NH, NC + 1,
    DQK]``; the state's ``mstate_ptr``) adds the later chunks' share: with ``w_j =
    exp(logf_end - logf_j + igate_j - m)``, ``dk_j += w_j (dC v_j + dn)``, ``dv_j += w_j
    dC^T k_j``, read from ``igate_ptr`` (``ACC``) and ``logf_ptr`` (fp64 or ``ACC``, the
    chunk-restarted sums), ``[B * NH, S]``, only with ``HAS_STATE``. Other arguments as
    :func:`mlstm_dq_tile`."""
    batch64 = (bh // num_heads).to(tl.int64)
    head64 = (bh % num_heads).to(tl.int64)
    gate_off = bh.to(tl.int64) * seq_len
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ok = cols < seq_len
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(k_ptr + batch64 * stride_kb + head64 * stride_kh, cols, stride_ks, dqk,
                  stride_kd, seq_len, DQK, BLOCK_DQK, True)
    v = load_tile(v_ptr + batch64 * stride_vb + head64 * stride_vh, cols, stride_vs, dv,
                  stride_vd, seq_len, DV, BLOCK_DV, True)
    term_hi_j = tl.load(term_hi_ptr + gate_off + cols, mask=col_ok, other=float("-inf"))
    term_lo_j = tl.load(term_lo_ptr + gate_off + cols, mask=col_ok, other=0.0)
    # The factorised decay of the unmasked query tiles (rows below every key of this tile).
    tile_ref = tl.max(term_hi_j, axis=0)
    col_scale = tl.exp2((term_hi_j - tile_ref) + term_lo_j)
    q_base = q_ptr + batch64 * stride_qb + head64 * stride_qh
    h_base = dh_ptr + batch64 * stride_hb + head64 * stride_hh
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=ACC)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_DV), dtype=ACC)
    colmax_hi_h = colmax_hi_ptr + gate_off
    colmax_lo_h = colmax_lo_ptr + gate_off
    r_h = r_ptr + gate_off
    beta_h = beta_ptr + gate_off
    chunk = start_n // chunk_len
    window_end = tl.minimum((chunk + 1) * chunk_len, seq_len)
    if HAS_STATE:
        slots = tl.maximum(tl.cdiv(seq_len, chunk_len), 1)
        state_ref = tl.load(mstate_ptr + bh.to(tl.int64) * (slots + 1) + chunk) * LOG2E
    else:
        state_ref = 0.0
    # The full query tiles below the diagonal one, the ragged end, the state leaving the chunk
    # (every pair of these is far), then the diagonal tile, masked.
    first_m = (start_n // BLOCK_M) * BLOCK_M
    full_end = (first_m + BLOCK_M
                + tl.maximum(window_end - first_m - BLOCK_M, 0) // BLOCK_M * BLOCK_M)
    for start_m in range(first_m + BLOCK_M, full_end, BLOCK_M):
        dk, dv_acc, _ = _dkv_step(
            dk, dv_acc, k, v, col_scale, tile_ref, cols, start_m, q_base, h_base,
            colmax_hi_h, colmax_lo_h, r_h, beta_h, seq_len, term_hi_j, term_lo_j, state_ref,
            stride_qs, stride_qd, stride_hs, stride_hd, scale,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, False, False, HAS_STATE, ACC,
            INPUT_PRECISION, UPCAST)
    if full_end < window_end:
        dk, dv_acc, _ = _dkv_step(
            dk, dv_acc, k, v, col_scale, tile_ref, cols, full_end, q_base, h_base,
            colmax_hi_h, colmax_lo_h, r_h, beta_h, seq_len, term_hi_j, term_lo_j, state_ref,
            stride_qs, stride_qd, stride_hs, stride_hd, scale,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, True, False, HAS_STATE, ACC,
            INPUT_PRECISION, UPCAST)
    if HAS_STATE:
        slot = bh.to(tl.int64) * (slots + 1) + chunk + 1
        dc = tl.load(dcstate_ptr + (bh.to(tl.int64) * slots + chunk) * DQK * DV
                     + dqk[:, None] * DV + dv[None, :],
                     mask=(dqk[:, None] < DQK) & (dv[None, :] < DV), other=0.0).to(k.dtype)
        dn = tl.load(dnstate_ptr + slot * DQK + dqk, mask=dqk < DQK, other=0.0)
        # Natural-log units, with the state kernels' expression for the same weight (the
        # forget sums' difference taken in their dtype).
        logf_h = logf_ptr + gate_off
        logf_end = tl.load(logf_h + window_end - 1)
        lf_nat = tl.load(logf_h + cols, mask=col_ok, other=0.0)
        ig_nat = tl.load(igate_ptr + gate_off + cols, mask=col_ok, other=0.0)
        w = tl.where(col_ok, tl.exp((logf_end - lf_nat).to(ACC) + ig_nat
                                    - tl.load(mstate_ptr + slot)), 0.0)
        dk_state = mma(v, tl.trans(dc), tl.zeros((BLOCK_N, BLOCK_DQK), dtype=ACC),
                       INPUT_PRECISION, UPCAST) + dn[None, :]
        dk = dk + w[:, None] * dk_state
        dv_state = mma(k, dc, tl.zeros((BLOCK_N, BLOCK_DV), dtype=ACC),
                       INPUT_PRECISION, UPCAST)
        dv_acc = dv_acc + w[:, None] * dv_state
    far_col = tl.sum(k.to(ACC) * dk, axis=1)
    dk, dv_acc, d_log_d = _dkv_step(
        dk, dv_acc, k, v, col_scale, tile_ref, cols, first_m, q_base, h_base,
        colmax_hi_h, colmax_lo_h, r_h, beta_h, seq_len, term_hi_j, term_lo_j, state_ref,
        stride_qs, stride_qd, stride_hs, stride_hd, scale,
        DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, True, True, HAS_STATE, ACC,
        INPUT_PRECISION, UPCAST)
    rows = first_m + tl.arange(0, BLOCK_M)
    far_in_tile, near_col, near_cross = _near_block_sums(d_log_d, cols, rows, start_n, BLOCK_N)
    tl.store(far_col_ptr + gate_off + cols, far_col + far_in_tile, mask=col_ok)
    tl.store(near_col_ptr + gate_off + cols, near_col, mask=col_ok)
    tl.store(near_cross_ptr + gate_off + rows, near_cross,
             mask=(rows >= start_n) & (rows < start_n + BLOCK_N) & (rows < seq_len))
    mask = col_ok[:, None]
    tl.store(dk_ptr + gate_off * DQK + cols[:, None] * DQK + dqk[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=mask & (dqk[None, :] < DQK))
    tl.store(dv_ptr + gate_off * DV + cols[:, None] * DV + dv[None, :],
             dv_acc.to(dv_ptr.dtype.element_ty), mask=mask & (dv[None, :] < DV))


def _dims(t: torch.Tensor, normed: bool, dv: int) -> tuple[int, int, int, int]:
    """(batch, head, seq, channel) strides of an output-shaped tensor: ``[B, S, NH * DV]``
    when ``normed`` (head h's channels start at ``h * DV``), else ``[B, NH, S, DV]``."""
    if normed:
        sb, ss, sc = t.stride()
        return sb, dv * sc, ss, sc
    return tuple(t.stride())


def norm_backward(
    grad_out: torch.Tensor, h: torch.Tensor, norm_weight: Optional[torch.Tensor],
    m_log2: torch.Tensor, row_sum: torch.Tensor, normed: bool, norm_eps: float, eps: float,
    residual_weight: bool, config: BackwardConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
           Optional[torch.Tensor]]:
    """``(dh, r, beta, dm, dweight_parts, dbias_parts)``: the raw h's gradient (the output's
    own gradient when not ``normed``), the cell backward's per-row terms ``[B, NH, S]`` from
    the forward's ``m_log2`` and ``row_sum`` (contiguous), and, when normed, partial sums of
    the norm's weight and bias gradients to reduce."""
    batch, heads, seq, dv = h.shape
    span = norm_rows_per_program(batch * heads, seq, config)
    rows = triton.cdiv(seq, span)
    r = torch.empty_like(m_log2)
    beta = torch.empty_like(m_log2)
    dm = torch.empty_like(m_log2)
    acc_dtype = m_log2.dtype
    if normed:
        dh = torch.empty_like(h, memory_format=torch.contiguous_format)
        parts_w = torch.empty((rows, batch, heads, dv), dtype=acc_dtype, device=h.device)
        parts_b = torch.empty_like(parts_w)
    else:
        dh, parts_w, parts_b = grad_out, None, None
    if batch * heads and seq:
        norm_backward_kernel[(batch * heads, rows)](
            grad_out, h, norm_weight if norm_weight is not None else r,
            dh if normed else r, m_log2, row_sum, r, beta, dm,
            parts_w if normed else r, parts_b if normed else r,
            seq, heads, span, *_dims(grad_out, normed, dv), norm_eps, eps,
            DV=dv, BLOCK_DV=head_tile(dv), BLOCK_ROWS=config.block_rows,
            HAS_NORM=normed, HAS_WEIGHT=norm_weight is not None,
            RESIDUAL_WEIGHT=residual_weight, ACC=accumulation_dtype(h.dtype),
            num_warps=config.norm_warps,
        )
    return dh, r, beta, dm, parts_w, parts_b


def near_block(config: BackwardConfig) -> int:
    """The blocks of near pairs (module docstring): the dK/dV programs' key tile, which the
    dQ programs' key tiles must divide."""
    if config.block_n % config.dq_tile:
        raise ValueError(f"the dK/dV key tile ({config.block_n}) must be a multiple of the dQ "
                         f"key tile ({config.dq_tile}): it is the blocks of near pairs")
    return config.block_n


def dlogd_sums(far_row: torch.Tensor, far_col: torch.Tensor, near_col: torch.Tensor,
               near_cross: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_grad, col_grad)`` ``[B, NH, S]`` fp64: ``sum_j dlogD_ij`` and ``sum_i
    dlogD_ij`` put together from the dQ and dK/dV programs' far and near parts (module
    docstring), so that ``row_grad - col_grad``, whose reverse sum the forget gates take, is
    that of the far parts plus the exact telescoping of the near reverse sums. Elementwise
    but for row ``t + 1``'s ``near_cross``, which is 0 where a block starts (so also at each
    packed document's first row)."""
    # near_cross is 0 at each block's first row, so its differences telescope block by block
    # (exactly, in fp64): the reverse sum of row_grad - col_grad gives it back.
    cross = near_cross.double()
    cross_next = torch.nn.functional.pad(cross[..., 1:], (0, 1))
    near = near_col.double()
    return far_row.double() + near + (cross - cross_next), far_col.double() + near


def cell_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dh: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor, r: torch.Tensor, beta: torch.Tensor,
    config: Optional[BackwardConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, row_grad, col_grad)``: the parallel cell's gradients for the raw h's
    gradient ``dh [B, NH, S, DV]`` (any strides). Per-row ``[B, NH, S]`` contiguous inputs:
    the gates (``igate`` in the accumulation dtype, ``logf`` in fp64 or that dtype; the
    column terms and their running max are computed from them here, as the forward's
    launcher does), ``r = 1 / (n + eps)`` and ``beta`` (module docstring).
    ``row_grad``/``col_grad``: ``sum_j dlogD_ij`` and ``sum_i dlogD_ij`` with the
    stabiliser held constant (its gradient is the caller's), in fp64 (:func:`dlogd_sums`).
    (The chunkwise form's: :func:`.chunk_tiles.chunk_cell_backward`.)"""
    batch, heads, seq, dqk = q.shape
    dvh = v.shape[-1]
    cfg = config or choose_backward_config(q, dqk, dvh)
    dq = torch.empty((batch, heads, seq, dqk), dtype=q.dtype, device=q.device)
    dk = torch.empty((batch, heads, seq, dqk), dtype=k.dtype, device=q.device)
    dv = torch.empty((batch, heads, seq, dvh), dtype=v.dtype, device=q.device)
    far_row, far_col, near_col, near_cross = (torch.empty_like(igate) for _ in range(4))
    if batch * heads == 0 or seq == 0:
        empty = torch.empty(igate.shape, dtype=torch.float64, device=q.device)
        return dq, dk, dv, empty, empty.clone()
    common = dict(
        DQK=dqk, DV=dvh, BLOCK_DQK=head_tile(dqk), BLOCK_DV=head_tile(dvh),
        BLOCK_M=cfg.block_m, ACC=accumulation_dtype(q.dtype),
        INPUT_PRECISION=input_precision(q.dtype), UPCAST=upcast_dots(q),
    )
    strides = (*q.stride(), *k.stride(), *v.stride(), *dh.stride())
    scale = 1.0 / math.sqrt(dqk)
    terms = column_terms(igate, logf)  # (term_hi, term_lo, colmax_hi, colmax_lo)
    mlstm_dq_kernel[(batch * heads * triton.cdiv(seq, cfg.block_m),)](
        q, k, v, dh, *terms, r, beta, dq, far_row, seq, heads, *strides, scale,
        BLOCK_N=cfg.dq_tile, NEAR=near_block(cfg), **common, num_warps=cfg.dq_warps,
        num_stages=cfg.dq_stages)
    mlstm_dkv_kernel[(batch * heads * triton.cdiv(seq, cfg.block_n),)](
        q, k, v, dh, *terms, r, beta, dk, dv, far_col, near_col, near_cross, seq, heads,
        *strides, scale, BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return (dq, dk, dv, *dlogd_sums(far_row, far_col, near_col, near_cross))
