"""The SwiGLU product of a gate/up pair kept as two weights (torchtitan's ``w1`` and ``w3``,
and models that store ``gate_proj`` and ``up_proj`` apart), in one kernel that reads both
where they are: no concatenated ``[G, 2H, K]`` copy in the forward, no split of dW in the
backward.

* ``compileops::grouped_linear_swiglu_pair(x [M, K], w_gate [G, H, K], w_up [G, H, K],
  offsets int32 [G]) -> [M, H]``: ``silu(x W_gate_g^T) * (x W_up_g^T)``; the backward
  recomputes the pre-activations (``recompute=True``).
* ``compileops::grouped_linear_swiglu_pair_with_preact``: the training form, which also
  writes the pre-activations ``[M, 2H]`` (gate, then up) for the backward.
* ``compileops::grouped_linear_dx_pair(grad [M, 2H], w_gate, w_up, offsets) -> [M, K]``: dX
  of the pair, ``grad_g[:, :H] @ W_gate_g + grad_g[:, H:] @ W_up_g`` in one fp32 sum per
  element (two products added after rounding would round twice).

dW of each weight is ``compileops::grouped_linear_wgrad`` on its half of the gradient's
columns (a strided view, no copy). Same tiles, same sums and the same bits as the fused
op on ``torch.cat([w_gate, w_up], 1)`` (dX: when the config's ``BLOCK_K`` divides H), and
the same tolerances (:mod:`.op`). 16-bit and fp32, no bias, no fp8: the public function
(:func:`compileops.grouped_linear_swiglu` with ``up_weight=``) says so when asked.
"""
from __future__ import annotations

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.grouped_linear import reference
from compileops.grouped_linear.backward_ops import (
    forward_mode,
    grouped_linear_wgrad_op,
    swiglu_derivative,
    use_triton,
)
from compileops.grouped_linear.checks import (
    check_dx_pair_args,
    check_offsets_eagerly,
    check_pair_args,
)
from compileops.modes import BATCH_INVARIANT


def _out_fake(x, w_gate):
    return x.new_empty((x.shape[0], w_gate.shape[1]))


def _forward(op_name: str, x, w_gate, w_up, offsets, preact=None) -> torch.Tensor:
    check_pair_args(x, w_gate, w_up, offsets)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton(op_name, x):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_swiglu_pair_forward(
            x, w_gate, w_up, offsets, batch_invariant=BATCH_INVARIANT.enabled(), preact=preact)
    out, pre = reference.grouped_linear_swiglu_with_preact(
        x, torch.cat([w_gate, w_up], 1), offsets)
    if preact is not None:
        preact.copy_(pre)
    return out


@custom_op("grouped_linear_swiglu_pair")
def grouped_linear_swiglu_pair_op(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                                  offsets: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]``, w_gate and w_up ``[G, H, K]`` -> ``silu(x W_gate^T) * (x W_up^T)``
    ``[M, H]``."""
    return _forward("grouped_linear_swiglu_pair", x, w_gate, w_up, offsets)


@grouped_linear_swiglu_pair_op.register_fake
def _pair_fake(x, w_gate, w_up, offsets):
    check_pair_args(x, w_gate, w_up, offsets)
    return _out_fake(x, w_gate)


@custom_op("grouped_linear_swiglu_pair_with_preact")
def grouped_linear_swiglu_pair_with_preact_op(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(gate) * up [M, H], preact [M, 2H])``: the pre-activations (gate, then up,
    rounded to x's dtype) are written by the same kernel for the backward."""
    preact = x.new_empty((x.shape[0], 2 * w_gate.shape[1]))
    out = _forward("grouped_linear_swiglu_pair_with_preact", x, w_gate, w_up, offsets, preact)
    return out, preact


@grouped_linear_swiglu_pair_with_preact_op.register_fake
def _pair_with_preact_fake(x, w_gate, w_up, offsets):
    check_pair_args(x, w_gate, w_up, offsets)
    return _out_fake(x, w_gate), x.new_empty((x.shape[0], 2 * w_gate.shape[1]))


@custom_op("grouped_linear_dx_pair")
def grouped_linear_dx_pair_op(grad: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                              offsets: torch.Tensor) -> torch.Tensor:
    """grad ``[M, 2H]`` -> ``dX [M, K] = grad_g[:, :H] @ W_gate_g + grad_g[:, H:] @ W_up_g``."""
    check_dx_pair_args(grad, w_gate, w_up, offsets)
    check_offsets_eagerly(offsets, grad.shape[0])
    if use_triton("grouped_linear_dx_pair", grad):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_dx_pair(grad, w_gate, w_up, offsets,
                                              batch_invariant=BATCH_INVARIANT.enabled())
    return reference.grouped_linear_dx(grad, torch.cat([w_gate, w_up], 1), offsets)


@grouped_linear_dx_pair_op.register_fake
def _dx_pair_fake(grad, w_gate, w_up, offsets):
    check_dx_pair_args(grad, w_gate, w_up, offsets)
    return grad.new_empty((grad.shape[0], w_gate.shape[2]))


# ---------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output) -> None:
    x, w_gate, w_up, offsets = inputs
    preact = output[1] if isinstance(output, tuple) else None
    if preact is not None:
        ctx.mark_non_differentiable(preact)
    ctx.save_for_backward(x, w_gate, w_up, offsets, preact)
    ctx.batch_invariant = BATCH_INVARIANT.enabled()


def _pair_backward(ctx, grad_preact_derivative, x, w_gate, w_up, offsets):
    """dX, dW_gate, dW_up from ``d swiglu / d preact`` times the upstream gradient (``[M,
    2H]``)."""
    h = w_gate.shape[1]
    dx = dw_gate = dw_up = None
    if ctx.needs_input_grad[0]:
        dx = grouped_linear_dx_pair_op(grad_preact_derivative, w_gate, w_up, offsets)
    if ctx.needs_input_grad[1]:
        dw_gate = grouped_linear_wgrad_op(grad_preact_derivative[:, :h], x, offsets,
                                          w_gate.dtype, w_gate.dtype, False)[0]
    if ctx.needs_input_grad[2]:
        dw_up = grouped_linear_wgrad_op(grad_preact_derivative[:, h:], x, offsets,
                                        w_up.dtype, w_up.dtype, False)[0]
    return dx, dw_gate, dw_up, None


def _recompute_backward(ctx, grad):
    with forward_mode(ctx):
        x, w_gate, w_up, offsets, _ = ctx.saved_tensors
        preact = grouped_linear_swiglu_pair_with_preact_op(x, w_gate, w_up, offsets)[1]
        return _pair_backward(ctx, swiglu_derivative(preact, grad), x, w_gate, w_up, offsets)


def _saved_backward(ctx, grad, _grad_preact):
    with forward_mode(ctx):
        x, w_gate, w_up, offsets, preact = ctx.saved_tensors
        return _pair_backward(ctx, swiglu_derivative(preact, grad), x, w_gate, w_up, offsets)


backends.register_autograd(grouped_linear_swiglu_pair_op, _recompute_backward, _setup_context)
backends.register_autograd(grouped_linear_swiglu_pair_with_preact_op, _saved_backward,
                           _setup_context)
