"""Find the op where two runs that should agree bitwise first part: exact fingerprints of
every compute op's inputs and outputs, in call order, and a comparison of two such traces.

Typical use: one training step sharded (FSDP2) and the same step on one device, each under
:class:`OpFingerprints`, then :func:`first_divergence` names the first op that was given
bitwise-equal inputs in both runs and still returned different outputs: the op whose kernel
differs, as opposed to every op downstream of it, which only inherits the difference.

Fingerprints are exact (integer sums of the raw bits), so nothing is copied or kept but two
integers per tensor. Dispatch modes see eager ops only: trace an uncompiled model.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: Matmul-like aten ops, traced besides every ``compileops::`` op: their kernels are the
#: ones picked by heuristics (cuBLAS by shape and alignment).
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm",
                     "_scaled_grouped_mm", "_addmm_activation"})


def fingerprint(t: torch.Tensor) -> tuple:
    """``(shape, dtype, sum of the raw bits, position-weighted sum)``, exact: equal tensors
    give equal fingerprints, and different ones almost surely do not."""
    if t.numel() == 0 or t.is_complex():
        return (tuple(t.shape), str(t.dtype), 0, 0)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    raw = t.detach().contiguous().view(bits).reshape(-1).to(torch.int64)
    weights = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) % 65521 + 1
    return (tuple(t.shape), str(t.dtype), int(raw.sum()), int((raw * weights).sum()))


@dataclasses.dataclass
class OpCall:
    """One traced call: ``name`` (``compileops::grouped_linear``, ``aten::mm``), its tensor
    inputs' and outputs' fingerprints."""

    name: str
    inputs: list
    outputs: list


class OpFingerprints(TorchDispatchMode):
    """Records :class:`OpCall` for every ``compileops::`` op and every aten matmul run under
    it (forward and backward, the autograd engine's threads included), in ``self.calls``."""

    def __init__(self):
        super().__init__()
        self.calls: list[OpCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        namespace = func.namespace
        base = func.overloadpacket.__name__
        if namespace == "compileops" or (namespace == "aten" and base in MATMULS):
            tensors_in = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            tensors_out = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.calls.append(OpCall(f"{namespace}::{base}",
                                     [fingerprint(t) for t in tensors_in],
                                     [fingerprint(t) for t in tensors_out]))
        return out


@dataclasses.dataclass
class Divergence:
    """The comparison of two traces: ``first_cause`` is the first call (by index) with equal
    inputs and different outputs, or None; ``per_op`` counts, per op name, the calls with
    equal inputs whose outputs agree and differ, and the calls whose inputs already differ."""

    first_cause: Optional[tuple[int, str]]
    per_op: dict
    same_sequence: bool

    def summary(self) -> str:
        cause = (f"first op to differ on equal inputs: #{self.first_cause[0]} "
                 f"{self.first_cause[1]}" if self.first_cause else
                 "no op differs on equal inputs")
        counts = "; ".join(f"{name} {c['equal']} equal / {c['differs']} differ on equal inputs"
                           f" / {c['inputs_differ']} with inputs already different"
                           for name, c in sorted(self.per_op.items()))
        order = "" if self.same_sequence else " (the two runs called different op sequences)"
        return f"{cause}{order}; {counts}"


def first_divergence(a: list[OpCall], b: list[OpCall]) -> Divergence:
    """Compare two traces call by call (the shorter length; ``same_sequence`` says whether
    the op names matched all along)."""
    per_op: dict = {}
    first = None
    same = len(a) == len(b)
    for index, (x, y) in enumerate(zip(a, b)):
        if x.name != y.name:
            same = False
            break
        counts = per_op.setdefault(x.name, {"equal": 0, "differs": 0, "inputs_differ": 0})
        if x.inputs != y.inputs:
            counts["inputs_differ"] += 1
        elif x.outputs == y.outputs:
            counts["equal"] += 1
        else:
            counts["differs"] += 1
            if first is None:
                first = (index, x.name)
    return Divergence(first, per_op, same)
