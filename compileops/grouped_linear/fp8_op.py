"""The fp8 grouped linear ops (experimental): the forward and dX products in e4m3.

Two scalings, each a string argument ``scaling`` of the ops:

* ``"rowwise"``: one fp32 scale per row of each operand along the forward product's
  reduction dim: per token for x, per output channel for the weight. dX reuses the forward's
  e4m3 weight copy (transposed): the weight's scales multiply dY's rows, which are then
  quantised per token (:mod:`compileops.grouped_linear.fp8`, "dX from the forward's weight
  copy");
* ``"blockwise"`` (DeepSeek-V3's): x and dY in ``1 x 128`` blocks along the reduction dim,
  the weight in ``128 x 128`` blocks, one quantisation for both products (a square block's
  scale is its transpose's); the scales are applied per 128-wide K step, inside the loop.

The ops:

* ``compileops::grouped_linear_fp8(x [M, K], weight [G, N, K], offsets int32 [G], scaling)
  -> [M, N]``;
* ``compileops::grouped_linear_row_scaled_fp8(x, weight, offsets, row_scale [M], scaling)
  -> [M, N]``: each output row times its scale in the epilogue (the MoE down projection times
  the router probability); its backward takes the scale's gradient from the fp8 dX product
  (:func:`compileops.grouped_linear.scaled.row_scaled_backward`);
* ``compileops::grouped_linear_fp8_dx(grad [M, N], weight, offsets, scaling) -> [M, K]``;
* ``compileops::grouped_linear_swiglu_fp8_with_preact(x, weight [G, 2H, K], offsets,
  scaling) -> (silu(gate) * up [M, H], preact [M, 2H])``, the pre-activations written beside
  the output for the backward.

The three forward ops take the weight's rowwise copy as ``weight_q [G, N, K]`` and
``weight_scale [G, N]`` when the caller made it (:func:`compileops.grouped_linear` does,
through ``compileops::fp8_weight_rowwise``, :mod:`.fp8_weight_op`): compiled, the copy is
then a tensor of the graph, which the backward reads for dX instead of quantising the
weight again. Without them the op quantises the weight itself.

Autograd: dX through ``grouped_linear_fp8_dx_from_copy`` (rowwise) or
``grouped_linear_fp8_dx`` (blockwise); ``dW = dY_g^T X_g`` in x's dtype
(``compileops::grouped_linear_wgrad``, from the saved unquantised x), or, with
``fp8_weight_grad`` (rowwise only, opt-in), in e4m3 too
(``compileops::grouped_linear_wgrad_fp8``, :mod:`.fp8_wgrad_op`, which gives its cost in
accuracy).

The numerics are :func:`compileops.grouped_linear.fp8.grouped_linear_reference`'s (the
reference backend runs it): e4m3 for both operands and for dY (why e4m3 for gradients: the
module docstring there), fp32 scales; relative L2 error about 3.7e-2 per product against
exact arithmetic on unit-normal data, as torchao's rowwise fp8. On Hopper the fp8 MMA sums
each 128-wide K step at reduced precision before the fp32 accumulator (about 1e-4
relative). Deterministic run to run; not batch-invariant (the tile config follows the group
sizes).

``fast_accum`` (rowwise only; the public ``fp8_fast_accum=True``): the MMA accumulates each
product over the whole K loop at its reduced precision instead of handing every 128-wide step
to the fp32 accumulator, as ``torch._scaled_mm(use_fast_accum=True)`` does. Steps no longer
wait for each other, so on an H200 the products ran 1.2-1.6x faster at the MoE bench's shapes
(all but Qwen3-30B-A3B's gate/up, bound by its SwiGLU epilogue: 1.0x). The price, measured
there on unit-normal operands against the fp32 product of the same e4m3 operands: a relative
L2 error of 1.7e-3 to 3.4e-3 (growing with K, 768 to 14336) in place of 1.7e-3 (the bf16
output's own rounding), next to the 3.7e-2 that quantising to e4m3 costs. Deterministic too.

A row, ``1 x 128`` tile or ``128 x 128`` block whose largest magnitude is below about
5.3e-36 (``448 * 2^-126``) is quantised with scale 1, like an all-zero one, and comes back as
exact zeros (:mod:`compileops.grouped_linear.fp8`), so tiny activations, weights or gradients
never overflow the scale.

``weight_base`` (every op; the Inductor lowering sets it, users need not): the tensor whose
version counter follows writes to ``weight``'s storage, for the weight cache. Compiled, a
view of a parameter (``w.transpose(1, 2)``, ``w[:, :H]``) reaches the op as a tensor rebuilt
over the parameter's storage with a version counter of its own, which never moves when the
parameter is written in place; the lowering passes the graph input the view was taken from,
and the cache checks that tensor's version. None: ``weight``'s own (eager views share their
base's counter).

The weight is quantised once per forward (unless ``cache_weight``: :mod:`.fp8_cache`); the
backward transposes that e4m3 copy for dX (1 byte read and written per weight element,
where a second quantisation read the 16- or 32-bit weight twice).

Compiled, the rowwise ops become Inductor templates over e4m3 operands that share the eager
kernel's ``@triton.jit`` bodies, with the activations' (and uncached weights') quantisation
as fused Inductor kernels and a cached weight read through
``compileops::fp8_weight_rowwise`` (``compileops/lowerings/grouped_linear_fp8.py``): the same
bits as these ops. Blockwise scaling stays a call of the op.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.grouped_linear import fp8 as fp8_rule
from compileops.grouped_linear.backward_ops import (
    forward_mode,
    grouped_linear_wgrad_op,
    keep_for_backward,
    swiglu_derivative,
    use_triton,
)
from compileops.grouped_linear.checks import (
    check_dim,
    check_forward_args,
    check_offsets_eagerly,
    check_row_scaled_args,
    check_same_device,
)
from compileops.grouped_linear.fp8_weight_op import (
    CUDAGRAPH_UNSAFE as _CUDAGRAPH_UNSAFE,
    fp8_weight_rowwise_op,
    quantised_weight,
)
from compileops.grouped_linear.fp8_wgrad_op import grouped_linear_wgrad_fp8_op
from compileops.grouped_linear.reference import grouped_linear_forward
from compileops.grouped_linear.scaled import row_scaled_backward
from compileops.modes import BATCH_INVARIANT

#: The ``fp8`` recipes of :func:`compileops.grouped_linear` and friends (None: no fp8).
RECIPES = ("rowwise", "blockwise")



def check_recipe(fp8, bias=None, fast_accum=False, weight_grad=False, **unsupported) -> None:
    """A clear error for an unknown recipe, or for what the fp8 path does not take yet."""
    if fp8 is None:
        return
    if fp8 not in RECIPES:
        raise ValueError(f"fp8 must be None or one of {RECIPES}, got {fp8!r}")
    if bias is not None:
        raise ValueError(f"fp8={fp8!r} takes no bias (MoE experts have none): pass bias=None")
    if fast_accum and fp8 != "rowwise":
        raise ValueError(f"fp8_fast_accum=True applies to fp8='rowwise'; fp8={fp8!r} scales "
                         "each 128-wide K step apart by construction")
    if weight_grad and fp8 != "rowwise":
        raise ValueError(f"fp8_weight_grad=True applies to fp8='rowwise' (dW quantised per "
                         f"group and column); fp8={fp8!r} has no fp8 dW")
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"fp8={fp8!r} does not support {name} yet")


def _check(x, weight, offsets, scaling: str, swiglu: bool = False,
           fast_accum: bool = False, weight_grad: bool = False) -> None:
    check_forward_args(x, weight, offsets, None, swiglu)
    torch._check_type(x.dtype != torch.float64,
                      lambda: "the fp8 grouped linear takes bf16, fp16 or fp32 inputs, got fp64")
    torch._check_value(scaling in RECIPES,
                       lambda: f"scaling must be one of {RECIPES}, got {scaling!r}")
    torch._check_value(not fast_accum or scaling == "rowwise",
                       lambda: f"fast_accum applies to rowwise scaling, got {scaling!r}")
    torch._check_value(not weight_grad or scaling == "rowwise",
                       lambda: f"fp8_weight_grad applies to rowwise scaling, got {scaling!r}")


def _reference(x, weight, offsets, scaling):
    """The reference's products in fp32 (quantising x or x.float() is the same)."""
    return fp8_rule.grouped_linear_reference(x.float(), weight.float(), offsets, scaling)


