"""The parallel mLSTM backward: dQ programs, dK/dV programs, launcher (the norm's backward
and the per-row terms, a preprocess before them: :mod:`.norm_backward`).

With ``r_i = 1 / (n_i + eps)`` and the upstream gradient ``dh`` of the raw h, the cell's
gradient is, per (batch, head), for ``j <= i`` (the stabiliser ``m`` held constant):

* ``dC_ij = r_i (dh_i . v_j) + beta_i``, where ``beta_i = -r_i (dh_i . h_i) sign(b_i)`` when
  the normaliser took ``|b_i|`` (``b_i = sum_j C_ij``), else 0: the normaliser's gradient,
  one scalar per row;
* ``dS = dC * exp(logD - m)`` gives ``dq = dS k / sqrt(DQK)`` and ``dk = dS^T q / sqrt(DQK)``;
  ``dv = (C * r)^T dh``;
* ``dlogD = dS * S``: its row sums and column sums give the gate gradients (the op finishes
  them: ``digate = colsum``, ``dF = rowsum - colsum``, ``dfgate = sigmoid(-f) revcumsum(dF)``).

No atomics: dQ programs walk the key tiles of their query rows, dK/dV programs the query
tiles of their key rows, each in a fixed order, so the backward is bitwise reproducible.
The multi-head layernorm's backward (and its weight/bias partial sums) runs first in a row
preprocess (:mod:`.norm_backward`) that also forms the per-row terms ``r``, ``beta`` and the
stabiliser's gradient.
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
    column_term_max,
    head_major_tile,
    head_scale,
    input_precision,
    load_tile,
    mma,
    upcast_dots,
)
from compileops.mlstm.kernels.config import (
    BackwardConfig,
    choose_backward_config,
    head_tile,
)


@triton.jit
def _dq_step(
    dq, dh, logf_i, m2_i, r_i, beta_i, col_ref, rows, start_n, k_base, v_base,
    logf_ptr, igate_ptr, seq_len, stride_ks, stride_kd, stride_vs, stride_vd,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Key tile ``[start_n, start_n + BLOCK_N)`` into the unscaled dQ accumulator
    ``[BLOCK_M, BLOCK_DQK]`` (``MASKED``: causal and bounds masks). No ``q k^T``: dQ needs
    only ``dS = dC * decay``; the row sums of ``dlogD = dS * S`` come from ``q . dq`` at
    the end. Unmasked tiles take only the column factor ``exp2(igate_j - logf_j - col_ref)``
    of the factorised decay; the caller applies the row factor once (see the forward)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    k = load_tile(k_base, cols, stride_ks, dqk, stride_kd, seq_len, DQK, BLOCK_DQK, MASKED)
    v = load_tile(v_base, cols, stride_vs, dv, stride_vd, seq_len, DV, BLOCK_DV, MASKED)
    if MASKED:
        col_ok = cols < seq_len
        logf_j = tl.load(logf_ptr + cols, mask=col_ok, other=0.0) * LOG2E
        igate_j = tl.load(igate_ptr + cols, mask=col_ok, other=0.0) * LOG2E
        live = (cols[None, :] <= rows[:, None]) & col_ok[None, :] & (rows[:, None] < seq_len)
        log_d = tl.where(live, logf_i[:, None] - logf_j[None, :] + igate_j[None, :],
                         float("-inf"))
        decay = tl.exp2(log_d - m2_i[:, None])
    else:
        # Left of the diagonal the decay factorises (see the forward): logD_ij = logf_i +
        # col_j with col_j = igate_j - logf_j.
        col_term = (tl.load(igate_ptr + cols) - tl.load(logf_ptr + cols)) * LOG2E
        decay = tl.exp2(col_term - col_ref)[None, :]
    d_c = mma(dh, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC),
              INPUT_PRECISION, UPCAST) * r_i[:, None] + beta_i[:, None]
    d_s = d_c * decay
    return mma(d_s.to(k.dtype), k, dq, INPUT_PRECISION, UPCAST)


@triton.jit
def mlstm_dq_kernel(
    q_ptr, k_ptr, v_ptr, dh_ptr, igate_ptr, logf_ptr, m2_ptr, r_ptr, beta_ptr,
    cstate_ptr, nstate_ptr, mstate_ptr, dq_ptr, row_grad_ptr, ref_ptr, seq_len, chunk_len,
    num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_STATE: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIRED: tl.constexpr = False,
):
    """Grid ``(B * NH * cdiv(S, BLOCK_M),)``, head-major (:func:`.common.head_major_tile`),
    within a head the longest rows first. Writes ``dq_ptr [B, NH,
    S, DQK]`` contiguous and ``row_grad_ptr [B * NH, S]`` (``sum_j dlogD_ij = q_i . dq_i``).
    ``PAIRED``: also ``ref_ptr [B * NH, cdiv(S, BLOCK_M)]`` (``ACC``), the tile's reference of
    the factorised decay (``-inf``: none), from which :func:`mlstm_dkv_kernel` rebuilds the
    products this kernel rounds.

    ``dh_ptr``: the raw h's gradient, (batch, head, seq, channel) strides given;
    ``igate_ptr``, ``logf_ptr`` (the forward's gates), ``m2_ptr`` (the forward's stabiliser,
    log2 units), ``r_ptr``, ``beta_ptr``: ``[B * NH, S]`` contiguous, ``ACC``. Chunks and
    ``HAS_STATE`` (the states entering each chunk) as in the forward tile: the state's
    share of dq is ``a_i (C (r_i dh_i) + beta_i n)`` with ``a_i = exp(logf_i + m - m_i)``."""
    num_tiles = tl.cdiv(seq_len, BLOCK_M)
    bh, tile = head_major_tile(num_tiles)
    start_m = (num_tiles - 1 - tile) * BLOCK_M
    scale = head_scale(scale, DQK, ACC)
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
    logf_i = tl.load(logf_ptr + gate_off + rows, mask=row_ok, other=0.0) * LOG2E
    m2_i = tl.load(m2_ptr + gate_off + rows, mask=row_ok, other=0.0)
    r_i = tl.load(r_ptr + gate_off + rows, mask=row_ok, other=0.0)
    beta_i = tl.load(beta_ptr + gate_off + rows, mask=row_ok, other=0.0)
    k_base = k_ptr + batch64 * stride_kb + head64 * stride_kh
    v_base = v_ptr + batch64 * stride_vb + head64 * stride_vh
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=ACC)
    # One reference for the key tiles left of the diagonal, >= each of their column terms:
    # the saved m_i >= logf_i + ref, so both factors of the decay are <= 1 (the forward's
    # argument), and the row factor is applied once after the loop.
    ref = column_term_max(igate_ptr + gate_off, logf_ptr + gate_off, window, start_m,
                          8 * BLOCK_M, ACC)
    has_ref = ref > float("-inf")
    col_ref = tl.where(has_ref, ref, 0.0)
    if PAIRED:
        tl.store(ref_ptr + bh.to(tl.int64) * num_tiles + start_m // BLOCK_M, ref)
    for start_n in range(window, start_m, BLOCK_N):
        dq = _dq_step(
            dq, dh, logf_i, m2_i, r_i, beta_i, col_ref, rows, start_n, k_base, v_base,
            logf_ptr + gate_off, igate_ptr + gate_off, seq_len,
            stride_ks, stride_kd, stride_vs, stride_vd,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, False, ACC, INPUT_PRECISION, UPCAST)
    row_factor = tl.where(has_ref, tl.exp2(logf_i + col_ref - m2_i), 0.0)
    dq = dq * tl.where(row_ok, row_factor, 0.0)[:, None]
    # The diagonal tiles, not software-pipelined: a second pipelined loop makes ptxas
    # serialise the kernel's wgmma (its warning C7515: the accumulator defined by non-wgmma
    # instructions inside a pipeline stage). H100, dQ: 3.31 / 10.64 ms at S = 1024 / 4096
    # against 3.55 / 11.65 with both loops pipelined.
    for start_n in tl.range(start_m, tl.minimum(start_m + BLOCK_M, seq_len), BLOCK_N,
                            num_stages=1):
        dq = _dq_step(
            dq, dh, logf_i, m2_i, r_i, beta_i, col_ref, rows, start_n, k_base, v_base,
            logf_ptr + gate_off, igate_ptr + gate_off, seq_len,
            stride_ks, stride_kd, stride_vs, stride_vd,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, True, ACC, INPUT_PRECISION, UPCAST)
    if HAS_STATE:
        chunk = start_m // chunk_len
        slots = tl.maximum(tl.cdiv(seq_len, chunk_len), 1)
        slot = bh.to(tl.int64) * (slots + 1) + chunk
        c = tl.load(cstate_ptr + (bh.to(tl.int64) * slots + chunk) * DQK * DV
                    + dqk[:, None] * DV + dv[None, :],
                    mask=(dqk[:, None] < DQK) & (dv[None, :] < DV), other=0.0)
        n = tl.load(nstate_ptr + slot * DQK + dqk, mask=dqk < DQK, other=0.0)
        a = tl.where(row_ok, tl.exp2(logf_i + tl.load(mstate_ptr + slot) * LOG2E - m2_i), 0.0)
        weighted = (dh.to(ACC) * (a * r_i)[:, None]).to(dh.dtype)
        dq = mma(weighted, tl.trans(c.to(dh.dtype)), dq, INPUT_PRECISION, UPCAST)
        dq = dq + (a * beta_i)[:, None] * n[None, :]
    dq = dq * scale
    q = load_tile(q_ptr + batch64 * stride_qb + head64 * stride_qh, rows, stride_qs, dqk,
                  stride_qd, seq_len, DQK, BLOCK_DQK, True)
    out = dq_ptr + gate_off * DQK + rows[:, None] * DQK + dqk[None, :]
    tl.store(out, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & (dqk[None, :] < DQK))
    tl.store(row_grad_ptr + gate_off + rows, tl.sum(q.to(ACC) * dq, axis=1), mask=row_ok)


@triton.jit
def _dkv_step(
    dk, dv_acc, col_acc, k, v, col_scale, tile_ref, col_term_j, cols, start_m, q_base, h_base,
    logf_ptr, m2_ptr, r_ptr, beta_ptr, ref_ptr, seq_len, logf_j, igate_j,
    stride_qs, stride_qd, stride_hs, stride_hd, scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIRED: tl.constexpr,
    CHECK_ROWS: tl.constexpr = False,
):
    """Query tile ``[start_m, start_m + BLOCK_M)`` into the unscaled dK ``[BLOCK_N,
    BLOCK_DQK]`` and the dV ``[BLOCK_N, BLOCK_DV]`` accumulators (``MASKED``: the diagonal
    tile, with the causal and bounds masks, on the transposed ``[BLOCK_N, BLOCK_M]`` tile).
    Tiles below the diagonal use the factorised decay: ``col_scale = exp2(igate_j - logf_j -
    tile_ref)`` (log2 units, ``tile_ref`` the largest column term of the key tile) times a
    per-row factor; ``CHECK_ROWS`` (the ragged last tile) masks the rows past ``seq_len``
    and computes the live ones exactly as a full tile would, so that a row's sums do not
    depend on where the sequence ends (a packed document is bitwise its own alone).

    ``PAIRED``: ``col_acc [BLOCK_N]`` (``ACC``) gathers the column sums of ``dlogD`` from the
    very products the dQ program multiplies (:func:`paired_products`), which the rounding of
    this tile's own ``dS`` would not match: with both sums of each pair alike, the forget
    gates' reverse cumulative sum cancels the pairs it should, as in exact arithmetic.
    ``col_term_j`` (dQ's column terms of these keys) and ``ref_ptr`` (dQ's references, one
    a query tile: :func:`mlstm_dq_kernel`) rebuild them."""
    rows = start_m + tl.arange(0, BLOCK_M)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = load_tile(q_base, rows, stride_qs, dqk, stride_qd, seq_len, DQK, BLOCK_DQK,
                  MASKED or CHECK_ROWS)
    dh = load_tile(h_base, rows, stride_hs, dv, stride_hd, seq_len, DV, BLOCK_DV,
                   MASKED or CHECK_ROWS).to(q.dtype)
    if MASKED or CHECK_ROWS:
        row_ok = rows < seq_len
        logf_i = tl.load(logf_ptr + rows, mask=row_ok, other=0.0) * LOG2E
        m2_i = tl.load(m2_ptr + rows, mask=row_ok, other=0.0)
        r_i = tl.load(r_ptr + rows, mask=row_ok, other=0.0)
        beta_i = tl.load(beta_ptr + rows, mask=row_ok, other=0.0)
    else:
        logf_i = tl.load(logf_ptr + rows) * LOG2E
        m2_i = tl.load(m2_ptr + rows)
        r_i = tl.load(r_ptr + rows)
        beta_i = tl.load(beta_ptr + rows)
    if MASKED:
        live = (cols[:, None] <= rows[None, :]) & row_ok[None, :] & (cols[:, None] < seq_len)
        log_d = tl.where(live, logf_i[None, :] - logf_j[:, None] + igate_j[:, None]
                         - m2_i[None, :], float("-inf"))
        decay = tl.exp2(log_d)  # [BLOCK_N, BLOCK_M]
    elif CHECK_ROWS:
        row_factor = tl.where(row_ok, tl.exp2(logf_i + tile_ref - m2_i), 0.0)
        decay = col_scale[:, None] * row_factor[None, :]
    else:
        decay = col_scale[:, None] * tl.exp2(logf_i + tile_ref - m2_i)[None, :]
    scores = mma(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC),
                 INPUT_PRECISION, UPCAST) * scale
    c_scaled = scores * decay * r_i[None, :]
    dv_acc = mma(c_scaled.to(dh.dtype), dh, dv_acc, INPUT_PRECISION, UPCAST)
    d_c = mma(v, tl.trans(dh), tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC),
              INPUT_PRECISION, UPCAST) * r_i[None, :] + beta_i[None, :]
    d_s = (d_c * decay).to(q.dtype)
    dk = mma(d_s, q, dk, INPUT_PRECISION, UPCAST)
    if PAIRED:
        if MASKED:
            # dQ's diagonal tiles round this same product (the same expression, bitwise).
            paired = d_s.to(ACC)
        else:
            paired = paired_products(d_c, col_term_j, logf_i, m2_i, ref_ptr, start_m,
                                     rows, seq_len, BLOCK_M, CHECK_ROWS, q.dtype)
        col_acc += tl.sum(paired * scores, axis=1)
    return dk, dv_acc, col_acc


@triton.jit
def paired_products(d_c, col_term_j, logf_i, m2_i, ref_ptr, start_m, rows, seq_len,
                    BLOCK_M: tl.constexpr, CHECK_ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """``[BLOCK_N, BLOCK_M]``: the products ``dS_ij`` of a query tile below the diagonal
    as the dQ program multiplies them (:func:`_dq_step`, unmasked): ``d_c`` times the column
    factor against the query tile's reference, rounded to the MMA's dtype ``DTYPE``, times the
    row factor that program applies after its key loop. Same expressions on the same
    values: the rounding lands alike (bitwise where the two ``d_c`` are)."""
    ref = tl.load(ref_ptr + start_m // BLOCK_M)
    has_ref = ref > float("-inf")
    col_ref = tl.where(has_ref, ref, 0.0)
    row_factor = tl.where(has_ref, tl.exp2(logf_i + col_ref - m2_i), 0.0)
    if CHECK_ROWS:
        row_factor = tl.where(rows < seq_len, row_factor, 0.0)
    col_factor = tl.exp2(col_term_j - col_ref)
    rounded = (d_c * col_factor[:, None]).to(DTYPE)
    return rounded.to(d_c.dtype) * row_factor[None, :]


@triton.jit
def mlstm_dkv_kernel(
    q_ptr, k_ptr, v_ptr, dh_ptr, igate_ptr, logf_ptr, m2_ptr, r_ptr, beta_ptr,
    dcstate_ptr, dnstate_ptr, mstate_ptr, dk_ptr, dv_ptr, col_grad_ptr, ref_ptr, state_col_ptr,
    seq_len, chunk_len, num_heads,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_STATE: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIRED: tl.constexpr = False,
):
    """Grid ``(B * NH * cdiv(S, BLOCK_N),)``, head-major (:func:`.common.head_major_tile`),
    within a head the earliest keys (most query tiles) first.
    Writes ``dk_ptr [B, NH, S, DQK]``, ``dv_ptr [B, NH, S, DV]`` contiguous and
    ``col_grad_ptr [B * NH, S]`` (``sum_i dlogD_ij = k_j . dk_j``). Query tiles run to the
    end of the keys' chunk; with ``HAS_STATE`` the gradient of the state leaving the chunk
    (``dcstate_ptr [B * NH, NC, DQK, DV]`` in k's dtype, ``dnstate_ptr [B * NH, NC + 1,
    DQK]``; the state's ``mstate_ptr``) adds the later chunks' share: with ``w_j =
    exp(logf_end - logf_j + igate_j - m)``, ``dk_j += w_j (dC v_j + dn)``, ``dv_j += w_j
    dC^T k_j``. Other arguments as :func:`mlstm_dq_kernel`.

    ``PAIRED`` (16-bit inputs): the column sums come from the products the dQ programs
    round (:func:`_dkv_step`; ``ref_ptr``: their references, written by
    :func:`mlstm_dq_kernel`), not from ``k . dk``; with ``HAS_STATE`` the later chunks'
    share of them, ``w_j k_j . (dC v_j + dn)``, is also written alone to ``state_col_ptr
    [B * NH, S]`` (``ACC``), for the sums that cross each chunk's end
    (:func:`.chunkwise.chunk_boundaries`)."""
    bh, tile = head_major_tile(tl.cdiv(seq_len, BLOCK_N))
    start_n = tile * BLOCK_N
    scale = head_scale(scale, DQK, ACC)
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
    logf_j = tl.load(logf_ptr + gate_off + cols, mask=col_ok, other=0.0) * LOG2E
    igate_j = tl.load(igate_ptr + gate_off + cols, mask=col_ok, other=0.0) * LOG2E
    # The factorised decay of the unmasked query tiles (rows below every key of this tile).
    col_term = tl.where(col_ok, igate_j - logf_j, float("-inf"))
    tile_ref = tl.max(col_term, axis=0)
    col_scale = tl.exp2(col_term - tile_ref)
    q_base = q_ptr + batch64 * stride_qb + head64 * stride_qh
    h_base = dh_ptr + batch64 * stride_hb + head64 * stride_hh
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=ACC)
    dv_acc = tl.zeros((BLOCK_N, BLOCK_DV), dtype=ACC)
    col_acc = tl.zeros((BLOCK_N,), dtype=ACC)
    lf_nat = tl.load(logf_ptr + gate_off + cols, mask=col_ok, other=0.0)
    ig_nat = tl.load(igate_ptr + gate_off + cols, mask=col_ok, other=0.0)
    # The dQ programs' column terms of these keys (their expression: see paired_products).
    pair_term = (ig_nat - lf_nat) * LOG2E
    refs = ref_ptr + bh.to(tl.int64) * tl.cdiv(seq_len, BLOCK_M)
    logf_h = logf_ptr + gate_off
    m2_h = m2_ptr + gate_off
    r_h = r_ptr + gate_off
    beta_h = beta_ptr + gate_off
    chunk = start_n // chunk_len
    window_end = tl.minimum((chunk + 1) * chunk_len, seq_len)
    # The query tile holding the diagonal, masked; the full tiles below it; the ragged end.
    first_m = (start_n // BLOCK_M) * BLOCK_M
    full_end = (first_m + BLOCK_M
                + tl.maximum(window_end - first_m - BLOCK_M, 0) // BLOCK_M * BLOCK_M)
    dk, dv_acc, col_acc = _dkv_step(
        dk, dv_acc, col_acc, k, v, col_scale, tile_ref, pair_term, cols, first_m, q_base,
        h_base, logf_h, m2_h, r_h, beta_h, refs, seq_len, logf_j, igate_j,
        stride_qs, stride_qd, stride_hs, stride_hd, scale,
        DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, True, ACC, INPUT_PRECISION, UPCAST,
        PAIRED)
    for start_m in range(first_m + BLOCK_M, full_end, BLOCK_M):
        dk, dv_acc, col_acc = _dkv_step(
            dk, dv_acc, col_acc, k, v, col_scale, tile_ref, pair_term, cols, start_m, q_base,
            h_base, logf_h, m2_h, r_h, beta_h, refs, seq_len, logf_j, igate_j,
            stride_qs, stride_qd, stride_hs, stride_hd, scale,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, False, ACC, INPUT_PRECISION, UPCAST,
            PAIRED)
    if full_end < window_end:
        dk, dv_acc, col_acc = _dkv_step(
            dk, dv_acc, col_acc, k, v, col_scale, tile_ref, pair_term, cols, full_end, q_base,
            h_base, logf_h, m2_h, r_h, beta_h, refs, seq_len, logf_j, igate_j,
            stride_qs, stride_qd, stride_hs, stride_hd, scale,
            DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, False, ACC, INPUT_PRECISION, UPCAST,
            PAIRED, CHECK_ROWS=True)
    dk = dk * scale
    if HAS_STATE:
        slots = tl.maximum(tl.cdiv(seq_len, chunk_len), 1)
        slot = bh.to(tl.int64) * (slots + 1) + chunk + 1
        dc = tl.load(dcstate_ptr + (bh.to(tl.int64) * slots + chunk) * DQK * DV
                     + dqk[:, None] * DV + dv[None, :],
                     mask=(dqk[:, None] < DQK) & (dv[None, :] < DV), other=0.0).to(k.dtype)
        dn = tl.load(dnstate_ptr + slot * DQK + dqk, mask=dqk < DQK, other=0.0)
        # Natural-log units, with the state kernels' expression for the same weight.
        logf_end = tl.load(logf_h + window_end - 1)
        # An m of -inf: the leaving state is empty, or the next chunk starts a new segment
        # (packed documents) and nothing reads it; its weights are 0, not exp(+inf).
        m_leaving = tl.load(mstate_ptr + slot)
        w = tl.where(col_ok, tl.exp(logf_end - lf_nat + ig_nat - m_leaving), 0.0)
        w = tl.where(m_leaving > float("-inf"), w, 0.0)
        dk_state = mma(v, tl.trans(dc), tl.zeros((BLOCK_N, BLOCK_DQK), dtype=ACC),
                       INPUT_PRECISION, UPCAST) + dn[None, :]
        dk = dk + w[:, None] * dk_state
        if PAIRED:
            state_col = w * tl.sum(k.to(ACC) * dk_state, axis=1)
            tl.store(state_col_ptr + gate_off + cols, state_col, mask=col_ok)
            col_acc += state_col
        dv_state = mma(k, dc, tl.zeros((BLOCK_N, BLOCK_DV), dtype=ACC),
                       INPUT_PRECISION, UPCAST)
        dv_acc = dv_acc + w[:, None] * dv_state
    mask = col_ok[:, None]
    tl.store(dk_ptr + gate_off * DQK + cols[:, None] * DQK + dqk[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=mask & (dqk[None, :] < DQK))
    tl.store(dv_ptr + gate_off * DV + cols[:, None] * DV + dv[None, :],
             dv_acc.to(dv_ptr.dtype.element_ty), mask=mask & (dv[None, :] < DV))
    if PAIRED:
        tl.store(col_grad_ptr + gate_off + cols, col_acc, mask=col_ok)
    else:
        tl.store(col_grad_ptr + gate_off + cols, tl.sum(k.to(ACC) * dk, axis=1), mask=col_ok)


def cell_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dh: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor, m_log2: torch.Tensor,
    r: torch.Tensor, beta: torch.Tensor,
    config: Optional[BackwardConfig] = None, chunk: int = 0,
    states: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    state_grads: Optional[tuple[torch.Tensor, torch.Tensor]] = None, paired: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           Optional[torch.Tensor]]:
    """``(dq, dk, dv, row_grad, col_grad, state_col)``: the cell's gradients for the raw
    h's gradient ``dh [B, NH, S, DV]`` (any strides). Per-row ``[B, NH, S]`` contiguous
    inputs in the accumulation dtype: the gates, the stabiliser in log2 units, ``r = 1 / (n + eps)``
    and ``beta`` (module docstring). ``row_grad``/``col_grad``: ``sum_j dlogD_ij`` and
    ``sum_i dlogD_ij`` with the stabiliser held constant (its gradient is the caller's).

    ``chunk`` > 0: the chunkwise form (``logf`` restarted at each chunk), with the forward's
    ``states`` ``(C, n, m)`` entering each chunk and ``state_grads`` ``(dC, dn)``, the
    gradients of the states leaving each chunk (:func:`.chunkwise.chunk_state_grads`).

    ``paired`` (16-bit inputs; a no-op otherwise, where nothing is rounded between the two
    sums): ``col_grad`` is summed from the products the dQ programs round, so that each pair
    ``(i, j)`` enters ``row_grad`` and ``col_grad`` alike (:func:`mlstm_dkv_kernel`); with
    states, ``state_col [B, NH, S]`` is the later chunks' share of ``col_grad`` (else None).
    Its cost: the dK/dV programs rebuild dQ's product below the diagonal (two more
    exponentials a row and a column of each tile, a rounding and three multiplies an
    element) and sum it with the scores along each key row; the dQ programs store one
    reference a tile."""
    batch, heads, seq, dqk = q.shape
    dvh = v.shape[-1]
    cfg = config or choose_backward_config(q, dqk, dvh)
    dq = torch.empty((batch, heads, seq, dqk), dtype=q.dtype, device=q.device)
    dk = torch.empty((batch, heads, seq, dqk), dtype=k.dtype, device=q.device)
    dv = torch.empty((batch, heads, seq, dvh), dtype=v.dtype, device=q.device)
    row_grad = torch.empty_like(logf)
    col_grad = torch.empty_like(logf)
    paired = paired and q.dtype in (torch.bfloat16, torch.float16)
    state_col = torch.empty_like(logf) if paired and states is not None else None
    if batch * heads == 0 or seq == 0:
        return dq, dk, dv, row_grad, col_grad, state_col
    if chunk and chunk % cfg.block_m:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_m ({cfg.block_m})")
    common = dict(
        DQK=dqk, DV=dvh, BLOCK_DQK=head_tile(dqk), BLOCK_DV=head_tile(dvh),
        BLOCK_M=cfg.block_m, HAS_STATE=states is not None, ACC=accumulation_dtype(q.dtype),
        INPUT_PRECISION=input_precision(q.dtype), UPCAST=upcast_dots(q), PAIRED=paired,
    )
    refs = (torch.empty((batch * heads, triton.cdiv(seq, cfg.block_m)), dtype=logf.dtype,
                        device=q.device) if paired else row_grad)
    cstates, nstates, mstates = states if states is not None else (r, r, r)
    dcstates, dnstates = state_grads if state_grads is not None else (r, r)
    chunk_len = chunk if chunk else seq
    strides = (*q.stride(), *k.stride(), *v.stride(), *dh.stride())
    scale = 1.0 / math.sqrt(dqk)
    mlstm_dq_kernel[(batch * heads * triton.cdiv(seq, cfg.block_m),)](
        q, k, v, dh, igate, logf, m_log2, r, beta, cstates, nstates, mstates, dq, row_grad,
        refs, seq, chunk_len, heads, *strides, scale, BLOCK_N=cfg.dq_tile, **common,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)
    mlstm_dkv_kernel[(batch * heads * triton.cdiv(seq, cfg.block_n),)](
        q, k, v, dh, igate, logf, m_log2, r, beta, dcstates, dnstates, mstates, dk, dv,
        col_grad, refs, state_col if state_col is not None else col_grad, seq, chunk_len, heads,
        *strides, scale, BLOCK_N=cfg.block_n, **common,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dq, dk, dv, row_grad, col_grad, state_col
