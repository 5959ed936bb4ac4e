"""Inductor lowering of the fp8 grouped linear ops.

**Rowwise scaling, where Triton is generated for the device: templates.** The three
forward products (``grouped_linear_fp8``, ``grouped_linear_row_scaled_fp8``,
``grouped_linear_swiglu_fp8_with_preact``) and dX from the forward's weight copy
(``grouped_linear_fp8_dx_from_copy``) become the grouped-linear template
(:func:`.grouped_linear._lower` with :class:`.grouped_linear.Fp8Operands`), which calls the
eager kernel's ``@triton.jit`` bodies on e4m3 operands and applies the row and column scales
in its epilogue, so a compiled fp8 step runs no Python of ours for the products:

* the activation (x; for dX, dY times the weight copy's scales of each row's group) is
  quantised per row as Inductor IR (:mod:`.fp8_quantize`): one kernel fused with whatever
  produces the rows (a gather, a cast; on a GPU not the SwiGLU derivative, whose halves
  Inductor concatenates as one pointwise node: ``fp8_quantize._part_loaders``). The SwiGLU
  product cannot write e4m3 h itself: a row's scale needs the amax over all its N tiles,
  which other programs compute, so h leaves in 16 bits and its quantisation is the down
  projection's fused IR kernel;
* the weight, without ``cache_weight``: ``compileops::fp8_weight_rowwise`` in the graph
  (:func:`compileops.grouped_linear` calls it and passes the copy to the forward op),
  lowered to IR fused with whatever produces the weight (a cast of fp32 masters). The
  backward reads that saved copy and transposes it for dX, instead of quantising the
  weight again;
* the weight with ``cache_weight``: an extern call of ``compileops::fp8_weight_cached``
  (:mod:`compileops.grouped_linear.fp8_weight_op`, the lookup without the custom op's
  Python wrappers), which returns the cached e4m3 copy (a dictionary lookup; quantised once
  per weight version; for dX the cached transposed copy) and is the only Python left in
  the step.

``grouped_linear_fp8_dx`` (dX from the weight itself, for direct callers) stays an extern
call.

Templates are the forward's output ``[M, N]`` in x's dtype, so pointwise consumers fuse as
their epilogue, as with bf16. dW stays the bf16 extern product. Blockwise scaling, the
reference backend, batch-invariant mode and the C++ backend keep the extern call of the op
(its eager kernels or reference), as do shapes the template cannot build.

**The weight cache and compiled graphs.** Inductor passes a view of a graph input
(``w.transpose(1, 2)``, ``w[:, :H]``) to an extern call as a tensor rebuilt over the input's
storage (``reinterpret_tensor``), whose version counter is its own and never moves when the
parameter is written in place. With ``cache_weight`` (``cache_fp8_weights=True``) the cache
would then keep serving the copies of the weights from before ``w.mul_(2)``, ``copy_`` or
``load_state_dict``. So, for each fp8 op with ``cache_weight``:

* the weight is a graph input, or a strided view of one: the weight's extern call gets that
  input as its ``weight_base``, and the cache checks the input's version (the parameter's
  own counter);
* the weight is computed inside the graph (a cast, a concatenation): nothing tracks writes to
  it, so ``cache_weight`` is turned off for that call (quantised every call) and a warning
  says so;
* the weight's graph input is also written in place by the graph (under ``no_grad``; whole,
  through a view, or in a list of a ``torch._foreach_*_`` op):
  AOTAutograd raises its version before the graph runs, while its values change only at the
  write, so a copy made before the write would be stored under the new version. The cache is
  turned off for that call too, with a warning.
"""
from __future__ import annotations

import warnings

import torch

from compileops import _log, backends
from compileops.lowerings import _compat
from compileops.lowerings import fp8_quantize
from compileops.lowerings import grouped_linear as bf16_lowering

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


