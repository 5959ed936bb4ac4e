"""Documents of the chunkwise mLSTM: where each document's rows and chunk slots are.

The chunkwise ops cut each document into its own chunks: chunk ``c`` of a document is its
rows ``[c * chunk, (c + 1) * chunk)`` counted from the document's start, as when the
document runs alone. Without ``cu_seqlens`` a row of the batch is one document ``[0, S)``;
with ``cu_seqlens [N + 1]`` (B = 1) document ``d`` is ``[cu[d], cu[d + 1])``.

The kernels find their document on the device (no host sync) from three int32 tables,
built by one small kernel (:func:`compileops.mlstm.kernels.documents.document_tables`):

* ``bounds [N + 2]``: the document boundaries, then a validity flag. The boundaries are
  ``cu_seqlens`` made safe (clamped into ``[0, S]``, non-decreasing, first 0, last S), so
  that even invalid values never take a kernel out of bounds; the flag is 1 when
  ``cu_seqlens`` needed no change (the forward writes NaN outputs otherwise).
* ``slot_first [N + 1]``: document ``d``'s chunks own the state slots ``slot_first[d] ..
  slot_first[d + 1] - 1`` (an empty document still owns one slot, its state entering
  nothing); ``slot_first[N]`` is the number in use.
* ``slot_doc [U]``: the document of each slot, ``N`` for a slot past the last document's.

``U = max(1, cdiv(S, chunk)) + N - 1`` (:func:`chunk_slots`) bounds the slots in use for any
packing: each document adds at most one partial chunk. It depends on the shapes only, so
the ops' outputs do too, and a grid of ``U * (chunk / block)`` programs per head covers
every document's tiles.
"""
from __future__ import annotations

import dataclasses

import torch


def chunk_slots(seq, chunk: int, docs):
    """``U``: the chunk slots of a row of ``seq`` positions holding ``docs`` documents (module
    docstring). Works on SymInts."""
    return torch.sym_max((seq + chunk - 1) // chunk, 1) + docs - 1


@dataclasses.dataclass(frozen=True)
class DocumentTables:
    """The device tables of the module docstring, and their host-side sizes."""

    bounds: torch.Tensor
    slot_first: torch.Tensor
    slot_doc: torch.Tensor
    docs: int
    slots: int


def host_bounds(cu_seqlens: Optional[torch.Tensor], seq: int) -> list[int]:
    """The document boundaries as Python ints (the reference backend's loop; reads
    ``cu_seqlens`` on the host, which the caller has checked)."""
    return [0, seq] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]


def host_slot_first(bounds: list[int], chunk: int) -> list[int]:
    """``slot_first`` (module docstring) from host boundaries."""
    first = [0]
    for start, end in zip(bounds, bounds[1:]):
        first.append(first[-1] + max(1, -(-(end - start) // chunk)))
    return first


__all__ = ["DocumentTables", "chunk_slots", "host_bounds", "host_slot_first"]
