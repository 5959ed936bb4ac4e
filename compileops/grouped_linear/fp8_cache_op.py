"""``compileops::fp8_weight_cached``: the fp8 weight cache's lookup as compiled graphs call it.

A compiled fp8 step with ``cache_fp8_weights=True`` makes one host call per weight and
layout (four in an MoE layer's forward and backward: gate/up and down, each for the forward
and, transposed, for dX); every other part of the step is a generated kernel. That call was
``compileops::fp8_weight_rowwise``, a ``torch.library.custom_op``, whose Python wrappers
(autograd, redispatch, the compiler-disable guard) cost several times the lookup itself.
This op is declared with ``torch.library.Library`` instead: one dispatcher entry straight
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

import torch

from compileops._library import NAMESPACE
from compileops.grouped_linear.fp8_op import fake_weight_copy, rowwise_weight_copy

NAME = "fp8_weight_cached"

_library = torch.library.Library(NAMESPACE, "FRAGMENT")
_library.define(
    f"{NAME}(Tensor weight, bool transposed, Tensor weight_base) -> (Tensor, Tensor)",
    tags=(torch.Tag.cudagraph_unsafe,))


def _cached_copy(weight: torch.Tensor, transposed: bool, weight_base: torch.Tensor):
    q, scale = rowwise_weight_copy(weight, transposed, True, weight_base)
    return q.detach(), scale.detach()


def _fake(weight, transposed, weight_base):
    return fake_weight_copy(weight, transposed)


_library.impl(NAME, _cached_copy, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::{NAME}", _fake, lib=_library)