def _kernels():
    from compileops.grouped_linear.kernels import fp8 as fp8_kernels

    return fp8_kernels


def _check_weight_copy(weight, weight_q, weight_scale, scaling) -> None:
    """A forward op's ``weight_q``/``weight_scale``: both or neither, rowwise, the weight's
    rowwise copy's shapes and dtypes."""
    torch._check_value((weight_q is None) == (weight_scale is None),
                       lambda: "pass weight_q and weight_scale together, or neither")
    if weight_q is None:
        return
    torch._check_value(scaling == "rowwise",
                       lambda: f"weight_q applies to rowwise scaling, got {scaling!r}")
    groups, n, k = weight.shape
    torch._check_value(
        weight_q.dtype == fp8_rule.E4M3 and tuple(weight_q.shape) == (groups, n, k),
        lambda: f"weight_q must be e4m3 {[groups, n, k]}, got {weight_q.dtype} "
                f"{list(weight_q.shape)}")
    torch._check_value(
        weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == (groups, n),
        lambda: f"weight_scale must be fp32 {[groups, n]}, got {weight_scale.dtype} "
                f"{list(weight_scale.shape)}")


def _product(x, weight, offsets, scaling, *, swiglu=False, preact=None, cache_weight=False,
             weight_base=None, row_scale=None, fast_accum=False, weight_copy=None):
    """The Triton fp8 forward product ``x W_g^T`` in x's dtype; ``row_scale [M]`` (x's
    dtype) multiplies each rounded row; ``fast_accum`` (rowwise): the MMA accumulates over
    the whole K loop; ``weight_copy``: the weight's rowwise ``(q, scale)`` if made already."""
    k = _kernels()
    wq, ws = weight_copy or quantised_weight(weight, scaling, False, cache_weight,
                                              weight_base)
    if scaling == "blockwise":
        return k.grouped_linear_fp8_blockwise(x, wq, ws, offsets, out_dtype=x.dtype,
                                              swiglu=swiglu, preact=preact,
                                              row_scale=row_scale)
    return k.grouped_linear_fp8_rowwise(x, wq, ws, offsets, out_dtype=x.dtype, swiglu=swiglu,
                                        preact=preact, row_scale=row_scale,
                                        fast_accum=fast_accum)


