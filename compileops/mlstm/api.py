"""The public mLSTM functions: :func:`mlstm` and :func:`mlstm_with_stats`."""
from __future__ import annotations

from typing import Optional

import torch

from compileops.mlstm.checks import check_gates_floating, check_kernel
from compileops.mlstm.op import mlstm_parallel_op
from compileops.mlstm.gates import log_forget_op
from compileops.mlstm.reference import gate_dtype


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors)


def mlstm_with_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None,
    norm_bias: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, eps: float = 1e-6,
    residual_weight: bool = False, kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mlstm`, also returning the normaliser and the stabiliser: ``(out, n [B, NH, S],
    m [B, NH, S])`` in fp32 (fp64 for fp64 inputs). ``n`` and ``m`` carry no gradient."""
    check_kernel(kernel)
    normed = norm_weight is not None or norm_bias is not None
    save_h = normed and _needs_grad(q, k, v, igate, fgate, norm_weight, norm_bias)
    check_gates_floating(igate, fgate)  # the rest is checked by the op, eagerly and traced
    acc = gate_dtype(q.dtype)
    logf = log_forget_op(fgate.to(acc))
    out, _, m_log2, b = mlstm_parallel_op(q, k, v, igate.to(acc), logf, norm_weight, norm_bias,
                                          normed, float(norm_eps), float(eps),
                                          bool(residual_weight), save_h)
    n = torch.maximum(b.abs(), torch.exp2(-m_log2))
    # ln 2 as a literal here: a module-level float becomes a symbolic input under dynamic=True.
    return out, n, m_log2 * 0.6931471805599453


def mlstm(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, *, norm_weight: Optional[torch.Tensor] = None,
    norm_bias: Optional[torch.Tensor] = None, norm_eps: float = 1e-6, eps: float = 1e-6,
    residual_weight: bool = False, kernel: str = "auto",
) -> torch.Tensor:
    """The mLSTM cell (stabilised, parallel form), with the multi-head layernorm fused when
    ``norm_weight`` or ``norm_bias`` is given.

    Shapes: ``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, the gate pre-activations
    ``igate, fgate [B, NH, S]``; ``norm_weight, norm_bias [NH * DV]`` (per channel,
    ``residual_weight=True`` scales by ``1 + weight``).

    Returns ``[B, S, NH * DV]`` when normed: the layout the xLSTM block consumes next (it
    transposes and reshapes there anyway), so an output gate ``sigmoid(o) * out`` and a cast
    fuse into the compiled kernel's epilogue. Without a norm: the raw ``h [B, NH, S, DV]``.

    Math (docs: ``compileops/mlstm/reference.py``): ``F = cumsum(log sigmoid(fgate))``,
    ``logD_ij = F_i - F_j + igate_j`` (``j <= i``), ``m_i = max_j logD_ij``,
    ``C = q k^T / sqrt(DQK) * exp(logD - m)``, ``h_i = sum_j C_ij v_j / (max(|sum_j C_ij|,
    exp(-m_i)) + eps)``, then per head over DV: ``(h - mean) / sqrt(var + norm_eps)`` times
    the weight, plus the bias. Gate sums, stabilisers and norm statistics are fp32 (fp64 for
    fp64 inputs); the products accumulate in fp32.

    Precision (axis B, against the fp64 reference; tests/mlstm): fp64 and fp32 (IEEE dots)
    within 1e-5 relative (L2), except the fp32 forget-gate gradient without a norm, within
    3e-5 (its reverse cumulative sum cancels large fp32 row and column sums); bf16 within a
    relative L2 error of 2e-2 for the output and 4e-2 for the gradients; fp16 within a
    relative L2 error of 1e-3 for the output and 4e-3 for the gradients. Deterministic and batch-invariant bitwise, forward and backward.

    ``kernel``: ``"auto"`` or ``"parallel"`` (the only form in this version). Memory: the
    forward keeps the raw h ``[B, NH, S, DV]`` for the norm's backward when a gradient is
    needed (one extra activation of the output's size); nothing ``S x S`` is stored.
    """
    return mlstm_with_stats(q, k, v, igate, fgate, norm_weight=norm_weight, norm_bias=norm_bias,
                            norm_eps=norm_eps, eps=eps, residual_weight=residual_weight,
                            kernel=kernel)[0]
