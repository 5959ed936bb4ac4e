"""The embedding custom ops: ``compileops::embedding`` and ``compileops::embedding_backward``.

Both are functional. The forward's backward is the second op, so the compiled backward graph
holds ``compileops::embedding_backward`` (sort + ordered fp32 run sums), never Inductor's
atomic scatter-add.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op, require_tensors
from compileops.embedding import checks, reference
from compileops.embedding.checks import check_backward_args, check_forward_args
from compileops.modes import STRICT_INDEX_CHECKS, set_strict_index_checks, strict_index_checks

__all__ = ["embedding", "set_strict_index_checks", "strict_index_checks"]


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
            checks.check_ids_in_range(ids, weight.shape[0])
        from compileops.embedding import kernels

        return kernels.embedding_forward(ids, weight, out_dtype)
    checks.check_ids_in_range(ids, weight.shape[0])
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


backends.register_autograd(embedding_op, _embedding_autograd, _embedding_setup_context)


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
    grads in position order; untouched rows and ``padding_idx`` are zero. Ids outside
    ``[0, num_embeddings)`` raise ``IndexError`` as in the forward (CPU tensors, and the
    reference backend).
    """
    check_backward_args(grad, ids, num_embeddings, padding_idx, weight_dtype)
    backend = backends.select("embedding_backward", grad.device)
    if backend == "reference" or ids.device.type == "cpu":
        # As in the forward: a bad id would wrap (reference) or be dropped (kernels).
        checks.check_ids_in_range(ids, num_embeddings)
    if backend == "triton":
        from compileops.embedding import kernels

        return kernels.embedding_backward(grad, ids, num_embeddings, padding_idx, weight_dtype)
    return reference.embedding_backward(grad, ids, num_embeddings, padding_idx, weight_dtype)


@embedding_backward_op.register_fake
def _embedding_backward_fake(grad, ids, num_embeddings, padding_idx, weight_dtype):
    check_backward_args(grad, ids, num_embeddings, padding_idx, weight_dtype)
    return grad.new_empty((num_embeddings, grad.shape[-1]), dtype=weight_dtype)


# ---------------------------------------------------------------------------------------
# Public function


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
      or, under strict index checks (``compileops.strict_index_checks()``, or the process
      default :func:`set_strict_index_checks`), an ``IndexError`` before the launch (one
      device sync; ignored while compiling).

    Dtype contract: bitwise equal to ``weight[ids].to(out_dtype)``. The backward is
    deterministic and bitwise batch-invariant.
    """
    require_tensors((("ids", ids), ("weight", weight)))
    if padding_idx is not None:  # (weight is not touched before ids: graph input order)
        padding_idx = checks.normalize_padding_idx(padding_idx, weight.shape[0])
    # is_compiling() first: Dynamo cannot trace a ContextVar read.
    if not torch.compiler.is_compiling() and STRICT_INDEX_CHECKS.enabled():
        checks.check_ids_in_range(ids, weight.shape[0])
    return embedding_op(ids, weight, out_dtype, padding_idx)
