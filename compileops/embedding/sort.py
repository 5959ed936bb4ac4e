"""A two-launch stable sort of token ids for the embedding backward (Triton).

``torch.sort(ids, stable=True)`` of 16K int32 ids takes ~57 us on an H100: cub's radix sort
is several launches, each short of work, plus ATen's index and copy kernels. In the
two-stream backward the hot-id chains cannot start before the sort ends, so the sort sits on
the critical path. Here the sort is two Triton launches:

1. ``sort_key_blocks_kernel``: each program packs ``SORT_BLOCK`` ids with their token
   positions into unique int64 keys ``id << pos_bits | position`` and sorts them
   (``tl.sort``, a bitonic network in registers and shared memory). Sorting unique keys that
   carry the position is a stable sort of the ids.
2. ``merge_rank_kernel``: a key's place in the whole sorted sequence is the number of keys
   smaller than it, summed over the sorted blocks: one branchless binary search per block,
   all blocks searched at once (a ``[BLOCK_I, NB]`` tile, ``log2(SORT_BLOCK) + 1`` rounds of
   cache-resident gathers). Each key then scatters its id and position to that place.

``hot_first`` order (``counts`` given): the keys carry ``n_tokens - count(id)`` above the id,
so the most frequent ids come first (ties by id), each id's entries still contiguous and in
token-position order. The backward's run programs are launched in sorted order, so the
longest (latency-bound) chains then start first instead of wherever their id falls.

The second launch does ``n_tokens * n_blocks`` searches, so the backward takes this path
only up to ``MAX_TOKENS`` tokens (64 blocks) and uses ``torch.sort`` above it.
Without ``counts`` the output is exactly ``torch.sort(ids, stable=True)``'s (as int32 ids,
int64 positions): the keys are unique, so there are no ties to order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_power_of_2

SORT_BLOCK = 1024  # keys per block sorted by one program
MAX_BLOCKS = 64  # the merge tile's widest block count
MAX_TOKENS = SORT_BLOCK * MAX_BLOCKS
KEY_PAD = tl.constexpr(2**63 - 1)  # sorts after every real key; never counted as smaller


@triton.jit
def sort_key_blocks_kernel(ids_ptr, counts_ptr, block_keys_ptr, n_tokens, pos_bits, id_bits,
                           SORT_BLOCK: tl.constexpr, HOT_FIRST: tl.constexpr):
    """Sort one block of packed keys: ``block_keys[b * SORT_BLOCK:(b + 1) * SORT_BLOCK]``
    (int64) gets ``id << pos_bits | position`` of ids ``[b * SORT_BLOCK, ...)`` (int32 or
    int64 ``[n_tokens]``) in increasing order, padded with ``2**63 - 1`` past the end.
    ``HOT_FIRST``: ``(n_tokens - counts[id]) << (id_bits + pos_bits)`` is added on top
    (``counts``: int32 ``[V]``, ``V <= 2**id_bits``; an id outside ``[0, 2**id_bits)``
    counts 1 and keeps only its low ``id_bits`` in the key: the run programs read the real
    id, which ``merge_rank_kernel`` gathers, and assert)."""
    block = tl.program_id(0)
    pos = block.to(tl.int64) * SORT_BLOCK + tl.arange(0, SORT_BLOCK)
    in_range = pos < n_tokens
    ids = tl.load(ids_ptr + pos, mask=in_range, other=0).to(tl.int64)
    if HOT_FIRST:
        id_ok = in_range & (ids >= 0) & (ids < (1 << id_bits))
        # A touched id counts >= 1, so the field n_tokens - count fits in pos_bits bits.
        count = tl.maximum(tl.load(counts_ptr + ids, mask=id_ok, other=1), 1).to(tl.int64)
        ids = ((n_tokens - count) << id_bits) | (ids & ((1 << id_bits) - 1))
    keys = tl.where(in_range, (ids << pos_bits) | pos, KEY_PAD)
    tl.store(block_keys_ptr + pos, tl.sort(keys))


@triton.jit
def merge_rank_kernel(block_keys_ptr, ids_ptr, sorted_ids_ptr, order_ptr, n_blocks, pos_bits,
                      SORT_BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr, BLOCK_I: tl.constexpr,
                      NB: tl.constexpr):
    """Scatter ``BLOCK_I`` sorted-block keys to their global places: ``sorted_ids[rank]``
    (int32, gathered from ``ids``) and ``order[rank]`` (int64, the key's position) for
    ``rank`` = the count of smaller keys over all ``n_blocks`` blocks (``NB``: a power of
    two >= n_blocks)."""
    slot = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    keys = tl.load(block_keys_ptr + slot)
    other = tl.arange(0, NB)
    other_ok = (other < n_blocks)[None, :]
    other_base = (other.to(tl.int64) * SORT_BLOCK)[None, :]
    probe_key = keys[:, None]
    # Branchless lower bound in each sorted block: after the halving steps `below` is within
    # one of the count of keys < probe_key, the last probe settles it.
    below = tl.zeros([BLOCK_I, NB], dtype=tl.int32)
    for step in tl.static_range(LOG_BLOCK):
        step_below = below + (SORT_BLOCK >> (step + 1))
        seen = tl.load(block_keys_ptr + other_base + (step_below - 1), mask=other_ok,
                       other=KEY_PAD)
        below = tl.where(seen < probe_key, step_below, below)
    seen = tl.load(block_keys_ptr + other_base + below, mask=other_ok, other=KEY_PAD)
    below = tl.where(seen < probe_key, below + 1, below)
    rank = tl.sum(below, axis=1).to(tl.int64)
    real = keys != KEY_PAD
    position = keys & ((1 << pos_bits) - 1)
    tl.store(sorted_ids_ptr + rank, tl.load(ids_ptr + position, mask=real).to(tl.int32),
             mask=real)
    tl.store(order_ptr + rank, position, mask=real)


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
           (flat_ids, flat_ids if counts is None else counts, block_keys, n_tokens, pos_bits,
            id_bits),
           dict(SORT_BLOCK=sort_block, HOT_FIRST=counts is not None), dict(num_warps=4))
    nb = next_power_of_2(n_blocks)
    block_i = min(sort_block, 4096 // nb)  # ~4096 searches in flight per program
    launch(merge_rank_kernel, (n_blocks * sort_block // block_i,),
           (block_keys, flat_ids, sorted_ids, order, n_blocks, pos_bits),
           dict(SORT_BLOCK=sort_block, LOG_BLOCK=sort_block.bit_length() - 1, BLOCK_I=block_i,
                NB=nb), dict(num_warps=4))
    return sorted_ids, order