def _cache_base(name: str, weight, cache_weight: bool, weight_base):
    """``(cache_weight, weight_base)`` as the call may use them (module docstring)."""
    if not cache_weight or weight_base is not None:
        return cache_weight, weight_base
    base = _compat.graph_input_behind(weight)
    if base is None:
        warnings.warn(
            f"cache_fp8_weights=True: the weight of compileops::{name} is computed "
            "inside the compiled graph (not a parameter or a view of one), so writes "
            "to it cannot be tracked; it is quantised on every call instead of "
            "cached. Pass the parameter (or a view of it) to cache its fp8 copy.",
            stacklevel=3)
        return False, None
    if _compat.graph_input_written(base):
        warnings.warn(
            f"cache_fp8_weights=True: the compiled graph that calls compileops::{name} "
            "also writes its weight in place, so the weight's version counter does "
            "not say which values the call sees; it is quantised on every call of "
            "this graph instead of cached. Write the weight outside the compiled "
            "function to keep the cache.", stacklevel=3)
        return False, None
    logger.debug("%s: the weight cache follows graph input %s", name, base.get_name())
    return True, base


def _why_extern(x, scaling: str, name: str) -> str | None:
    """None when the rowwise template applies, else why the op stays an extern call."""
    from compileops.modes import is_batch_invariant

    if scaling != "rowwise":
        return f"{scaling} scaling has no template (its block scales apply per K step)"
    device = x.get_device()
    why = bf16_lowering._why_no_template(device, x.get_dtype())
    if why is not None:
        return why
    if backends.select(name, device) != "triton":
        return "the reference backend is selected"
    if is_batch_invariant():
        return "batch-invariant mode keeps the eager kernels' one code path"
    if 0 in (_compat.size_hint(s) for s in x.get_size()):
        return "an empty operand"
    return None


def _template(name: str, args: dict):
    """The template lowering of a rowwise fp8 forward op (``args``: its arguments by name),
    or None (no config could be built). The weight's copy is the op's ``weight_q`` and
    ``weight_scale`` when the caller made it (``fp8_weight_rowwise``, lowered below), else
    the cache's through an extern call, else quantised here as IR."""
    if args["weight_q"] is not None:
        w_q, w_scale = args["weight_q"], args["weight_scale"]
    else:
        w_q, w_scale = _lower_weight_copy(args["weight"], False, args["cache_weight"],
                                          args["weight_base"])
    x = args["x"]
    x_q, x_scale = fp8_quantize.quantise_rows(x)
    fp8 = bf16_lowering.Fp8Operands(x_scale, w_scale, x.get_dtype(), bool(args["fast_accum"]))
    swiglu = name == "grouped_linear_swiglu_fp8_with_preact"
    return bf16_lowering._lower(name, swiglu, x_q, w_q, args["offsets"],
                                row_scale=args.get("row_scale"), save_preact=swiglu, fp8=fp8)


def _lowering(op: torch._ops.OpOverload):
    names = [argument.name for argument in op._schema.arguments]
    name = op._schema.name.split("::")[-1]

    def lower(*args, **kwargs):
        named = dict(zip(names, _arguments(op, args, kwargs)))
        named["cache_weight"], named["weight_base"] = _cache_base(
            name, named["weight"], named["cache_weight"], named["weight_base"])
        why = _why_extern(named[names[0]], named["scaling"], name)
        if why is None and name == "grouped_linear_fp8_dx":
            why = ("dX from the weight itself; the layers' backward reads the forward's copy "
                   "through grouped_linear_fp8_dx_from_copy, a template")
        if why is None:
            lowered = _template(name, named)
            if lowered is not None:
                return lowered
            why = "the template could not be built"
        logger.info("%s: extern call of the eager op: %s", name, why)
        return _compat.fallback(op)(*(named[n] for n in names))

    return lower


