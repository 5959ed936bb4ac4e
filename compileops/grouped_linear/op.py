"""The grouped linear custom ops (MoE grouped GEMM).

* ``compileops::grouped_linear(x [M, K], weight [G, N, K], offsets int32 [G], bias [G, N]?)
  -> [M, N]``
* ``compileops::grouped_linear_swiglu(x, weight [G, 2H, K], offsets, bias [G, 2H]?) -> [M, H]``:
  ``silu(gate) * up`` over the two halves of a fused gate/up projection, in one kernel.
* ``compileops::grouped_linear_dx(grad [M, N], weight, offsets) -> [M, K]``
* ``compileops::grouped_linear_wgrad(grad [M, N], x [M, K], offsets, weight_dtype, bias_dtype,
  with_db=True) -> (dW [G, N, K], db [G, N])``: K-jagged, deterministic (no split-K, no
  atomics). ``with_db=False`` (a layer without a trainable bias) skips the column sums and
  returns an empty ``db [G, 0]``.

All functional; the backward of the forward ops is made of the last two, so the compiled
backward graph holds compileops ops too.

Offset checks. Shape, dtype and device preconditions are checked in the fake functions
and eagerly (``torch._check*``). The data-dependent ones (offsets non-decreasing, within
``[0, M]``) read the offsets: they run eagerly on CPU tensors (free there), and on CUDA only
after :func:`set_strict_offset_checks` (one host sync per call; off by default so CUDA graph
capture works). The kernels clamp offsets, so bad values never access memory out of bounds;
the output for them is unspecified.

Precision (axis B): fp32 accumulation, one rounding to the output dtype; fp32 inputs use TF32
when ``torch.backends.cuda.matmul.allow_tf32`` is set. Tested tolerance vs fp64: relative
error 1e-5 (fp32, IEEE), 1e-2 (bf16), 2e-3 (fp16).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from compileops import backends
from compileops._library import check_dim, check_same_device, custom_op
from compileops.grouped_linear import reference

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_strict_checks = False
_batch_invariant = False


def set_strict_offset_checks(enabled: bool) -> None:
    """Opt-in: validate offset values on the host before every eager call on CUDA (a sync)."""
    global _strict_checks
    _strict_checks = bool(enabled)


def is_batch_invariant() -> bool:
    return _batch_invariant


def set_batch_invariant(enabled: bool) -> None:
    """Batch-invariant mode: one fixed tile config for the row-wise products (forward, dX,
    SwiGLU), so a row's output never depends on other rows or on group sizes. Read when a
    kernel launches eagerly and when Inductor lowers (set it before compiling)."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    previous = _batch_invariant
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)


