"""The grouped linear custom ops (MoE grouped GEMM).

* ``compileops::grouped_linear(x [M, K], weight [G, N, K], offsets int32 [G], bias [G, N]?)
  -> [M, N]``
* ``compileops::grouped_linear_swiglu(x, weight [G, 2H, K], offsets, bias [G, 2H]?) -> [M, H]``:
  ``silu(gate) * up`` over the two halves of a fused gate/up projection, in one kernel.
* ``compileops::grouped_linear_row_scaled(x, weight, offsets, row_scale [M]) -> [M, N]``: the
  forward with each output row times its scale (in x's dtype), in one kernel; the MoE down
  projection times the router probability (its autograd: ``scaled.py``).
* ``compileops::grouped_linear_dx(grad [M, N], weight, offsets) -> [M, K]``
* ``compileops::grouped_linear_wgrad(grad [M, N], x [M, K], offsets, weight_dtype, bias_dtype,
  with_db=True) -> (dW [G, N, K], db [G, N])``: K-jagged, deterministic (no split-K, no
  atomics). ``with_db=False`` (a layer without a trainable bias) skips the column sums and
  returns an empty ``db [G, 0]``.

All functional; the backward of the forward ops is made of the last two, so the compiled
backward graph holds compileops ops too.

Checks (``checks.py``): shape, dtype and device preconditions run in the fake functions and
eagerly; the data-dependent offset checks run eagerly on CPU tensors, and on CUDA only with
strict offset checks on (:func:`compileops.strict_offset_checks`, one host sync per call; off
by default so CUDA graph capture works). Batch-invariant mode
(:func:`compileops.batch_invariant`) fixes the tile config of the row-wise products.

Precision (axis B): fp32 accumulation, one rounding to the output dtype; fp32 inputs use TF32
when ``torch.backends.cuda.matmul.allow_tf32`` is set. Tested tolerance vs fp64: relative
error 1e-5 (fp32, IEEE), 1e-2 (bf16), 2e-3 (fp16).
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.grouped_linear import reference
from compileops.grouped_linear.checks import (
    assert_split_values_on_device,
    check_dx_args,
    check_forward_args,
    check_kernel_dtype,
    check_offsets_eagerly,
    check_row_scaled_args,
    check_splits,
    check_splits_eagerly,
    check_wgrad_args,
)
from compileops.modes import BATCH_INVARIANT


def _use_triton(op: str, t: torch.Tensor) -> bool:
    """Whether ``op`` runs its Triton kernel on ``t``'s device; refuses fp64 there (a clear
    error naming the reference backend)."""
    if backends.select(op, t.device) != "triton":
        return False
    check_kernel_dtype(op, t)
    return True


# ---------------------------------------------------------------------------------------
# Forward


def _forward_fake(x, weight, offsets, bias, swiglu: bool) -> torch.Tensor:
    check_forward_args(x, weight, offsets, bias, swiglu)
    n = weight.shape[1] // 2 if swiglu else weight.shape[1]
    return x.new_empty((x.shape[0], n))


def _forward(x, weight, offsets, bias, swiglu: bool) -> torch.Tensor:
    """Eager forward of both ops: the same checks as the fake, then the chosen backend."""
    check_forward_args(x, weight, offsets, bias, swiglu)
    check_offsets_eagerly(offsets, x.shape[0])
    name = "grouped_linear_swiglu" if swiglu else "grouped_linear"
    if _use_triton(name, x):
        from compileops.grouped_linear import kernels

        fn = kernels.grouped_linear_swiglu_forward if swiglu else kernels.grouped_linear_forward
        return fn(x, weight, offsets, bias, batch_invariant=BATCH_INVARIANT.enabled())
    fn = reference.grouped_linear_swiglu_forward if swiglu else reference.grouped_linear_forward
    return fn(x, weight, offsets, bias)



@custom_op("grouped_linear")
def grouped_linear_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, bias ``[G, N]`` -> ``[M, N]``."""
    return _forward(x, weight, offsets, bias, swiglu=False)


@grouped_linear_op.register_fake
def _grouped_linear_fake(x, weight, offsets, bias=None):
    return _forward_fake(x, weight, offsets, bias, swiglu=False)


