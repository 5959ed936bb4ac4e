"""Data-parallel helper for the distillation loss normaliser."""
from __future__ import annotations

from typing import Union

import torch


def dp_all_reduce_sum(x: Union[torch.Tensor, int, float], group=None) -> torch.Tensor:
    """Sum a count across the data-parallel ``group`` (default: the world).

    Returns a fresh fp32 tensor (``x`` is never modified); without an initialised process
    group it is a copy of ``x`` in fp32. ``x`` must be on a device the group's backend
    supports (CPU for gloo, CUDA for NCCL).
    """
    out = torch.as_tensor(x).detach().to(torch.float32, copy=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
