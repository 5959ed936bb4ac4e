"""The fp8 grouped linear ops (experimental): the forward and dX products in e4m3.

Two scalings, each a string argument ``scaling`` of the ops:

* ``"rowwise"``: one fp32 scale per row of each operand along the product's reduction dim:
  per token for x (and dY), per output channel for the forward's weight, per input channel
  for dX's (a second quantisation of the weight, along N, written as ``W_g^T`` by one
  column-wise kernel);
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

Autograd: dX through ``grouped_linear_fp8_dx``; ``dW = dY_g^T X_g`` stays in x's dtype
(``compileops::grouped_linear_wgrad``, from the saved unquantised x): a reduction over a
group's tokens, whose fp8 form needs per-group scales along M.

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

The weight is quantised on every call (unless ``cache_weight``: :mod:`.fp8_cache`): with
rowwise scaling once for the forward and once, per input channel, for dX. At the MoE bench
layers on an H200 that costs about as much as the fp8 products save, so the layer is not yet
faster than bf16 without the cache (benchmarks/RESULTS.md, fp8).

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
from compileops.grouped_linear import fp8_cache
from compileops.grouped_linear.backward_ops import (
    forward_mode,
    grouped_linear_wgrad_op,
    keep_for_backward,
    swiglu_derivative,
    use_triton,
)
from compileops.grouped_linear.checks import (
    check_forward_args,
    check_offsets_eagerly,
    check_row_scaled_args,
)
from compileops.grouped_linear.scaled import row_scaled_backward
from compileops.modes import BATCH_INVARIANT

#: The ``fp8`` recipes of :func:`compileops.grouped_linear` and friends (None: no fp8).
RECIPES = ("rowwise", "blockwise")

#: Every fp8 op may read the weight cache (:mod:`.fp8_cache`), a Python lookup whose answer
#: changes when the weight does. A CUDA graph replays the kernels it captured without that
#: Python: a captured step would keep reading the e4m3 copy of the weights from the
#: capture, stale after the first optimizer step. So the ops are ``cudagraph_unsafe``:
#: Inductor's CUDA graphs (``mode="reduce-overhead"``) leave out the lookups (with graph
#: partitioning, the default, only them: the compiled fp8 products and quantisation kernels
#: stay in the graph), or the whole graph without partitioning.
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,)


def check_recipe(fp8, bias=None, fast_accum=False, **unsupported) -> None:
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
    for name, value in unsupported.items():
        if value:
            raise ValueError(f"fp8={fp8!r} does not support {name} yet")


def _check(x, weight, offsets, scaling: str, swiglu: bool = False,
           fast_accum: bool = False) -> None:
    check_forward_args(x, weight, offsets, None, swiglu)
    torch._check_type(x.dtype != torch.float64,
                      lambda: "the fp8 grouped linear takes bf16, fp16 or fp32 inputs, got fp64")
    torch._check_value(scaling in RECIPES,
                       lambda: f"scaling must be one of {RECIPES}, got {scaling!r}")
    torch._check_value(not fast_accum or scaling == "rowwise",
                       lambda: f"fast_accum applies to rowwise scaling, got {scaling!r}")


def _reference(x, weight, offsets, scaling):
    """The reference's products in fp32 (quantising x or x.float() is the same)."""
    return fp8_rule.grouped_linear_reference(x.float(), weight.float(), offsets, scaling)


def _kernels():
    from compileops.grouped_linear.kernels import fp8 as fp8_kernels

    return fp8_kernels


def _quantised_weight(weight, scaling, transposed, cache_weight, weight_base):
    """The weight's e4m3 copy and scales for the product (``transposed``: dX's), made now or
    taken from :mod:`compileops.grouped_linear.fp8_cache` (``cache_weight``; ``weight_base``:
    the tensor whose version counter follows writes to ``weight``, see the ops). Blockwise has
    one layout for both products (a square block's scale is its transpose's)."""
    k = _kernels()
    if scaling == "blockwise":
        def quantise():
            return k.quantize_blockwise(weight, fp8_rule.WEIGHT_BLOCK)
        layout = ("blockwise",)
    else:
        def quantise():
            return k.quantize_weight_rowwise(weight, transpose=transposed)
        layout = ("rowwise", transposed)
    if not cache_weight:
        return quantise()
    return fp8_cache.quantised_weight(weight, layout, quantise, base=weight_base)


