"""Grouped linear (MoE grouped GEMM): ops, Triton kernels, module and routing helpers."""
from compileops.grouped_linear.op import (
    batch_invariant,
    grouped_linear,
    grouped_linear_splits,
    grouped_linear_swiglu,
    is_batch_invariant,
    set_batch_invariant,
    set_strict_offset_checks,
    splits_to_offsets,
)
from compileops.grouped_linear.routing import permute_by_expert, unpermute_and_combine

__all__ = [
    "batch_invariant",
    "grouped_linear",
    "grouped_linear_splits",
    "grouped_linear_swiglu",
    "is_batch_invariant",
    "permute_by_expert",
    "set_batch_invariant",
    "set_strict_offset_checks",
    "splits_to_offsets",
    "unpermute_and_combine",
]