def _lower_weight_copy(weight, transposed, cache_weight=False, weight_base=None):
    """``fp8_weight_rowwise``: the forward's uncached copy as a fused IR kernel (with
    whatever produces the weight: a cast of fp32 masters), else an extern call of the op
    (the cache's lookup, with its ``weight_base`` as the products' own)."""
    name = "fp8_weight_rowwise"
    cache_weight, weight_base = _cache_base(name, weight, cache_weight, weight_base)
    if not cache_weight and not transposed and _why_extern(weight, "rowwise", name) is None:
        return fp8_quantize.quantise_rows(weight)
    if cache_weight:
        # The cache's copy: allocated at most once per weight version, never freed by the
        # step. Through the lean lookup op, the step's one host call per weight and layout.
        lookup = torch.ops.compileops.fp8_weight_cached.default
        return _compat.fallback_held_outside_the_step(lookup)(weight, transposed, weight_base)
    op = torch.ops.compileops.fp8_weight_rowwise.default
    return _compat.fallback(op)(weight, transposed, cache_weight, weight_base)


def _row_groups(offsets, rows):
    """``[rows]`` int64 IR: each row's group, ``searchsorted(offsets, row, right=True)`` (G
    for rows past the last offset), as :func:`compileops.grouped_linear.reference.row_groups`."""
    iota = _compat.aten_lowering(torch.ops.prims.iota.default)(
        rows, start=0, step=1, dtype=offsets.get_dtype(), device=offsets.get_device(),
        requires_grad=False)
    return _compat.aten_lowering(torch.ops.aten.searchsorted.Tensor)(offsets, iota, right=True)


def _lower_dx_from_copy(grad, weight_q_t, weight_scale, offsets, fast_accum=False,
                        cached_copy=False):
    """``grouped_linear_fp8_dx_from_copy``: the template over dY's rows times the weight's
    scales, quantised as IR in one kernel with whatever computed dY where Inductor lets it
    (:func:`.fp8_quantize.quantise_rows`), with unit weight scales. The cache's
    copy may reach the backward saved by the forward (AOTAutograd moves the lookup there when
    the weight is a plain tensor input rather than a parameter): a graph input, which the
    memory planner is then told the step never frees, as it is for the lookup's outputs.
    (``cached_copy`` says the cache was asked for; a weight the compile does not cache, one
    computed in the graph, is then counted as held too: the planner's estimate is off by its
    copy, and nothing that runs changes.)"""
    name = "grouped_linear_fp8_dx_from_copy"
    if cached_copy:
        _compat.hold_graph_inputs(weight_q_t, weight_scale)
    why = _why_extern(grad, "rowwise", name)
    groups, k, _ = weight_q_t.get_size()
    groups = _compat.specialize(groups, what="the number of groups G")
    if why is None and groups == 0:
        why = "no groups"
    if why is None:
        row_groups = _row_groups(offsets, grad.get_size()[0])
        x_q, x_scale = fp8_quantize.quantise_rows(grad, (weight_scale, row_groups, groups))
        ops = _compat.ops()
        # One row of ones read by every group (group stride 0): a [G, K] buffer of ones
        # would be allocated early and held to the dX product, beside the step's peak.
        unit_row = _compat.pointwise(device=weight_q_t.get_device(), dtype=torch.float32,
                                     inner_fn=lambda idx: ops.constant(1.0, torch.float32),
                                     ranges=[1, k])
        unit = _compat.aten_lowering(torch.ops.aten.expand.default)(unit_row, [groups, k])
        fp8 = bf16_lowering.Fp8Operands(x_scale, unit, grad.get_dtype(), bool(fast_accum))
        lowered = bf16_lowering._lower(name, False, x_q, weight_q_t, offsets, fp8=fp8)
        if lowered is not None:
            return lowered
        why = "the template could not be built"
    logger.info("%s: extern call of the eager op: %s", name, why)
    op = torch.ops.compileops.grouped_linear_fp8_dx_from_copy.default
    return _compat.fallback(op)(grad, weight_q_t, weight_scale, offsets, fast_accum, cached_copy)


def register() -> None:
    import compileops.grouped_linear.fp8_op  # noqa: F401  (the ops must exist before lowering)

    for name in FP8_OPS:
        op = getattr(torch.ops.compileops, name).default
        _compat.register_lowering(op, _lowering(op))
    _compat.register_lowering(torch.ops.compileops.fp8_weight_rowwise.default,
                              _lower_weight_copy)
    _compat.register_lowering(torch.ops.compileops.grouped_linear_fp8_dx_from_copy.default,
                              _lower_dx_from_copy)