def _copy_or_none(weight_q, weight_scale):
    return None if weight_q is None else (weight_q, weight_scale)


def _forward_reference(x, weight, offsets, scaling, weight_q=None, weight_scale=None):
    """The reference's forward in fp32, from the given rowwise copy if any (the same values
    as quantising ``weight``)."""
    if weight_q is None:
        return _reference(x, weight, offsets, scaling)
    return grouped_linear_forward(fp8_rule.dequantize(*fp8_rule.quantize_rowwise(x.float())),
                                  fp8_rule.dequantize(weight_q, weight_scale), offsets)


@custom_op("grouped_linear_fp8", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_fp8_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                          scaling: str, cache_weight: bool = False, fast_accum: bool = False,
                          weight_base: Optional[torch.Tensor] = None,
                          weight_q: Optional[torch.Tensor] = None,
                          weight_scale: Optional[torch.Tensor] = None,
                          fp8_weight_grad: bool = False) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]`` -> ``[M, N]`` in x's dtype,
    fp8 with ``scaling`` (module docstring); rows past ``offsets[-1]`` are zeros.
    ``cache_weight``: the weight's e4m3 copy from :mod:`.fp8_cache`; ``weight_base``: the
    module docstring's. ``fast_accum`` (rowwise): the MMA accumulates over the whole K
    loop, in the forward and dX. ``weight_q``, ``weight_scale``: the weight's rowwise copy
    (``fp8_weight_rowwise``), used instead of quantising ``weight``. ``fp8_weight_grad``
    (rowwise): the backward's dW in fp8 too (``grouped_linear_wgrad_fp8``)."""
    _check(x, weight, offsets, scaling, fast_accum=fast_accum, weight_grad=fp8_weight_grad)
    _check_weight_copy(weight, weight_q, weight_scale, scaling)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_fp8", x):
        return _product(x, weight, offsets, scaling, cache_weight=cache_weight,
                        weight_base=weight_base, fast_accum=fast_accum,
                        weight_copy=_copy_or_none(weight_q, weight_scale))
    return _forward_reference(x, weight, offsets, scaling, weight_q,
                              weight_scale).to(x.dtype)


