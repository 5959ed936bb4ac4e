"""The rowwise fp8 grouped linear ops (experimental): the forward and dX products in e4m3.

* ``compileops::grouped_linear_fp8(x [M, K], weight [G, N, K], offsets int32 [G]) -> [M,
  N]``: ``x`` quantised per row (token), each ``W_g`` per output channel, both over K; the
  product summed in fp32 and scaled in the GEMM's epilogue, rounded once to x's dtype.
* ``compileops::grouped_linear_swiglu_fp8_with_preact(x, weight [G, 2H, K], offsets) ->
  (silu(gate) * up [M, H], preact [M, 2H])``: the same for a fused gate/up projection, the
  pre-activations written beside the output for the backward.

Autograd: ``dX = dY W_g`` runs through ``grouped_linear_fp8`` itself, on ``W_g^T``: dY is
quantised per row over N, the weight per input channel over N, so each product's reduction
dim carries the scales, as in the forward. ``dW = dY_g^T X_g`` stays in x's dtype
(``compileops::grouped_linear_wgrad``, from the saved unquantised x): a reduction over a
group's tokens, whose fp8 form needs per-group column scales.

The numerics are :func:`compileops.grouped_linear.fp8.grouped_linear_reference`'s (the
reference backend runs it): e4m3 for both operands and for dY (why e4m3 for gradients: the
module docstring there), fp32 scales, relative L2 error about 3.7e-2 against bf16 on
unit-normal data. On Hopper the fp8 MMA sums each 128-wide K step at reduced precision before
the fp32 accumulator (about 1e-4 relative). Deterministic run to run; not batch-invariant
(the tile config follows the group sizes).

The weight is quantised on every call (a copy of it in e4m3; 0.5-1.5 ms at MoE sizes on an
H200).
"""
from __future__ import annotations

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.grouped_linear import fp8 as fp8_rule
from compileops.grouped_linear.checks import check_forward_args, check_offsets_eagerly
from compileops.grouped_linear.op import (
    _forward_mode,
    _keep_for_backward,
    _swiglu_derivative,
    _use_triton,
    grouped_linear_wgrad_op,
)

#: The ``fp8`` recipes of :func:`compileops.grouped_linear` and friends (None: no fp8).
RECIPES = ("rowwise",)


def check_recipe(fp8, bias=None, **unsupported) -> None:
    """A clear error for an unknown recipe, or for what the fp8 path does not take yet."""
    if fp8 is None:
        return
    if fp8 not in RECIPES:
        raise ValueError(f"fp8 must be None or one of {RECIPES}, got {fp8!r}")
    if bias is not None:
        raise ValueError("fp8='rowwise' takes no bias (MoE experts have none): pass bias=None")
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"fp8='rowwise' does not support {name} yet")


def _check(x, weight, offsets, swiglu: bool) -> None:
    check_forward_args(x, weight, offsets, None, swiglu)
    torch._check_type(x.dtype != torch.float64,
                      lambda: "the fp8 grouped linear takes bf16, fp16 or fp32 inputs, got fp64")


def _forward_fp32_reference(x, weight, offsets):
    """The reference's products in fp32 (quantising x or x.float() is the same)."""
    return fp8_rule.grouped_linear_reference(x.float(), weight.float(), offsets, "rowwise")


@custom_op("grouped_linear_fp8")
def grouped_linear_fp8_op(x: torch.Tensor, weight: torch.Tensor,
                          offsets: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]`` (any strides), offsets int32 ``[G]`` -> ``[M, N]``
    in x's dtype, rowwise fp8 (module docstring); rows past ``offsets[-1]`` are zeros."""
    _check(x, weight, offsets, swiglu=False)
    check_offsets_eagerly(offsets, x.shape[0])
    if _use_triton("grouped_linear_fp8", x):
        from compileops.grouped_linear.kernels import fp8 as fp8_kernels

        wq, ws = fp8_kernels.quantize_weight_rowwise(weight)
        return fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, out_dtype=x.dtype)
    return _forward_fp32_reference(x, weight, offsets).to(x.dtype)


@grouped_linear_fp8_op.register_fake
def _grouped_linear_fp8_fake(x, weight, offsets):
    _check(x, weight, offsets, swiglu=False)
    return x.new_empty((x.shape[0], weight.shape[1]))


def _fp8_linear_backward(ctx, grad, x, weight, offsets):
    """dX in fp8 (the forward op on ``W_g^T``), dW in x's dtype."""
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_linear_fp8_op(grad, weight.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        dw, _ = grouped_linear_wgrad_op(grad, x, offsets, weight.dtype, grad.dtype, False)
    return dx, dw, None


def _setup_context(ctx, inputs, output) -> None:
    x, weight, offsets = inputs
    _keep_for_backward(ctx, (x, weight, offsets, None))


def _grouped_linear_fp8_backward(ctx, grad):
    with _forward_mode(ctx):
        x, weight, offsets, _ = ctx.saved_tensors
        return _fp8_linear_backward(ctx, grad, x, weight, offsets)


backends.register_autograd(grouped_linear_fp8_op, _grouped_linear_fp8_backward, _setup_context)


@custom_op("grouped_linear_swiglu_fp8_with_preact")
def grouped_linear_swiglu_fp8_with_preact_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ``[G, 2H, K]`` (gate rows first) -> ``(silu(gate) * up [M, H], preact [M,
    2H])``, rowwise fp8; ``preact`` in x's dtype, for the backward."""
    _check(x, weight, offsets, swiglu=True)
    check_offsets_eagerly(offsets, x.shape[0])
    if _use_triton("grouped_linear_swiglu_fp8_with_preact", x):
        from compileops.grouped_linear.kernels import fp8 as fp8_kernels

        wq, ws = fp8_kernels.quantize_weight_rowwise(weight)
        preact = x.new_empty((x.shape[0], weight.shape[1]))
        out = fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, swiglu=True,
                                                     out_dtype=x.dtype, preact=preact)
        return out, preact
    pre = _forward_fp32_reference(x, weight, offsets)
    gate, up = pre.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype), pre.to(x.dtype)


@grouped_linear_swiglu_fp8_with_preact_op.register_fake
def _grouped_linear_swiglu_fp8_with_preact_fake(x, weight, offsets):
    _check(x, weight, offsets, swiglu=True)
    return (x.new_empty((x.shape[0], weight.shape[1] // 2)),
            x.new_empty((x.shape[0], weight.shape[1])))


def _setup_preact_context(ctx, inputs, output) -> None:
    x, weight, offsets = inputs
    _keep_for_backward(ctx, (x, weight, offsets, None), output[1])
    ctx.mark_non_differentiable(output[1])


def _swiglu_fp8_backward(ctx, grad, _grad_preact):
    with _forward_mode(ctx):
        x, weight, offsets, _, preact = ctx.saved_tensors
        return _fp8_linear_backward(ctx, _swiglu_derivative(preact, grad), x, weight, offsets)


backends.register_autograd(grouped_linear_swiglu_fp8_with_preact_op, _swiglu_fp8_backward,
                           _setup_preact_context)
