"""The MoE layer's permuted tokens read where they are by the weight gradient: a pass over
the forward and backward traced together (Inductor's joint-graph custom pass), before the
partitioner decides what the forward saves.

A MoE layer permutes its tokens to expert order, ``xs = x[rows]`` (``[M, K]``, each token once
per expert it is routed to: ``M = top_k * T``), and its first grouped product reads ``xs``.
That product's dW reads ``xs`` again in the backward, so the forward keeps the copy: at
Qwen3-30B-A3B's shape, 256 MiB of bf16 a layer, written by the forward and held until the
backward. The pass rewrites ``grouped_linear_wgrad(grad, x[rows], ...)`` to
``grouped_linear_wgrad(grad, x, ..., x_rows=rows)``: the dW kernel reads the rows through
the index (:mod:`compileops.grouped_linear.kernels.kjagged`, the same bits), ``xs`` is
used by the forward alone, and the forward keeps ``x`` (an input, kept anyway) and the
``[M]`` index instead. In fp8 the permutation's kernel then writes the e4m3 codes alone.

Matched: ``aten.index.Tensor(x, [rows])`` and ``aten.index_select(x, 0, rows)`` with a 2-D
``x`` and a 1-D int64 ``rows``. Anything else is left as written.
"""
from __future__ import annotations

import torch
import torch.fx

from compileops.lowerings import _compat


def _row_gather(node) -> tuple | None:
    """``(x, rows)`` where ``node`` computes ``x[rows]`` for a 2-D ``x`` and 1-D int64
    ``rows``; else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    aten = torch.ops.aten
    if node.target is aten.index.Tensor and len(node.args) == 2:
        source, indices = node.args
        if len(indices) != 1 or indices[0] is None:
            return None
        rows = indices[0]
    elif node.target is aten.index_select.default and node.args[1] == 0:
        source, rows = node.args[0], node.args[2]
    else:
        return None
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None
              for n in (source, rows)]
    if any(v is None for v in values):
        return None
    source_val, rows_val = values
    if source_val.dim() != 2 or rows_val.dim() != 1 or rows_val.dtype != torch.int64:
        return None
    return source, rows


def _read_gathered_rows(graph: torch.fx.Graph) -> int:
    done = 0
    wgrad = torch.ops.compileops.grouped_linear_wgrad.default
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not wgrad:
            continue
        if len(node.args) > 6 or "x_rows" in node.kwargs:
            continue  # already reads through an index
        gather = _row_gather(node.args[1])
        if gather is None:
            continue
        source, rows = gather
        node.args = (node.args[0], source, *node.args[2:])
        node.kwargs = {**node.kwargs, "x_rows": rows}
        # The fake inputs recorded for the old arguments no longer match them.
        node.meta.pop("eager_input_vals", None)
        done += 1
    return done


class GatheredRows(_compat.CustomGraphPass):
    """The joint-graph pass; ``uuid`` is compileops' source fingerprint."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        if _read_gathered_rows(graph):
            graph.eliminate_dead_code()
            graph.lint()

    def uuid(self):
        from compileops.lowerings import source_fingerprint

        return f"compileops-gathered-rows-{source_fingerprint()}"


PASS = GatheredRows()


def register() -> None:
    _compat.add_joint_pass(PASS)
