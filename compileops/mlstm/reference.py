"""Ground truth of the mLSTM cell and its multi-head layernorm, in plain PyTorch.

The math only (../../docs and REFERENCE.md section 3): readable, materialises the ``S x S``
decay matrix, correct in fp64. Autograd through these functions is the gradient contract the
kernels are held to.

Shapes: ``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, gate pre-activations ``igate, fgate
[B, NH, S]``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


#: Natural-log to log2 units: the kernels keep stabilisers and gate terms in log2 units.
LOG2E = 1.0 / math.log(2.0)


def gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of gate cumsums, stabilisers and norm statistics: fp32, or fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def floor_input_gate(igate: torch.Tensor) -> torch.Tensor:
    """``igate`` with every value below ``-1e30`` (``-inf``: a closed input gate) raised to
    ``-1e30``, the floor of the pad rows of packed documents.

    Why: a row before which every input gate is ``-inf`` (a closed gate at the first row of a
    sequence or document) has nothing in its cell and the stabiliser ``m = -inf``, so its
    weights ``exp(logD - m)`` would be ``exp(-inf - -inf)``, NaN. With the floor ``m`` is
    finite, ``exp(-m)`` overflows to ``inf``, and ``h = 0``: the limit of ``igate -> -inf``.
    Exact for every other input: a floored term weighs ``exp(-1e30 + ...) = 0`` against any
    row whose ``exp(-m)`` is finite, and a row whose ``exp(-m)`` overflows has ``h = 0``
    either way; its gradient is 0, as the weight it multiplies is. What moves is the
    stabiliser reported for such rows, ``m`` (about -1e30 where it was lower or ``-inf``),
    and a state's ``(C, n, m)`` there, whose ``C exp(m)`` is still 0. NaN stays NaN.
    A literal: a module-level float becomes a symbolic input under ``dynamic=True``."""
    return igate.clamp(min=-1e30)


def log_forget_cumsum(fgate: torch.Tensor) -> torch.Tensor:
    """``F_t = sum_{tau<=t} log sigmoid(fgate_tau)`` ``[B, NH, S]`` in the accumulation dtype."""
    return torch.cumsum(F.logsigmoid(fgate.to(gate_dtype(fgate.dtype))), dim=-1)


def cell(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, fgate: torch.Tensor, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mlstm_parallel`'s math, returning ``(h, b, m)`` in the accumulation dtype, with
    the signed row sum ``b = sum_j C_ij`` (``n = max(|b|, exp(-m))``), which the backward's
    normaliser term needs."""
    acc = gate_dtype(q.dtype)
    return cell_from_log_gates(q, k, v, floor_input_gate(igate.to(acc)),
                               log_forget_cumsum(fgate.to(acc)), eps)


