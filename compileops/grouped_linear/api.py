"""The grouped linear's public functions: :func:`grouped_linear`, :func:`grouped_linear_splits`,
:func:`grouped_linear_swiglu` and :func:`splits_to_offsets` (re-exported as
``compileops.grouped_linear`` and friends). They check what the ops' schemas cannot (Python
types, options that need each other) and pick the op: bf16/fp16/fp32 (:mod:`.op`), row-scaled
(:mod:`.scaled`) or fp8 (:mod:`.fp8_op`).
"""
from __future__ import annotations

import torch

from compileops._library import require_tensors
from compileops.grouped_linear.checks import (
    assert_split_values_on_device,
    check_row_scale,
    check_splits,
    check_splits_eagerly,
)
from compileops.grouped_linear.fp8_op import (
    check_recipe,
    forward_weight_copy,
    grouped_linear_fp8_op,
    grouped_linear_row_scaled_fp8_op,
    grouped_linear_swiglu_fp8_with_preact_op,
)
from compileops.grouped_linear.op import (
    grouped_linear_op,
    grouped_linear_swiglu_op,
    grouped_linear_swiglu_with_preact_op,
)
from compileops.grouped_linear.pair_op import (
    grouped_linear_swiglu_pair_op,
    grouped_linear_swiglu_pair_with_preact_op,
)
from compileops.grouped_linear.scaled import row_scaled_grouped_linear


#: What a non-tensor ``offsets`` most likely meant.
_OFFSETS_HINT = {"offsets": " (cumulative end rows, int32, on x's device; per-group row "
                            "counts go to grouped_linear_splits, or through splits_to_offsets)"}


def _check_tensor_args(x, weight, offsets) -> None:
    require_tensors((("x", x), ("weight", weight), ("offsets", offsets)), _OFFSETS_HINT)


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
                   cache_fp8_weights=False, fp8_fast_accum=False, fp8_weight_grad=False):
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
    ``fp8_weight_grad=True`` (with ``"rowwise"``; off by default): dW in e4m3 too, x and the
    output's gradient quantised with one scale per expert and column: a relative error of
    about 3.7e-2, where dW from the 16-bit operands has 1.7e-3 as a bf16 gradient and 1e-7 as
    an fp32 one (unit-normal data; :mod:`compileops.grouped_linear.fp8_wgrad_op`), for a cheaper
    weight-gradient product that only pays with many rows per expert: the compiled MoE layer
    (fw+bw, H100) ran 1.03x faster with it at 2048 rows per expert, 0.96x at 1024 and 0.76-0.84x
    at 512, with 0.2-0.5 GiB more peak memory (``benchmarks/RESULTS.md``).
    """
    _check_tensor_args(x, weight, offsets)
    if fp8 is not None:
        check_recipe(fp8, bias, fast_accum=fp8_fast_accum, weight_grad=fp8_weight_grad)
        copy = forward_weight_copy(x, weight, fp8, cache_fp8_weights)
        if row_scale is not None:
            check_row_scale(x, row_scale)
            return grouped_linear_row_scaled_fp8_op(x, weight, offsets, row_scale.to(x.dtype),
                                                    fp8, bool(cache_fp8_weights),
                                                    bool(fp8_fast_accum), None, *copy,
                                                    bool(fp8_weight_grad))
        return grouped_linear_fp8_op(x, weight, offsets, fp8, bool(cache_fp8_weights),
                                     bool(fp8_fast_accum), None, *copy, bool(fp8_weight_grad))
    check_fp8_options(cache_fp8_weights, fp8_fast_accum, fp8_weight_grad)
    if row_scale is not None:
        return row_scaled_grouped_linear(x, weight, offsets, bias, row_scale)
    return grouped_linear_op(x, weight, offsets, bias)


def grouped_linear_splits(x, weight, m_splits, bias=None, *, fp8=None,
                          cache_fp8_weights=False, fp8_fast_accum=False,
                          fp8_weight_grad=False):
    """:func:`grouped_linear` with per-group row counts ``m_splits`` ``[G]`` (a device tensor;
    ``fp8``, ``cache_fp8_weights``, ``fp8_fast_accum`` and ``fp8_weight_grad`` as there).

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
                              fp8_fast_accum=fp8_fast_accum, fp8_weight_grad=fp8_weight_grad)
    check_fp8_options(cache_fp8_weights, fp8_fast_accum, fp8_weight_grad)
    return grouped_linear_op(x, weight, offsets, bias)