def _check_common(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    check_dim(x, 2, "x", "[M, K]")
    check_dim(weight, 3, "weight", "[G, N, K]")
    check_dim(offsets, 1, "offsets", "[G] (cumulative end row of each group)")
    torch._check_type(x.dtype in DTYPES, lambda: f"x must be bf16, fp16 or fp32, got {x.dtype}")
    torch._check_type(
        weight.dtype == x.dtype,
        lambda: f"weight dtype {weight.dtype} must match x dtype {x.dtype}",
    )
    torch._check_type(
        offsets.dtype == torch.int32,
        lambda: f"offsets must be int32 (cumulative end rows), got {offsets.dtype}",
    )
    torch._check_value(
        offsets.shape[0] == weight.shape[0],
        lambda: f"offsets must have one entry per group: got {offsets.shape[0]} offsets "
        f"for {weight.shape[0]} groups (weight [G, N, K] = {tuple(weight.shape)})",
    )
    torch._check_value(
        x.shape[1] == weight.shape[2],
        lambda: f"mismatched K: x is [M, K] = {tuple(x.shape)} but weight is [G, N, K] = "
        f"{tuple(weight.shape)}",
    )
    check_same_device([("x", x), ("weight", weight), ("offsets", offsets)])


def _check_bias(bias: Optional[torch.Tensor], weight: torch.Tensor, x: torch.Tensor) -> None:
    if bias is None:
        return
    torch._check_value(
        bias.dim() == 2 and bias.shape[0] == weight.shape[0] and bias.shape[1] == weight.shape[1],
        lambda: f"bias must be [G, N] = [{weight.shape[0]}, {weight.shape[1]}], "
        f"got {tuple(bias.shape)}",
    )
    torch._check_type(
        bias.dtype == x.dtype, lambda: f"bias dtype {bias.dtype} must match x dtype {x.dtype}"
    )
    check_same_device([("x", x), ("bias", bias)])


def check_forward_args(x, weight, offsets, bias) -> None:
    _check_common(x, weight, offsets)
    _check_bias(bias, weight, x)


def _check_offset_values(offsets: torch.Tensor, m: int) -> None:
    """Eager value checks: always on CPU, on CUDA only in strict mode, never while compiling."""
    if torch.compiler.is_compiling():
        return
    if offsets.device.type == "cpu" or _strict_checks:
        reference.check_offsets_values(offsets, m)


def _use_triton(op: str, device: torch.device) -> bool:
    return backends.select(op, device) == "triton"


# ---------------------------------------------------------------------------------------
# Forward


def _check_swiglu_n(weight) -> None:
    torch._check_value(
        weight.shape[1] % 2 == 0,
        lambda: f"grouped_linear_swiglu needs an even N (gate and up halves), got N = {weight.shape[1]}",
    )


def _check_forward(x, weight, offsets, bias, swiglu: bool) -> None:
    """Shape/dtype/device checks shared by the eager ops and their fake functions."""
    check_forward_args(x, weight, offsets, bias)
    if swiglu:
        _check_swiglu_n(weight)


def _forward_fake(x, weight, offsets, bias, swiglu: bool) -> torch.Tensor:
    _check_forward(x, weight, offsets, bias, swiglu)
    n = weight.shape[1] // 2 if swiglu else weight.shape[1]
    return x.new_empty((x.shape[0], n))


def _forward(x, weight, offsets, bias, swiglu: bool) -> torch.Tensor:
    """Eager forward of both ops: the same checks as the fake, then the chosen backend."""
    _check_forward(x, weight, offsets, bias, swiglu)
    _check_offset_values(offsets, x.shape[0])
    name = "grouped_linear_swiglu" if swiglu else "grouped_linear"
    if _use_triton(name, x.device):
        from compileops.grouped_linear import kernels

        fn = kernels.grouped_linear_swiglu_forward if swiglu else kernels.grouped_linear_forward
        return fn(x, weight, offsets, bias, batch_invariant=_batch_invariant)
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


def _setup_context(ctx, inputs, output) -> None:
    x, weight, offsets, bias = inputs
    ctx.save_for_backward(x, weight, offsets, bias)
    ctx.has_bias = bias is not None


def _grouped_linear_backward(ctx, grad):
    x, weight, offsets, bias = ctx.saved_tensors
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


grouped_linear_op.register_autograd(_grouped_linear_backward, setup_context=_setup_context)


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


def _swiglu_backward(ctx, grad):
    # Recompute the pre-activation [M, 2H] (one more grouped GEMM; saves M x 2H of memory),
    # then the SwiGLU derivative (pointwise, fused by Inductor) and the linear backward.
    x, weight, offsets, bias = ctx.saved_tensors
    h = grouped_linear_op(x, weight, offsets, bias).float()
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    g = grad.float()
    d_gate = g * up * sig * (1 + gate * (1 - sig))
    d_up = g * gate * sig
    dh = torch.cat([d_gate, d_up], dim=-1).to(grad.dtype)
    return _grouped_linear_backward(ctx, dh)


grouped_linear_swiglu_op.register_autograd(_swiglu_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# Backward ops


def check_dx_args(grad, weight, offsets) -> None:
    check_dim(grad, 2, "grad", "[M, N]")
    torch._check_value(
        weight.dim() == 3 and grad.shape[1] == weight.shape[1],
        lambda: f"grad [M, N] = {tuple(grad.shape)} does not match weight [G, N, K] = "
        f"{tuple(weight.shape)}",
    )
    _check_common(grad.new_empty((grad.shape[0], weight.shape[2])), weight, offsets)


@custom_op("grouped_linear_dx")
def grouped_linear_dx_op(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad ``[M, N]`` -> ``dX [M, K]``: ``dX_g = grad_g @ W_g`` (weight untransposed)."""
    check_dx_args(grad, weight, offsets)
    if _use_triton("grouped_linear_dx", grad.device):
        from compileops.grouped_linear import kernels

        return kernels.grouped_linear_dx(grad, weight, offsets, batch_invariant=_batch_invariant)
    return reference.grouped_linear_dx(grad, weight, offsets)


@grouped_linear_dx_op.register_fake
def _grouped_linear_dx_fake(grad, weight, offsets):
    check_dx_args(grad, weight, offsets)
    return grad.new_empty((grad.shape[0], weight.shape[2]))


def check_wgrad_args(grad, x, offsets) -> None:
    check_dim(grad, 2, "grad", "[M, N]")
    check_dim(x, 2, "x", "[M, K]")
    check_dim(offsets, 1, "offsets", "[G]")
    torch._check_value(
        grad.shape[0] == x.shape[0],
        lambda: f"grad has {grad.shape[0]} rows but x has {x.shape[0]}",
    )
    torch._check_type(offsets.dtype == torch.int32, lambda: "offsets must be int32")
    check_same_device([("grad", grad), ("x", x), ("offsets", offsets)])


@custom_op("grouped_linear_wgrad")
def grouped_linear_wgrad_op(
    grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
    weight_dtype: torch.dtype, bias_dtype: torch.dtype, with_db: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dW [G, N, K] = grad_g^T x_g, db [G, N] = colsum grad_g)``; empty groups give zeros.
    ``with_db=False``: ``db`` is an empty ``[G, 0]`` tensor and no column sums are computed
    (on the GPU they cost 2-5% of the dW kernel's time; see benchmarks/RESULTS.md)."""
    check_wgrad_args(grad, x, offsets)
    if _use_triton("grouped_linear_wgrad", grad.device):
        from compileops.grouped_linear import kernels

        dw, db = kernels.grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype,
                                              compute_db=with_db)
    else:
        dw, db = reference.grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype,
                                                with_db)
    return dw, db if with_db else _no_db(grad, offsets, bias_dtype)


def _no_db(grad, offsets, bias_dtype) -> torch.Tensor:
    return grad.new_empty((offsets.shape[0], 0), dtype=bias_dtype)


@grouped_linear_wgrad_op.register_fake
def _grouped_linear_wgrad_fake(grad, x, offsets, weight_dtype, bias_dtype, with_db=True):
    check_wgrad_args(grad, x, offsets)
    groups, n, k = offsets.shape[0], grad.shape[1], x.shape[1]
    db = (grad.new_empty((groups, n), dtype=bias_dtype) if with_db
          else _no_db(grad, offsets, bias_dtype))
    return grad.new_empty((groups, n, k), dtype=weight_dtype), db


# ---------------------------------------------------------------------------------------
# Public functions


def splits_to_offsets(m_splits: torch.Tensor) -> torch.Tensor:
    """Per-group row counts ``[G]`` -> int32 cumulative end rows ``[G]``, on the device."""
    if not isinstance(m_splits, torch.Tensor):
        m_splits = torch.tensor(list(m_splits), dtype=torch.int64)
    return torch.cumsum(m_splits, 0, dtype=torch.int32)


def grouped_linear(x, weight, offsets, bias=None):
    """Grouped linear: ``y[rows of g] = x[rows of g] @ weight[g].T + bias[g]``.

    x ``[M, K]``; weight ``[G, N, K]``; offsets int32 ``[G]``: cumulative end row of each group
    (kept on the device, never read on the host on CUDA); bias ``[G, N]`` or None.
    Returns ``[M, N]`` in x's dtype; rows past ``offsets[-1]`` are exactly zero.
    """
    return grouped_linear_op(x, weight, offsets, bias)


def grouped_linear_splits(x, weight, m_splits, bias=None):
    """:func:`grouped_linear` with per-group row counts ``m_splits`` ``[G]`` (a device tensor)."""
    return grouped_linear_op(x, weight, splits_to_offsets(m_splits).to(x.device), bias)


def grouped_linear_swiglu(x, weight, offsets, bias=None):
    """``silu(gate) * up`` of a fused gate/up grouped projection: weight ``[G, 2H, K]`` ->
    ``[M, H]``. Same as ``reference.swiglu(grouped_linear(...))`` in one kernel."""
    return grouped_linear_swiglu_op(x, weight, offsets, bias)
