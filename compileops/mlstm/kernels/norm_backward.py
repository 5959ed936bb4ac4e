"""The multi-head layernorm's backward and the per-row terms of the mLSTM cell's backward:
a row preprocess before the dQ and dK/dV programs (:mod:`.backward`).

Per row of ``[B, NH, S]``: the gradient of the raw h through the per-head norm (when
normed), with partial sums of the norm weight's and bias's gradients, and the terms the
cell's backward reads: ``r_i = 1 / (n_i + eps)``, ``beta_i`` (the normaliser's gradient) and
the stabiliser's gradient ``dm``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.mlstm.kernels.common import accumulation_dtype
from compileops.mlstm.kernels.config import BackwardConfig, head_tile, norm_rows_per_program

@triton.jit
def norm_backward_rows(
    grad_ptr, h_ptr, weight_ptr, dh_ptr, m2_ptr, rowsum_ptr, r_ptr, beta_ptr, dm_ptr,
    beta_exact_ptr, bh, start_s, seq_len, num_heads,
    stride_gb, stride_gh, stride_gs, stride_gd,
    norm_eps, eps,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, RESIDUAL_WEIGHT: tl.constexpr,
    EXACT_BETA: tl.constexpr, ACC: tl.constexpr,
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
    * With ``EXACT_BETA`` also ``beta_exact_ptr [B * NH, S]`` (``ACC``): beta from the
      unrounded dh. A norm after the cell makes ``<dh, h>`` vanish in exact arithmetic (the
      norm does not see h's scale), so beta is rounding noise: the cell's gate gradients
      want that noise (their numerator part, which reads the rounded dh, carries the same),
      the initial normaliser state's gradient, which has no numerator part, does not.
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
        # The cell sees dh rounded to h's dtype: its normaliser term (hdot below) takes the
        # same rounded dh, so the numerator's and the normaliser's parts of the gate
        # gradients cancel as they do in exact arithmetic.
        dh_exact = dh
        dh = dh.to(dh_ptr.dtype.element_ty)
        tl.store(dh_ptr + h_off + rows[:, None] * DV + dv[None, :], dh, mask=mask)
        dh = dh.to(ACC)
        dweight = tl.sum(dy * y_hat, axis=0)
        dbias = tl.sum(dy, axis=0)
    else:
        dh = dy
        dh_exact = dy
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
    if EXACT_BETA:
        hdot_exact = tl.sum(dh_exact * h, axis=1)
        tl.store(beta_exact_ptr + row_off,
                 tl.where(tl.abs(row_sum) > floor, -r * hdot_exact * sign, 0.0), mask=row_ok)
    return dweight, dbias


@triton.jit
def norm_backward_kernel(
    grad_ptr, h_ptr, weight_ptr, dh_ptr, m2_ptr, rowsum_ptr, r_ptr, beta_ptr, dm_ptr,
    beta_exact_ptr, dweight_ptr, dbias_ptr, seq_len, num_heads, rows_per_program,
    stride_gb, stride_gh, stride_gs, stride_gd, norm_eps, eps,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, RESIDUAL_WEIGHT: tl.constexpr,
    EXACT_BETA: tl.constexpr, ACC: tl.constexpr,
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
            beta_exact_ptr, bh, start_s, seq_len, num_heads, stride_gb, stride_gh, stride_gs,
            stride_gd, norm_eps, eps, DV, BLOCK_DV, BLOCK_ROWS, HAS_NORM, HAS_WEIGHT,
            RESIDUAL_WEIGHT, EXACT_BETA, ACC,
        )
        dweight += rows_dweight
        dbias += rows_dbias
    if HAS_NORM:
        dv = tl.arange(0, BLOCK_DV)
        part = (tl.program_id(1).to(tl.int64) * tl.num_programs(0) + bh) * DV + dv
        tl.store(dweight_ptr + part, dweight, mask=dv < DV)
        tl.store(dbias_ptr + part, dbias, mask=dv < DV)


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
    residual_weight: bool, config: BackwardConfig, *,
    beta_exact: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
           Optional[torch.Tensor]]:
    """``(dh, r, beta, dm, dweight_parts, dbias_parts)``: the raw h's gradient (the output's
    own gradient when not ``normed``), the cell backward's per-row terms ``[B, NH, S]`` from
    the forward's ``m_log2`` and ``row_sum`` (contiguous), and, when normed, partial sums of
    the norm's weight and bias gradients to reduce. ``beta_exact`` (``[B, NH, S]`` like
    ``m_log2``, written when given): beta from the unrounded dh (:func:`norm_backward_rows`)."""
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
            beta_exact if beta_exact is not None else r,
            parts_w if normed else r, parts_b if normed else r,
            seq, heads, span, *_dims(grad_out, normed, dv), norm_eps, eps,
            DV=dv, BLOCK_DV=head_tile(dv), BLOCK_ROWS=config.block_rows,
            HAS_NORM=normed, HAS_WEIGHT=norm_weight is not None,
            RESIDUAL_WEIGHT=residual_weight, EXACT_BETA=beta_exact is not None,
            ACC=accumulation_dtype(h.dtype),
            num_warps=config.norm_warps,
        )
    return dh, r, beta, dm, parts_w, parts_b
