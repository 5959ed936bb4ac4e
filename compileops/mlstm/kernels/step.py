"""One recurrent mLSTM step (generation): kernel body, kernel and eager launcher.

State convention: :mod:`compileops.mlstm.recurrent` (``C [DQK, DV]``, ``n [DQK]``, ``m``
per (batch, head), stabilised, in the accumulation dtype; the empty state is ``(0, 0,
-inf)``). For the token ``(q, k, v, igate, logf = log sigmoid(fgate))``::

    m' = max(logf + m, igate)
    C' = exp(logf + m - m') C + exp(igate - m') k v^T         (n' alike, with k)
    h  = (q . C' / sqrt(DQK)) / (max(|q . n' / sqrt(DQK)|, exp(-m')) + eps)

Grid ``(B * NH, DV tiles)``. A program reads its ``[DQK, BLOCK_DV]`` slice of C in
``[BLOCK_K, BLOCK_DV]`` tiles, updates it and writes it to the fresh output state (the
inputs are never modified), accumulating ``q . C'`` for its columns of h as it goes. Every
program of a head computes ``m'`` and ``n'`` (the normaliser needs ``q . n'``), in the same
order, so they agree bitwise; the first stores them. No atomics: deterministic, and a
head's result depends on that head only (batch-invariant).

The state math is in the accumulation dtype whatever q, k and v are (bf16, fp16, fp32 or
fp64): there is no MMA, only outer products and reductions. ``1 / sqrt(DQK)`` is computed in
that dtype inside the kernel (a Python float argument would reach it as fp32).

With the multi-head layernorm (``HAS_NORM``) one program owns all of DV (a single DV tile,
``BLOCK_DV >= DV``), and applies :func:`.forward._layernorm_rows`, the parallel forward's.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from compileops._launch import next_power_of_2
from compileops.mlstm.kernels.common import accumulation_dtype
from compileops.mlstm.kernels.forward import _layernorm_rows

#: The largest ``[BLOCK_K, BLOCK_DV]`` state tile a program holds at once on a GPU.
MAX_TILE = 8192
#: DV columns per program without the norm on a GPU (more programs for small batches).
GPU_BLOCK_DV = 64


@triton.jit
def mlstm_step_kernel(
    q_ptr, k_ptr, v_ptr, igate_ptr, logf_ptr, c_ptr, n_ptr, m_ptr, weight_ptr, bias_ptr,
    out_ptr, c_new_ptr, n_new_ptr, m_new_ptr, num_heads,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kd,
    stride_vb, stride_vh, stride_vd,
    eps, norm_eps,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_STATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, RESIDUAL_WEIGHT: tl.constexpr, ACC: tl.constexpr,
):
    """Program ``(bh, pv)``: head ``bh = b * num_heads + head``, h columns ``pv * BLOCK_DV +
    arange(BLOCK_DV)``.

    * ``q_ptr, k_ptr [B, NH, DQK]``, ``v_ptr [B, NH, DV]``: any strides, given per dimension.
    * ``igate_ptr``, ``logf_ptr [B * NH]`` (``ACC``): the input-gate pre-activation and
      ``log sigmoid(fgate)``.
    * ``c_ptr [B * NH, DQK, DV]``, ``n_ptr [B * NH, DQK]``, ``m_ptr [B * NH]`` (``ACC``,
      contiguous): the state before the token, read when ``HAS_STATE`` (else the empty state).
    * Written: ``c_new_ptr``, ``n_new_ptr``, ``m_new_ptr``, same layout (n and m by the
      programs with ``pv == 0``); ``out_ptr [B * NH, DV]`` contiguous (``[B, NH, DV]`` or,
      normed, ``[B, NH * DV]``: the same memory): h, or the normed h, in its own dtype.
    * ``weight_ptr``, ``bias_ptr [NH * DV]``: the norm's affine (``RESIDUAL_WEIGHT``: the
      scale is ``1 + weight``).
    """
    bh = tl.program_id(0)
    pv = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    batch64 = (bh // num_heads).to(tl.int64)
    head = bh % num_heads
    q_base = q_ptr + batch64 * stride_qb + (head.to(tl.int64)) * stride_qh
    k_base = k_ptr + batch64 * stride_kb + (head.to(tl.int64)) * stride_kh
    v_base = v_ptr + batch64 * stride_vb + (head.to(tl.int64)) * stride_vh

    igate = tl.load(igate_ptr + bh64).to(ACC)
    logf = tl.load(logf_ptr + bh64).to(ACC)
    if HAS_STATE:
        m_old = tl.load(m_ptr + bh64).to(ACC)
        m_new = tl.maximum(logf + m_old, igate)
        decay = tl.exp(logf + m_old - m_new)
    else:  # the empty state: m = -inf, so m' = igate and the old state counts for nothing
        m_new = igate
    gain = tl.exp(igate - m_new)
    if ACC == tl.float64:
        scale = 1.0 / tl.sqrt(tl.full((), DQK, dtype=ACC))
    else:  # fp32's tl.sqrt may be approximate
        scale = 1.0 / tl.sqrt_rn(tl.full((), DQK, dtype=ACC))

    cols = pv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    col_ok = cols < DV
    v = tl.load(v_base + cols * stride_vd, mask=col_ok, other=0.0).to(ACC)
    gain_v = gain * v
    numerator = tl.zeros((BLOCK_DV,), dtype=ACC)
    q_dot_n = tl.zeros((BLOCK_K,), dtype=ACC)
    c_base = bh64 * DQK * DV
    # Only the first DV block writes n and m. A scalar joins a block mask through tl.where:
    # & widens it to int32 under triton 3.9's interpreter, whose loads take bool masks.
    first = pv == 0
    for start in range(0, DQK, BLOCK_K):
        rows = start + tl.arange(0, BLOCK_K)
        row_ok = rows < DQK
        q = tl.load(q_base + rows * stride_qd, mask=row_ok, other=0.0).to(ACC)
        k = tl.load(k_base + rows * stride_kd, mask=row_ok, other=0.0).to(ACC)
        tile = c_base + rows[:, None] * DV + cols[None, :]
        tile_ok = row_ok[:, None] & col_ok[None, :]
        c = k[:, None] * gain_v[None, :]
        n = gain * k
        if HAS_STATE:
            c += decay * tl.load(c_ptr + tile, mask=tile_ok, other=0.0)
            n += decay * tl.load(n_ptr + bh64 * DQK + rows, mask=row_ok, other=0.0)
        tl.store(c_new_ptr + tile, c, mask=tile_ok)
        tl.store(n_new_ptr + bh64 * DQK + rows, n, mask=tl.where(first, row_ok, False))
        numerator += tl.sum(q[:, None] * c, axis=0)
        q_dot_n += q * n
    tl.store(m_new_ptr + bh64, m_new, mask=first)

    normaliser = tl.maximum(tl.abs(tl.sum(q_dot_n, axis=0) * scale), tl.exp(-m_new))
    h = numerator * scale / (normaliser + eps)
    out = out_ptr + bh64 * DV + cols
    if HAS_NORM:
        # The parallel forward's norm takes rows and their scale; h is already scaled.
        y = _layernorm_rows(h[None, :], tl.full((1,), 1.0, dtype=h.dtype), weight_ptr,
                            bias_ptr, head, norm_eps, DV, BLOCK_DV, HAS_WEIGHT, HAS_BIAS,
                            RESIDUAL_WEIGHT)
        tl.store(out[None, :], y.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])
    else:
        tl.store(out, h.to(out_ptr.dtype.element_ty), mask=col_ok)


def choose_blocks(q: torch.Tensor, dqk: int, dv: int, normed: bool) -> tuple[int, int]:
    """``(block_k, block_dv)``: on a GPU, DV tiles of 64 (normed: all of DV) and DQK tiles
    that keep the state tile at most ``MAX_TILE`` elements; under the interpreter (CPU
    tensors) one tile of each, the fewest numpy ops."""
    full_k, full_dv = max(16, next_power_of_2(dqk)), max(16, next_power_of_2(dv))
    if q.device.type == "cpu":
        return full_k, full_dv
    block_dv = full_dv if normed else min(full_dv, GPU_BLOCK_DV)
    return max(1, min(full_k, MAX_TILE // block_dv)), block_dv


def mlstm_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor], normed: bool,
    norm_eps: float, eps: float, residual_weight: bool,
    blocks: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager launch: ``(out, C', n', m')``, out ``[B, NH * DV]`` when ``normed`` else ``[B, NH,
    DV]`` in v's dtype, the new state in the accumulation dtype, all freshly allocated.

    ``igate``, ``logf [B, NH]`` and the state ``(C, n, m)`` (None: the empty state) in the
    accumulation dtype; the state, gates and norm affine are read densely (made contiguous
    here when they are not). ``blocks``: ``(block_k, block_dv)`` powers of two, to override
    :func:`choose_blocks` (tests use small ones to run several tiles); normed needs
    ``block_dv >= DV``.
    """
    batch, heads, dqk = q.shape
    dv = v.shape[-1]
    acc = logf.dtype
    block_k, block_dv = blocks or choose_blocks(q, dqk, dv, normed)
    if normed and block_dv < dv:
        raise ValueError(f"the normed step needs one DV tile: block_dv ({block_dv}) < DV ({dv})")
    out = v.new_empty((batch, heads * dv) if normed else (batch, heads, dv))
    c_new = q.new_empty((batch, heads, dqk, dv), dtype=acc)
    n_new = q.new_empty((batch, heads, dqk), dtype=acc)
    m_new = q.new_empty((batch, heads), dtype=acc)
    if batch * heads == 0:
        return out, c_new, n_new, m_new
    if state is not None:
        c, n, m = (t.contiguous() for t in state)
    else:
        c, n, m = c_new, n_new, m_new  # not read
    grid = (batch * heads, max(1, triton.cdiv(dv, block_dv)))
    mlstm_step_kernel[grid](
        q, k, v, igate.contiguous(), logf.contiguous(), c, n, m,
        norm_weight.contiguous() if norm_weight is not None else m_new,
        norm_bias.contiguous() if norm_bias is not None else m_new,
        out, c_new, n_new, m_new, heads,
        *q.stride(), *k.stride(), *v.stride(), eps, norm_eps,
        DQK=dqk, DV=dv, BLOCK_K=block_k, BLOCK_DV=block_dv, HAS_STATE=state is not None,
        HAS_NORM=normed, HAS_WEIGHT=norm_weight is not None, HAS_BIAS=norm_bias is not None,
        RESIDUAL_WEIGHT=residual_weight, ACC=accumulation_dtype(q.dtype),
        num_warps=4,
    )
    return out, c_new, n_new, m_new
