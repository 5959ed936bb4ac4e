"""Inductor lowering of the fp8 grouped linear ops: extern calls of the ops themselves, with
the weight cache told which tensor's version counter to follow.

Inductor passes a view of a graph input (``w.transpose(1, 2)``, ``w[:, :H]``) to an extern
call as a tensor rebuilt over the input's storage (``reinterpret_tensor``), whose version
counter is its own and never moves when the parameter is written in place. With
``cache_weight`` (``cache_fp8_weights=True``) the cache would then keep serving the copies
of the weights from before ``w.mul_(2)``, ``copy_`` or ``load_state_dict``. So, for each fp8
op with ``cache_weight``:

* the weight is a graph input, or a strided view of one: the op gets that input as its
  ``weight_base``, and the cache checks the input's version (the parameter's own counter);
* the weight is computed inside the graph (a cast, a concatenation): nothing tracks writes to
  it, so ``cache_weight`` is turned off for that call (quantised every call) and a warning
  says so;
* the weight's graph input is also written in place by the graph (under ``no_grad``; whole,
  through a view, or in a list of a ``torch._foreach_*_`` op):
  AOTAutograd raises its version before the graph runs, while its values change only at the
  write, so a copy made before the write would be stored under the new version. The cache is
  turned off for that call too, with a warning.

The products stay the eager Triton kernels (called through the op).
"""
from __future__ import annotations

import warnings

import torch

from compileops import _log
from compileops.lowerings import _compat

logger = _log.get_logger("grouped_linear")

#: The fp8 ops whose weight may come from the cache (all take ``weight``, ``cache_weight``
#: and ``weight_base`` by those names).
FP8_OPS = ("grouped_linear_fp8", "grouped_linear_fp8_dx", "grouped_linear_row_scaled_fp8",
           "grouped_linear_swiglu_fp8_with_preact")


def _arguments(op: torch._ops.OpOverload, args, kwargs) -> list:
    """The op's arguments in schema order, defaults filled in."""
    schema = op._schema.arguments
    values = list(args)
    for argument in schema[len(values):]:
        if argument.name in kwargs:
            values.append(kwargs[argument.name])
        else:
            values.append(argument.default_value)
    return values


def _lowering(op: torch._ops.OpOverload):
    names = [argument.name for argument in op._schema.arguments]
    weight_at, cache_at, base_at = (names.index(n) for n in
                                    ("weight", "cache_weight", "weight_base"))
    name = op._schema.name.split("::")[-1]

    def lower(*args, **kwargs):
        values = _arguments(op, args, kwargs)
        if values[cache_at] and values[base_at] is None:
            base = _compat.graph_input_behind(values[weight_at])
            if base is None:
                warnings.warn(
                    f"cache_fp8_weights=True: the weight of compileops::{name} is computed "
                    "inside the compiled graph (not a parameter or a view of one), so writes "
                    "to it cannot be tracked; it is quantised on every call instead of "
                    "cached. Pass the parameter (or a view of it) to cache its fp8 copy.",
                    stacklevel=2)
                values[cache_at] = False
            elif _compat.graph_input_written(base):
                warnings.warn(
                    f"cache_fp8_weights=True: the compiled graph that calls compileops::{name} "
                    "also writes its weight in place, so the weight's version counter does "
                    "not say which values the call sees; it is quantised on every call of "
                    "this graph instead of cached. Write the weight outside the compiled "
                    "function to keep the cache.", stacklevel=2)
                values[cache_at] = False
            else:
                values[base_at] = base
                logger.debug("%s: the weight cache follows graph input %s", name,
                             base.get_name())
        return _compat.fallback(op)(*values)

    return lower


def register() -> None:
    import compileops.grouped_linear.fp8_op  # noqa: F401  (the ops must exist before lowering)

    for name in FP8_OPS:
        op = getattr(torch.ops.compileops, name).default
        _compat.register_lowering(op, _lowering(op))
