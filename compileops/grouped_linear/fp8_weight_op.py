"""The weight's e4m3 copy: ``compileops::fp8_weight_rowwise``, its body shared by the fp8
products, and ``compileops::fp8_weight_cached``, the weight cache's lookup as compiled
graphs call it.

**The lookup op.** A compiled fp8 step with ``cache_fp8_weights=True`` makes one host call
per weight and layout (four in an MoE layer's forward and backward: gate/up and down, each
for the forward and, transposed, for dX); every other part of the step is a generated
kernel. That call was ``compileops::fp8_weight_rowwise``, a ``torch.library.custom_op``,
whose Python wrappers (autograd, redispatch, the compiler-disable guard) cost several times
the lookup itself. ``compileops::fp8_weight_cached`` is declared with ``torch.library.Library`` instead: one dispatcher entry straight
into the lookup, no autograd kernel of ours (its outputs are never differentiated: they are
the cache's copies, returned detached, so no autograd history is ever attached to the
cache's own tensors). On a 2-core x86 CPU a cache hit costs 9.6 us through this op, where
it cost 20.7 us through ``fp8_weight_rowwise`` (medians of 7 x 5,000 calls).

Only Inductor's lowering of ``fp8_weight_rowwise`` with the cache on
(``compileops/lowerings/grouped_linear_fp8.py``) emits it; users call
:func:`compileops.grouped_linear` and never this op.

Shapes: ``weight [G, N, K]`` -> ``(q [G, N, K]`` e4m3, or ``[G, K, N]`` when ``transposed``;
``scale [G, N]`` fp32). ``weight_base``: the graph input whose version counter follows
writes to ``weight``'s storage (:mod:`.fp8_cache`).
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import NAMESPACE, custom_op
from compileops.grouped_linear import fp8 as fp8_rule
from compileops.grouped_linear import fp8_cache
from compileops.grouped_linear.backward_ops import use_triton

#: Every fp8 op may read the weight cache (:mod:`.fp8_cache`), a Python lookup whose answer
#: changes when the weight does. A CUDA graph replays the kernels it captured without that
#: Python: a captured step would keep reading the e4m3 copy of the weights from the
#: capture, stale after the first optimizer step. So the ops are ``cudagraph_unsafe``:
#: Inductor's CUDA graphs (``mode="reduce-overhead"``) leave out the lookups (with graph
#: partitioning, the default, only them: the compiled fp8 products and quantisation kernels
#: stay in the graph), or the whole graph without partitioning.
CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,)


def quantised_weight(weight, scaling, transposed, cache_weight, weight_base):
    """The weight's e4m3 copy and scales for the product (``transposed``: dX's, the rowwise
    copy written as ``W_g^T``), made now or taken from
    :mod:`compileops.grouped_linear.fp8_cache` (``cache_weight``; ``weight_base``: the
    tensor whose version counter follows writes to ``weight``, see the ops). Blockwise has
    one layout for both products (a square block's scale is its transpose's)."""
    from compileops.grouped_linear.kernels import fp8 as k  # Triton, imported on first use

    if scaling == "blockwise":
        def quantise():
            return k.quantize_blockwise(weight, fp8_rule.WEIGHT_BLOCK)
        layout = ("blockwise",)
    else:
        def quantise():
            return k.quantize_weight_rowwise(weight, transpose=transposed)
        layout = ("rowwise", transposed)
    if not cache_weight:
        return quantise()
    return fp8_cache.quantised_weight(weight, layout, quantise, base=weight_base)


def _check_weight_dims(weight) -> None:
    if weight.dim() != 3:  # a plain int: no torch._check needed, and this runs every call
        raise ValueError(f"weight must be [G, N, K], got shape {tuple(weight.shape)}")


@custom_op("fp8_weight_rowwise", tags=CUDAGRAPH_UNSAFE)
def fp8_weight_rowwise_op(weight: torch.Tensor, transposed: bool, cache_weight: bool = False,
                          weight_base: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight ``[G, N, K]`` quantised rowwise, one scale per output channel: ``(q [G, N,
    K]`` e4m3, ``scale [G, N]`` fp32) for the forward; ``transposed`` (dX): the same values
    written as ``W_g^T``, ``q [G, K, N]``, with the same ``scale [G, N]``.
    ``cache_weight``: taken from :mod:`.fp8_cache` while the weight is unchanged
    (``weight_base``: the ops' own). :func:`compileops.grouped_linear` passes the forward's
    copy to the fp8 products; compiled, an uncached copy is a fused Inductor kernel. The
    returned tensors may be the cache's: read them, never write them. Not differentiable."""
    return rowwise_weight_copy(weight, transposed, cache_weight, weight_base)


def rowwise_weight_copy(weight: torch.Tensor, transposed: bool, cache_weight: bool = False,
                        weight_base: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_weight_rowwise``'s body, for the op and for the lean lookup op that compiled
    graphs call (below)."""
    _check_weight_dims(weight)
    if not use_triton("fp8_weight_rowwise", weight):
        # The rule itself, in torch (the kernels' bits): a device without our kernels.
        q, scale = fp8_rule.quantize_rowwise(weight)
        return (q.transpose(1, 2) if transposed else q).contiguous(), scale
    return quantised_weight(weight, "rowwise", transposed, cache_weight, weight_base)


@fp8_weight_rowwise_op.register_fake
def fake_weight_copy(weight, transposed, cache_weight=False, weight_base=None):
    """The rowwise copy's outputs as empty tensors of their shapes and dtypes (the fake
    function of ``fp8_weight_rowwise`` and of the compiled graphs' lookup op)."""
    _check_weight_dims(weight)
    groups, n, k = weight.shape
    rows, cols = (k, n) if transposed else (n, k)
    return (weight.new_empty((groups, rows, cols), dtype=fp8_rule.E4M3),
            weight.new_empty((groups, n), dtype=torch.float32))


def _weight_copy_setup(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output)


def _weight_copy_backward(ctx, grad_q, grad_scale):
    return None, None, None, None


fp8_weight_rowwise_op.register_autograd(_weight_copy_backward, setup_context=_weight_copy_setup)


# ---------------------------------------------------------------------------------------
# The lookup compiled graphs call (the module docstring says why it is not a custom_op)

LOOKUP_NAME = "fp8_weight_cached"

_library = torch.library.Library(NAMESPACE, "FRAGMENT")
_library.define(
    f"{LOOKUP_NAME}(Tensor weight, bool transposed, Tensor weight_base) -> (Tensor, Tensor)",
    tags=CUDAGRAPH_UNSAFE)


def _cached_copy(weight: torch.Tensor, transposed: bool, weight_base: torch.Tensor):
    q, scale = rowwise_weight_copy(weight, transposed, True, weight_base)
    return q.detach(), scale.detach()


def _fake_cached_copy(weight, transposed, weight_base):
    return fake_weight_copy(weight, transposed)


_library.impl(LOOKUP_NAME, _cached_copy, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::{LOOKUP_NAME}", _fake_cached_copy, lib=_library)
