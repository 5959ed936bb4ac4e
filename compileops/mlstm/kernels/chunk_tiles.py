"""The chunkwise form's cell kernels: the parallel form's tile bodies (:func:`.forward.
mlstm_forward_tile`, :func:`.backward.mlstm_dq_tile`, :func:`.backward.mlstm_dkv_tile`) run
per document, plus the states entering each chunk.

Grid: ``B * NH * U * (CHUNK / BLOCK)`` programs, head-major, then the chunk slots
(:mod:`compileops.mlstm.documents`), then the tiles of a chunk. A program finds its
document and chunk on the device (:mod:`.documents`); one past the document's end (a
document's partial last chunk, an unused slot) does nothing. The rest call the tile body
with every pointer moved to the document's first row and first state slot, as head 0 of a
batch of one, with the document's length as the sequence length: the body computes what it
computes for the document alone, in the same order, and masks every row past its end. So a
document's outputs and gradients are bitwise those of the document alone, whatever the
other documents hold (NaN and Inf included), and without packed documents (one document
per batch row) nothing changes.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.mlstm.documents import DocumentTables
from compileops.mlstm.kernels import chunk_gates
from compileops.mlstm.kernels.backward import mlstm_dkv_tile, mlstm_dq_tile
from compileops.mlstm.kernels.common import accumulation_dtype, input_precision, upcast_dots
from compileops.mlstm.kernels.config import (
    BackwardConfig,
    ForwardConfig,
    choose_backward_config,
    choose_forward_config,
    head_tile,
)
from compileops.mlstm.kernels.documents import (
    documents_valid,
    locate_slot,
    split_program,
    state_slot_offsets,
)
from compileops.mlstm.kernels.forward import mlstm_forward_tile


@triton.jit
def chunk_forward_kernel(
    q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, term_ptr, colmax_ptr, weight_ptr, bias_ptr,
    h_ptr, m_ptr, b_ptr, cstate_ptr, nstate_ptr, mstate_ptr, out_ptr,
    bounds_ptr, slot_first_ptr, slot_doc_ptr, seq_len, num_heads, num_docs, num_slots,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    scale, eps, norm_eps,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RESIDUAL_WEIGHT: tl.constexpr, SAVE_H: tl.constexpr,
    ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """The arguments of :func:`.forward.mlstm_forward_kernel` (``HAS_STATE`` always: the
    states entering each chunk, in the slots of :mod:`compileops.mlstm.documents`), plus
    the document tables. Rows of an invalid ``cu_seqlens`` come out NaN."""
    bh, slot, tile = split_program(tl.program_id(0), num_slots, CHUNK // BLOCK_M)
    doc, chunk, start, length = locate_slot(slot, bounds_ptr, slot_first_ptr, slot_doc_ptr,
                                            num_docs)
    start_m = chunk * CHUNK + tile * BLOCK_M
    if start_m < length:
        batch64 = (bh // num_heads).to(tl.int64)
        head = bh % num_heads
        head64 = head.to(tl.int64)
        start64 = start.to(tl.int64)
        rows_off = bh.to(tl.int64) * seq_len + start64
        c_slot, nm_slot = state_slot_offsets(bh, doc, slot - chunk, num_slots, num_docs)
        out = mlstm_forward_tile(
            q_ptr + batch64 * stride_qb + head64 * stride_qh + start64 * stride_qs,
            k_ptr + batch64 * stride_kb + head64 * stride_kh + start64 * stride_ks,
            v_ptr + batch64 * stride_vb + head64 * stride_vh + start64 * stride_vs,
            igate_ptr + rows_off, logf_ptr + rows_off, term_ptr + rows_off,
            colmax_ptr + rows_off, weight_ptr + head * DV, bias_ptr + head * DV,
            h_ptr + rows_off * DV, m_ptr + rows_off, b_ptr + rows_off,
            cstate_ptr + c_slot * DQK * DV, nstate_ptr + nm_slot * DQK, mstate_ptr + nm_slot,
            bh * 0, start_m, length, CHUNK, 1,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_vb, stride_vh, stride_vs, stride_vd,
            scale, eps, norm_eps, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N,
            HAS_NORM, HAS_WEIGHT, HAS_BIAS, RESIDUAL_WEIGHT, SAVE_H, True, ACC,
            INPUT_PRECISION, UPCAST,
        )
        out = tl.where(documents_valid(bounds_ptr, num_docs), out, float("nan"))
        rows = start_m + tl.arange(0, BLOCK_M)
        dv = tl.arange(0, BLOCK_DV)
        base = out_ptr + batch64 * stride_ob + head64 * stride_oh + start64 * stride_os
        tl.store(base + rows[:, None] * stride_os + dv[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < length) & (dv[None, :] < DV))


@triton.jit
def chunk_dq_kernel(
    q_ptr, k_ptr, v_ptr, dh_ptr, igate_ptr, logf_ptr, m2_ptr, r_ptr, beta_ptr,
    cstate_ptr, nstate_ptr, mstate_ptr, dq_ptr, row_grad_ptr,
    bounds_ptr, slot_first_ptr, slot_doc_ptr, seq_len, num_heads, num_docs, num_slots,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """:func:`.backward.mlstm_dq_kernel`'s arguments (with the states), plus the document
    tables."""
    bh, slot, tile = split_program(tl.program_id(0), num_slots, CHUNK // BLOCK_M)
    doc, chunk, start, length = locate_slot(slot, bounds_ptr, slot_first_ptr, slot_doc_ptr,
                                            num_docs)
    start_m = chunk * CHUNK + tile * BLOCK_M
    if start_m < length:
        batch64 = (bh // num_heads).to(tl.int64)
        head64 = (bh % num_heads).to(tl.int64)
        start64 = start.to(tl.int64)
        rows_off = bh.to(tl.int64) * seq_len + start64
        c_slot, nm_slot = state_slot_offsets(bh, doc, slot - chunk, num_slots, num_docs)
        mlstm_dq_tile(
            q_ptr + batch64 * stride_qb + head64 * stride_qh + start64 * stride_qs,
            k_ptr + batch64 * stride_kb + head64 * stride_kh + start64 * stride_ks,
            v_ptr + batch64 * stride_vb + head64 * stride_vh + start64 * stride_vs,
            dh_ptr + batch64 * stride_hb + head64 * stride_hh + start64 * stride_hs,
            igate_ptr + rows_off, logf_ptr + rows_off, m2_ptr + rows_off, r_ptr + rows_off,
            beta_ptr + rows_off, cstate_ptr + c_slot * DQK * DV, nstate_ptr + nm_slot * DQK,
            mstate_ptr + nm_slot, dq_ptr + rows_off * DQK, row_grad_ptr + rows_off,
            bh * 0, start_m, length, CHUNK, 1,
            stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks,
            stride_kd, stride_vb, stride_vh, stride_vs, stride_vd, stride_hb, stride_hh,
            stride_hs, stride_hd, scale, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N,
            True, ACC, INPUT_PRECISION, UPCAST)


@triton.jit
def chunk_dkv_kernel(
    q_ptr, k_ptr, v_ptr, dh_ptr, igate_ptr, logf_ptr, m2_ptr, r_ptr, beta_ptr,
    dcstate_ptr, dnstate_ptr, mstate_ptr, dk_ptr, dv_ptr, col_grad_ptr,
    bounds_ptr, slot_first_ptr, slot_doc_ptr, seq_len, num_heads, num_docs, num_slots,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """:func:`.backward.mlstm_dkv_kernel`'s arguments (with the states' gradients), plus the
    document tables."""
    bh, slot, tile = split_program(tl.program_id(0), num_slots, CHUNK // BLOCK_N)
    doc, chunk, start, length = locate_slot(slot, bounds_ptr, slot_first_ptr, slot_doc_ptr,
                                            num_docs)
    start_n = chunk * CHUNK + tile * BLOCK_N
    if start_n < length:
        batch64 = (bh // num_heads).to(tl.int64)
        head64 = (bh % num_heads).to(tl.int64)
        start64 = start.to(tl.int64)
        rows_off = bh.to(tl.int64) * seq_len + start64
        c_slot, nm_slot = state_slot_offsets(bh, doc, slot - chunk, num_slots, num_docs)
        mlstm_dkv_tile(
            q_ptr + batch64 * stride_qb + head64 * stride_qh + start64 * stride_qs,
            k_ptr + batch64 * stride_kb + head64 * stride_kh + start64 * stride_ks,
            v_ptr + batch64 * stride_vb + head64 * stride_vh + start64 * stride_vs,
            dh_ptr + batch64 * stride_hb + head64 * stride_hh + start64 * stride_hs,
            igate_ptr + rows_off, logf_ptr + rows_off, m2_ptr + rows_off, r_ptr + rows_off,
            beta_ptr + rows_off, dcstate_ptr + c_slot * DQK * DV,
            dnstate_ptr + nm_slot * DQK, mstate_ptr + nm_slot, dk_ptr + rows_off * DQK,
            dv_ptr + rows_off * DV, col_grad_ptr + rows_off,
            bh * 0, start_n, length, CHUNK, 1,
            stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks,
            stride_kd, stride_vb, stride_vh, stride_vs, stride_vd, stride_hb, stride_hh,
            stride_hs, stride_hd, scale, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N,
            True, ACC, INPUT_PRECISION, UPCAST)


def _output_strides(out: torch.Tensor, normed: bool, dv: int) -> tuple[int, int, int, int]:
    """(batch, head, seq, channel) strides of ``[B, S, NH * DV]`` (normed) or ``[B, NH, S,
    DV]``."""
    if normed:
        so_b, so_s, so_c = out.stride()
        return so_b, dv * so_c, so_s, so_c
    return tuple(out.stride())


def chunk_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    normed: bool, norm_eps: float, eps: float, residual_weight: bool, save_h: bool,
    chunk: int, states: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    tables: DocumentTables, config: Optional[ForwardConfig] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Eager launch: ``(out, h_raw or None, m_log2 [B, NH, S], b [B, NH, S])`` as
    :func:`.forward.mlstm_forward` returns them, for the chunkwise form: ``logf`` restarted
    at each chunk of each document, the ``states`` entering each chunk
    (:func:`.chunkwise.chunk_states`), ``igate``/``logf`` contiguous in the accumulation
    dtype."""
    batch, heads, seq, dqk = q.shape
    dv = v.shape[-1]
    cfg = config or choose_forward_config(q, dqk, dv, with_state=True, max_block_m=chunk)
    out = v.new_empty((batch, seq, heads * dv) if normed else (batch, heads, seq, dv))
    h_raw = v.new_empty((batch, heads, seq, dv)) if save_h else None
    m = torch.empty((batch, heads, seq), dtype=logf.dtype, device=q.device)
    b = torch.empty_like(m)
    if batch * heads == 0 or seq == 0:
        return out, h_raw, m, b
    if chunk % cfg.block_m:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_m ({cfg.block_m})")
    terms, colmax = chunk_gates.column_terms(igate, logf, chunk, tables)
    grid = (batch * heads * tables.slots * (chunk // cfg.block_m),)
    chunk_forward_kernel[grid](
        q, k, v, igate, logf, terms, colmax,
        norm_weight if norm_weight is not None else m,
        norm_bias if norm_bias is not None else m,
        h_raw if save_h else m, m, b, *states, out,
        tables.bounds, tables.slot_first, tables.slot_doc, seq, heads, tables.docs,
        tables.slots, *q.stride(), *k.stride(), *v.stride(),
        *_output_strides(out, normed, dv), 1.0 / math.sqrt(dqk), eps, norm_eps,
        DQK=dqk, DV=dv, BLOCK_DQK=head_tile(dqk), BLOCK_DV=head_tile(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CHUNK=chunk,
        HAS_NORM=normed, HAS_WEIGHT=norm_weight is not None, HAS_BIAS=norm_bias is not None,
        RESIDUAL_WEIGHT=residual_weight, SAVE_H=save_h,
        ACC=accumulation_dtype(q.dtype), INPUT_PRECISION=input_precision(q.dtype),
        UPCAST=upcast_dots(q), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, h_raw, m, b


def chunk_cell_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dh: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor, m_log2: torch.Tensor,
    r: torch.Tensor, beta: torch.Tensor, chunk: int,
    states: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    state_grads: tuple[torch.Tensor, torch.Tensor], tables: DocumentTables,
    config: Optional[BackwardConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, row_grad, col_grad)`` as :func:`.backward.cell_backward` returns them,
    for the chunkwise form: the forward's ``states`` entering each chunk and
    ``state_grads``, the gradients of the states leaving each chunk
    (:func:`.chunkwise.chunk_state_grads`)."""
    batch, heads, seq, dqk = q.shape
    dvh = v.shape[-1]
    cfg = config or choose_backward_config(q, dqk, dvh).capped(chunk)
    dq = torch.empty((batch, heads, seq, dqk), dtype=q.dtype, device=q.device)
    dk = torch.empty((batch, heads, seq, dqk), dtype=k.dtype, device=q.device)
    dv = torch.empty((batch, heads, seq, dvh), dtype=v.dtype, device=q.device)
    row_grad = torch.empty_like(logf)
    col_grad = torch.empty_like(logf)
    if batch * heads == 0 or seq == 0:
        return dq, dk, dv, row_grad, col_grad
    if chunk % cfg.block_m:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_m ({cfg.block_m})")
    common = dict(
        DQK=dqk, DV=dvh, BLOCK_DQK=head_tile(dqk), BLOCK_DV=head_tile(dvh),
        BLOCK_M=cfg.block_m, CHUNK=chunk, ACC=accumulation_dtype(q.dtype),
        INPUT_PRECISION=input_precision(q.dtype), UPCAST=upcast_dots(q),
    )
    docs = (tables.bounds, tables.slot_first, tables.slot_doc, seq, heads, tables.docs,
            tables.slots)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dh.stride())
    scale = 1.0 / math.sqrt(dqk)
    per_head = batch * heads * tables.slots
    chunk_dq_kernel[(per_head * (chunk // cfg.block_m),)](
        q, k, v, dh, igate, logf, m_log2, r, beta, *states, dq, row_grad, *docs, *strides,
        scale, BLOCK_N=cfg.dq_tile, **common, num_warps=cfg.dq_warps,
        num_stages=cfg.dq_stages)
    chunk_dkv_kernel[(per_head * (chunk // cfg.block_n),)](
        q, k, v, dh, igate, logf, m_log2, r, beta, *state_grads, states[2], dk, dv, col_grad,
        *docs, *strides, scale, BLOCK_N=cfg.block_n, **common, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dq, dk, dv, row_grad, col_grad
