"""Where a chunkwise program's rows are: its document and chunk, read from the device tables
of :mod:`compileops.mlstm.documents` (``bounds [N + 2]``, ``slot_first [N + 1]``,
``slot_doc [U]``, int32, contiguous). ``@triton.jit`` helpers only.

A program works on one document as if it ran alone: its pointers are moved to the
document's first row (and first state slot), and it is given the document's length as the
sequence length, so every tile starts where it starts for the document alone and every
load past the document's end is masked. The kernel bodies it calls are the unpacked ones.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.mlstm.documents import DocumentTables, chunk_slots

#: Lanes of the table kernel's walks over documents and slots.
TABLE_BLOCK = 128


@triton.jit
def document_rows(bounds_ptr, doc, num_docs):
    """``(start, length)`` of document ``doc``; ``doc == num_docs`` (a slot past the last
    document) is empty."""
    start = tl.load(bounds_ptr + doc)
    end = tl.load(bounds_ptr + doc + 1, mask=doc < num_docs, other=0)
    return start, tl.maximum(end - start, 0)


@triton.jit
def locate_slot(slot, bounds_ptr, slot_first_ptr, slot_doc_ptr, num_docs):
    """Chunk slot ``slot`` -> ``(doc, chunk, start, length)``: its document, its chunk in
    the document (the chunk's rows are ``[chunk * CHUNK, (chunk + 1) * CHUNK)`` of the
    document, none when at or past ``length``), and the document's rows."""
    doc = tl.load(slot_doc_ptr + slot)
    chunk = slot - tl.load(slot_first_ptr + doc)
    start, length = document_rows(bounds_ptr, doc, num_docs)
    return doc, chunk, start, length


@triton.jit
def documents_valid(bounds_ptr, num_docs):
    """Whether ``cu_seqlens`` was valid as given (the flag after the boundaries)."""
    return tl.load(bounds_ptr + num_docs + 1) != 0


@triton.jit
def split_program(pid, num_slots, TILES: tl.constexpr):
    """Program ``pid`` of a grid of ``B * NH * num_slots * TILES`` -> ``(bh, slot, tile)``:
    head-major, then chunk slots, then the ``TILES`` tiles of a chunk."""
    per_head = num_slots * TILES
    return pid // per_head, (pid % per_head) // TILES, pid % TILES