def _keep_for_backward(ctx, inputs, *extra: torch.Tensor) -> None:
    """Save ``x, weight, offsets, bias`` (and ``extra`` tensors) and the forward's mode."""
    x, weight, offsets, bias = inputs
    ctx.save_for_backward(x, weight, offsets, bias, *extra)
    ctx.has_bias = bias is not None
    # The modes are contextvars, and on CUDA the backward runs on autograd's device thread,
    # which does not see a `with compileops.batch_invariant():` of this thread: keep the mode.
    ctx.batch_invariant = BATCH_INVARIANT.enabled()


def _setup_context(ctx, inputs, output) -> None:
    _keep_for_backward(ctx, inputs)


def _forward_mode(ctx):
    """The batch-invariant mode the forward ran in (or the one set here), for the backward."""
    return BATCH_INVARIANT.override(ctx.batch_invariant or BATCH_INVARIANT.enabled())


def _grouped_linear_backward(ctx, grad):
    with _forward_mode(ctx):
        return _linear_backward(ctx, grad, *ctx.saved_tensors)


def _linear_backward(ctx, grad, x, weight, offsets, bias):
    """dX, dW, db of ``y = x W_g^T + b_g`` for the upstream gradient ``grad [M, N]``."""
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = grouped_linear_dx_op(grad, weight, offsets)
    with_db = ctx.has_bias and ctx.needs_input_grad[3]
    if ctx.needs_input_grad[1] or with_db:
        dw, db = grouped_linear_wgrad_op(
            grad, x, offsets, weight.dtype, bias.dtype if ctx.has_bias else grad.dtype, with_db
        )
        if not with_db:
            db = None
    return dx, dw, None, db


backends.register_autograd(grouped_linear_op, _grouped_linear_backward, _setup_context)


@custom_op("grouped_linear_swiglu")
def grouped_linear_swiglu_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """weight ``[G, 2H, K]`` (gate rows ``[:H]``, up rows ``[H:]``) ->
    ``silu(x W_gate^T + b_gate) * (x W_up^T + b_up)`` ``[M, H]``, in one kernel."""
    return _forward(x, weight, offsets, bias, swiglu=True)


@grouped_linear_swiglu_op.register_fake
def _grouped_linear_swiglu_fake(x, weight, offsets, bias=None):
    return _forward_fake(x, weight, offsets, bias, swiglu=True)


