"""Grouped linear with a per-row output scale: ``y = row_scale[:, None] * (x W_g^T)``.

The MoE down projection times the router probability of each routed row. Written as
``grouped_linear(h, w, offsets) * p[:, None]``, autograd keeps the unscaled output ``[M, N]``
for ``dp = rowsum(grad * y_unscaled)``, a second pass over ``[M, N]`` in the backward. Here
the backward takes ``dp`` from the product it computes anyway: ``dh_unscaled = grad @ W_g``
``[M, K]``, and ``dp_i = dh_unscaled_i . x_i``, a sum over K (the expert hidden size, smaller
than N = the model width). Nothing ``[M, N]`` is kept from forward to backward. The scaled
operand of dW is the narrower of ``p * x`` ``[M, K]`` and ``p * grad`` ``[M, N]``.
"""
from __future__ import annotations

import torch

from compileops import backends
from compileops.grouped_linear.backward_ops import grouped_linear_dx_op, grouped_linear_wgrad_op
from compileops.grouped_linear.checks import check_row_scale
from compileops.grouped_linear.op import grouped_linear_op, grouped_linear_row_scaled_op
from compileops.grouped_linear.reference import compute_dtype
from compileops.modes import BATCH_INVARIANT


def row_scaled_grouped_linear(x, weight, offsets, bias, row_scale):
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, bias ``[G, N]`` or None,
    row_scale ``[M]`` -> ``[M, N]``: ``row_scale[:, None] * grouped_linear(x, weight, offsets,
    bias)``, the scale rounded to x's dtype first (the same bits as writing that product out).
    With a bias, that product is what runs (dp then needs the biased output: it is kept)."""
    check_row_scale(x, row_scale)
    if bias is not None:
        return grouped_linear_op(x, weight, offsets, bias) * row_scale.to(x.dtype).unsqueeze(-1)
    return _RowScaledGroupedLinear.apply(x, weight, offsets, row_scale)


@backends.keeps_forward_backend
class _RowScaledGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, offsets, row_scale):
        # One op, not the product written out: compiled, the scale is then the template's
        # own input, loaded once per row, and its producers cannot become a per-element
        # epilogue of the GEMM (compileops::grouped_linear_row_scaled).
        return grouped_linear_row_scaled_op(x, weight, offsets, row_scale.to(x.dtype))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, offsets, row_scale = inputs
        ctx.save_for_backward(x, weight, offsets, row_scale)
        # Eager: the backward runs on autograd's device thread, which does not see this
        # thread's batch-invariant mode (a contextvar), so keep it. Compiled, the lowering
        # reads the mode when it compiles (and Dynamo cannot trace a contextvar read).
        ctx.batch_invariant = None if torch.compiler.is_compiling() else BATCH_INVARIANT.enabled()

    @staticmethod
    def backward(ctx, grad):
        if ctx.batch_invariant:
            with BATCH_INVARIANT.override(True):
                return _backward(ctx, grad)
        return _backward(ctx, grad)


def _backward(ctx, grad):
    x, weight, offsets, row_scale = ctx.saved_tensors
    return row_scaled_backward(grad, x, weight, offsets, row_scale, ctx.needs_input_grad[:4],
                               lambda: grouped_linear_dx_op(grad, weight, offsets))


def row_scaled_backward(grad, x, weight, offsets, row_scale, needs, unscaled_dx,
                        weight_grad=None):
    """``(dx, dw, None, ds)`` of ``y = row_scale[:, None] * (x W_g^T)`` for ``grad [M, N]``;
    ``needs``: which of ``(x, weight, offsets, row_scale)`` want a gradient;
    ``unscaled_dx()``: the product ``grad_g @ W_g`` ``[M, K]`` (bf16, or fp8's), from which
    both dx and ds come. dW in the weight's dtype, from the unquantised operands, by
    ``weight_grad(grad_op, x_op)`` when given (fp8's), else the 16/32-bit product."""
    need_dx, need_dw, _, need_ds = needs
    scale = row_scale.to(x.dtype).unsqueeze(-1)
    dx = dw = ds = None
    if need_dx or need_ds:
        dx_unscaled = unscaled_dx()  # [M, K]
        if need_dx:
            dx = dx_unscaled * scale
        if need_ds:
            acc = compute_dtype(x.dtype)
            ds = (dx_unscaled.to(acc) * x.to(acc)).sum(-1).to(row_scale.dtype)
    if need_dw:
        # sum_i (s_i g_i) x_i^T = sum_i g_i (s_i x_i)^T: scale the narrower operand.
        if x.shape[1] <= grad.shape[1]:
            grad_op, x_op = grad, x * scale
        else:
            grad_op, x_op = grad * scale, x
        if weight_grad is not None:
            dw = weight_grad(grad_op, x_op)
        else:
            dw, _ = grouped_linear_wgrad_op(grad_op, x_op, offsets, weight.dtype, grad.dtype,
                                            False)
    return dx, dw, None, ds
