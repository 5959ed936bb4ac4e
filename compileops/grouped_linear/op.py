"""The grouped linear's bf16/fp16/fp32 forward ops (MoE grouped GEMM) and their autograd.

* ``compileops::grouped_linear(x [M, K], weight [G, N, K], offsets int32 [G], bias [G, N]?)
  -> [M, N]``
* ``compileops::grouped_linear_swiglu(x, weight [G, 2H, K], offsets, bias [G, 2H]?) -> [M, H]``:
  ``silu(gate) * up`` over the two halves of a fused gate/up projection, in one kernel.
* ``compileops::grouped_linear_swiglu_with_preact``: its training form, which also writes the
  pre-activations ``[M, 2H]`` for the backward.
* ``compileops::grouped_linear_row_scaled(x, weight, offsets, row_scale [M]) -> [M, N]``: the
  forward with each output row times its scale (in x's dtype), in one kernel; the MoE down
  projection times the router probability (its autograd: ``scaled.py``).

All functional; their backward is made of ``compileops::grouped_linear_dx`` and
``compileops::grouped_linear_wgrad`` (:mod:`.backward_ops`), so the compiled backward graph
holds compileops ops too. The public functions are in :mod:`.api`.

Checks (``checks.py``): shape, dtype and device preconditions run in the fake functions and
eagerly; the data-dependent offset checks run eagerly on CPU tensors, and on CUDA only with
strict offset checks on (:func:`compileops.strict_offset_checks`, one host sync per call; off
by default so CUDA graph capture works). Batch-invariant mode
(:func:`compileops.batch_invariant`) fixes the tile config of the row-wise products.

Precision (axis B): fp32 accumulation, one rounding to the output dtype; fp32 inputs use TF32
when ``torch.backends.cuda.matmul.allow_tf32`` is set. Tested tolerance vs fp64: relative
error 1e-5 (fp32, IEEE), 1e-2 (bf16), 2e-3 (fp16).
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.grouped_linear import reference
from compileops.grouped_linear.backward_ops import (
    forward_mode,
    keep_for_backward,
    linear_backward,
    swiglu_derivative,
    use_triton,
)
from compileops.grouped_linear.checks import (
    check_forward_args,
    check_offsets_eagerly,
    check_row_scaled_args,
)
from compileops.modes import BATCH_INVARIANT


# ---------------------------------------------------------------------------------------
# Forward


def _forward_fake(x, weight, offsets, bias, swiglu: bool) -> torch.Tensor:
    check_forward_args(x, weight, offsets, bias, swiglu)
    n = weight.shape[1] // 2 if swiglu else weight.shape[1]
    return x.new_empty((x.shape[0], n))


def _forward(x, weight, offsets, bias, swiglu: bool) -> torch.Tensor:
    """Eager forward of both ops: the same checks as the fake, then the chosen backend."""
    check_forward_args(x, weight, offsets, bias, swiglu)
    check_offsets_eagerly(offsets, x.shape[0])
    name = "grouped_linear_swiglu" if swiglu else "grouped_linear"
    if use_triton(name, x):
        from compileops.grouped_linear import kernels

        fn = kernels.grouped_linear_swiglu_forward if swiglu else kernels.grouped_linear_forward
        return fn(x, weight, offsets, bias, batch_invariant=BATCH_INVARIANT.enabled())
    fn = reference.grouped_linear_swiglu_forward if swiglu else reference.grouped_linear_forward
    return fn(x, weight, offsets, bias)



@custom_op("grouped_linear")
def grouped_linear_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, bias ``[G, N]`` -> ``[M, N]``."""
    return _forward(x, weight, offsets, bias, swiglu=False)


@grouped_linear_op.register_fake
def _grouped_linear_fake(x, weight, offsets, bias=None):
    return _forward_fake(x, weight, offsets, bias, swiglu=False)


def _setup_context(ctx, inputs, output) -> None:
    keep_for_backward(ctx, inputs)


def _grouped_linear_backward(ctx, grad):
    with forward_mode(ctx):
        return linear_backward(ctx, grad, *ctx.saved_tensors)


backends.register_autograd(grouped_linear_op, _grouped_linear_backward, _setup_context)


