"""The SwiGLU expert MLP of an MoE layer as one differentiable call:
``y = row_scale[:, None] * (silu(x W_gate_g^T) * (x W_up_g^T)) @ W_down_g^T``.

The forward is the two products of :func:`~compileops.grouped_linear` and
:func:`~compileops.grouped_linear_swiglu` (the same kernels, the same bits). What one call
buys is the backward: written as two calls, the down projection's backward writes ``dh = dY_g
@ W_down_g`` ``[M, H]``, a reduction reads it back with h for the router scale's gradient, and
a pointwise kernel reads it a third time with the pre-activations to make their gradient
``[M, 2H]``. Here the row scaling, the scale's gradient and the SwiGLU derivative are the
epilogue of that dX product (``compileops::grouped_swiglu_down_dx``): ``dh`` never reaches
memory, and two kernels are gone. Nothing more is kept from forward to backward than the two
calls keep (x, h and the pre-activations).
"""
from __future__ import annotations

import torch

from compileops import backends
from compileops.grouped_linear.checks import check_row_scale
from compileops.modes import BATCH_INVARIANT


def grouped_swiglu_mlp(x, gate_up, down, offsets, *, row_scale=None, fp8=None,
                       cache_fp8_weights=False):
    """The expert MLP: x ``[M, D]``, gate_up ``[G, 2H, D]`` (gate rows first, then up), down
    ``[G, D, H]``, offsets int32 ``[G]`` (cumulative end rows), row_scale ``[M]`` or None ->
    ``[M, D]``. The same result as ``grouped_linear(grouped_linear_swiglu(x, gate_up,
    offsets), down, offsets, row_scale=row_scale)``, bitwise in the forward; rows past
    ``offsets[-1]`` are zeros.

    The backward fuses the SwiGLU derivative (and the row scale and its gradient) into the
    down projection's dX product (:mod:`compileops.grouped_linear.mlp`). The gradients are
    those of the two calls up to the order in which the scale's gradient is summed (fp32,
    by column tiles here). No biases (MoE experts have none); ``fp8`` and
    ``cache_fp8_weights`` are :func:`~compileops.grouped_linear`'s, and with ``fp8`` this is
    the two calls (the fused backward is bf16, fp16 and fp32).
    """
    from compileops.grouped_linear.op import (
        _needs_grad,
        check_fp8_weight_cache,
        grouped_linear,
        grouped_linear_swiglu,
        grouped_linear_swiglu_op,
    )

    if fp8 is not None:
        h = grouped_linear_swiglu(x, gate_up, offsets, fp8=fp8,
                                  cache_fp8_weights=cache_fp8_weights)
        return grouped_linear(h, down, offsets, row_scale=row_scale, fp8=fp8,
                              cache_fp8_weights=cache_fp8_weights)
    check_fp8_weight_cache(cache_fp8_weights)
    if row_scale is not None:
        check_row_scale(x, row_scale)
    if not _needs_grad(x, gate_up, down, row_scale):
        h = grouped_linear_swiglu_op(x, gate_up, offsets)
        return _down_forward(h, down, offsets, row_scale)
    return _GroupedSwigluMLP.apply(x, gate_up, down, offsets, row_scale)[0]


def _down_forward(h, down, offsets, row_scale):
    from compileops.grouped_linear.op import grouped_linear_op, grouped_linear_row_scaled_op

    if row_scale is None:
        return grouped_linear_op(h, down, offsets)
    return grouped_linear_row_scaled_op(h, down, offsets, row_scale.to(h.dtype))


@backends.keeps_forward_backend
class _GroupedSwigluMLP(torch.autograd.Function):
    @staticmethod
    def forward(x, gate_up, down, offsets, row_scale):
        from compileops.grouped_linear.op import grouped_linear_swiglu_with_preact_op

        h, preact = grouped_linear_swiglu_with_preact_op(x, gate_up, offsets)
        # h and the pre-activations are outputs so that setup_context can keep them.
        return _down_forward(h, down, offsets, row_scale), h, preact

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gate_up, down, offsets, row_scale = inputs
        _, h, preact = output
        ctx.save_for_backward(x, gate_up, down, offsets, row_scale, h, preact)
        ctx.mark_non_differentiable(h, preact)
        # As in scaled.py: eager, keep this thread's batch-invariant mode for autograd's
        # device thread; compiled, the lowerings read the mode when they compile.
        ctx.batch_invariant = None if torch.compiler.is_compiling() else BATCH_INVARIANT.enabled()

    @staticmethod
    def backward(ctx, grad, _grad_h, _grad_preact):
        if ctx.batch_invariant:
            with BATCH_INVARIANT.override(True):
                return _backward(ctx, grad)
        return _backward(ctx, grad)


def _backward(ctx, grad):
    from compileops.grouped_linear.op import (
        grouped_linear_dx_op,
        grouped_linear_wgrad_op,
        grouped_swiglu_down_dx_op,
    )
    from compileops.grouped_linear.scaled import row_scaled_backward

    x, gate_up, down, offsets, row_scale, h, preact = ctx.saved_tensors
    need_x, need_gate_up, need_down, _, need_scale = ctx.needs_input_grad
    scale = row_scale.to(x.dtype) if row_scale is not None else None
    dx = d_gate_up = d_down = d_scale = None
    if need_x or need_gate_up or need_scale:
        dpreact, ds = grouped_swiglu_down_dx_op(grad, down, offsets, preact,
                                                h if scale is not None else None, scale)
        if need_scale:
            d_scale = ds.to(row_scale.dtype)
        if need_x:
            dx = grouped_linear_dx_op(dpreact, gate_up, offsets)
        if need_gate_up:
            d_gate_up, _ = grouped_linear_wgrad_op(dpreact, x, offsets, gate_up.dtype,
                                                   grad.dtype, False)
    if need_down:
        if scale is None:
            d_down, _ = grouped_linear_wgrad_op(grad, h, offsets, down.dtype, grad.dtype, False)
        else:
            _, d_down, _, _ = row_scaled_backward(grad, h, down, offsets, row_scale,
                                                  (False, True, False, False), None)
    return dx, d_gate_up, d_down, None, d_scale
