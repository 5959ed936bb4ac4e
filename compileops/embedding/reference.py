"""Ground truth for the embedding family, in plain PyTorch.

This is the numerical contract the Triton kernels and the Inductor lowering are tested
against, and what the ``reference`` backend runs. Keep it obvious: only the math. Argument
checks (out-of-range ids included) are the ops' (``checks.py``), run before either backend.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import as_rows


def embedding_forward(
    ids: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """``out[*ids.shape, D] = weight[ids]``, upcast after the gather when ``out_dtype`` is given.

    ids: int32/int64 ``[*]`` in ``[0, V)``; weight: ``[V, D]``. Lossless: bitwise equal to
    ``weight[ids]``. Only the gathered rows are converted, never the whole table.
    """
    # Gathered into a tensor of the final shape: a reshape of index_select's [n, D] result
    # (or torch's embedding, which does that) would be a view, and autograd refuses the
    # caller's in-place ops on a view that a custom op returns.
    rows = weight.new_empty((*ids.shape, weight.shape[1]))
    torch.index_select(weight, 0, ids.reshape(-1).long(), out=as_rows(rows))
    if out_dtype is not None and out_dtype != weight.dtype:
        rows = rows.to(out_dtype)
    return rows


def accumulation_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 grads, fp64 for fp64 grads."""
    return torch.promote_types(grad_dtype, torch.float32)


def embedding_backward(
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int],
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """Gradient of the table: ``grad_weight[V, D]``, each row the fp32 sum of its tokens' grads.

    grad: ``[*ids.shape, D]`` (any float dtype, any strides); ids: ``[*]``.
    Contributions to one row are added in token-position order in fp32 (fp64 when ``grad``
    is fp64), then cast once to ``weight_dtype``. Untouched rows and the ``padding_idx`` row are zero.
    """
    dim = grad.shape[-1]
    flat_ids = ids.reshape(-1).long()
    acc_dtype = accumulation_dtype(grad.dtype)
    flat_grad = as_rows(grad).to(acc_dtype)
    if padding_idx is not None:
        keep = flat_ids != padding_idx
        flat_ids, flat_grad = flat_ids[keep], flat_grad[keep]
    order = torch.argsort(flat_ids, stable=True)  # (id, position) order
    sorted_ids, sorted_grad = flat_ids[order], flat_grad[order]
    out = torch.zeros(num_embeddings, dim, dtype=acc_dtype, device=grad.device)
    if sorted_ids.numel() == 0:
        return out.to(weight_dtype)
    # Sum each run of equal ids sequentially in position order, vectorised across runs:
    # step r adds the r-th contribution of every run that has one. (index_add_/scatter_add_
    # on GPU use atomics and would leave the order undefined.)
    is_start = torch.ones_like(sorted_ids, dtype=torch.bool)
    is_start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    run_starts = is_start.nonzero().reshape(-1)
    run_lengths = torch.diff(run_starts, append=run_starts.new_tensor([sorted_ids.numel()]))
    acc = torch.zeros(run_starts.numel(), dim, dtype=acc_dtype, device=grad.device)
    for r in range(int(run_lengths.max())):
        active = run_lengths > r
        acc[active] += sorted_grad[run_starts[active] + r]
    out[sorted_ids[run_starts]] = acc
    return out.to(weight_dtype)
