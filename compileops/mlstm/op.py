"""The mLSTM custom ops: the parallel cell with its multi-head layernorm fused.

* ``compileops::mlstm_parallel(q, k, v, igate, logf, norm_weight?, norm_bias?, normed,
  norm_eps, eps, residual_weight, save_h) -> (out, h, m_log2, b)``: ``out`` is ``[B, S, NH * DV]``
  (normed) or ``[B, NH, S, DV]`` (raw); ``h [B, NH, S, DV]`` is the raw h kept for the norm's
  backward when ``save_h`` (else empty); ``m_log2, b [B, NH, S]`` (fp32, fp64 for fp64
  inputs) are the stabiliser in log2 units (``m = m_log2 * ln 2``) and the signed row sum,
  ``n = max(|b|, exp(-m))``.
* ``compileops::mlstm_parallel_backward(grad, q, k, v, igate, logf, norm_weight?, h, m_log2,
  b, normed, norm_eps, eps, residual_weight) -> (dq, dk, dv, digate, dlogf, dweight, dbias)``.

The gates enter as ``igate`` and ``logf = cumsum(log sigmoid(fgate))``, both ``[B, NH, S]`` in
the accumulation dtype (fp32, fp64 for fp64): the public function computes ``logf`` with
torch ops, so autograd (and Inductor, which fuses them) handles the cumsum and the sigmoid.

Both functional; the forward's autograd calls the backward op, so the compiled backward
graph holds a compileops op too.

Gradient: exact, as autograd through the reference gives it: the normaliser
``max(|b|, exp(-m))`` through its live branch, and the stabiliser ``m_i = max_j logD_ij``
(``h`` depends on it through ``eps`` only: ``dm_i = -eps / (n_i + eps) * (dh_i . h_i)``),
routed to the row's first maximal column, as ``torch.max`` routes it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.mlstm import reference
from compileops.mlstm.checks import (
    check_backward_grad,
    check_inputs,
    check_kernel_head_dims,
    check_log_gates,
)

LOG2E = 1.0 / math.log(2.0)


def _use_triton(op: str, q: torch.Tensor, v: torch.Tensor) -> bool:
    if backends.select(op, q.device) != "triton":
        return False
    check_kernel_head_dims(q, v)
    return True


def _out_shape(q, v, normed):
    b, nh, s, _ = q.shape
    dv = v.shape[-1]
    return (b, s, nh * dv) if normed else (b, nh, s, dv)


@custom_op("mlstm_parallel")
def mlstm_parallel_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    normed: bool, norm_eps: float, eps: float, residual_weight: bool, save_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    if _use_triton("mlstm_parallel", q, v):
        from compileops.mlstm import kernels

        out, h, m, b = kernels.mlstm_forward(
            q, k, v, igate.contiguous(), logf.contiguous(), norm_weight, norm_bias, normed,
            norm_eps, eps, residual_weight, save_h and normed)
        return out, (h if h is not None else v.new_empty((0,))), m, b
    h, b, m = reference.cell_from_log_gates(q, k, v, igate, logf, eps)
    if normed:
        out = reference.multihead_layernorm(h, norm_weight, norm_bias, norm_eps,
                                            residual_weight, v.dtype)
    else:
        out = h.to(v.dtype)
    kept = h.to(v.dtype) if (save_h and normed) else v.new_empty((0,))
    return out, kept, m * LOG2E, b


@mlstm_parallel_op.register_fake
def _mlstm_parallel_fake(q, k, v, igate, logf, norm_weight, norm_bias, normed, norm_eps,
                         eps, residual_weight, save_h):
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    acc = reference.gate_dtype(q.dtype)
    out = v.new_empty(_out_shape(q, v, normed))
    h = v.new_empty(v.shape) if (save_h and normed) else v.new_empty((0,))
    m = q.new_empty(q.shape[:3], dtype=acc)
    return out, h, m, q.new_empty(q.shape[:3], dtype=acc)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, igate, logf, norm_weight, norm_bias, normed, norm_eps, eps, residual, _ = inputs
    out, h, m, b = output
    ctx.mark_non_differentiable(h, m, b)
    kept_h = h if normed else out
    ctx.save_for_backward(q, k, v, igate, logf, norm_weight, kept_h, m, b)
    ctx.normed = normed
    ctx.norm_eps = norm_eps
    ctx.eps = eps
    ctx.residual_weight = residual
    ctx.has_bias = norm_bias is not None


def _backward(ctx, grad_out, _grad_h, _grad_m, _grad_b):
    q, k, v, igate, logf, norm_weight, h, m, b = ctx.saved_tensors
    if ctx.normed and h.numel() == 0 and q.numel():
        raise RuntimeError("mlstm_parallel was called with save_h=False but a gradient is "
                           "needed: call compileops.mlstm, which keeps h when it must")
    dq, dk, dv, digate, dlogf, dweight, dbias = mlstm_parallel_backward_op(
        grad_out, q, k, v, igate, logf, norm_weight, h, m, b, ctx.normed, ctx.norm_eps,
        ctx.eps, ctx.residual_weight)
    dweight = dweight.to(norm_weight.dtype) if norm_weight is not None else None
    dbias = dbias.to(grad_out.dtype) if ctx.has_bias else None
    return dq, dk, dv, digate, dlogf, dweight, dbias, None, None, None, None, None


mlstm_parallel_op.register_autograd(_backward, setup_context=_setup_context)


@custom_op("mlstm_parallel_backward")
def mlstm_parallel_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor, norm_weight: Optional[torch.Tensor],
    h: torch.Tensor, m: torch.Tensor, b: torch.Tensor, normed: bool, norm_eps: float,
    eps: float, residual_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """Gradients of :func:`mlstm_parallel_op`'s ``out`` for ``grad_out``: ``(dq, dk, dv,
    digate, dlogf, dweight [NH * DV], dbias [NH * DV])``; the gates' and the norm's in the
    accumulation dtype (the norm's empty when not ``normed``). ``h``: the raw h when ``normed``,
    else the output itself."""
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    acc = reference.gate_dtype(q.dtype)
    if _use_triton("mlstm_parallel_backward", q, v):
        return _kernel_backward(grad_out, q, k, v, igate, logf, norm_weight, h, m, b, normed,
                                norm_eps, eps, residual_weight, acc)
    return _reference_backward(grad_out, q, k, v, igate, logf, norm_weight, normed, norm_eps,
                               eps, residual_weight, acc)


@mlstm_parallel_backward_op.register_fake
def _mlstm_parallel_backward_fake(grad_out, q, k, v, igate, logf, norm_weight, h, m, b,
                                  normed, norm_eps, eps, residual_weight):
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    acc = reference.gate_dtype(q.dtype)
    channels = q.shape[1] * v.shape[3] if normed else 0
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            igate.new_empty(igate.shape), logf.new_empty(logf.shape),
            q.new_empty((channels,), dtype=acc), q.new_empty((channels,), dtype=acc))


def _kernel_backward(grad_out, q, k, v, igate, logf, norm_weight, h, m, b, normed,
                     norm_eps, eps, residual_weight, acc):
    from compileops.mlstm import kernels

    cfg = kernels.choose_backward_config(q, q.shape[-1], v.shape[-1])
    dh, hdot, parts_w, parts_b = kernels.norm_backward(
        grad_out, h, norm_weight, normed, norm_eps, residual_weight, acc, cfg)
    r, beta, dm = normaliser_terms(m, b, hdot, eps)
    dq, dk, dv, row_grad, col_grad = kernels.cell_backward(
        q, k, v, dh, igate.contiguous(), logf.contiguous(), m, r, beta, dm, cfg)
    # logD_ij = F_i - F_j + igate_j: dF gets the row sums of dlogD minus its column sums
    # (dm: the stabiliser's share, which sits in row i too).
    dlogf = row_grad + dm - col_grad
    if normed:
        dweight = parts_w.sum(dim=(0, 1)).reshape(-1)
        dbias = parts_b.sum(dim=(0, 1)).reshape(-1)
    else:
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    return dq, dk, dv, col_grad, dlogf, dweight, dbias


def normaliser_terms(m_log2: torch.Tensor, b: torch.Tensor, hdot: torch.Tensor, eps: float):
    """Per row ``[B, NH, S]``: ``r = 1 / (n + eps)``; ``beta``, the normaliser's share of
    ``dC``: ``-r (dh . h) sign(b)`` where ``n = |b|`` won the max, else 0; and ``dm = -eps r
    (dh . h)``, the stabiliser's gradient."""
    floor = torch.exp2(-m_log2)
    r = 1.0 / (torch.maximum(b.abs(), floor) + eps)
    beta = torch.where(b.abs() > floor, -r * hdot * torch.sign(b), torch.zeros_like(b))
    return r.contiguous(), beta.contiguous(), (-eps * r * hdot).contiguous()


def _reference_backward(grad_out, q, k, v, igate, logf, norm_weight, normed, norm_eps, eps,
                        residual_weight, acc):
    """Autograd through the reference, the ground truth (the stabiliser's max included)."""
    channels = q.shape[1] * v.shape[3]
    weight = norm_weight if norm_weight is not None else None
    bias = q.new_zeros((channels,), dtype=acc) if normed else None

    def forward(q, k, v, igate, logf, *affine):
        affine = list(affine)
        weight = affine.pop(0) if weight_given else None
        bias = affine.pop(0) if normed else None
        h, _, _ = reference.cell_from_log_gates(q, k, v, igate, logf, eps)
        if not normed:
            return h.to(v.dtype)
        return reference.multihead_layernorm(h, weight, bias, norm_eps, residual_weight,
                                             v.dtype)

    # torch.func re-enables autograd below the op's dispatch, where plain autograd is off.
    weight_given = weight is not None
    affine = ((weight,) if weight_given else ()) + ((bias,) if normed else ())
    _, vjp = torch.func.vjp(forward, q, k, v, igate, logf, *affine)
    grads = vjp(grad_out)
    # The fake function promises dense gradients (the kernels write dense ones too).
    dq, dk, dv, digate, dlogf = (g.contiguous() for g in grads[:5])
    if normed:
        dweight = grads[5].to(acc) if weight_given else q.new_zeros((channels,), dtype=acc)
        dbias = grads[-1].to(acc)
    else:
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    return dq, dk, dv, digate, dlogf, dweight, dbias