@triton.jit
def state_slot_offsets(bh, doc, first_slot, num_slots, num_docs):
    """``(c_slot, nm_slot)``: the first state slot of document ``doc`` of head ``bh`` in the
    chunk states ``C [B * NH, U, ...]`` and in ``n``/``m [B * NH, U + N, ...]`` (each
    document has one more n/m slot: the state leaving its last chunk), as int64."""
    bh64 = bh.to(tl.int64)
    c_slot = bh64 * num_slots + first_slot
    return c_slot, bh64 * (num_slots + num_docs) + first_slot + doc


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def document_tables_kernel(cu_ptr, bounds_ptr, slot_first_ptr, slot_doc_ptr, seq_len,
                           num_docs, num_slots, search_steps, HAS_CU: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the tables of :mod:`compileops.mlstm.documents` from ``cu_ptr [N + 1]``
    (any int dtype; ``HAS_CU`` false: one document ``[0, S)``). Walks the documents in
    blocks (carrying the running max of the boundaries and the running count of slots),
    then, once those are written, finds each slot's document by a binary search of
    ``slot_first`` (``search_steps`` >= log2(N + 1) halvings)."""
    lanes = tl.arange(0, BLOCK)
    end_carry = tl.zeros((), dtype=tl.int64)
    slot_carry = tl.zeros((), dtype=tl.int64)
    valid = tl.full((), 1, dtype=tl.int32)  # 1 while cu_seqlens needs no change
    for first in range(0, num_docs + 1, BLOCK):
        idx = first + lanes
        if HAS_CU:
            raw = tl.load(cu_ptr + idx, mask=idx <= num_docs, other=0).to(tl.int64)
            nxt = tl.load(cu_ptr + idx + 1, mask=idx < num_docs, other=0).to(tl.int64)
        else:
            raw = tl.where(idx == 0, 0, seq_len).to(tl.int64)
            nxt = tl.zeros((BLOCK,), dtype=tl.int64) + seq_len
        # Boundaries made safe: clamped into [0, S], non-decreasing, first 0, last S.
        start = tl.maximum(tl.associative_scan(tl.minimum(tl.maximum(raw, 0), seq_len), 0,
                                               _larger), end_carry)
        end = tl.maximum(start, tl.minimum(tl.maximum(nxt, 0), seq_len))
        start = tl.where(idx == 0, 0, start)
        end = tl.where(idx == num_docs - 1, seq_len, end)
        bound = tl.where(idx == num_docs, seq_len, start)
        tl.store(bounds_ptr + idx, bound.to(tl.int32), mask=idx <= num_docs)
        bad = (((idx == 0) & (raw != 0)) | ((idx == num_docs) & (raw != seq_len))
               | ((idx < num_docs) & (nxt < raw)))
        valid = valid * (tl.sum(tl.where((idx <= num_docs) & bad, 1, 0), axis=0) == 0).to(tl.int32)
        is_doc = idx < num_docs
        slots = tl.where(is_doc, tl.maximum(tl.cdiv(end - start, CHUNK), 1), 0)
        owned = tl.cumsum(slots, axis=0) + slot_carry
        tl.store(slot_first_ptr + idx + 1, owned.to(tl.int32), mask=is_doc)
        slot_carry += tl.sum(slots, axis=0)
        end_carry = tl.max(tl.where(idx <= num_docs, start, 0), axis=0)
    tl.store(slot_first_ptr, 0)
    tl.store(bounds_ptr + num_docs + 1, valid)
    tl.debug_barrier()  # slot_first, written above by this program's threads, is read below
    for first in range(0, num_slots, BLOCK):
        slot = first + lanes
        # The document owning the slot: the least d with slot_first[d + 1] > slot (N: none).
        low = tl.zeros((BLOCK,), dtype=tl.int32)
        high = tl.zeros((BLOCK,), dtype=tl.int32) + num_docs
        for _ in range(0, search_steps):
            mid = (low + high) // 2
            owned = tl.load(slot_first_ptr + mid + 1, mask=mid < num_docs, other=0)
            right = (owned <= slot) & (mid < num_docs)
            low = tl.where(right, mid + 1, low)
            high = tl.where(right, high, mid)
        tl.store(slot_doc_ptr + slot, low, mask=slot < num_slots)


def document_tables(cu_seqlens: Optional[torch.Tensor], seq: int, chunk: int,
                    device: torch.device) -> DocumentTables:
    """The tables of :mod:`compileops.mlstm.documents` for ``cu_seqlens [N + 1]`` (None:
    one document ``[0, seq)``), on ``device``: one program, no host sync."""
    docs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    slots = chunk_slots(seq, chunk, docs)
    bounds = torch.empty((docs + 2,), dtype=torch.int32, device=device)
    slot_first = torch.empty((docs + 1,), dtype=torch.int32, device=device)
    slot_doc = torch.empty((slots,), dtype=torch.int32, device=device)
    cu = cu_seqlens.contiguous() if cu_seqlens is not None else bounds
    document_tables_kernel[(1,)](
        cu, bounds, slot_first, slot_doc, seq, docs, slots, max(1, docs.bit_length()),
        HAS_CU=cu_seqlens is not None, CHUNK=chunk, BLOCK=TABLE_BLOCK,
        num_warps=4 if device.type == "cuda" else 1)
    return DocumentTables(bounds, slot_first, slot_doc, docs, slots)


__all__ = ["document_tables", "document_rows", "documents_valid", "locate_slot", "split_program",
           "state_slot_offsets"]
