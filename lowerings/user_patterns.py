"""What users write around the compileops ops, rewritten to the op that does it in its kernel.

A pass over the graph Dynamo captures, before autograd (Inductor's pre-grad custom pass), so
that the op put in brings its own backward. Two rewrites:

* ``grouped_linear(x, w, offsets) * p[:, None]`` becomes ``grouped_linear(x, w, offsets,
  row_scale=p)`` (:func:`compileops.grouped_linear.scaled.row_scaled_grouped_linear`), where
  ``p`` is a 1-D floating tensor with one value per row, made a column by ``p[:, None]``,
  ``p[..., None]``, ``p.unsqueeze(-1)`` (or ``(1)``, ``torch.unsqueeze``), ``p.view(-1, 1)``
  or ``p.reshape(-1, 1)``, cast to the product's dtype before or after (``.to(dtype)``) or
  already of it; either operand order; the product used by nothing else, no bias.

  Why: written as a product, the multiply becomes the GEMM template's epilogue, and
  Inductor inlines the producers of ``p`` (the gather by routing order, the top-k
  normalisation) into it, recomputed for every element of the ``[M, N]`` tile; at
  Mixtral-8x7B's down projection on an H200 that made the layer's forward 0.70-0.81x of the
  same layer on ``torch._grouped_mm``, where ``row_scale=`` ran at 0.99-1.00x
  (``benchmarks/RESULTS.md``). The forward's bits are the same (the row-scaled op rounds
  the product, then multiplies by the scale rounded to its dtype, and rounds again: the
  written-out product's arithmetic). The backward is the row-scaled op's: ``dp`` as a sum
  over K from the dX product it computes anyway, instead of a sum over N of ``grad * y``;
  both round each summand's factor once, so the two are within the same bound of exact
  arithmetic (``tests/grouped_linear/test_user_patterns.py`` measures it against fp64).

* ``silu(grouped_linear(x, w_gate, offsets)) * grouped_linear(x, w_up, offsets)``, either
  operand order, ``F.silu`` or ``nn.SiLU``, becomes ``grouped_linear_swiglu(x, w_gate,
  offsets, up_weight=w_up)`` (the gate/up pair kernel), where both products read the same
  ``x`` and ``offsets``, have no bias and are used by nothing else, the weights have one
  shape, and every value keeps x's dtype.

  Why: written out, the two products write their ``[M, H]`` outputs, and the SwiGLU reads
  them back; the pair kernel reads x once for both and writes ``silu(gate) * up``. At
  Mixtral-8x7B on an H200 the written-out form's forward was 0.93x ``torch._grouped_mm``'s,
  the pair's 1.00-1.02x (``benchmarks/RESULTS.md``). Not bitwise: the kernel takes the SwiGLU
  of the fp32 accumulators and rounds once, where the written-out form rounds gate and up to
  x's dtype first, so the rewritten forward is nearer exact arithmetic, never further (the
  test measures both against fp64). The backward keeps the two pre-activations in x's dtype,
  as the written-out form keeps the two products.

Both rewrites put the fused op where the multiply is. So neither applies when anything
between the first matched node and the multiply could change what the products compute: a
grad-mode or autocast switch (``with torch.no_grad():`` around one product), an in-place
write (``x.mul_(2)``, ``x[0] = 1``, ``x += 1``, a mutating op) or a module call.

Anything else is left as written. The pass keys Inductor's caches on compileops' sources
(``uuid``), as the lowerings do.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx

from compileops.lowerings import _compat


def _grouped_linear_without_bias(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.compileops.grouped_linear.default:
        return False
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    return bias is None


def _value(node) -> Optional[torch.Tensor]:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_column(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The node whose 1-D value ``node`` makes a ``[M, 1]`` column, else None."""
    args = node.args
    if node.op == "call_method" and node.target == "unsqueeze" and len(args) == 2:
        return args[0] if args[1] in (1, -1) else None
    if node.op == "call_function" and node.target is torch.unsqueeze and len(args) == 2:
        return args[0] if args[1] in (1, -1) else None
    if node.op == "call_function" and node.target is operator.getitem and len(args) == 2:
        index = args[1]
        if index in ((slice(None), None), (Ellipsis, None)):
            return args[0]
        return None
    if node.op == "call_method" and node.target in ("view", "reshape") and len(args) >= 2:
        shape = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list)) \
            else tuple(args[1:])
        return args[0] if shape == (-1, 1) else None
    return None