def cell_from_log_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, log_f: torch.Tensor, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cell` from the input gate and ``F = cumsum(log sigmoid(fgate))``, both
    ``[B, NH, S]`` in the accumulation dtype."""
    acc = gate_dtype(q.dtype)
    seq = q.shape[-2]
    if seq == 0:  # max over an empty row is undefined; an empty sequence has empty results
        return v.new_zeros(v.shape, dtype=acc), log_f.new_zeros(log_f.shape), \
            log_f.new_zeros(log_f.shape)
    log_d = log_f[..., :, None] - log_f[..., None, :] + igate[..., None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    log_d = log_d.masked_fill(~causal, float("-inf"))  # [B, NH, S, S]
    m = log_d.max(dim=-1).values  # [B, NH, S]; its gradient goes to the first max
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    # Selected, not multiplied by exp(-inf) = 0: a non-finite k_j makes scores[:, j] NaN for
    # every row, and NaN * 0 would reach the rows before j.
    c = torch.where(causal, scores * torch.exp(log_d - m[..., None]), 0.0)
    b = c.sum(dim=-1)
    n = torch.maximum(b.abs(), torch.exp(-m))
    h = masked_product(c, v.to(acc)) / (n[..., None] + eps)
    return h, b, m


def masked_product(c: torch.Tensor, v: torch.Tensor,
                   live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``c @ v`` for ``c [..., S, T]`` that is 0 wherever ``live [S, T]`` (bool) is False,
    ``v [..., T, DV]``, causal under non-finite values: a plain product multiplies every
    ``v_j`` by ``c_ij = 0`` too, and ``0 * NaN`` would reach rows that must not see j. Here
    a non-finite ``v[j, d]`` makes ``out[i, d]`` NaN exactly where ``live[i, j]``, and no
    other entry changes. ``live`` None: causal (``j <= i``, S = T), counted by a cumulative
    sum (``O(S * DV)``, no second ``S x S`` product); else one ``[S, T] @ [T, DV]`` product of
    0/1 values. No branch on the data, so it traces whole under ``torch.compile``."""
    finite = torch.isfinite(v)
    out = c @ torch.where(finite, v, 0.0)
    bad = (~finite).to(c.dtype)
    hits = torch.cumsum(bad, dim=-2) if live is None else live.to(c.dtype) @ bad
    return torch.where(hits > 0, float("nan"), out)


def mlstm_parallel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, fgate: torch.Tensor, eps: float = 1e-6, round_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stabilised parallel mLSTM: ``(h [B, NH, S, DV], n [B, NH, S], m [B, NH, S])``.

    ``F_t = sum_{tau<=t} log sigmoid(fgate_tau)``; ``logD_ij = F_i - F_j + igate_j`` for
    ``j <= i`` (else -inf); ``m_i = max_j logD_ij``; ``C = (q k^T / sqrt(DQK)) * exp(logD - m)``;
    ``n_i = max(|sum_j C_ij|, exp(-m_i))``; ``h_i = sum_j C_ij v_j / (n_i + eps)``.
    Gates, ``m`` and ``n`` are computed in fp32 (fp64 for fp64 inputs); ``h`` is returned in
    v's dtype (in that accumulation dtype if not ``round_h``, as the fused norm reads it).

    Causal under NaN and Inf: a non-finite input at position t never reaches a row before t
    (``h``, ``n`` and ``m`` of the rows ``i < t`` are those of the same call with any finite
    value there). From t on it enters the arithmetic as it is: a non-finite ``k_t`` makes
    every column of h non-finite (``q_t``: row t's only), a non-finite ``v_t[d]`` column d
    (as NaN), a NaN gate, ``igate = +inf`` or ``fgate = -inf`` every column; the limits that
    are numbers (``igate = -inf``, a closed input gate; ``fgate = +inf``, an open forget
    gate) give numbers: ``igate = -inf`` before anything entered the cell gives ``h = 0``
    (:func:`floor_input_gate`).
    """
    h, b, m = cell(q, k, v, igate, fgate, eps)
    n = torch.maximum(b.abs(), torch.exp(-m))
    return (h.to(v.dtype) if round_h else h), n, m


def multihead_layernorm(
    h: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6, residual_weight: bool = False, out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Per-head layernorm of ``h [B, NH, S, DV]`` over DV -> ``[B, S, NH * DV]``.

    Mean and biased variance per head in fp32 (fp64 for fp64); affine per channel with
    ``weight [NH * DV]`` (``1 + weight`` when ``residual_weight``) and ``bias [NH * DV]``, each
    optional. The result is in ``out_dtype`` (default h's dtype), laid out as the xLSTM
    block consumes it next.
    """
    b, nh, s, dv = h.shape
    x = h.to(gate_dtype(h.dtype))
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).square().mean(dim=-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)  # [B, NH, S, DV]
    y = y.transpose(1, 2).reshape(b, s, nh * dv)
    if weight is not None:
        y = y * ((1 + weight.to(y.dtype)) if residual_weight else weight.to(y.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype or h.dtype)


def mlstm(
    q, k, v, igate, fgate, norm_weight=None, norm_bias=None, norm_eps: float = 1e-6,
    eps: float = 1e-6, residual_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cell, then the norm when a norm weight or bias is given: ``(out, n, m)`` with out
    ``[B, S, NH * DV]`` normed or ``[B, NH, S, DV]`` raw. The norm reads the unrounded h."""
    if norm_weight is None and norm_bias is None:
        return mlstm_parallel(q, k, v, igate, fgate, eps)
    h, n, m = mlstm_parallel(q, k, v, igate, fgate, eps, round_h=False)
    out = multihead_layernorm(h, norm_weight, norm_bias, norm_eps, residual_weight, v.dtype)
    return out, n, m