def _check_weight_dims(weight) -> None:
    torch._check_value(weight.dim() == 3,
                       lambda: f"weight must be [G, N, K], got shape {tuple(weight.shape)}")


@custom_op("fp8_weight_rowwise", tags=_CUDAGRAPH_UNSAFE)
def fp8_weight_rowwise_op(weight: torch.Tensor, transposed: bool, cache_weight: bool = False,
                          weight_base: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight ``[G, N, K]`` quantised rowwise for one fp8 product: ``(q [G, N, K]`` e4m3,
    ``scale [G, N]`` fp32) for the forward, one scale per output channel; ``transposed``
    (dX): ``(q [G, K, N], scale [G, K])``, one per input channel, written as ``W_g^T``.
    ``cache_weight``: taken from :mod:`.fp8_cache` while the weight is unchanged
    (``weight_base``: the ops' own). The compiled fp8 products call it for a cached weight;
    the returned tensors may be the cache's: read them, never write them."""
    _check_weight_dims(weight)
    if not use_triton("fp8_weight_rowwise", weight):
        # The rule itself, in torch (the kernels' bits): a device without our kernels.
        q, scale = fp8_rule.quantize_rowwise(weight.transpose(1, 2) if transposed else weight)
        return q.contiguous(), scale
    return _quantised_weight(weight, "rowwise", transposed, cache_weight, weight_base)


@fp8_weight_rowwise_op.register_fake
def _fp8_weight_rowwise_fake(weight, transposed, cache_weight=False, weight_base=None):
    _check_weight_dims(weight)
    groups, n, k = weight.shape
    rows, cols = (k, n) if transposed else (n, k)
    return (weight.new_empty((groups, rows, cols), dtype=fp8_rule.E4M3),
            weight.new_empty((groups, rows), dtype=torch.float32))


def _product(x, weight, offsets, scaling, *, transposed=False, swiglu=False, preact=None,
             cache_weight=False, weight_base=None, row_scale=None, fast_accum=False):
    """The Triton fp8 product ``x W_g^T`` (``transposed``: ``x W_g``) in x's dtype;
    ``row_scale [M]`` (x's dtype) multiplies each rounded row of the forward's;
    ``fast_accum`` (rowwise): the MMA accumulates over the whole K loop."""
    k = _kernels()
    wq, ws = _quantised_weight(weight, scaling, transposed, cache_weight, weight_base)
    if scaling == "blockwise":
        return k.grouped_linear_fp8_blockwise(x, wq, ws, offsets, out_dtype=x.dtype,
                                              swiglu=swiglu, transposed=transposed,
                                              preact=preact, row_scale=row_scale)
    return k.grouped_linear_fp8_rowwise(x, wq, ws, offsets, out_dtype=x.dtype, swiglu=swiglu,
                                        preact=preact, row_scale=row_scale,
                                        fast_accum=fast_accum)


@custom_op("grouped_linear_fp8", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_fp8_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                          scaling: str, cache_weight: bool = False, fast_accum: bool = False,
                          weight_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]`` -> ``[M, N]`` in x's dtype,
    fp8 with ``scaling`` (module docstring); rows past ``offsets[-1]`` are zeros.
    ``cache_weight``: the weight's e4m3 copy from :mod:`.fp8_cache`; ``weight_base``: the
    module docstring's. ``fast_accum`` (rowwise): the MMA accumulates over the whole K
    loop, in the forward and dX."""
    _check(x, weight, offsets, scaling, fast_accum=fast_accum)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_fp8", x):
        return _product(x, weight, offsets, scaling, cache_weight=cache_weight,
                        weight_base=weight_base, fast_accum=fast_accum)
    return _reference(x, weight, offsets, scaling).to(x.dtype)


@grouped_linear_fp8_op.register_fake
def _grouped_linear_fp8_fake(x, weight, offsets, scaling, cache_weight=False,
                             fast_accum=False, weight_base=None):
    _check(x, weight, offsets, scaling, fast_accum=fast_accum)
    return x.new_empty((x.shape[0], weight.shape[1]))


@custom_op("grouped_linear_fp8_dx", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_fp8_dx_op(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                             scaling: str, cache_weight: bool = False, fast_accum: bool = False,
                             weight_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad ``[M, N]`` -> ``dX [M, K] = grad_g @ W_g`` in grad's dtype, fp8 with
    ``scaling``: grad quantised along N, the weight as the module docstring says."""
    _check(grad, weight.transpose(1, 2), offsets, scaling, fast_accum=fast_accum)
    check_offsets_eagerly(offsets, grad.shape[0])
    if use_triton("grouped_linear_fp8_dx", grad):
        return _product(grad, weight, offsets, scaling, transposed=True,
                        cache_weight=cache_weight, weight_base=weight_base,
                        fast_accum=fast_accum)
    return _reference(grad, weight.transpose(1, 2), offsets, scaling).to(grad.dtype)


@grouped_linear_fp8_dx_op.register_fake
def _grouped_linear_fp8_dx_fake(grad, weight, offsets, scaling, cache_weight=False,
                                fast_accum=False, weight_base=None):
    _check(grad, weight.transpose(1, 2), offsets, scaling, fast_accum=fast_accum)
    return grad.new_empty((grad.shape[0], weight.shape[2]))


def _fp8_linear_backward(ctx, grad, x, weight, offsets):
    """dX in fp8, dW in x's dtype."""
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_linear_fp8_dx_op(grad, weight, offsets, ctx.scaling, ctx.cache_weight,
                                      ctx.fast_accum)
    if ctx.needs_input_grad[1]:
        dw, _ = grouped_linear_wgrad_op(grad, x, offsets, weight.dtype, grad.dtype, False)
    return dx, dw, None, None, None, None, None


def _setup_context(ctx, inputs, output) -> None:
    x, weight, offsets, scaling, cache_weight, fast_accum, _ = inputs
    keep_for_backward(ctx, (x, weight, offsets, None))
    ctx.scaling, ctx.cache_weight, ctx.fast_accum = scaling, cache_weight, fast_accum


def _grouped_linear_fp8_backward(ctx, grad):
    with forward_mode(ctx):
        x, weight, offsets, _ = ctx.saved_tensors
        return _fp8_linear_backward(ctx, grad, x, weight, offsets)


backends.register_autograd(grouped_linear_fp8_op, _grouped_linear_fp8_backward, _setup_context)


@custom_op("grouped_linear_row_scaled_fp8", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_row_scaled_fp8_op(x: torch.Tensor, weight: torch.Tensor,
                                     offsets: torch.Tensor, row_scale: torch.Tensor,
                                     scaling: str, cache_weight: bool = False,
                                     fast_accum: bool = False,
                                     weight_base: Optional[torch.Tensor] = None
                                     ) -> torch.Tensor:
    """``grouped_linear_fp8`` with row i of the output, rounded to x's dtype, times
    ``row_scale[i]`` (``[M]`` in x's dtype) and rounded again: the MoE down projection times
    the router probability, in the product's epilogue."""
    _check(x, weight, offsets, scaling, fast_accum=fast_accum)
    check_row_scaled_args(x, weight, offsets, row_scale)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_row_scaled_fp8", x):
        return _product(x, weight, offsets, scaling, cache_weight=cache_weight,
                        weight_base=weight_base, row_scale=row_scale.contiguous(),
                        fast_accum=fast_accum)
    y = _reference(x, weight, offsets, scaling).to(x.dtype)
    return (y.float() * row_scale.float()[:, None]).to(x.dtype)


@grouped_linear_row_scaled_fp8_op.register_fake
def _grouped_linear_row_scaled_fp8_fake(x, weight, offsets, row_scale, scaling,
                                        cache_weight=False, fast_accum=False,
                                        weight_base=None):
    _check(x, weight, offsets, scaling, fast_accum=fast_accum)
    check_row_scaled_args(x, weight, offsets, row_scale)
    return x.new_empty((x.shape[0], weight.shape[1]))


def _setup_row_scaled_context(ctx, inputs, output) -> None:
    x, weight, offsets, row_scale, scaling, cache_weight, fast_accum, _ = inputs
    ctx.save_for_backward(x, weight, offsets, row_scale)
    ctx.batch_invariant = BATCH_INVARIANT.enabled()
    ctx.scaling, ctx.cache_weight, ctx.fast_accum = scaling, cache_weight, fast_accum


def _grouped_linear_row_scaled_fp8_backward(ctx, grad):
    """dX in fp8 (unscaled, then times the row scale), the scale's gradient as a sum over K
    of that fp8 dX with x, dW in x's dtype (:func:`.scaled.row_scaled_backward`)."""
    with forward_mode(ctx):
        x, weight, offsets, row_scale = ctx.saved_tensors
        dx, dw, _, ds = row_scaled_backward(
            grad, x, weight, offsets, row_scale, ctx.needs_input_grad[:4],
            lambda: grouped_linear_fp8_dx_op(grad, weight, offsets, ctx.scaling,
                                             ctx.cache_weight, ctx.fast_accum))
    return dx, dw, None, ds, None, None, None, None


backends.register_autograd(grouped_linear_row_scaled_fp8_op,
                           _grouped_linear_row_scaled_fp8_backward, _setup_row_scaled_context)


@custom_op("grouped_linear_swiglu_fp8_with_preact", tags=_CUDAGRAPH_UNSAFE)
def grouped_linear_swiglu_fp8_with_preact_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, scaling: str,
    cache_weight: bool = False, fast_accum: bool = False,
    weight_base: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ``[G, 2H, K]`` (gate rows first) -> ``(silu(gate) * up [M, H], preact [M,
    2H])``, fp8 with ``scaling``; ``preact`` in x's dtype, for the backward."""
    _check(x, weight, offsets, scaling, swiglu=True, fast_accum=fast_accum)
    check_offsets_eagerly(offsets, x.shape[0])
    if use_triton("grouped_linear_swiglu_fp8_with_preact", x):
        preact = x.new_empty((x.shape[0], weight.shape[1]))
        out = _product(x, weight, offsets, scaling, swiglu=True, preact=preact,
                       cache_weight=cache_weight, weight_base=weight_base,
                       fast_accum=fast_accum)
        return out, preact
    pre = _reference(x, weight, offsets, scaling)
    gate, up = pre.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype), pre.to(x.dtype)


@grouped_linear_swiglu_fp8_with_preact_op.register_fake
def _grouped_linear_swiglu_fp8_with_preact_fake(x, weight, offsets, scaling,
                                                cache_weight=False, fast_accum=False,
                                                weight_base=None):
    _check(x, weight, offsets, scaling, swiglu=True, fast_accum=fast_accum)
    return (x.new_empty((x.shape[0], weight.shape[1] // 2)),
            x.new_empty((x.shape[0], weight.shape[1])))


def _setup_preact_context(ctx, inputs, output) -> None:
    x, weight, offsets, scaling, cache_weight, fast_accum, _ = inputs
    keep_for_backward(ctx, (x, weight, offsets, None), output[1])
    ctx.scaling, ctx.cache_weight, ctx.fast_accum = scaling, cache_weight, fast_accum
    ctx.mark_non_differentiable(output[1])


def _swiglu_fp8_backward(ctx, grad, _grad_preact):
    with forward_mode(ctx):
        x, weight, offsets, _, preact = ctx.saved_tensors
        return _fp8_linear_backward(ctx, swiglu_derivative(preact, grad), x, weight, offsets)


backends.register_autograd(grouped_linear_swiglu_fp8_with_preact_op, _swiglu_fp8_backward,
                           _setup_preact_context)
