"""Process-group sums for the distillation loss: the normaliser's count, and the chunk sums
of a context-parallel sequence."""
from __future__ import annotations

from typing import Union

import torch

from compileops import backends


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


@backends.keeps_forward_backend
class _SumAcrossGroup(torch.autograd.Function):
    """``y = sum over the group's ranks of x``; backward passes ``grad_y`` through unchanged.

    Every rank ends with the same ``y`` and computes the same loss from it, so each rank's
    upstream gradient already is the whole ``dL/dy``, and ``dy/dx_r = 1`` routes it to its
    own ``x_r``; summing the gradients across ranks as well would count it once per rank.
    """

    @staticmethod
    def forward(x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass  # the backward needs nothing

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, None


def group_size(group) -> int:
    """The number of ranks in ``group`` (1 for ``None``); ``ValueError`` if a group is given
    but ``torch.distributed`` is not initialised."""
    if group is None:
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was given (cp_group) but torch.distributed is not "
                         "initialised; pass cp_group=None on a single process")
    return dist.get_world_size(group)


def all_reduce_sum_with_grad(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, as a new tensor (``x`` is not modified);
    differentiable, the gradient passes through to each rank's ``x`` unchanged. ``x`` itself
    when the group is ``None`` or has one rank."""
    if group_size(group) <= 1:
        return x
    return _SumAcrossGroup.apply(x, group)
