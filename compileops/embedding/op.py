"""The embedding custom ops: ``compileops::embedding`` and ``compileops::embedding_backward``.

Both are functional. The forward's backward is the second op, so the compiled backward graph
holds ``compileops::embedding_backward`` (sort + ordered fp32 run sums), never Inductor's
atomic scatter-add.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops import backends
from compileops._library import (
    check_dim,
    check_floating,
    check_index_dtype,
    check_same_device,
    custom_op,
)
from compileops.embedding import reference


def _check_padding_idx(padding_idx: Optional[int], num_embeddings) -> None:
    if padding_idx is not None:
        torch._check_value(
            0 <= padding_idx < num_embeddings,
            lambda: f"padding_idx must be in [0, {num_embeddings}) once normalised, "
            f"got {padding_idx}",
        )


def check_forward_args(ids, weight, out_dtype, padding_idx) -> None:
    check_index_dtype(ids, "ids")
    check_dim(weight, 2, "weight", "[num_embeddings, embedding_dim]")
    check_floating(weight, "weight")
    check_same_device([("weight", weight), ("ids", ids)])
    if out_dtype is not None:
        torch._check_type(
            out_dtype.is_floating_point,
            lambda: f"out_dtype must be a floating-point dtype, got {out_dtype}",
        )
    _check_padding_idx(padding_idx, weight.shape[0])


def check_backward_args(grad, ids, num_embeddings, padding_idx, weight_dtype) -> None:
    check_index_dtype(ids, "ids")
    check_floating(grad, "grad")
    check_same_device([("grad", grad), ("ids", ids)])
    torch._check_value(
        grad.dim() == ids.dim() + 1 and tuple(grad.shape[:-1]) == tuple(ids.shape),
        lambda: f"grad must be [*ids.shape, D] = [{', '.join(map(str, ids.shape))}, D], "
        f"got {tuple(grad.shape)}",
    )
    torch._check_value(num_embeddings >= 0, lambda: "num_embeddings must be >= 0")
    torch._check_type(
        weight_dtype.is_floating_point,
        lambda: f"weight_dtype must be a floating-point dtype, got {weight_dtype}",
    )
    _check_padding_idx(padding_idx, num_embeddings)


# ---------------------------------------------------------------------------------------
# Forward


@custom_op("embedding")
def embedding_op(
    ids: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
    padding_idx: Optional[int] = None,
) -> torch.Tensor:
    """ids ``[*]`` int32/int64, weight ``[V, D]`` -> ``weight[ids]`` ``[*, D]`` in ``out_dtype``.

    ``padding_idx`` (already normalised to ``[0, V)``) only affects the backward.
    """
    check_forward_args(ids, weight, out_dtype, padding_idx)
    if backends.select("embedding", weight.device) == "triton":
        if ids.device.type == "cpu":
            # Triton's interpreter has no device asserts: keep the CPU IndexError contract.
            reference.check_ids_in_range(ids, weight.shape[0])
        from compileops.embedding import kernels

        return kernels.embedding_forward(ids, weight, out_dtype)
    return reference.embedding_forward(ids, weight, out_dtype)


@embedding_op.register_fake
def _embedding_fake(ids, weight, out_dtype=None, padding_idx=None):
    check_forward_args(ids, weight, out_dtype, padding_idx)
    return weight.new_empty((*ids.shape, weight.shape[1]), dtype=out_dtype or weight.dtype)


def _embedding_setup_context(ctx, inputs, output) -> None:
    ids, weight, _out_dtype, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_embeddings = weight.shape[0]
    ctx.weight_dtype = weight.dtype
    ctx.padding_idx = padding_idx


def _embedding_autograd(ctx, grad_out):
    (ids,) = ctx.saved_tensors
    grad_weight = embedding_backward_op(
        grad_out, ids, ctx.num_embeddings, ctx.padding_idx, ctx.weight_dtype
    )
    return None, grad_weight, None, None


embedding_op.register_autograd(_embedding_autograd, setup_context=_embedding_setup_context)


# ---------------------------------------------------------------------------------------
# Backward


@custom_op("embedding_backward")
def embedding_backward_op(
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int],
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """grad ``[*ids.shape, D]`` -> grad_weight ``[V, D]`` in ``weight_dtype``.

    Deterministic and bitwise batch-invariant: each row is the fp32 sum of its tokens'
    grads in position order; untouched rows and ``padding_idx`` are zero.
    """
    check_backward_args(grad, ids, num_embeddings, padding_idx, weight_dtype)
    if backends.select("embedding_backward", grad.device) == "triton":
        from compileops.embedding import kernels

        return kernels.embedding_backward(grad, ids, num_embeddings, padding_idx, weight_dtype)
    return reference.embedding_backward(grad, ids, num_embeddings, padding_idx, weight_dtype)


@embedding_backward_op.register_fake
def _embedding_backward_fake(grad, ids, num_embeddings, padding_idx, weight_dtype):
    check_backward_args(grad, ids, num_embeddings, padding_idx, weight_dtype)
    return grad.new_empty((num_embeddings, grad.shape[-1]), dtype=weight_dtype)


# ---------------------------------------------------------------------------------------
# Public function

_strict_checks = False


def set_strict_index_checks(enabled: bool) -> None:
    """Opt-in: check ids on the host before every eager embedding call (one device sync).

    On GPUs the kernels already assert on the device; strict mode turns a bad id into a
    Python ``IndexError`` naming it, before any kernel runs. Ignored while compiling.
    """
    global _strict_checks
    _strict_checks = bool(enabled)


def embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    out_dtype: Optional[torch.dtype] = None,
    padding_idx: Optional[int] = None,
) -> torch.Tensor:
    """Look up rows of ``weight`` ``[V, D]`` for ``ids`` ``[*]`` (int32/int64): returns ``[*, D]``.

    * ``out_dtype=torch.float32`` is the ground-truth path: it gathers in the weight dtype
      and upcasts only the gathered rows (the table is never copied).
    * ``padding_idx`` (negative counts from the end, as in ``torch.nn.Embedding``) receives
      no gradient.
    * Bad ids raise ``IndexError`` naming the id on CPU; on GPU a device-side assert fires,
      or, with :func:`set_strict_index_checks`, an ``IndexError`` before the launch.

    Dtype contract: bitwise equal to ``weight[ids].to(out_dtype)``. The backward is
    deterministic and bitwise batch-invariant.
    """
    if padding_idx is not None and padding_idx < 0:
        padding_idx = weight.shape[0] + padding_idx
    if _strict_checks and not torch.compiler.is_compiling():
        reference.check_ids_in_range(ids, weight.shape[0])
    return embedding_op(ids, weight, out_dtype, padding_idx)
