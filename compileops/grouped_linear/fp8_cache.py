"""The fp8 grouped linear's weight cache (opt-in: ``cache_fp8_weights=True``).

Without it each fp8 forward quantises its weight again (with rowwise scaling the backward
transposes that copy for dX). With it the e4m3 copy of a weight is made once
per version of that weight and reused by every later call until the weight changes:
micro-batches of one optimizer step, and the forward and backward of each, share one copy
per layout.

**When a copy is stale.** An entry belongs to one tensor storage (held by a weak reference,
so a freed and reallocated weight can never match it) at one value of the tensor's version
counter, which every in-place update through autograd's view of the tensor bumps: optimizer
steps, ``copy_`` and ``load_state_dict`` under ``torch.no_grad()``. And every entry is
dropped after any ``torch.optim`` optimizer's step (a global step hook, registered when the
first copy is cached): FSDP2 (``fully_shard``) all-gathers the updated shards into the same
unsharded parameter storage *with the parameter's version counter kept as it was*, so
without the hook the forward after a step could match the copies of the weights before it.
Writes that bypass both are not seen: through another tensor over the same storage with a
version counter of its own (``param.data``, a parameter built as ``nn.Parameter(p.data)``:
a write through one is not seen by a cached call on the other), or into the storage by other
means with no optimizer step after them (``load_state_dict`` into an FSDP2-sharded model,
which the next all-gather brings into the unsharded storage). After such writes call
:func:`clear_fp8_weight_cache`.

**Compiled.** Inductor hands an op a view of a graph input (``w.transpose(1, 2)``,
``w[:, :H]``) as a tensor rebuilt over the same storage with a version counter of its own,
which no write to the parameter ever moves. So under ``torch.compile`` the cache follows the
graph input the weight was taken from (the parameter, or the view passed in), which the
lowering hands the op as its ``weight_base``: every write above is seen there as it is
eagerly, with ``dynamic=True`` too. A weight computed inside the compiled graph (a cast of
fp32 masters, a concatenation) is a new tensor whose writes nothing tracks: it is not
cached, it is quantised on every call, and the compile warns saying so (once, when
the graph is lowered: a compile served from Inductor's on-disk cache does not warn again).
Nor is a weight that the same compiled graph also writes in place, whole, through a view or
in a list (``w.mul_(2)``, ``w[:, :4].mul_(2)``, ``w[0].zero_()``, ``torch._foreach_mul_([w],
0.5)`` under ``no_grad`` inside the compiled function): its version is raised before the graph runs, so
the version cannot tell the values before the write from those after it.

**The cost.** Memory: each cached weight keeps its e4m3 copy and fp32 scales alive, one
byte per element per layout (rowwise: two layouts, the forward's copy and its transpose for
dX; blockwise: one),
until the next optimizer step, or until the weight changes, or until the weight's storage is
freed (the parameter deleted, or ``param.data = other``): a finaliser on the storage releases
its copies then. Nothing else: a lookup is a dict access under a lock, on the host, no device
sync. The cache holds no reference to the weight tensor itself, so
``torch.utils.swap_tensors`` (``load_state_dict`` and ``Module.to`` with
``torch.__future__.set_swap_module_params_on_conversion(True)``) works on cached weights.

**What it buys**, measured on an H200 (rowwise, a compiled MoE layer's forward and backward,
``benchmarks/bench_moe_layer.py --impls compileops-fp8-cached``, weights unchanged between
steps): against the bf16 ``torch._grouped_mm`` layer, 1.16x at Mixtral-8x7B's shape for 2.6
GiB of copies, 1.02x at Qwen3-30B-A3B's for 1.1 GiB, 1.12x at DeepSeek-V3's 32-expert shard
for 2.6 GiB and 1.10x at Qwen3-235B-A22B's for 4.5 GiB; without the cache the fp8 layer is
0.67-0.94x bf16. With ``fp8_fast_accum=True`` as well: 1.32x, 1.05x, 1.18x and 1.19x. With
N micro-batches per optimizer step the copies are made once per N micro-batches, so each pays
about 1/N of the difference between the two.

Inference tensors have no version counter; their copies are not cached. Nor are copies made
while a CUDA graph is being captured (``torch.compile(mode="reduce-overhead")``,
``torch.cuda.graph``): a lookup is host code, which a graph's replays do not run again, so
a replay after an optimizer step would read the copies of the weights before it. Captured,
the quantisation is part of the graph and every replay makes the copies anew.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

# Re-entrant: a weight's finaliser (which takes the lock) can run inside a locked section,
# when the garbage collector happens to free that weight there.
_lock = threading.RLock()
# key -> (weak reference to the weight's storage, the version of the tensor that tracks
# writes to it, (q, scale), that tensor's id)
_entries: dict[tuple, tuple[StorageWeakRef, int, tuple[torch.Tensor, torch.Tensor], int]] = {}
# A weight storage's identity (``StorageWeakRef.cdata``) -> its finaliser (one per storage),
# which drops that storage's entries when it is freed. On the storage, not the tensor: a
# weak reference to a tensor would make ``torch.utils.swap_tensors`` refuse it (which
# ``load_state_dict`` and ``Module.to`` use under
# ``torch.__future__.set_swap_module_params_on_conversion(True)``, and for tensor
# subclasses); torch keeps one Python object per live storage, so the finaliser runs when
# the storage itself is freed.
_finalisers: dict[int, weakref.finalize] = {}
# The global optimizer-step hook's handle, once registered (the first cached copy).
_step_hook = None


def _drop_after_optimizer_step(optimizer, args, kwargs) -> None:
    """After any optimizer step the weights may have changed behind their version counters
    (FSDP2's all-gathers keep them): drop every copy."""
    clear_fp8_weight_cache()


def _watch_optimizer_steps() -> None:
    global _step_hook
    with _lock:
        if _step_hook is None:
            _step_hook = register_optimizer_step_post_hook(_drop_after_optimizer_step)


def _key(weight: torch.Tensor, storage: torch.UntypedStorage, layout: tuple) -> tuple:
    return (storage.data_ptr(), weight.storage_offset(), tuple(weight.shape),
            tuple(weight.stride()), weight.dtype, weight.device, layout)


def _capturing(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s device is capturing a CUDA graph on the current stream."""
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


def _version_source(weight: torch.Tensor, base: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose version counter follows writes to ``weight``'s storage: ``base``
    when given (it must hold that storage), else the root of ``weight``'s views (eager views
    share their root's counter). None when ``base`` holds another storage: nothing to check
    the weight's values by."""
    if base is None:
        return weight if weight._base is None else weight._base
    if base.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
        return None
    return base


def _release(storage_id: int) -> None:
    """The weight storage ``storage_id`` (its ``StorageWeakRef.cdata``) was freed: drop its
    entries."""
    with _lock:
        _finalisers.pop(storage_id, None)
        for key in [k for k, e in _entries.items() if e[0].cdata == storage_id or e[0].expired()]:
            del _entries[key]


def quantised_weight(weight: torch.Tensor, layout: tuple,
                     quantise: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                     base: Optional[torch.Tensor] = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantise()``'s ``(q, scale)`` for ``weight`` in ``layout`` (a hashable naming the
    scaling and the product), from the cache while the weight's storage and version are
    those it was made from; made and stored otherwise. ``base``: the tensor whose version
    counter follows writes to ``weight``'s storage, when ``weight``'s own does not (a
    compiled graph's rebuilt view of a parameter: the fp8 ops' ``weight_base``)."""
    source = _version_source(weight, base)
    if source is None or source.is_inference() or _capturing(weight):
        return quantise()
    untyped = weight.untyped_storage()
    key, version = _key(weight, untyped, layout), source._version
    storage = StorageWeakRef(untyped)
    with _lock:
        entry = _entries.get(key)
        # The same storage (a weak reference keeps its identity from being reused), its
        # version read from the same tensor, at the same version: the same values. (Two
        # tensors over one storage with counters of their own, ``nn.Parameter(p.data)``,
        # can be at equal versions after different writes.)
        if entry is not None and entry[1] == version and entry[0] == storage \
                and entry[3] == id(source) and not entry[0].expired():
            return entry[2]
    _watch_optimizer_steps()
    value = quantise()
    with _lock:
        for stale in [k for k, e in _entries.items() if e[0].expired()]:
            del _entries[stale]  # their storages were freed while their tensors live on
        _entries[key] = (storage, version, value, id(source))
        if storage.cdata not in _finalisers:
            _finalisers[storage.cdata] = weakref.finalize(untyped, _release, storage.cdata)
    return value


def clear_fp8_weight_cache() -> None:
    """Drop every cached e4m3 weight copy (after writing weights behind the version
    counter's back, or to free the memory)."""
    with _lock:
        _entries.clear()


def cached_fp8_weight_bytes() -> int:
    """Bytes held by the cache's e4m3 copies and scales."""
    with _lock:
        return sum(q.nbytes + s.nbytes for _, _, (q, s), _ in _entries.values())
