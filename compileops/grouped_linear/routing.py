"""Sync-free MoE routing helpers: top-k assignments -> expert-sorted rows + offsets, and back.

Nothing here reads a group size on the host: the sort, the offsets (``searchsorted`` of
the expert ids ``0..G-1`` in the sorted assignment list) and the inverse permutation all
stay on the device, so the MoE layer compiles with ``fullgraph=True`` and captures in CUDA
graphs. Both directions are gathers, and so are both backwards: no scatter-add, whose
atomics on a GPU would sum a token's ``k`` copies in a different order from run to run
(autograd's own ``index_select`` backward). The combine's backward gathers by the inverse
permutation (:class:`_PermuteRows`); the permute's gathers the ``k`` copies back into token
order and sums them over the slots in order (:class:`_GatherTokenCopies`).
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops.grouped_linear import checks


def permute_by_expert(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """x ``[T, D]``, expert_ids ``[T, k]`` (int) -> ``(x_sorted [T*k, D], order [T*k],
    offsets int32 [E])``.

    ``order[i]`` is the flat assignment (``token * k + slot``) in sorted position i; assignments
    of one expert keep token order (stable sort). ``offsets[e]`` is the end row of expert e.

    Ids must lie in ``[0, num_experts)``: a bad id raises ``IndexError`` naming it on CPU
    tensors (elsewhere only with strict offset checks: the check reads the ids on the host).
    """
    checks.check_permute_args(x, expert_ids, num_experts)
    checks.check_expert_id_values(expert_ids, num_experts)
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    x_sorted = _GatherTokenCopies.apply(x, order, top_k)
    return x_sorted, order, offsets


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``: a scatter into distinct slots (no sort, no atomics).
    ``perm`` must be a permutation of ``0..n-1`` (here: one a sort produced)."""
    return torch.empty_like(perm).scatter_(
        0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))


class _PermuteRows(torch.autograd.Function):
    """``rows [N, D]`` -> ``rows[perm]`` for a permutation ``perm`` of ``0..N-1``; the
    backward gathers by its inverse, where autograd would zero-fill and ``index_add``."""

    @staticmethod
    def forward(rows, perm):
        return rows.index_select(0, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (perm,) = ctx.saved_tensors
        return grad.index_select(0, inverse_permutation(perm)), None


class _GatherTokenCopies(torch.autograd.Function):
    """``x [T, D]``, ``order [T*k]`` (a permutation of the flat assignments) -> ``x[order //
    k]`` ``[T*k, D]``. Backward: ``dx[t] = sum_j dxs[inverse[t*k + j]]``, a gather by the
    inverse permutation and a sum over the ``k`` slots in slot order, instead of autograd's
    ``index_add`` (atomic adds on CUDA: the order of a token's ``k`` contributions, and so
    the last bits of dx, changed from run to run)."""

    @staticmethod
    def forward(x, order, top_k):
        return x.index_select(0, order // top_k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, order, top_k = inputs
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        ctx.tokens = x.shape[0]

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        per_slot = grad.index_select(0, inverse_permutation(order)).reshape(ctx.tokens, ctx.top_k, grad.shape[-1])
        return per_slot.sum(1), None, None


def unpermute_and_combine(y_sorted: torch.Tensor, order: torch.Tensor,
                          weights: torch.Tensor, *,
                          order_is_permutation: bool = False) -> torch.Tensor:
    """y_sorted ``[T*k, D]`` (rows in expert order), order ``[T*k]``, weights ``[T, k]`` ->
    ``[T, D]``: ``out[t] = sum_j weights[t, j] * y[t*k + j]`` summed over slots in order.

    ``order_is_permutation=True`` (``order`` is the one :func:`permute_by_expert` returned):
    the un-permutation is its inverse, a scatter into distinct slots, so the layer sorts once.
    The default accepts any caller's values and inverts them with a second sort (``argsort``),
    where a scatter of a non-permutation would write out of bounds. Same bits either way,
    forward and backward.
    """
    checks.check_unpermute_args(y_sorted, order, weights)
    tokens, top_k = weights.shape
    inverse = inverse_permutation(order) if order_is_permutation else torch.argsort(order)
    y = _PermuteRows.apply(y_sorted, inverse).reshape(tokens, top_k, y_sorted.shape[-1])
    return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def dirichlet_offsets(groups: int, m: int, *, seed: int = 0,
                      generator: Optional[torch.Generator] = None,
                      device=None) -> torch.Tensor:
    """int32 cumulative end rows ``[groups]`` of Dirichlet(1)-skewed group sizes summing to
    ``m`` (realistic MoE routing imbalance; for tests, benchmarks and autotuning inputs).

    Drawn on the CPU from ``generator`` (or a fresh one seeded with ``seed``), then moved to
    ``device``. Groups may be empty.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(seed)
    if groups == 0:
        return torch.zeros(0, dtype=torch.int32, device=device)
    e = -torch.log(torch.rand(groups, generator=generator).clamp_min(1e-12))  # Exp(1)
    share = e / e.sum()  # normalized Exp(1) draws: Dirichlet(1)
    ends = torch.round(torch.cumsum(share, 0) * m).to(torch.int64)
    ends[-1] = m
    return ends.to(torch.int32).to(device)
