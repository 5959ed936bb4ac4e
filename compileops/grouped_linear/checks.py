"""Argument checks of the grouped linear ops, shared by both backends and the fake functions.

The reference (``reference.py``) is only the math; the ops (``op.py``) validate their
arguments here before either backend runs. Being separate, these are tested on their own
(``tests/grouped_linear/test_checks.py``).

Shape, dtype and device preconditions use ``torch._check*``, so they hold in the fake
functions too. The data-dependent offset checks (non-decreasing, within ``[0, M]``) read the
offsets on the host: :func:`check_offsets_eagerly` runs them on CPU tensors (free there)
and on CUDA only in strict mode (:mod:`compileops.modes`, one device sync per call), never
while compiling. The kernels clamp offsets, so bad values never access memory out of
bounds; the output for them is unspecified.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import check_dim, check_same_device
from compileops.modes import STRICT_OFFSET_CHECKS

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the Triton kernels'


def check_common(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
    """x ``[M, K]`` bf16/fp16/fp32/fp64 (fp64: the reference backend), weight ``[G, N, K]`` of x's dtype, offsets int32 ``[G]``,
    all on one device."""
    check_dim(x, 2, "x", "[M, K]")
    check_dim(weight, 3, "weight", "[G, N, K]")
    check_dim(offsets, 1, "offsets", "[G] (cumulative end row of each group)")
    torch._check_type(x.dtype in DTYPES,
                      lambda: f"x must be bf16, fp16, fp32 or fp64, got {x.dtype}")
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


def check_bias(bias: Optional[torch.Tensor], weight: torch.Tensor, x: torch.Tensor) -> None:
    """bias ``[G, N]`` in x's dtype on x's device, or None."""
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


def check_forward_args(x, weight, offsets, bias, swiglu: bool = False) -> None:
    """The forward ops' preconditions; ``swiglu`` also needs an even N (gate and up halves)."""
    check_common(x, weight, offsets)
    check_bias(bias, weight, x)
    if swiglu:
        torch._check_value(
            weight.shape[1] % 2 == 0,
            lambda: f"grouped_linear_swiglu needs an even N (gate and up halves), got N = "
            f"{weight.shape[1]}",
        )


def check_dx_args(grad, weight, offsets) -> None:
    """grad ``[M, N]`` matching weight ``[G, N, K]``, plus :func:`check_common`."""
    check_dim(grad, 2, "grad", "[M, N]")
    torch._check_value(
        weight.dim() == 3 and grad.shape[1] == weight.shape[1],
        lambda: f"grad [M, N] = {tuple(grad.shape)} does not match weight [G, N, K] = "
        f"{tuple(weight.shape)}",
    )
    check_common(grad.new_empty((grad.shape[0], weight.shape[2])), weight, offsets)


def check_wgrad_args(grad, x, offsets) -> None:
    """grad ``[M, N]`` and x ``[M, K]`` with the same rows, offsets int32 ``[G]``, one device."""
    check_dim(grad, 2, "grad", "[M, N]")
    check_dim(x, 2, "x", "[M, K]")
    check_dim(offsets, 1, "offsets", "[G]")
    torch._check_value(
        grad.shape[0] == x.shape[0],
        lambda: f"grad has {grad.shape[0]} rows but x has {x.shape[0]}",
    )
    torch._check_type(offsets.dtype == torch.int32, lambda: "offsets must be int32")
    check_same_device([("grad", grad), ("x", x), ("offsets", offsets)])


def check_offset_values(offsets: torch.Tensor, m: int) -> None:
    """Raise ``ValueError`` if offsets decrease, are negative or exceed ``m`` (reads them on
    the host: a device sync on GPUs, so only run eagerly on CPU or when asked to)."""
    if offsets.numel() == 0:
        return
    o = offsets.detach().to("cpu", torch.int64)
    if bool((o < 0).any()):
        raise ValueError(f"grouped_linear: offsets must be >= 0, got {o.tolist()}")
    if bool((o[1:] < o[:-1]).any()):
        raise ValueError(
            "grouped_linear: offsets must be non-decreasing (cumulative end rows), got "
            f"{o.tolist()}"
        )
    if int(o[-1]) > m:
        raise ValueError(
            f"grouped_linear: offsets[-1] = {int(o[-1])} exceeds the number of rows M = {m}"
        )


def check_offsets_eagerly(offsets: torch.Tensor, m: int) -> None:
    """:func:`check_offset_values` where it is cheap or asked for: always on CPU tensors, on
    other devices only with strict offset checks on, never while compiling."""
    if torch.compiler.is_compiling():
        return
    if offsets.device.type == "cpu" or STRICT_OFFSET_CHECKS.enabled():
        check_offset_values(offsets, m)


def check_kernel_dtype(op: str, t: torch.Tensor) -> None:
    """The Triton kernels take bf16, fp16 and fp32; fp64 (the ground truth of the numerical
    contract) runs on the reference backend only, and the error says how to get it."""
    torch._check_type(
        t.dtype in KERNEL_DTYPES,
        lambda: f"compileops::{op}: the triton backend runs bf16, fp16 and fp32, got {t.dtype}; "
        "fp64 runs on the reference backend: with compileops.use_backend('reference'): ...",
    )
