"""Where a chunkwise program's rows are: its document and chunk, read from the device tables
of :mod:`compileops.mlstm.documents` (``bounds [N + 2]``, ``slot_first [N + 1]``,
``slot_doc [U]``, int32, contiguous). ``@triton.jit`` helpers only.

A program works on one document as if it ran alone: its pointers are moved to the
document's first row (and first state slot), and it is given the document's length as the
sequence length, so every tile starts where it starts for the document alone and every
load past the document's end is masked. The kernel bodies it calls are the unpacked ones.
"""
from __future__ import annotations

import triton
import triton.language as tl


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


__all__ = ["document_rows", "documents_valid", "locate_slot", "split_program",
           "state_slot_offsets"]
