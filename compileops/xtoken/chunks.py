"""Chunk averaging of per-token log-probs: a segment sum, not a one-hot bmm.

``chunk_sums`` and the sizes are kept separate so a context-parallel all-reduce can sit
between them: ``sums, sizes = chunk_sums(...); all_reduce(sums); all_reduce(sizes);
mean = sums / sizes.clamp(min=1)[..., None]``. :func:`chunk_average` is that division.
"""
from __future__ import annotations

import torch

from compileops.xtoken.checks import check_valid_chunk_mask_args
from compileops.xtoken.op import chunk_sums_op


def chunk_sums(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs [B, T, V]`` (any float dtype), ``chunk_id [B, T]`` int32/int64 ->
    ``sums [B, C, V]`` fp32, ``sizes [B, C]`` fp32 (exact counts), ``C = max_chunks``.

    Each chunk's rows are added in token order in fp32 (deterministic, bitwise
    batch-invariant). ``chunk_id == -1`` (and any id outside ``[0, C)``) contributes nowhere;
    empty chunks give 0. Ids need not be contiguous or sorted. The gradient of ``sums`` is a
    gather back to the tokens; ``sizes`` is not differentiable.
    """
    return chunk_sums_op(log_probs, chunk_id, max_chunks)


def chunk_average(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk mean ``[B, C, V]`` fp32 and sizes ``[B, C]``; empty chunks give 0.

    Against an fp64 mean the error is that of an fp32 running sum over the chunk. The
    backward gathers ``grad / size`` to each token of the chunk.
    """
    sums, sizes = chunk_sums_op(log_probs, chunk_id, max_chunks)
    return sums / sizes.clamp(min=1).unsqueeze(-1), sizes


def valid_chunk_mask(
    student_sizes: torch.Tensor, teacher_sizes: torch.Tensor, pair_valid: torch.Tensor
) -> torch.Tensor:
    """``(student_sizes > 0) & (teacher_sizes > 0) & pair_valid``, all ``[B, C]``, bool."""
    check_valid_chunk_mask_args(student_sizes, teacher_sizes, pair_valid)
    return (student_sizes > 0) & (teacher_sizes > 0) & pair_valid.bool()