def _swiglu_derivative(preact: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d swiglu / d preact`` times ``grad [M, H]``: ``[M, 2H]`` (gate, then up) in grad's dtype,
    computed in fp32 (fp64 for fp64). Plain pointwise torch ops, so Inductor fuses them into one kernel."""
    acc = reference.compute_dtype(preact.dtype)
    gate, up = preact.to(acc).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    g = grad.to(acc)
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(grad.dtype)


def _swiglu_recompute_backward(ctx, grad):
    # recompute=True: the pre-activation [M, 2H] is recomputed (one more grouped GEMM).
    with _forward_mode(ctx):
        x, weight, offsets, bias = ctx.saved_tensors
        preact = grouped_linear_op(x, weight, offsets, bias)
        return _linear_backward(ctx, _swiglu_derivative(preact, grad), x, weight, offsets, bias)


backends.register_autograd(grouped_linear_swiglu_op, _swiglu_recompute_backward, _setup_context)


@custom_op("grouped_linear_swiglu_with_preact")
def grouped_linear_swiglu_with_preact_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training form of ``grouped_linear_swiglu``: ``(silu(gate) * up [M, H],
    preact [M, 2H])``, where ``preact = x W_g^T + b_g`` (rounded to x's dtype) is written by the
    same kernel for the backward, which then needs no GEMM of its own beyond dX and dW."""
    check_forward_args(x, weight, offsets, bias, True)
    check_offsets_eagerly(offsets, x.shape[0])
    if _use_triton("grouped_linear_swiglu_with_preact", x):
        from compileops.grouped_linear import kernels

        preact = x.new_empty((x.shape[0], weight.shape[1]))
        out = kernels.grouped_linear_swiglu_forward(
            x, weight, offsets, bias, batch_invariant=BATCH_INVARIANT.enabled(), preact=preact)
        return out, preact
    return reference.grouped_linear_swiglu_with_preact(x, weight, offsets, bias)


@grouped_linear_swiglu_with_preact_op.register_fake
def _grouped_linear_swiglu_with_preact_fake(x, weight, offsets, bias=None):
    out = _forward_fake(x, weight, offsets, bias, swiglu=True)
    return out, x.new_empty((x.shape[0], weight.shape[1]))


def _setup_preact_context(ctx, inputs, output) -> None:
    _, preact = output
    _keep_for_backward(ctx, inputs, preact)
    ctx.mark_non_differentiable(preact)


def _swiglu_saved_backward(ctx, grad, _grad_preact):
    with _forward_mode(ctx):
        x, weight, offsets, bias, preact = ctx.saved_tensors
        return _linear_backward(ctx, _swiglu_derivative(preact, grad), x, weight, offsets, bias)


backends.register_autograd(grouped_linear_swiglu_with_preact_op, _swiglu_saved_backward,
                           _setup_preact_context)


@custom_op("grouped_linear_row_scaled")
def grouped_linear_row_scaled_op(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, row_scale: torch.Tensor,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int32 ``[G]``, row_scale ``[M]`` in x's
    dtype -> ``[M, N]``: ``grouped_linear(x, weight, offsets) * row_scale[:, None]``, the same
    bits, in one kernel (the scale is applied per row as the tile leaves the GEMM).

    Compiled, the scale is an input of the template, loaded once per tile row: written as a
    product after the op, Inductor may inline the scale's producers (a gather by the routing
    order, the top-k normalisation) into the GEMM's epilogue, recomputed for every element.
    No autograd of its own: :mod:`compileops.grouped_linear.scaled` differentiates it."""
    check_row_scaled_args(x, weight, offsets, row_scale)
    check_offsets_eagerly(offsets, x.shape[0])
    if _use_triton("grouped_linear_row_scaled", x):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_forward(x, weight, offsets, row_scale=row_scale,
                                              batch_invariant=BATCH_INVARIANT.enabled())
    return reference.grouped_linear_row_scaled(x, weight, offsets, row_scale)


@grouped_linear_row_scaled_op.register_fake
def _grouped_linear_row_scaled_fake(x, weight, offsets, row_scale):
    check_row_scaled_args(x, weight, offsets, row_scale)
    return x.new_empty((x.shape[0], weight.shape[1]))


# ---------------------------------------------------------------------------------------
# Backward ops


@custom_op("grouped_linear_dx")
def grouped_linear_dx_op(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad ``[M, N]`` -> ``dX [M, K]``: ``dX_g = grad_g @ W_g`` (weight untransposed)."""
    check_dx_args(grad, weight, offsets)
    check_offsets_eagerly(offsets, grad.shape[0])
    if _use_triton("grouped_linear_dx", grad):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_dx(grad, weight, offsets,
                                         batch_invariant=BATCH_INVARIANT.enabled())
    return reference.grouped_linear_dx(grad, weight, offsets)


@grouped_linear_dx_op.register_fake
def _grouped_linear_dx_fake(grad, weight, offsets):
    check_dx_args(grad, weight, offsets)
    return grad.new_empty((grad.shape[0], weight.shape[2]))


@custom_op("grouped_linear_wgrad")
def grouped_linear_wgrad_op(
    grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
    weight_dtype: torch.dtype, bias_dtype: torch.dtype, with_db: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dW [G, N, K] = grad_g^T x_g, db [G, N] = colsum grad_g)``; empty groups give zeros.
    ``with_db=False``: ``db`` is an empty ``[G, 0]`` tensor and no column sums are computed."""
    check_wgrad_args(grad, x, offsets, weight_dtype, bias_dtype)
    check_offsets_eagerly(offsets, grad.shape[0])
    if _use_triton("grouped_linear_wgrad", grad):
        from compileops.grouped_linear import kernels

        dw, db = kernels.grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype,
                                              with_db=with_db)
    else:
        dw, db = reference.grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype,
                                                with_db)
    return dw, db if with_db else _no_db(grad, offsets, bias_dtype)


def _no_db(grad, offsets, bias_dtype) -> torch.Tensor:
    return grad.new_empty((offsets.shape[0], 0), dtype=bias_dtype)


@grouped_linear_wgrad_op.register_fake
def _grouped_linear_wgrad_fake(grad, x, offsets, weight_dtype, bias_dtype, with_db=True):
    check_wgrad_args(grad, x, offsets, weight_dtype, bias_dtype)
    groups, n, k = offsets.shape[0], grad.shape[1], x.shape[1]
    db = (grad.new_empty((groups, n), dtype=bias_dtype) if with_db
          else _no_db(grad, offsets, bias_dtype))
    return grad.new_empty((groups, n, k), dtype=weight_dtype), db


# ---------------------------------------------------------------------------------------
# Public functions


def _splits_tensor(m_splits) -> torch.Tensor:
    if isinstance(m_splits, torch.Tensor):
        return m_splits
    values = list(m_splits)  # (as_tensor keeps float values float, so the check sees them)
    return torch.as_tensor(values) if values else torch.zeros(0, dtype=torch.int32)


def splits_to_offsets(m_splits: torch.Tensor) -> torch.Tensor:
    """Per-group row counts ``[G]`` (an integer tensor, or a sequence of ints) -> int32
    cumulative end rows ``[G]``, on the device."""
    m_splits = _splits_tensor(m_splits)
    check_splits(m_splits)
    if m_splits.numel() == 0:  # no groups (a cumsum of nothing: its dtype is lost compiled)
        return torch.zeros(0, dtype=torch.int32, device=m_splits.device)
    return torch.cumsum(m_splits, 0, dtype=torch.int32)


def grouped_linear(x, weight, offsets, bias=None, *, row_scale=None, fp8=None,
                   cache_fp8_weights=False, fp8_fast_accum=False):
    """Grouped linear: ``y[rows of g] = x[rows of g] @ weight[g].T + bias[g]``.

    x ``[M, K]``; weight ``[G, N, K]``; offsets int32 ``[G]``: cumulative end row of each group
    (kept on the device, never read on the host on CUDA); bias ``[G, N]`` or None.
    Returns ``[M, N]`` in x's dtype; rows past ``offsets[-1]`` are exactly zero.

    ``row_scale`` ``[M]`` (floating; the MoE router probability of each routed row) multiplies
    row i of the output, after rounding to x's dtype: the same forward as ``grouped_linear(...)
    * row_scale[:, None].to(x.dtype)``, and compiled the product is the GEMM's epilogue either
    way. Without a bias, the backward is cheaper (:mod:`compileops.grouped_linear.scaled`): it
    keeps nothing ``[M, N]`` for the scale's gradient and takes it as a sum over K from the dX
    product, where the written-out product keeps the unscaled output and sums over N.

    ``fp8="rowwise"`` or ``"blockwise"`` (experimental; no bias): the forward and dX products
    in e4m3, with per-row scales or with DeepSeek-V3's ``1 x 128`` / ``128 x 128`` blocks; dW
    in x's dtype (:mod:`compileops.grouped_linear.fp8_op` for the numerics). With
    ``row_scale`` the scaling is the fp8 product's epilogue too, and the scale's gradient
    comes from the fp8 dX product (so it carries fp8's error). ``None``: no fp8. ``cache_fp8_weights=True``: the weight's e4m3 copies are
    made once per version of the weight and reused (:mod:`compileops.grouped_linear.fp8_cache`
    says when a copy is stale, and what the cache holds); otherwise every call quantises it.
    ``fp8_fast_accum=True`` (with ``"rowwise"``): the e4m3 products accumulate in the MMA's
    own reduced-precision sum over all of K, not one 128-wide step at a time into fp32:
    faster, at a small cost in error (measured in :mod:`compileops.grouped_linear.fp8_op`).
    """
    if fp8 is not None:
        from compileops.grouped_linear.checks import check_row_scale
        from compileops.grouped_linear.fp8_op import (
            check_recipe,
            grouped_linear_fp8_op,
            grouped_linear_row_scaled_fp8_op,
        )

        check_recipe(fp8, bias, fast_accum=fp8_fast_accum)
        if row_scale is not None:
            check_row_scale(x, row_scale)
            return grouped_linear_row_scaled_fp8_op(x, weight, offsets, row_scale.to(x.dtype),
                                                    fp8, bool(cache_fp8_weights),
                                                    bool(fp8_fast_accum))
        return grouped_linear_fp8_op(x, weight, offsets, fp8, bool(cache_fp8_weights),
                                     bool(fp8_fast_accum))
    check_fp8_options(cache_fp8_weights, fp8_fast_accum)
    if row_scale is not None:
        from compileops.grouped_linear.scaled import row_scaled_grouped_linear

        return row_scaled_grouped_linear(x, weight, offsets, bias, row_scale)
    return grouped_linear_op(x, weight, offsets, bias)


def grouped_linear_splits(x, weight, m_splits, bias=None, *, fp8=None,
                          cache_fp8_weights=False, fp8_fast_accum=False):
    """:func:`grouped_linear` with per-group row counts ``m_splits`` ``[G]`` (a device tensor;
    ``fp8``, ``cache_fp8_weights`` and ``fp8_fast_accum`` as there).

    ``m_splits`` must be integers >= 0 adding up to at most M. Their values are checked on
    the host, naming them, on CPU tensors and elsewhere with strict offset checks, when
    running eagerly; otherwise (CUDA without strict checks, and compiled) on the device with
    no host sync: a device-side assert on CUDA, a ``RuntimeError`` when compiled on CPU."""
    m_splits = _splits_tensor(m_splits)
    check_splits(m_splits, weight.shape[0] if weight.dim() == 3 else None)
    if not check_splits_eagerly(m_splits, x.shape[0]) and m_splits.numel():
        assert_split_values_on_device(m_splits, x.shape[0])
    offsets = splits_to_offsets(m_splits).to(x.device)
    if fp8 is not None:
        return grouped_linear(x, weight, offsets, bias, fp8=fp8,
                              cache_fp8_weights=cache_fp8_weights,
                              fp8_fast_accum=fp8_fast_accum)
    check_fp8_options(cache_fp8_weights, fp8_fast_accum)
    return grouped_linear_op(x, weight, offsets, bias)


def check_fp8_options(cache_fp8_weights=False, fp8_fast_accum=False) -> None:
    """A clear error for fp8-only options where no fp8 recipe is asked for."""
    if cache_fp8_weights:
        raise ValueError("cache_fp8_weights=True caches the fp8 copies of the weights: it "
                         "needs fp8='rowwise' or 'blockwise'")
    if fp8_fast_accum:
        raise ValueError("fp8_fast_accum=True chooses how the fp8 products accumulate: it "
                         "needs fp8='rowwise'")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def grouped_linear_swiglu(x, weight, offsets, bias=None, *, recompute=False, fp8=None,
                          cache_fp8_weights=False, fp8_fast_accum=False):
    """``silu(gate) * up`` of a fused gate/up grouped projection: weight ``[G, 2H, K]``
    (gate rows first, then up) -> ``[M, H]``. Same as ``reference.swiglu(grouped_linear(...))``
    in one kernel.

    Memory for compute, the user's choice:

    * ``recompute=False`` (default, training-grade): when a gradient is needed, the kernel
      also writes the pre-activations ``[M, 2H]`` in x's dtype and the backward keeps them,
      so it is the pointwise SwiGLU derivative plus dX and dW: no extra GEMM. Costs
      ``M * 2H * x.element_size()`` bytes held from forward to backward (Mixtral-8x7B, 16384
      routed rows, bf16: 0.94 GB per layer). Without a gradient (inference) nothing is stored.
    * ``recompute=True``: nothing beyond x is kept; the backward recomputes the pre-activations
      with one more ``[M, K] x [K, 2H]`` grouped GEMM. Measured on an H100 (bf16, whole MoE
      layer compiled, forward + backward): Mixtral-8x7B 34.0 ms against 30.2 ms (+13-15%),
      Qwen3-30B-A3B 8.0 against 7.3 ms (+8-9%). A single layer's peak memory is the same (the
      backward materialises ``[M, 2H]`` either way); the saving is the activation held from
      forward to backward in every layer. ``benchmarks/RESULTS.md`` ("MoE layer").

    Both give the same gradients up to the rounding of the stored pre-activations (bitwise
    when the two forwards use the same K blocking).

    ``fp8="rowwise"`` or ``"blockwise"`` (experimental; no bias, no ``recompute`` yet): the
    gate/up and dX products in e4m3 (:func:`grouped_linear`'s ``fp8``), dW in x's dtype; the
    pre-activations are kept as with ``recompute=False`` (and written even without a
    gradient). ``cache_fp8_weights`` and ``fp8_fast_accum``: as in :func:`grouped_linear`.
    """
    if fp8 is not None:
        from compileops.grouped_linear.fp8_op import (
            check_recipe,
            grouped_linear_swiglu_fp8_with_preact_op,
        )

        check_recipe(fp8, bias, fast_accum=fp8_fast_accum, recompute=recompute)
        return grouped_linear_swiglu_fp8_with_preact_op(x, weight, offsets, fp8,
                                                        bool(cache_fp8_weights),
                                                        bool(fp8_fast_accum))[0]
    check_fp8_options(cache_fp8_weights, fp8_fast_accum)
    if recompute or not _needs_grad(x, weight, bias):
        return grouped_linear_swiglu_op(x, weight, offsets, bias)
    return grouped_linear_swiglu_with_preact_op(x, weight, offsets, bias)[0]
