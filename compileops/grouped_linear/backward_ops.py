"""What every grouped-linear op module shares, below all of them: the backend choice, the
autograd context helpers, the SwiGLU derivative, and the two backward ops that every forward
op's autograd calls.

* ``compileops::grouped_linear_dx(grad [M, N], weight [G, N, K], offsets) -> [M, K]``:
  ``dX_g = grad_g @ W_g``;
* ``compileops::grouped_linear_wgrad(grad [M, N], x [M, K], offsets, weight_dtype, bias_dtype,
  with_db=True) -> (dW [G, N, K], db [G, N])``: K-jagged, deterministic (no split-K, no
  atomics). ``with_db=False`` (a layer without a trainable bias) skips the column sums and
  returns an empty ``db [G, 0]``.

The bf16 forward ops (:mod:`.op`), the row-scaled autograd (:mod:`.scaled`) and the fp8 ops
(:mod:`.fp8_op`) import from here; nothing here imports them.
"""
from __future__ import annotations

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.grouped_linear import reference
from compileops.grouped_linear.checks import (
    check_dx_args,
    check_kernel_dtype,
    check_offsets_eagerly,
    check_wgrad_args,
)
from compileops.modes import BATCH_INVARIANT


def use_triton(op: str, t: torch.Tensor) -> bool:
    """Whether ``op`` runs its Triton kernel on ``t``'s device; refuses fp64 there (a clear
    error naming the reference backend)."""
    if backends.select(op, t.device) != "triton":
        return False
    check_kernel_dtype(op, t)
    return True


def keep_for_backward(ctx, inputs, *extra: torch.Tensor) -> None:
    """Save ``x, weight, offsets, bias`` (and ``extra`` tensors) and the forward's mode."""
    x, weight, offsets, bias = inputs
    ctx.save_for_backward(x, weight, offsets, bias, *extra)
    ctx.has_bias = bias is not None
    # The modes are contextvars, and on CUDA the backward runs on autograd's device thread,
    # which does not see a `with compileops.batch_invariant():` of this thread: keep the mode.
    ctx.batch_invariant = BATCH_INVARIANT.enabled()


def forward_mode(ctx):
    """The batch-invariant mode the forward ran in (or the one set here), for the backward."""
    return BATCH_INVARIANT.override(ctx.batch_invariant or BATCH_INVARIANT.enabled())


def swiglu_derivative(preact: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d swiglu / d preact`` times ``grad [M, H]``: ``[M, 2H]`` (gate, then up) in grad's dtype,
    computed in fp32 (fp64 for fp64). Plain pointwise torch ops, so Inductor fuses them into one kernel.
    Each half is rounded before the concatenation (the same bits as rounding the whole), so a
    compiled backward writes the ``[M, 2H]`` buffer in grad's dtype, never an fp32 one.

    ``grad`` reaches each half through one ``[M, 2, H]`` broadcast of it, widened per half.
    When ``grad`` is itself a fused expression with many reads (the MoE down projection's dX
    times the router probability, gathered by expert), Inductor stores an expression read
    twice rather than compute it twice: this way what it stores is ``grad`` in its own dtype,
    where two reads of one widened copy made it store that fp32 ``[M, H]`` copy, twice the
    bytes, written by one kernel and read back by the next. Eager, the cost is one more
    ``[M, H]`` widening (each half converts its own view of ``grad``); the bits are the same."""
    acc = reference.compute_dtype(preact.dtype)
    # [..., 2, H]: a view, no copy when eager
    per_half = grad.unsqueeze(-2).expand(*grad.shape[:-1], 2, grad.shape[-1])
    gate, up = preact.to(acc).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    d_gate = per_half[..., 0, :].to(acc) * up * sig * (1 + gate * (1 - sig))
    d_up = per_half[..., 1, :].to(acc) * gate * sig
    return torch.cat([d_gate.to(grad.dtype), d_up.to(grad.dtype)], dim=-1)


@custom_op("grouped_linear_dx")
def grouped_linear_dx_op(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad ``[M, N]`` -> ``dX [M, K]``: ``dX_g = grad_g @ W_g`` (weight untransposed)."""
    check_dx_args(grad, weight, offsets)
    check_offsets_eagerly(offsets, grad.shape[0])
    if use_triton("grouped_linear_dx", grad):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_dx(grad, weight, offsets,
                                         batch_invariant=BATCH_INVARIANT.enabled())
    return reference.grouped_linear_dx(grad, weight, offsets)


@grouped_linear_dx_op.register_fake
def _grouped_linear_dx_fake(grad, weight, offsets):
    check_dx_args(grad, weight, offsets)
    return grad.new_empty((grad.shape[0], weight.shape[2]))


@custom_op("grouped_linear_wgrad")
def grouped_linear_wgrad_op(
    grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
    weight_dtype: torch.dtype, bias_dtype: torch.dtype, with_db: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dW [G, N, K] = grad_g^T x_g, db [G, N] = colsum grad_g)``; empty groups give zeros.
    ``with_db=False``: ``db`` is an empty ``[G, 0]`` tensor and no column sums are computed."""
    check_wgrad_args(grad, x, offsets, weight_dtype, bias_dtype)
    check_offsets_eagerly(offsets, grad.shape[0])
    if use_triton("grouped_linear_wgrad", grad):
        from compileops.grouped_linear import kernels

        dw, db = kernels.grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype,
                                              with_db=with_db)
    else:
        dw, db = reference.grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype,
                                                with_db)
    return dw, db if with_db else _no_db(grad, offsets, bias_dtype)


def _no_db(grad, offsets, bias_dtype) -> torch.Tensor:
    return grad.new_empty((offsets.shape[0], 0), dtype=bias_dtype)


@grouped_linear_wgrad_op.register_fake
def _grouped_linear_wgrad_fake(grad, x, offsets, weight_dtype, bias_dtype, with_db=True):
    check_wgrad_args(grad, x, offsets, weight_dtype, bias_dtype)
    groups, n, k = offsets.shape[0], grad.shape[1], x.shape[1]
    db = (grad.new_empty((groups, n), dtype=bias_dtype) if with_db
          else _no_db(grad, offsets, bias_dtype))
    return grad.new_empty((groups, n, k), dtype=weight_dtype), db


def linear_backward(ctx, grad, x, weight, offsets, bias):
    """dX, dW, db of ``y = x W_g^T + b_g`` for the upstream gradient ``grad [M, N]``
    (``ctx``: :func:`keep_for_backward`'s)."""
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = grouped_linear_dx_op(grad, weight, offsets)
    with_db = ctx.has_bias and ctx.needs_input_grad[3]
    if ctx.needs_input_grad[1] or with_db:
        dw, db = grouped_linear_wgrad_op(
            grad, x, offsets, weight.dtype, bias.dtype if ctx.has_bias else grad.dtype, with_db
        )
        if not with_db:
            db = None
    return dx, dw, None, db
