"""The fp8 MoE layer's permuted tokens gathered again for the gate/up weight gradient instead
of kept from the forward: a pass over the forward and backward traced together (Inductor's
joint-graph custom pass), before the partitioner decides what the forward saves.

A MoE layer permutes its tokens to expert order, ``xs = x[rows]`` (``[M, K]``, each token once
per expert it is routed to: ``M = top_k * T``). In fp8 the forward's product reads ``xs``
only through its e4m3 codes, which the permutation's kernel writes as it gathers; the bf16
``xs`` is wanted by the backward's gate/up dW alone (it stays bf16). The partitioner keeps it
from the forward anyway (a row gather feeding an extern kernel must be materialised in the
backward, so it counts recomputing as not free), and the forward then writes and holds both
the codes and the bf16 copy. The pass marks that gather for recomputation (``recompute``
= ``MUST_RECOMPUTE``, the tag activation checkpointing uses): the forward writes the codes
alone and saves ``x`` (an input, kept anyway) and the ``[M]`` index, and the backward
gathers the rows again for the dW.

The trade: one more gather in the backward (``M * K`` elements written) against one fewer
bf16 write in the forward, for a step that never holds the ``[M, K]`` copy from the forward
to the backward. The bf16 layer is left as it is: its forward product reads the bf16 copy,
so gathering again would add a gather and save nothing the forward does not write anyway.

Matched: ``grouped_linear_wgrad(grad, x[rows], ...)`` (``aten.index.Tensor(x, [rows])`` or
``aten.index_select(x, 0, rows)``, a 2-D ``x`` and a 1-D int64 ``rows``) where every other
reader of ``x[rows]`` is an fp8 product, which reads it to quantise it. Anything else is left
as written, as is a gather the user's own checkpoint policy has tagged.
"""
from __future__ import annotations

import torch
import torch.fx

from compileops.lowerings import _compat


def _row_gather(node) -> bool:
    """Whether ``node`` computes ``x[rows]`` for a 2-D ``x`` and a 1-D int64 ``rows``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    aten = torch.ops.aten
    if node.target is aten.index.Tensor and len(node.args) == 2:
        source, indices = node.args
        if len(indices) != 1 or indices[0] is None:
            return False
        rows = indices[0]
    elif node.target is aten.index_select.default and node.args[1] == 0:
        source, rows = node.args[0], node.args[2]
    else:
        return False
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None
              for n in (source, rows)]
    if any(v is None for v in values):
        return False
    source_val, rows_val = values
    return source_val.dim() == 2 and rows_val.dim() == 1 and rows_val.dtype == torch.int64


def _fp8_products():
    ops = torch.ops.compileops
    return {ops.grouped_linear_fp8.default, ops.grouped_linear_swiglu_fp8_with_preact.default,
            ops.grouped_linear_row_scaled_fp8.default}


def mark_permuted_tokens_for_recompute(graph: torch.fx.Graph) -> int:
    """Tag each matched gather ``MUST_RECOMPUTE``; returns how many were tagged."""
    wgrad = torch.ops.compileops.grouped_linear_wgrad.default
    fp8_products = _fp8_products()
    tagged = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not wgrad:
            continue
        gather = node.args[1]
        if not _row_gather(gather) or "recompute" in gather.meta:
            continue
        others = [user for user in gather.users if user is not node]
        if not others or any(user.op != "call_function" or user.target not in fp8_products
                             for user in others):
            continue
        gather.meta["recompute"] = _compat.must_recompute_policy()
        tagged += 1
    return tagged


class PermutedTokens(_compat.CustomGraphPass):
    """The joint-graph pass; ``uuid`` is compileops' source fingerprint."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        mark_permuted_tokens_for_recompute(graph)

    def uuid(self):
        from compileops.lowerings import source_fingerprint

        return f"compileops-permuted-tokens-{source_fingerprint()}"


PASS = PermutedTokens()


def register() -> None:
    _compat.add_joint_pass(PASS)