@custom_op("grouped_linear_swiglu")
def grouped_linear_swiglu_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """weight ``[G, 2H, K]`` (gate rows ``[:H]``, up rows ``[H:]``) ->
    ``silu(x W_gate^T + b_gate) * (x W_up^T + b_up)`` ``[M, H]``, in one kernel."""
    return _forward(x, weight, offsets, bias, swiglu=True)


@grouped_linear_swiglu_op.register_fake
def _grouped_linear_swiglu_fake(x, weight, offsets, bias=None):
    return _forward_fake(x, weight, offsets, bias, swiglu=True)


def _swiglu_recompute_backward(ctx, grad):
    # recompute=True: the pre-activation [M, 2H] is recomputed (one more grouped GEMM).
    with forward_mode(ctx):
        x, weight, offsets, bias = ctx.saved_tensors
        preact = grouped_linear_op(x, weight, offsets, bias)
        return linear_backward(ctx, swiglu_derivative(preact, grad), x, weight, offsets, bias)


backends.register_autograd(grouped_linear_swiglu_op, _swiglu_recompute_backward, _setup_context)


@custom_op("grouped_linear_swiglu_with_preact")
def grouped_linear_swiglu_with_preact_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training form of ``grouped_linear_swiglu``: ``(silu(gate) * up [M, H],
    preact [M, 2H])``, where ``preact = x W_g^T + b_g`` (rounded to x's dtype) is written by the
    same kernel for the backward, which then needs no GEMM of its own beyond dX and dW."""
    check_forward_args(x, weight, offsets, bias, True)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_swiglu_with_preact", x):
        from compileops.grouped_linear import kernels

        preact = x.new_empty((x.shape[0], weight.shape[1]))
        out = kernels.grouped_linear_swiglu_forward(
            x, weight, offsets, bias, batch_invariant=BATCH_INVARIANT.enabled(), preact=preact)
        return out, preact
    return reference.grouped_linear_swiglu_with_preact(x, weight, offsets, bias)


@grouped_linear_swiglu_with_preact_op.register_fake
def _grouped_linear_swiglu_with_preact_fake(x, weight, offsets, bias=None):
    out = _forward_fake(x, weight, offsets, bias, swiglu=True)
    return out, x.new_empty((x.shape[0], weight.shape[1]))


def _setup_preact_context(ctx, inputs, output) -> None:
    _, preact = output
    keep_for_backward(ctx, inputs, preact)
    ctx.mark_non_differentiable(preact)


def _swiglu_saved_backward(ctx, grad, _grad_preact):
    with forward_mode(ctx):
        x, weight, offsets, bias, preact = ctx.saved_tensors
        return linear_backward(ctx, swiglu_derivative(preact, grad), x, weight, offsets, bias)


backends.register_autograd(grouped_linear_swiglu_with_preact_op, _swiglu_saved_backward,
                           _setup_preact_context)


@custom_op("grouped_linear_row_scaled")
def grouped_linear_row_scaled_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, row_scale: torch.Tensor,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, row_scale ``[M]`` in x's
    dtype -> ``[M, N]``: ``grouped_linear(x, weight, offsets) * row_scale[:, None]``, the same
    bits, in one kernel (the scale is applied per row as the tile leaves the GEMM).

    Compiled, the scale is an input of the template, loaded once per tile row: written as a
    product after the op, Inductor may inline the scale's producers (a gather by the routing
    order, the top-k normalisation) into the GEMM's epilogue, recomputed for every element.
    No autograd of its own: :mod:`compileops.grouped_linear.scaled` differentiates it."""
    check_row_scaled_args(x, weight, offsets, row_scale)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_row_scaled", x):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_forward(x, weight, offsets, row_scale=row_scale,
                                              batch_invariant=BATCH_INVARIANT.enabled())
    return reference.grouped_linear_row_scaled(x, weight, offsets, row_scale)


@grouped_linear_row_scaled_op.register_fake
def _grouped_linear_row_scaled_fake(x, weight, offsets, row_scale):
    check_row_scaled_args(x, weight, offsets, row_scale)
    return x.new_empty((x.shape[0], weight.shape[1]))
