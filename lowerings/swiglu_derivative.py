"""The SwiGLU derivative of the fp8 backward, lowered in the column pieces in which the fp8
quantisation of its rows reads them, so that the two are one kernel.

``compileops::swiglu_derivative(preact [M, 2H], grad [M, H]) -> d [M, 2H]`` (gate columns
``[0, H)``, up columns ``[H, 2H)``) feeds both the gate/up dW (an extern call, which reads
the whole buffer) and dX, whose operand is ``d`` quantised per row as Inductor IR
(:func:`.fp8_quantize.quantise_rows`). A row wider than Inductor's persistent-reduction limit
is quantised in equal parts (its amax reduces over one part's width), and Inductor fuses a
producer with that reduction only when the producer's own loop has the part's width.

Written as torch ops (``torch.cat`` of the two halves), the derivative on a GPU becomes one
``[M, 2H]`` pointwise kernel (Inductor's pointwise concatenation), which no part-wide
reduction can fuse with: at Qwen3-30B-A3B (2H = 1536, two parts of 768) the derivative
wrote ``d`` in one kernel and the quantisation read it back in another. Here, when the
quantiser's parts each lie inside one half, each part of ``d`` is its own pointwise node of
the part's width, computed straight into its slice of ``d`` (``_compat.concat_parts``, no
copy); the quantisation reads the parts from where they are computed and Inductor fuses
derivative, row amax and the e4m3 cast into one persistent kernel that writes ``d`` and its
quantised copy. Otherwise (a row within the limit, or one no split fits) the halves go
through Inductor's own concatenation, as the torch ops would.

The arithmetic is the torch function's (:func:`compileops.grouped_linear.backward_ops.
swiglu_derivative`), op for op in the same order, in fp32 (fp64 for fp64): ``d_gate = g * up
* s * (1 + gate * (1 - s))`` and ``d_up = g * gate * s`` with ``s = sigmoid(gate)``, each
rounded once to grad's dtype. The compiled values are the ones Inductor generated for the
torch ops (``tests/grouped_linear/test_swiglu_derivative.py``).
"""
from __future__ import annotations

import torch

from compileops.grouped_linear.reference import compute_dtype
from compileops.lowerings import _compat, fp8_quantize


def _halves(preact, grad):
    """``(d_gate, d_up)``: loaders of the two halves' values (grad's dtype) at ``[*rows, c]``,
    ``c`` in ``[0, H)``."""
    ops = _compat.ops()
    acc, out = compute_dtype(preact.get_dtype()), grad.get_dtype()
    h = grad.get_size()[-1]
    load_preact, load_grad = preact.make_loader(), grad.make_loader()

    def operands(idx):
        rows, c = list(idx[:-1]), idx[-1]
        gate = ops.to_dtype(load_preact([*rows, c]), acc)
        up = ops.to_dtype(load_preact([*rows, c + h]), acc)
        g = ops.to_dtype(load_grad([*rows, c]), acc)
        return g, gate, up, ops.sigmoid(gate)

    def d_gate(idx):
        g, gate, up, s = operands(idx)
        one = ops.constant(1.0, acc)
        slope = ops.add(one, ops.mul(gate, ops.sub(one, s)))
        return ops.to_dtype(ops.mul(ops.mul(ops.mul(g, up), s), slope), out)

    def d_up(idx):
        g, gate, _, s = operands(idx)
        return ops.to_dtype(ops.mul(ops.mul(g, gate), s), out)

    return d_gate, d_up


def _piece_width(h) -> int | None:
    """The width of the quantiser's row parts of a ``[M, 2H]`` row when more than one part
    fits and every part lies inside one half, else None."""
    if not _compat.is_static(h):
        return None
    width = 2 * int(h)
    parts = fp8_quantize._row_parts(width, [0, int(h)])
    part = width // parts
    return part if parts > 1 and int(h) % part == 0 else None


def lower_swiglu_derivative(preact, grad):
    device, out = grad.get_device(), grad.get_dtype()
    size = list(grad.get_size())
    h = size[-1]
    d_gate, d_up = _halves(preact, grad)
    part = _piece_width(h)
    if part is None:
        halves = [_compat.pointwise(device=device, dtype=out, inner_fn=fn, ranges=size)
                  for fn in (d_gate, d_up)]
        return _compat.aten_lowering(torch.ops.aten.cat.default)(halves, len(size) - 1)

    def piece(first):
        half, start = (d_gate, first) if first < int(h) else (d_up, first - int(h))
        return _compat.pointwise(
            device=device, dtype=out, ranges=[*size[:-1], part],
            inner_fn=lambda idx: half([*idx[:-1], idx[-1] + start]))

    pieces = [piece(first) for first in range(0, 2 * int(h), part)]
    return _compat.concat_parts(pieces, len(size) - 1)


def register() -> None:
    import compileops.grouped_linear.backward_ops  # noqa: F401  (the op must exist first)

    _compat.register_lowering(torch.ops.compileops.swiglu_derivative.default,
                              lower_swiglu_derivative)