@grouped_linear_fp8_op.register_fake
def _grouped_linear_fp8_fake(x, weight, offsets, scaling, cache_weight=False,
                             fast_accum=False, weight_base=None, weight_q=None,
                             weight_scale=None, fp8_weight_grad=False):
    _check(x, weight, offsets, scaling, fast_accum=fast_accum, weight_grad=fp8_weight_grad)
    _check_weight_copy(weight, weight_q, weight_scale, scaling)
    return x.new_empty((x.shape[0], weight.shape[1]))


def _check_from_copy(grad, weight_q_t, weight_scale, offsets) -> None:
    """``grad [M, N]`` (16- or 32-bit), e4m3 ``weight_q_t [G, K, N]``, fp32 ``weight_scale
    [G, N]``, int32 ``offsets [G]``."""
    check_dim(grad, 2, "grad", "[M, N]")
    check_dim(weight_q_t, 3, "weight_q_t", "[G, K, N]")
    check_dim(offsets, 1, "offsets", "[G] (cumulative end row of each group)")
    torch._check_type(grad.dtype in (torch.bfloat16, torch.float16, torch.float32),
                      lambda: f"grad must be bf16, fp16 or fp32, got {grad.dtype}")
    torch._check_type(weight_q_t.dtype == fp8_rule.E4M3,
                      lambda: f"weight_q_t must be e4m3, got {weight_q_t.dtype}")
    torch._check_type(offsets.dtype == torch.int32,
                      lambda: f"offsets must be int32, got {offsets.dtype}")
    groups, _, n = weight_q_t.shape
    torch._check_value(offsets.shape[0] == groups,
                       lambda: f"{offsets.shape[0]} offsets for {groups} groups")
    torch._check_value(grad.shape[1] == n,
                       lambda: f"mismatched N: grad {tuple(grad.shape)}, weight_q_t [G, K, N] "
                               f"{tuple(weight_q_t.shape)}")
    torch._check_value(
        weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == (groups, n),
        lambda: f"weight_scale must be fp32 {[groups, n]}, got {weight_scale.dtype} "
                f"{list(weight_scale.shape)}")
    check_same_device([("grad", grad), ("weight_q_t", weight_q_t),
                       ("weight_scale", weight_scale), ("offsets", offsets)])


