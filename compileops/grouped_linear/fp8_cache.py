"""The fp8 grouped linear's weight cache (opt-in: ``cache_fp8_weights=True``).

Without it each fp8 call quantises its weight again: with rowwise scaling once for the
forward and once, per input channel, for dX. With it the e4m3 copy of a weight is made once
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
Writes that bypass both are not seen: through ``param.data``, or into the storage by other
means with no optimizer step after them (``load_state_dict`` into an FSDP2-sharded model,
which the next all-gather brings into the unsharded storage). After such writes call
:func:`clear_fp8_weight_cache`.

**The cost.** Memory: each cached weight keeps its e4m3 copy and fp32 scales alive, one
byte per element per layout (rowwise: two layouts, the forward's and dX's; blockwise: one),
until the next optimizer step, or until the weight changes or its storage is freed. Nothing
else: a lookup is a dict access under a lock, on the host, no device sync.

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
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

_lock = threading.Lock()
# key -> (weak reference to the weight's storage, the weight's version, (q, scale))
_entries: dict[tuple, tuple[StorageWeakRef, int, tuple[torch.Tensor, torch.Tensor]]] = {}
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


def quantised_weight(weight: torch.Tensor, layout: tuple,
                     quantise: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantise()``'s ``(q, scale)`` for ``weight`` in ``layout`` (a hashable naming the
    scaling and the product), from the cache while the weight's storage and version are
    those it was made from; made and stored otherwise."""
    if weight.is_inference() or _capturing(weight):
        return quantise()
    untyped = weight.untyped_storage()
    key, version = _key(weight, untyped, layout), weight._version
    storage = StorageWeakRef(untyped)
    with _lock:
        entry = _entries.get(key)
        # The same storage (a weak reference keeps its identity from being reused) at the
        # same version: the same values.
        if entry is not None and entry[1] == version and entry[0] == storage \
                and not entry[0].expired():
            return entry[2]
    _watch_optimizer_steps()
    value = quantise()
    with _lock:
        for stale in [k for k, e in _entries.items() if e[0].expired()]:
            del _entries[stale]  # their weights were freed
        _entries[key] = (storage, version, value)
    return value


def clear_fp8_weight_cache() -> None:
    """Drop every cached e4m3 weight copy (after writing weights behind the version
    counter's back, or to free the memory)."""
    with _lock:
        _entries.clear()


def cached_fp8_weight_bytes() -> int:
    """Bytes held by the cache's e4m3 copies and scales (live weights only)."""
    with _lock:
        return sum(q.nbytes + s.nbytes for ref, _, (q, s) in _entries.values()
                   if not ref.expired())
