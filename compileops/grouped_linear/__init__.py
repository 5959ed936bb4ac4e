"""Grouped linear (MoE grouped GEMM): ops, Triton kernels, module and routing helpers.

The modes (strict offset checks, batch-invariant mode) live in :mod:`compileops.modes`;
they are re-exported here.
"""
from compileops.grouped_linear.api import (
    grouped_linear,
    grouped_linear_splits,
    grouped_linear_swiglu,
    splits_to_offsets,
)
from compileops.grouped_linear.routing import permute_by_expert, unpermute_and_combine
from compileops.grouped_linear import scaled  # noqa: F401  (documented: the row-scaled autograd)
from compileops.grouped_linear import fp8_op  # noqa: F401  (registers the fp8 ops)
from compileops.grouped_linear.fp8_cache import cached_fp8_weight_bytes, clear_fp8_weight_cache
from compileops.modes import (
    batch_invariant,
    is_batch_invariant,
    set_batch_invariant,
    set_strict_offset_checks,
    strict_offset_checks,
)

__all__ = [
    "batch_invariant",
    "cached_fp8_weight_bytes",
    "clear_fp8_weight_cache",
    "grouped_linear",
    "grouped_linear_splits",
    "grouped_linear_swiglu",
    "is_batch_invariant",
    "permute_by_expert",
    "set_batch_invariant",
    "set_strict_offset_checks",
    "splits_to_offsets",
    "strict_offset_checks",
    "unpermute_and_combine",
]