def _cast_to(node: torch.fx.Node, dtype: torch.dtype) -> Optional[torch.fx.Node]:
    """The node cast by ``node`` when it is ``.to(dtype)`` (nothing else), else None."""
    if node.op != "call_method" or node.target != "to" or node.kwargs:
        return None
    if len(node.args) == 2 and node.args[1] == dtype:
        return node.args[0]
    return None


def _row_scale(column: torch.fx.Node, product: torch.Tensor) -> Optional[torch.fx.Node]:
    """The 1-D node ``p`` when ``column`` is ``p`` made an ``[M, 1]`` column (and cast to
    ``product``'s dtype, or of it already), ``M`` the product's rows; else None."""
    node = column
    column_seen = False
    for _ in range(4):  # a column step and casts, in any order
        if not isinstance(node, torch.fx.Node):
            return None
        inner = _cast_to(node, product.dtype)
        if inner is None and not column_seen:
            inner = _is_column(node)
            column_seen = inner is not None
        if inner is None:
            break
        node = inner
    value = _value(node)
    if not column_seen or value is None or value.dim() != 1 or not value.is_floating_point():
        return None
    if not _compat.statically_equal(value.shape[0], product.shape[0]):
        return None
    return node


def _binary_multiplies(graph: torch.fx.Graph) -> list:
    """The graph's ``a * b`` / ``torch.mul(a, b)`` nodes (a list: rewrites erase nodes)."""
    return [n for n in graph.nodes if n.op == "call_function"
            and n.target in (operator.mul, torch.mul) and len(n.args) == 2 and not n.kwargs]


def _rewrite_row_scale(graph: torch.fx.Graph) -> int:
    from compileops.grouped_linear.scaled import row_scaled_grouped_linear

    done = 0
    for mul in _binary_multiplies(graph):
        for product_node, column in (mul.args, mul.args[::-1]):
            if not isinstance(product_node, torch.fx.Node) or \
                    not _grouped_linear_without_bias(product_node) or len(product_node.users) != 1:
                continue
            product, out = _value(product_node), _value(mul)
            if product is None or out is None or out.dtype != product.dtype \
                    or tuple(out.shape) != tuple(product.shape):
                continue
            scale = _row_scale(column, product)
            if scale is None or _moved_across_barrier(
                    graph, [product_node, *_column_chain(column, scale)], mul):
                continue
            x, weight, offsets = product_node.args[:3]
            with graph.inserting_before(mul):
                scaled = graph.call_function(row_scaled_grouped_linear,
                                             (x, weight, offsets, None, scale))
            scaled.meta.update(mul.meta)
            mul.replace_all_uses_with(scaled)
            graph.erase_node(mul)
            graph.erase_node(product_node)
            _erase_unused(graph, column)
            done += 1
            break
    return done


#: Calls that switch global state the products depend on, by name (Dynamo records
#: ``torch.no_grad()`` and ``torch.autocast`` as these).
_STATE_SWITCHES = {"_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast",
                   "_set_autocast_enabled", "_set_fwd_grad_enabled", "inference_mode"}
_INPLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub,
                      operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
                      operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul}


