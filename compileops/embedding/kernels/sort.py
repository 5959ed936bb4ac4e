"""Sorting the token ids for the embedding backward, and the per-id maps built beside it.

The backward needs the ids stably sorted (each distinct id a contiguous run of sorted
positions, in token-position order) with each entry's token position. :func:`sort_ids`
picks one of two sorts, which give the same order:

* ``torch.sort(stable=True)``, with int32 keys when the table allows (half the radix
  passes of int64 keys);
* a two-launch Triton sort (:func:`stable_sort_ids`), fewer launches than the radix sort,
  so the backward's run programs start sooner:

  1. ``sort_key_blocks_kernel``: each program packs ``SORT_BLOCK`` ids with their token
     positions into unique int64 keys ``id << pos_bits | position`` and sorts them
     (``tl.sort``, a bitonic network). Sorting unique keys that carry the position is a
     stable sort of the ids.
  2. ``merge_rank_kernel``: a key's place in the whole sorted sequence is the number of
     keys smaller than it, summed over the sorted blocks: one branchless binary search per
     block, all blocks searched at once (a ``[BLOCK_I, NB]`` tile). Each key then scatters
     its id and position to that place.

  The second launch does ``n_tokens * n_blocks`` searches, so :func:`sort_ids` takes this
  path only up to ``MAX_TOKENS`` ids. Without ``counts`` the output is exactly
  ``torch.sort(ids, stable=True)``'s (as int32 ids, int64 positions).

Hot-first order (``counts`` given, Triton sort only): the keys carry ``n_tokens -
count(id)`` above the id, so the most frequent ids come first (ties by id), each id's
entries still contiguous and in token-position order.

The maps: :func:`touched_map` (int8, 1 where some token has the id) and :func:`id_counts`
(int32 counts, which serve both as a touched map and as the hot-first sort's counts).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..._launch import cdiv, launch, next_power_of_2
from .config import SORTS

SORT_BLOCK = 1024  # keys per block sorted by one program
MAX_BLOCKS = 64  # the merge tile's widest block count
MAX_TOKENS = SORT_BLOCK * MAX_BLOCKS
KEY_PAD = tl.constexpr(2**63 - 1)  # sorts after every real key; never counted as smaller


@triton.jit
def sort_key_blocks_kernel(ids_ptr, counts_ptr, block_keys_ptr, n_tokens, num_ids, pos_bits,
                           id_bits, SORT_BLOCK: tl.constexpr, HOT_FIRST: tl.constexpr):
    """Sort one block of packed keys; program ``b`` owns ids ``[b * SORT_BLOCK, +SORT_BLOCK)``.

    * ``ids_ptr``: ids ``[n_tokens]`` int32 or int64, contiguous.
    * ``counts_ptr``: ``HOT_FIRST`` only, int32 ``[V]`` tokens per id, ``V = num_ids <=
      2**id_bits``.
    * ``block_keys_ptr``: int64 ``[n_blocks * SORT_BLOCK]``, contiguous; block ``b`` gets
      ``id << pos_bits | position`` of its ids in increasing order, padded with ``KEY_PAD``.

    ``HOT_FIRST``: ``(n_tokens - counts[id]) << (id_bits + pos_bits)`` is added on top. An
    id outside ``[0, V)`` counts 1 (``counts`` is not read there) and keeps only its low
    ``id_bits`` in the key:
    the run programs read the real id, which ``merge_rank_kernel`` gathers, and assert.
    """
    block = tl.program_id(0)
    pos = block.to(tl.int64) * SORT_BLOCK + tl.arange(0, SORT_BLOCK)  # [SORT_BLOCK]
    in_range = pos < n_tokens
    ids = tl.load(ids_ptr + pos, mask=in_range, other=0).to(tl.int64)  # [SORT_BLOCK]
    if HOT_FIRST:
        # ids past V but below 2**id_bits would read past counts' end: not read.
        id_ok = in_range & (ids >= 0) & (ids < num_ids)
        # A touched id counts >= 1, so the field n_tokens - count fits in pos_bits bits.
        count = tl.maximum(tl.load(counts_ptr + ids, mask=id_ok, other=1), 1).to(tl.int64)
        ids = ((n_tokens - count) << id_bits) | (ids & ((1 << id_bits) - 1))
    keys = tl.where(in_range, (ids << pos_bits) | pos, KEY_PAD)
    tl.store(block_keys_ptr + pos, tl.sort(keys))


@triton.jit
def merge_rank_kernel(block_keys_ptr, ids_ptr, sorted_ids_ptr, order_ptr, n_blocks, pos_bits,
                      SORT_BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, BLOCK_I: tl.constexpr,
                      NB: tl.constexpr):
    """Scatter ``BLOCK_I`` keys of the sorted blocks to their places in the whole order.

    * ``block_keys_ptr``: int64 ``[n_blocks * SORT_BLOCK]``, ``sort_key_blocks_kernel``'s
      output (each block sorted); program ``i`` reads keys ``[i * BLOCK_I, +BLOCK_I)``.
    * ``ids_ptr``: the unsorted ids ``[n_tokens]`` (int32 or int64), contiguous.
    * ``sorted_ids_ptr``: int32 ``[n_tokens]``; ``order_ptr``: int64 ``[n_tokens]``.

    A key's ``rank`` is the count of smaller keys over all ``n_blocks`` blocks (``NB``: a
    power of two >= n_blocks); ``sorted_ids[rank]`` gets its token's id and ``order[rank]``
    its token position.
    """
    slot = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    keys = tl.load(block_keys_ptr + slot)  # [BLOCK_I]
    other = tl.arange(0, NB)
    other_ok = (other < n_blocks)[None, :]
    other_base = (other.to(tl.int64) * SORT_BLOCK)[None, :]  # [1, NB]
    probe_key = keys[:, None]
    # Branchless lower bound in each sorted block: after the halving steps `below` is within
    # one of the count of keys < probe_key, the last probe settles it.
    below = tl.zeros([BLOCK_I, NB], dtype=tl.int32)
    for step in tl.static_range(LOG_BLOCK):
        step_below = below + (SORT_BLOCK >> (step + 1))
        seen = tl.load(block_keys_ptr + other_base + (step_below - 1), mask=other_ok,
                       other=KEY_PAD)  # [BLOCK_I, NB]
        below = tl.where(seen < probe_key, step_below, below)
    seen = tl.load(block_keys_ptr + other_base + below, mask=other_ok,
                   other=KEY_PAD)  # [BLOCK_I, NB]
    below = tl.where(seen < probe_key, below + 1, below)
    rank = tl.sum(below, axis=1).to(tl.int64)  # [BLOCK_I]
    real = keys != KEY_PAD
    position = keys & ((1 << pos_bits) - 1)
    tl.store(sorted_ids_ptr + rank, tl.load(ids_ptr + position, mask=real).to(tl.int32),
             mask=real)
    tl.store(order_ptr + rank, position, mask=real)


@triton.jit
def id_counts_kernel(ids_ptr, counts_ptr, n_tokens, num_embeddings, BLOCK: tl.constexpr):
    """``counts[id] += 1`` for each in-range id of ids ``[b * BLOCK, +BLOCK)`` (program b).

    * ``ids_ptr``: ids ``[n_tokens]`` int32 or int64, contiguous.
    * ``counts_ptr``: int32 ``[num_embeddings]``, zeroed before the launch.

    Integer atomics: the final counts do not depend on their order. Out-of-range ids are
    skipped: the backward's run programs assert on them.
    """
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_n = pos < n_tokens
    ids = tl.load(ids_ptr + pos, mask=in_n, other=-1).to(tl.int64)  # [BLOCK]
    ok = in_n & (ids >= 0) & (ids < num_embeddings)
    tl.atomic_add(counts_ptr + ids, tl.full([BLOCK], 1, tl.int32), mask=ok, sem="relaxed")


COUNTS_BLOCK = 1024  # ids per id_counts_kernel program


def hot_first_fits(n_tokens: int, num_embeddings: int) -> bool:
    """Whether the ``hot_first`` keys (count, id and position fields) fit in 62 bits."""
    return _hot_first_bits(n_tokens, num_embeddings) <= 62


def _hot_first_bits(n_tokens: int, num_embeddings: int) -> int:
    pos_bits = max(1, (n_tokens - 1).bit_length())  # also holds n_tokens - count, count >= 1
    return 2 * pos_bits + max(1, (num_embeddings - 1).bit_length())


def stable_sort_ids(flat_ids: torch.Tensor, sort_block: int = SORT_BLOCK,
                    counts: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids int32 [n], order int64 [n])``: ``flat_ids`` (int32/int64 ``[n]``, values
    in ``[-2**31, 2**31)``) sorted stably, with the token position of each sorted entry.
    Two launches, no host sync. ``sort_block`` (a power of two; tests use small ones to
    merge many blocks cheaply under the interpreter) bounds ``n`` to ``64 * sort_block``.

    ``counts`` (int32 ``[V]``, the number of tokens of each id; see ``hot_first_fits``):
    hot-first order, by decreasing count, then id, then position."""
    n_tokens = flat_ids.numel()
    if sort_block < 2 or sort_block & (sort_block - 1):
        raise ValueError(f"sort_block must be a power of two >= 2, got {sort_block}")
    if n_tokens > sort_block * MAX_BLOCKS:
        raise ValueError(f"stable_sort_ids sorts at most {sort_block * MAX_BLOCKS} ids with "
                         f"sort_block {sort_block}, got {n_tokens}")
    device = flat_ids.device
    sorted_ids = torch.empty(n_tokens, dtype=torch.int32, device=device)
    order = torch.empty(n_tokens, dtype=torch.int64, device=device)
    if n_tokens == 0:
        return sorted_ids, order
    n_blocks = cdiv(n_tokens, sort_block)
    pos_bits = max(1, (n_tokens - 1).bit_length())
    id_bits = 0
    if counts is not None:
        if not hot_first_fits(n_tokens, counts.numel()):
            raise ValueError(f"hot-first keys need {_hot_first_bits(n_tokens, counts.numel())}"
                             f" bits for {n_tokens} ids of a {counts.numel()}-row table (> 62)")
        id_bits = max(1, (counts.numel() - 1).bit_length())
    block_keys = torch.empty(n_blocks * sort_block, dtype=torch.int64, device=device)
    launch(sort_key_blocks_kernel, (n_blocks,),
           (flat_ids, flat_ids if counts is None else counts, block_keys, n_tokens,
            0 if counts is None else counts.numel(), pos_bits, id_bits),
           dict(SORT_BLOCK=sort_block, HOT_FIRST=counts is not None), dict(num_warps=4))
    nb = next_power_of_2(n_blocks)
    block_i = min(sort_block, 4096 // nb)  # ~4096 searches in flight per program
    launch(merge_rank_kernel, (n_blocks * sort_block // block_i,),
           (block_keys, flat_ids, sorted_ids, order, n_blocks, pos_bits),
           dict(SORT_BLOCK=sort_block, LOG_BLOCK=sort_block.bit_length() - 1, BLOCK_I=block_i,
                NB=nb), dict(num_warps=4))
    return sorted_ids, order


def resolve_sort(sort: str, flat_ids: torch.Tensor, num_embeddings: int) -> str:
    """``"auto"``: the Triton sort on CUDA up to ``MAX_TOKENS`` ids (fewer launches), else
    ``torch.sort`` (also on CPU, where the interpreted bitonic network is slow)."""
    if sort not in SORTS:
        raise ValueError(f"unknown sort {sort!r}: expected one of {SORTS}")
    if sort == "auto":
        fits = flat_ids.numel() <= MAX_TOKENS and num_embeddings <= 2**31 - 1
        sort = "triton" if fits and flat_ids.device.type == "cuda" else "torch"
    return sort


def sort_ids(flat_ids: torch.Tensor, num_embeddings: int, sort: str = "auto",
             counts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable device sort of ids ``[n]``: ``(sorted ids, token positions)``.

    ``sort``: ``"auto"`` (:func:`resolve_sort`), ``"triton"`` (:func:`stable_sort_ids`) or
    ``"torch"`` (``torch.sort``, int32 keys when the table allows; int32 ids are not
    copied). ``counts`` (:func:`id_counts`; Triton sort only): hot-first order."""
    if resolve_sort(sort, flat_ids, num_embeddings) == "triton":
        return stable_sort_ids(flat_ids, counts=counts)
    if counts is not None:
        raise ValueError("hot-first order needs the Triton sort")
    keys = flat_ids
    if keys.dtype != torch.int32 and num_embeddings <= 2**31 - 1:
        keys = keys.to(torch.int32)
    return torch.sort(keys, stable=True)


def touched_map(flat_ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """int8 ``[V]``: 1 where some token has that id (every write stores 1: deterministic)."""
    touched = torch.zeros(num_embeddings, dtype=torch.int8, device=flat_ids.device)
    touched.index_fill_(0, flat_ids.long(), 1)
    return touched


def id_counts(flat_ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """int32 ``[V]``: the number of tokens of each id. Two launches (zeros, counts); it
    serves as the touched map (nonzero = touched) and orders the hot-first sort."""
    counts = torch.zeros(num_embeddings, dtype=torch.int32, device=flat_ids.device)
    n_tokens = flat_ids.numel()
    if n_tokens:
        launch(id_counts_kernel, (cdiv(n_tokens, COUNTS_BLOCK),),
               (flat_ids, counts, n_tokens, num_embeddings),
               dict(BLOCK=COUNTS_BLOCK), dict(num_warps=4))
    return counts