def check_fp8_options(cache_fp8_weights=False, fp8_fast_accum=False,
                      fp8_weight_grad=False) -> None:
    """A clear error for fp8-only options where no fp8 recipe is asked for."""
    if cache_fp8_weights:
        raise ValueError("cache_fp8_weights=True caches the fp8 copies of the weights: it "
                         "needs fp8='rowwise' or 'blockwise'")
    if fp8_fast_accum:
        raise ValueError("fp8_fast_accum=True chooses how the fp8 products accumulate: it "
                         "needs fp8='rowwise'")
    if fp8_weight_grad:
        raise ValueError("fp8_weight_grad=True computes the weight gradient in fp8: it needs "
                         "fp8='rowwise'")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def grouped_linear_swiglu(x, weight, offsets, bias=None, *, up_weight=None, recompute=False,
                          fp8=None, cache_fp8_weights=False, fp8_fast_accum=False,
                          fp8_weight_grad=False):
    """``silu(gate) * up`` of a fused gate/up grouped projection: weight ``[G, 2H, K]``
    (gate rows first, then up) -> ``[M, H]``. Same as ``reference.swiglu(grouped_linear(...))``
    in one kernel.

    ``up_weight`` ``[G, H, K]``: the gate and up projections kept as two weights (``weight``
    is then the gate's, ``[G, H, K]``), as torchtitan's experts and several Hugging Face
    models store them. The kernel reads both where they are: the result, its gradients and
    their bits are those of ``weight=torch.cat([weight, up_weight], 1)`` (dX's bits when the
    kernel's K step divides H; otherwise within a last bit of them), without that
    ``[G, 2H, K]`` copy in every forward and the split of its gradient in every backward.
    No bias and no fp8 with ``up_weight`` (each raises a ``ValueError``). On an H200 (bf16, the
    whole MoE layer compiled at Mixtral-8x7B's shape) it runs at the concatenated weight's
    speed, 1.00-1.03x ``torch._grouped_mm`` forward and forward + backward
    (``benchmarks/RESULTS.md``). Compiled, ``silu(grouped_linear(x, w_gate, offsets)) *
    grouped_linear(x, w_up, offsets)`` becomes this call (``lowerings/user_patterns.py``).

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
    gradient). ``cache_fp8_weights``, ``fp8_fast_accum`` and ``fp8_weight_grad``: as in
    :func:`grouped_linear`.
    """
    _check_tensor_args(x, weight, offsets)
    if up_weight is not None:
        if fp8 is None:
            check_fp8_options(cache_fp8_weights, fp8_fast_accum, fp8_weight_grad)
        return _swiglu_pair(x, weight, up_weight, offsets, bias, recompute, fp8)
    if fp8 is not None:
        check_recipe(fp8, bias, fast_accum=fp8_fast_accum, weight_grad=fp8_weight_grad,
                     recompute=recompute)
        return grouped_linear_swiglu_fp8_with_preact_op(
            x, weight, offsets, fp8, bool(cache_fp8_weights), bool(fp8_fast_accum), None,
            *forward_weight_copy(x, weight, fp8, cache_fp8_weights),
            bool(fp8_weight_grad))[0]
    check_fp8_options(cache_fp8_weights, fp8_fast_accum, fp8_weight_grad)
    if recompute or not _needs_grad(x, weight, bias):
        return grouped_linear_swiglu_op(x, weight, offsets, bias)
    return grouped_linear_swiglu_with_preact_op(x, weight, offsets, bias)[0]


def _swiglu_pair(x, w_gate, w_up, offsets, bias, recompute, fp8):
    """:func:`grouped_linear_swiglu` with ``up_weight``: the pair op (:mod:`.pair_op`)."""
    require_tensors((("up_weight", w_up),))
    if bias is not None:
        raise ValueError("grouped_linear_swiglu takes no bias with up_weight (gate and up as "
                         "two weights); pass the concatenated [G, 2H, K] weight with its "
                         "[G, 2H] bias instead")
    if fp8 is not None:
        raise ValueError("grouped_linear_swiglu has no fp8 form with up_weight (gate and up as "
                         "two weights) yet; pass the concatenated [G, 2H, K] weight for fp8")
    if recompute or not _needs_grad(x, w_gate, w_up):
        return grouped_linear_swiglu_pair_op(x, w_gate, w_up, offsets)
    return grouped_linear_swiglu_pair_with_preact_op(x, w_gate, w_up, offsets)[0]