def _is_barrier(node: torch.fx.Node) -> bool:
    """Whether ``node`` may change what a product moved past it computes: a global state
    switch, an in-place write, a mutating op, or a module call (opaque)."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op != "call_function":
        return False
    target = node.target
    if target in _INPLACE_OPERATORS:
        return True
    name = getattr(target, "__name__", "")
    if name in _STATE_SWITCHES or (name.endswith("_") and not name.startswith("__")):
        return True
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _moved_across_barrier(graph: torch.fx.Graph, matched, mul: torch.fx.Node) -> bool:
    """Whether any node from the earliest of ``matched`` (the nodes the rewrite replaces:
    where the products and the scale's column read their inputs) to ``mul`` (graph order) is
    a barrier: the fused op, put at ``mul``, would then compute under other state or on
    other values than the products did where they were."""
    matched = {n for n in matched if isinstance(n, torch.fx.Node)}
    inside = False
    for node in graph.nodes:
        if node is mul:
            return False
        if node in matched:
            inside = True
        elif inside and _is_barrier(node):
            return True
    return False


def _column_chain(column, scale) -> list:
    """The nodes from ``column`` down to ``scale`` (the column and cast steps)."""
    chain, node = [], column
    while isinstance(node, torch.fx.Node) and node is not scale:
        chain.append(node)
        node = node.args[0] if node.args else None
    return chain


def _erase_unused(graph: torch.fx.Graph, node) -> None:
    """Erase ``node`` and the view/cast nodes feeding it that nothing else uses."""
    while isinstance(node, torch.fx.Node) and not node.users and (
            _is_column(node) is not None or node.target == "to"):
        feeding = node.args[0]
        graph.erase_node(node)
        node = feeding


def _is_silu(node) -> Optional[torch.fx.Node]:
    """The input of ``node`` when it is ``F.silu(a)`` (not in place), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
            or node.target is not torch.nn.functional.silu or len(node.args) != 1:
        return None
    if any(k != "inplace" or v for k, v in node.kwargs.items()):
        return None
    return node.args[0]


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_compat.statically_equal(i, j)
                                      for i, j in zip(a.shape, b.shape))


def _rewrite_swiglu_pair(graph: torch.fx.Graph) -> int:
    from compileops.grouped_linear.api import grouped_linear_swiglu

    done = 0
    for mul in _binary_multiplies(graph):
        for silu, up in (mul.args, mul.args[::-1]):
            gate = _is_silu(silu)
            products = (gate, up)
            if gate is None or len(silu.users) != 1 or not all(
                    isinstance(n, torch.fx.Node) and _grouped_linear_without_bias(n)
                    and len(n.users) == 1 for n in products):
                continue
            (x, w_gate, offsets), (x_up, w_up, offsets_up) = gate.args[:3], up.args[:3]
            if x is not x_up or offsets is not offsets_up:
                continue
            values = [_value(n) for n in (x, w_gate, w_up, gate, up, silu, mul)]
            if any(v is None for v in values):
                continue
            if _moved_across_barrier(graph, [gate, up, silu], mul):
                continue
            x_val, wg_val, wu_val, *outs = values
            if wg_val.dtype != wu_val.dtype or any(v.dtype != x_val.dtype for v in outs) \
                    or not _same_shape(wg_val, wu_val) \
                    or not all(_same_shape(v, outs[0]) for v in outs):
                continue
            with graph.inserting_before(mul):
                fused = graph.call_function(grouped_linear_swiglu, (x, w_gate, offsets),
                                            {"up_weight": w_up})
            fused.meta.update(mul.meta)
            mul.replace_all_uses_with(fused)
            for node in (mul, silu, gate, up):
                graph.erase_node(node)
            done += 1
            break
    return done


class UserPatterns(_compat.CustomGraphPass):
    """The pre-grad pass; ``uuid`` is compileops' source fingerprint."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        # The pair first: its products are the SwiGLU's inputs, never a row-scaled product.
        if _rewrite_swiglu_pair(graph) + _rewrite_row_scale(graph):
            graph.lint()

    def uuid(self):
        from compileops.lowerings import source_fingerprint

        return f"compileops-user-patterns-{source_fingerprint()}"


PASS = UserPatterns()


def register() -> None:
    _compat.add_pre_grad_pass(PASS)
