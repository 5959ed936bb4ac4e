"""Argument checks and id preprocessing of the embedding ops, shared by both backends.

The reference (``reference.py``) is only the math; the ops (``op.py``) validate their
arguments here before either backend runs, and the Triton launchers flatten ids here. Being
separate, these are tested on their own (``tests/embedding/test_checks.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import check_dim, check_floating, check_index_dtype, check_same_device


def out_of_range_message(bad_id: int, num_embeddings: int) -> str:
    return (
        f"compileops.embedding: id {bad_id} is out of range for a table of "
        f"{num_embeddings} rows (valid ids are 0..{num_embeddings - 1})"
    )


def check_ids_in_range(ids: torch.Tensor, num_embeddings: int) -> None:
    """Raise ``IndexError`` naming the first bad id. Reads ids on the host (a sync on GPU)."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num_embeddings)
    if bool(bad.any()):
        first_bad = int(ids.reshape(-1)[bad.reshape(-1)][0])
        raise IndexError(out_of_range_message(first_bad, num_embeddings))


def normalize_padding_idx(padding_idx: Optional[int], num_embeddings: int) -> Optional[int]:
    """A negative ``padding_idx`` counts from the end, as in ``torch.nn.Embedding``."""
    if padding_idx is not None and padding_idx < 0:
        return num_embeddings + padding_idx
    return padding_idx


def check_padding_idx(padding_idx: Optional[int], num_embeddings) -> None:
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
    check_padding_idx(padding_idx, weight.shape[0])


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
    check_padding_idx(padding_idx, num_embeddings)


def flatten_ids(ids: torch.Tensor) -> torch.Tensor:
    """ids ``[*]`` -> a dense ``[n]`` vector, as the kernels index it (a view when ``ids``
    is contiguous). A strided 1-D view such as ``ids[::2]`` reshapes to itself, so it is
    copied."""
    return ids.reshape(-1).contiguous()
