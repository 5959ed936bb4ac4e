"""Packed documents (``cu_seqlens``) laid out for the chunkwise kernels.

Each document is moved to start on a chunk boundary, its last chunk filled with pad rows, so
that no chunk holds rows of two documents. The chunkwise op then takes a segment table
(``segments``): the state entering a document's first chunk is reset to the empty state (a
select, not a multiplication by a tiny decay: an Inf or NaN before it stays before it), and
the backward's row scans restart at each document (:mod:`.kernels.segments`). A document's
chunks are then computed exactly as when it runs alone, in the same order: its outputs and
gradients are bitwise the document's alone, whatever the other documents hold.

Layout of a packed row of S tokens, N documents, chunk ``c``: ``NC = cdiv(S, c) + N`` chunks
(a bound: each document adds at most one partial chunk; a function of the shapes only, so
one compile serves every packing), ``P = NC * c`` rows. Document d starts at the sum of the
earlier documents' lengths, each rounded up to a multiple of ``c``; the rows after the last
document (the tail) are one more segment. Pad rows (inside a document and in the tail alike): zero q, k
and v; forget gate ``+inf`` (``log sigmoid = 0``: the forget sums stay as the document left
them); input gate ``-1e30`` (:func:`pad_value`; far below any real one: nothing of a pad row
enters a real row's stabiliser or the state, and a tail of pad rows computes zeros). All of it is computed on the
device from ``cu_seqlens``, with no host sync.

Cost: the row grows by at most one chunk per document (``N * c`` rows), plus a copy of the
inputs and outputs into and out of the layout, and of their gradients.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from compileops import backends


def pad_value(name: str) -> float:
    """The fill of a pad row, by name: q, k and v ``"zero"``; ``"input_gate"``: ``-1e30``,
    below every real gate by far, so a pad row never holds a running maximum a real row
    reads, yet finite, so that a tile of pad keys still has a finite reference for its
    exponentials (``-inf - -inf`` would be NaN); ``"forget_gate"``: ``+inf`` (no decay
    across the pad).

    Literals, and looked up by name: under ``torch.compile(dynamic=True)`` Dynamo makes a
    float that reaches traced code from an argument, a default or a global a symbolic input,
    which it then fails to carry into :class:`_ToLayout`'s graph when a gradient is needed
    (an internal error); a literal stays a constant."""
    if name == "input_gate":
        return -1e30
    if name == "forget_gate":
        return float("inf")
    return 0.0


class Layout(NamedTuple):
    """``target [S]`` (int64): the laid-out row of each packed row. ``segments [2, N + 2]`` (int32), the chunkwise op's segment table:
    row 0 each document's first laid-out row, the tail's, then ``P``; row 1 where each
    one's real rows end (the tail's: ``P``), then ``P``. ``pad_rows [P - S]`` (int64): the laid-out rows that read no token, inside
    documents or in the tail (a size from the shapes only)."""

    target: torch.Tensor
    segments: torch.Tensor
    pad_rows: torch.Tensor


def laid_out_chunks(seq, documents, chunk: int):
    """``NC``: the chunks of the laid-out row (module docstring)."""
    return (seq + chunk - 1) // chunk + documents


def layout(cu_seqlens: torch.Tensor, seq, chunk: int) -> Layout:
    """The layout of ``cu_seqlens [N + 1]`` (already checked) for rows of ``chunk``."""
    device = cu_seqlens.device
    documents = cu_seqlens.shape[0] - 1
    total = laid_out_chunks(seq, documents, chunk) * chunk
    ends = cu_seqlens.long()
    lengths = ends[1:] - ends[:-1]
    padded = (lengths + (chunk - 1)) // chunk * chunk
    stops = torch.cumsum(padded, 0)
    starts = stops - padded
    tokens = torch.arange(seq, device=device)
    # The document of each token: the number of documents that end at or before it, as a
    # running count of the ends (Inductor's searchsorted cannot read a sliced boundary).
    ended = torch.zeros(seq + 1, dtype=torch.int64, device=device).index_put(
        (ends[1:],), torch.ones_like(ends[1:]), accumulate=True)
    doc = torch.cumsum(ended, 0)[:seq]
    target = starts[doc] + (tokens - ends[:-1][doc])
    used = stops[-1:]
    # The pad rows: P - S of them whatever the packing, so their positions (the rows that
    # read no token, sorted last by a stable sort) fit a static shape.
    reads_token = torch.zeros(total, dtype=torch.bool, device=device).index_fill(0, target, True)
    pad_rows = torch.argsort(reads_token.to(torch.int8), stable=True)[:total - seq]
    end = torch.full_like(used, total)
    segments = torch.stack([torch.cat([starts, used, end]),
                            torch.cat([starts + lengths, end, end])]).to(torch.int32)
    return Layout(target, segments, pad_rows)


def chunk_resets(starts: torch.Tensor, num_chunks, chunk: int) -> torch.Tensor:
    """``[NC]`` int8: 1 at each chunk where a segment starts (its entering state is reset),
    from the segments' first rows ``starts [K + 1]`` (the last, the row's end, ignored)."""
    flags = torch.zeros(num_chunks + 1, dtype=torch.int8, device=starts.device)
    first = (starts[:-1].long() // chunk).clamp(max=num_chunks)
    return flags.index_fill(0, first, 1)[:num_chunks]


@backends.keeps_forward_backend
class _ToLayout(torch.autograd.Function):
    """Each packed row copied to its laid-out row (``target``), pad rows filled; backward: a
    gather by ``target`` (no scatter-add: deterministic on every device)."""

    @staticmethod
    def forward(x, target, pad_rows, dim, pad):
        shape = list(x.shape)
        shape[dim] = target.shape[0] + pad_rows.shape[0]
        out = x.new_empty(shape)
        out.index_copy_(dim, target, x)
        return out.index_fill_(dim, pad_rows, pad_value(pad))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.dim = inputs[3]

    @staticmethod
    def backward(ctx, grad):
        (target,) = ctx.saved_tensors
        return grad.index_select(ctx.dim, target), None, None, None, None


@backends.keeps_forward_backend
class _FromLayout(torch.autograd.Function):
    """Gather the packed rows by ``target``; backward: the laid-out gradient, zero on pad
    rows (a copy into zeros, no scatter-add)."""

    @staticmethod
    def forward(x, target, dim):
        return x.index_select(dim, target)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, target, dim = inputs
        ctx.save_for_backward(target)
        ctx.dim = dim
        ctx.rows = x.shape[dim]

    @staticmethod
    def backward(ctx, grad):
        (target,) = ctx.saved_tensors
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.rows
        return grad.new_zeros(shape).index_copy_(ctx.dim, target, grad), None, None


def to_layout(x: torch.Tensor, lay: Layout, dim: int, pad: str = "zero") -> torch.Tensor:
    """``x`` with its ``S`` rows along ``dim`` laid out (``P`` rows), pad rows filled with
    :func:`pad_value` ``(pad)``. Differentiable: the gradient of a packed row is its
    laid-out row's."""
    return _ToLayout.apply(x, lay.target, lay.pad_rows, dim % x.dim(), pad)


def from_layout(x: torch.Tensor, lay: Layout, dim: int) -> torch.Tensor:
    """The packed rows of laid-out ``x`` (``P`` rows along ``dim`` -> ``S``); pad rows get a
    zero gradient."""
    return _FromLayout.apply(x, lay.target, dim % x.dim())



def pad_rows(q, k, v, igate, fgate, rows: int):
    """``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, ``igate, fgate [B, NH, S]`` (the
    gates in the accumulation dtype) with ``rows`` pad rows appended, as a document's: zero
    q, k, v, input gate and forget gate as :func:`pad_value` fills them. Differentiable (the
    pad rows' gradients are dropped)."""
    pad = torch.nn.functional.pad
    return (*(pad(t, (0, 0, 0, rows)) for t in (q, k, v)),
            pad(igate, (0, rows), value=pad_value("input_gate")),
            pad(fgate, (0, rows), value=pad_value("forget_gate")))