@custom_op("grouped_linear_fp8_dx_from_copy", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_fp8_dx_from_copy_op(grad: torch.Tensor, weight_q_t: torch.Tensor,
                                       weight_scale: torch.Tensor, offsets: torch.Tensor,
                                       fast_accum: bool = False,
                                       cached_copy: bool = False) -> torch.Tensor:
    """Rowwise fp8 ``dX [M, K] = grad_g @ W_g`` in grad's dtype from the forward's weight
    copy: ``weight_q_t [G, K, N]`` e4m3 (``fp8_weight_rowwise(weight, True)``, the copy
    transposed) and its per-output-channel ``weight_scale [G, N]``. ``grad [M, N]`` times
    its group's scales (:func:`compileops.grouped_linear.fp8.scale_gradient_rows`) is
    quantised per row; rows past ``offsets[-1]`` are zeros. ``fast_accum``: as the
    forward's. ``cached_copy``: the copy is the weight cache's (compiled, Inductor's memory
    planner is told the step never frees it; nothing else changes). Not differentiable."""
    _check_from_copy(grad, weight_q_t, weight_scale, offsets)
    check_offsets_eagerly(offsets, grad.shape[0])
    scaled = fp8_rule.scale_gradient_rows(grad, weight_scale, offsets)
    if use_triton("grouped_linear_fp8_dx_from_copy", grad):
        groups, k, _ = weight_q_t.shape
        unit = torch.ones((groups, k), dtype=torch.float32, device=weight_q_t.device)
        return _kernels().grouped_linear_fp8_rowwise(scaled, weight_q_t, unit, offsets,
                                                     out_dtype=grad.dtype,
                                                     fast_accum=fast_accum)
    return fp8_rule.prescaled_dx_reference(scaled, weight_q_t, offsets).to(grad.dtype)


@grouped_linear_fp8_dx_from_copy_op.register_fake
def _grouped_linear_fp8_dx_from_copy_fake(grad, weight_q_t, weight_scale, offsets,
                                          fast_accum=False, cached_copy=False):
    _check_from_copy(grad, weight_q_t, weight_scale, offsets)
    return grad.new_empty((grad.shape[0], weight_q_t.shape[1]))


@custom_op("grouped_linear_fp8_dx", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_fp8_dx_op(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                             scaling: str, cache_weight: bool = False, fast_accum: bool = False,
                             weight_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad ``[M, N]`` -> ``dX [M, K] = grad_g @ W_g`` in grad's dtype, fp8 with
    ``scaling``: rowwise from the weight's forward copy (module docstring), blockwise from
    its block copy. Compiled, an extern call (the layers' backward is
    ``grouped_linear_fp8_dx_from_copy``, a template)."""
    _check(grad, weight.transpose(1, 2), offsets, scaling, fast_accum=fast_accum)
    check_offsets_eagerly(offsets, grad.shape[0])
    if not use_triton("grouped_linear_fp8_dx", grad):
        return fp8_rule.grouped_linear_dx_reference(grad, weight, offsets,
                                                    scaling).to(grad.dtype)
    if scaling == "rowwise":
        weight_q_t, weight_scale = quantised_weight(weight, scaling, True, cache_weight,
                                                     weight_base)
        return grouped_linear_fp8_dx_from_copy_op(grad, weight_q_t, weight_scale, offsets,
                                                  fast_accum)
    wq, ws = quantised_weight(weight, scaling, True, cache_weight, weight_base)
    return _kernels().grouped_linear_fp8_blockwise(grad, wq, ws, offsets, out_dtype=grad.dtype,
                                                   transposed=True)


@grouped_linear_fp8_dx_op.register_fake
def _grouped_linear_fp8_dx_fake(grad, weight, offsets, scaling, cache_weight=False,
                                fast_accum=False, weight_base=None):
    _check(grad, weight.transpose(1, 2), offsets, scaling, fast_accum=fast_accum)
    return grad.new_empty((grad.shape[0], weight.shape[2]))


def _weight_grad(ctx, grad, x, offsets, weight_dtype):
    """dW of a forward op: fp8 with ``fp8_weight_grad``, else in x's dtype."""
    if ctx.fp8_weight_grad:
        return grouped_linear_wgrad_fp8_op(grad, x, offsets, weight_dtype, ctx.fast_accum)
    dw, _ = grouped_linear_wgrad_op(grad, x, offsets, weight_dtype, grad.dtype, False)
    return dw


def _fp8_dx(ctx, grad, weight, offsets, weight_copy):
    """dX of a forward op: rowwise from the forward's weight copy (the cache's transposed
    one; else the copy saved by the forward, transposed here: torch ops, 1 byte per weight
    element each way; else, the op called without a copy, made now), blockwise through
    ``grouped_linear_fp8_dx``."""
    if ctx.scaling != "rowwise":
        return grouped_linear_fp8_dx_op(grad, weight, offsets, ctx.scaling, ctx.cache_weight,
                                        ctx.fast_accum)
    if ctx.cache_weight or weight_copy is None:
        weight_q_t, weight_scale = fp8_weight_rowwise_op(weight, True, ctx.cache_weight)
    else:
        weight_q, weight_scale = weight_copy
        weight_q_t = weight_q.transpose(1, 2).contiguous()
    return grouped_linear_fp8_dx_from_copy_op(grad, weight_q_t, weight_scale, offsets,
                                              ctx.fast_accum, bool(ctx.cache_weight))


def _fp8_linear_backward(ctx, grad, x, weight, offsets, weight_copy):
    """dX in fp8, dW in x's dtype or (``fp8_weight_grad``) fp8."""
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _fp8_dx(ctx, grad, weight, offsets, weight_copy)
    if ctx.needs_input_grad[1]:
        dw = _weight_grad(ctx, grad, x, offsets, weight.dtype)
    return dx, dw


def _keep_options(ctx, scaling, cache_weight, fast_accum, weight_q, fp8_weight_grad) -> None:
    ctx.scaling, ctx.cache_weight, ctx.fast_accum = scaling, cache_weight, fast_accum
    ctx.has_weight_copy = weight_q is not None
    ctx.fp8_weight_grad = fp8_weight_grad


def _saved_copy(ctx, saved):
    """The forward's weight copy from the tail of ``saved``, or None."""
    return tuple(saved[-2:]) if ctx.has_weight_copy else None


def _setup_context(ctx, inputs, output) -> None:
    (x, weight, offsets, scaling, cache_weight, fast_accum, _, weight_q, weight_scale,
     fp8_weight_grad) = inputs
    keep_for_backward(ctx, (x, weight, offsets, None),
                      *((weight_q, weight_scale) if weight_q is not None else ()))
    _keep_options(ctx, scaling, cache_weight, fast_accum, weight_q, fp8_weight_grad)


def _grouped_linear_fp8_backward(ctx, grad):
    with forward_mode(ctx):
        saved = ctx.saved_tensors
        x, weight, offsets = saved[:3]
        dx, dw = _fp8_linear_backward(ctx, grad, x, weight, offsets, _saved_copy(ctx, saved))
        return dx, dw, None, None, None, None, None, None, None, None


backends.register_autograd(grouped_linear_fp8_op, _grouped_linear_fp8_backward, _setup_context)


@custom_op("grouped_linear_row_scaled_fp8", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_row_scaled_fp8_op(x: torch.Tensor, weight: torch.Tensor,
                                     offsets: torch.Tensor, row_scale: torch.Tensor,
                                     scaling: str, cache_weight: bool = False,
                                     fast_accum: bool = False,
                                     weight_base: Optional[torch.Tensor] = None,
                                     weight_q: Optional[torch.Tensor] = None,
                                     weight_scale: Optional[torch.Tensor] = None,
                                     fp8_weight_grad: bool = False) -> torch.Tensor:
    """``grouped_linear_fp8`` with row i of the output, rounded to x's dtype, times
    ``row_scale[i]`` (``[M]`` in x's dtype) and rounded again: the MoE down projection times
    the router probability, in the product's epilogue."""
    _check(x, weight, offsets, scaling, fast_accum=fast_accum, weight_grad=fp8_weight_grad)
    check_row_scaled_args(x, weight, offsets, row_scale)
    _check_weight_copy(weight, weight_q, weight_scale, scaling)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_row_scaled_fp8", x):
        return _product(x, weight, offsets, scaling, cache_weight=cache_weight,
                        weight_base=weight_base, row_scale=row_scale.contiguous(),
                        fast_accum=fast_accum,
                        weight_copy=_copy_or_none(weight_q, weight_scale))
    y = _forward_reference(x, weight, offsets, scaling, weight_q, weight_scale).to(x.dtype)
    return (y.float() * row_scale.float()[:, None]).to(x.dtype)


@grouped_linear_row_scaled_fp8_op.register_fake
def _grouped_linear_row_scaled_fp8_fake(x, weight, offsets, row_scale, scaling,
                                        cache_weight=False, fast_accum=False,
                                        weight_base=None, weight_q=None, weight_scale=None,
                                        fp8_weight_grad=False):
    _check(x, weight, offsets, scaling, fast_accum=fast_accum, weight_grad=fp8_weight_grad)
    check_row_scaled_args(x, weight, offsets, row_scale)
    _check_weight_copy(weight, weight_q, weight_scale, scaling)
    return x.new_empty((x.shape[0], weight.shape[1]))


def _setup_row_scaled_context(ctx, inputs, output) -> None:
    (x, weight, offsets, row_scale, scaling, cache_weight, fast_accum, _, weight_q,
     weight_scale, fp8_weight_grad) = inputs
    copy = (weight_q, weight_scale) if weight_q is not None else ()
    ctx.save_for_backward(x, weight, offsets, row_scale, *copy)
    ctx.batch_invariant = BATCH_INVARIANT.enabled()
    _keep_options(ctx, scaling, cache_weight, fast_accum, weight_q, fp8_weight_grad)


def _grouped_linear_row_scaled_fp8_backward(ctx, grad):
    """dX in fp8 (unscaled, then times the row scale), the scale's gradient as a sum over K
    of that fp8 dX with x, dW in x's dtype (:func:`.scaled.row_scaled_backward`)."""
    with forward_mode(ctx):
        saved = ctx.saved_tensors
        x, weight, offsets, row_scale = saved[:4]
        copy = _saved_copy(ctx, saved)
        dx, dw, _, ds = row_scaled_backward(
            grad, x, weight, offsets, row_scale, ctx.needs_input_grad[:4],
            lambda: _fp8_dx(ctx, grad, weight, offsets, copy),
            lambda g, a: _weight_grad(ctx, g, a, offsets, weight.dtype))
    return dx, dw, None, ds, None, None, None, None, None, None, None


backends.register_autograd(grouped_linear_row_scaled_fp8_op,
                           _grouped_linear_row_scaled_fp8_backward, _setup_row_scaled_context)


@custom_op("grouped_linear_swiglu_fp8_with_preact", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_swiglu_fp8_with_preact_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, scaling: str,
    cache_weight: bool = False, fast_accum: bool = False,
    weight_base: Optional[torch.Tensor] = None, weight_q: Optional[torch.Tensor] = None,
    weight_scale: Optional[torch.Tensor] = None, fp8_weight_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ``[G, 2H, K]`` (gate rows first) -> ``(silu(gate) * up [M, H], preact [M,
    2H])``, fp8 with ``scaling``; ``preact`` in x's dtype, for the backward. ``weight_q``,
    ``weight_scale``, ``fp8_weight_grad``: as ``grouped_linear_fp8``'s."""
    _check(x, weight, offsets, scaling, swiglu=True, fast_accum=fast_accum,
           weight_grad=fp8_weight_grad)
    _check_weight_copy(weight, weight_q, weight_scale, scaling)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_swiglu_fp8_with_preact", x):
        preact = x.new_empty((x.shape[0], weight.shape[1]))
        out = _product(x, weight, offsets, scaling, swiglu=True, preact=preact,
                       cache_weight=cache_weight, weight_base=weight_base,
                       fast_accum=fast_accum, weight_copy=_copy_or_none(weight_q, weight_scale))
        return out, preact
    pre = _forward_reference(x, weight, offsets, scaling, weight_q, weight_scale)
    gate, up = pre.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype), pre.to(x.dtype)


@grouped_linear_swiglu_fp8_with_preact_op.register_fake
def _grouped_linear_swiglu_fp8_with_preact_fake(x, weight, offsets, scaling,
                                                cache_weight=False, fast_accum=False,
                                                weight_base=None, weight_q=None,
                                                weight_scale=None, fp8_weight_grad=False):
    _check(x, weight, offsets, scaling, swiglu=True, fast_accum=fast_accum,
           weight_grad=fp8_weight_grad)
    _check_weight_copy(weight, weight_q, weight_scale, scaling)
    return (x.new_empty((x.shape[0], weight.shape[1] // 2)),
            x.new_empty((x.shape[0], weight.shape[1])))


def _setup_preact_context(ctx, inputs, output) -> None:
    (x, weight, offsets, scaling, cache_weight, fast_accum, _, weight_q, weight_scale,
     fp8_weight_grad) = inputs
    copy = (weight_q, weight_scale) if weight_q is not None else ()
    keep_for_backward(ctx, (x, weight, offsets, None), output[1], *copy)
    _keep_options(ctx, scaling, cache_weight, fast_accum, weight_q, fp8_weight_grad)
    ctx.mark_non_differentiable(output[1])


def _swiglu_fp8_backward(ctx, grad, _grad_preact):
    with forward_mode(ctx):
        saved = ctx.saved_tensors
        x, weight, offsets, _, preact = saved[:5]
        dx, dw = _fp8_linear_backward(ctx, swiglu_derivative(preact, grad), x, weight,
                                      offsets, _saved_copy(ctx, saved))
        return dx, dw, None, None, None, None, None, None, None, None


backends.register_autograd(grouped_linear_swiglu_fp8_with_preact_op, _swiglu_fp8_backward,
                           _setup_preact_context)


def forward_weight_copy(x, weight, scaling, cache_weight):
    """``(weight_q, weight_scale)`` for a forward op's arguments: the rowwise copy made by
    ``fp8_weight_rowwise`` (so that, compiled, the backward reads it for dX instead of
    quantising the weight again); ``(None, None)`` for blockwise scaling, and for arguments
    the op refuses, so that the op itself raises its error."""
    usable = (scaling == "rowwise" and weight.dim() == 3 and weight.dtype == x.dtype
              and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
              and weight.device == x.device)
    if not usable:
        return None, None
    return fp8_weight_rowwise_op(weight, False, bool(cache_weight))
