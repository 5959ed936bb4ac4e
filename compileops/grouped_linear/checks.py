"""Argument checks of the grouped linear ops, shared by both backends and the fake functions.

The reference (``reference.py``) is only the math; the ops (``op.py``) validate their
arguments here before either backend runs. Being separate, these are tested on their own
(``tests/grouped_linear/test_checks.py``).

Shape, dtype and device preconditions use ``torch._check*``, so they hold in the fake
functions too. The data-dependent offset checks (non-decreasing, within ``[0, M]``) read the
offsets on the host: :func:`check_offsets_eagerly` runs them on CPU tensors (free there)
and on CUDA only in strict mode (:mod:`compileops.modes`, one device sync per call), never
while compiling. The kernels clamp offsets, so bad values never access memory out of
bounds; the output for them is unspecified. ``m_splits`` values and the routing helpers'
expert ids and ``order`` follow the same rule (:func:`check_splits_eagerly`,
:func:`check_expert_id_values`, :func:`check_order_eagerly`); an ``order`` left unchecked on
the host is checked on the device instead (``routing.unpermute_and_combine``).

The checks of the public functions that Dynamo traces (``m_splits``, the routing helpers) are
plain raises (:func:`_require`), not ``torch._check``: see there.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from compileops._library import check_dim, check_same_device
from compileops.modes import host_value_checks

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
            lambda: f"grouped_linear_swiglu needs an even N in weight [G, 2H, K] (gate and up "
            f"halves), got N = {weight.shape[1]}",
        )


def check_pair_args(x, w_gate, w_up, offsets) -> None:
    """A gate/up pair kept as two weights: each ``[G, H, K]`` as :func:`check_common` wants
    it, and the two of one shape (named ``weight`` and ``up_weight``, as the public function
    takes them)."""
    check_common(x, w_gate, offsets)
    check_dim(w_up, 3, "up_weight", "[G, H, K]")
    torch._check_value(
        w_up.shape == w_gate.shape,
        lambda: f"up_weight [G, H, K] = {tuple(w_up.shape)} must have the gate weight's shape "
        f"{tuple(w_gate.shape)}",
    )
    torch._check_type(
        w_up.dtype == w_gate.dtype,
        lambda: f"up_weight dtype {w_up.dtype} must match the gate weight's {w_gate.dtype}",
    )
    check_same_device([("x", x), ("up_weight", w_up)])


def check_dx_pair_args(grad, w_gate, w_up, offsets) -> None:
    """grad ``[M, 2H]`` for the pair of ``[G, H, K]`` weights, plus :func:`check_dx_args`."""
    check_dim(grad, 2, "grad", "[M, 2H]")
    torch._check_value(
        w_gate.dim() == 3 and grad.shape[1] == 2 * w_gate.shape[1],
        lambda: f"grad [M, 2H] = {tuple(grad.shape)} does not match the gate/up weights [G, "
        f"H, K] = {tuple(w_gate.shape)}",
    )
    check_dx_args(grad[:, : w_gate.shape[1]], w_gate, offsets)
    check_pair_args(grad.new_empty((grad.shape[0], w_gate.shape[2])), w_gate, w_up, offsets)


def check_dx_args(grad, weight, offsets) -> None:
    """grad ``[M, N]`` matching weight ``[G, N, K]``, plus :func:`check_common`."""
    check_dim(grad, 2, "grad", "[M, N]")
    # grad's dtype and device are checked under its own name: check_common below sees a
    # stand-in for x made from grad, whose messages would name x.
    torch._check_type(grad.dtype in DTYPES,
                      lambda: f"grad must be bf16, fp16, fp32 or fp64, got {grad.dtype}")
    torch._check_type(
        weight.dtype == grad.dtype,
        lambda: f"weight dtype {weight.dtype} must match grad dtype {grad.dtype}",
    )
    check_same_device([("grad", grad), ("weight", weight), ("offsets", offsets)])
    torch._check_value(
        weight.dim() == 3 and grad.shape[1] == weight.shape[1],
        lambda: f"grad [M, N] = {tuple(grad.shape)} does not match weight [G, N, K] = "
        f"{tuple(weight.shape)}",
    )
    check_common(grad.new_empty((grad.shape[0], weight.shape[2])), weight, offsets)


def check_wgrad_args(grad, x, offsets, weight_dtype=None, bias_dtype=None) -> None:
    """grad ``[M, N]`` and x ``[M, K]`` of one floating dtype with the same rows, offsets
    int32 ``[G]``, one device; ``weight_dtype`` and ``bias_dtype`` (when given) floating."""
    check_dim(grad, 2, "grad", "[M, N]")
    check_dim(x, 2, "x", "[M, K]")
    check_dim(offsets, 1, "offsets", "[G]")
    torch._check_value(
        grad.shape[0] == x.shape[0],
        lambda: f"grad has {grad.shape[0]} rows but x has {x.shape[0]}",
    )
    torch._check_type(grad.dtype in DTYPES,
                      lambda: f"grad must be bf16, fp16, fp32 or fp64, got {grad.dtype}")
    torch._check_type(x.dtype == grad.dtype,
                      lambda: f"x dtype {x.dtype} must match grad dtype {grad.dtype}")
    torch._check_type(offsets.dtype == torch.int32,
                      lambda: f"offsets must be int32 (cumulative end rows), got {offsets.dtype}")
    for name, dtype in (("weight_dtype", weight_dtype), ("bias_dtype", bias_dtype)):
        if dtype is not None:
            torch._check_type(dtype.is_floating_point,
                              lambda: f"{name} must be a floating-point dtype, got {dtype}")
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
    if host_value_checks(offsets):
        check_offset_values(offsets, m)


def _require(cond: bool, error: type, message: Callable[[], str]) -> None:
    """``torch._check*`` for the public functions that Dynamo traces (not the ops' fake
    functions): Dynamo refuses a ``torch._check`` whose message closes over a tensor, even
    when the check passes, but traces a plain ``raise`` (which ``fullgraph=True`` reports
    with the message)."""
    if not cond:
        raise error(message())


def check_splits(m_splits: torch.Tensor, groups: Optional[int] = None) -> None:
    """``m_splits [G]``: per-group row counts, an integer tensor (a float one would be
    truncated by the cumulative sum), with one entry per group when ``groups`` is given."""
    _require(m_splits.dim() == 1, RuntimeError,
             lambda: f"m_splits must be 1-D [G] (rows per group), got shape "
             f"{tuple(m_splits.shape)}")
    _require(
        not m_splits.is_floating_point() and not m_splits.is_complex()
        and m_splits.dtype != torch.bool,
        TypeError,
        lambda: f"m_splits must be an integer tensor (rows per group), got {m_splits.dtype}",
    )
    if groups is not None:
        _require(
            m_splits.shape[0] == groups, ValueError,
            lambda: f"m_splits must have one entry per group: got {m_splits.shape[0]} for "
            f"{groups} groups",
        )


def check_split_values(m_splits: torch.Tensor, m: int) -> None:
    """Raise ``ValueError`` if a split is negative or the splits add up to more than ``m``
    rows (reads them on the host, like :func:`check_offset_values`)."""
    if m_splits.numel() == 0:
        return
    s = m_splits.detach().to("cpu", torch.int64)
    if bool((s < 0).any()):
        raise ValueError(f"grouped_linear: m_splits must be >= 0, got {s.tolist()}")
    if int(s.sum()) > m:
        raise ValueError(
            f"grouped_linear: m_splits add up to {int(s.sum())} rows, more than the number of "
            f"rows M = {m} (m_splits = {s.tolist()})"
        )


def check_splits_eagerly(m_splits: torch.Tensor, m: int) -> bool:
    """:func:`check_split_values` under the rule of :func:`check_offsets_eagerly`; whether it
    ran."""
    if host_value_checks(m_splits):
        check_split_values(m_splits, m)
        return True
    return False


#: The device-side message for ``m_splits`` that are negative or add up to more than M (no
#: host sync there, so it cannot name the entry; :func:`check_split_values` does).
SPLITS_INVALID = (
    "compileops.grouped_linear_splits: m_splits must be >= 0 and add up to at most M, the rows "
    "of x (run eagerly under compileops.strict_offset_checks() to see the values)"
)


def assert_split_values_on_device(m_splits: torch.Tensor, m: int) -> None:
    """:func:`check_split_values` without a host sync, where it did not run on the host: a
    device-side assert on CUDA, a ``RuntimeError`` when compiled on CPU. Summed in int64, so
    splits that would wrap the int32 offsets are caught too."""
    ok = (m_splits >= 0).all() & (m_splits.to(torch.int64).sum() <= m)
    torch._assert_async(ok, SPLITS_INVALID)


def check_permute_args(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> None:
    """``permute_by_expert``: x ``[T, D]``, expert_ids ``[T, k]`` int32/int64 on x's device,
    ``num_experts >= 0``."""
    _require(x.dim() == 2, RuntimeError,
             lambda: f"x must be 2-D [T, D], got shape {tuple(x.shape)}")
    _require(expert_ids.dim() == 2, RuntimeError,
             lambda: f"expert_ids must be 2-D [T, k], got shape {tuple(expert_ids.shape)}")
    _require(expert_ids.dtype in (torch.int32, torch.int64), RuntimeError,
             lambda: f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    _require(
        expert_ids.shape[0] == x.shape[0], ValueError,
        lambda: f"expert_ids [T, k] = {tuple(expert_ids.shape)} must have one row per row of "
        f"x [T, D] = {tuple(x.shape)}",
    )
    _require(num_experts >= 0, ValueError,
             lambda: f"num_experts must be >= 0, got {num_experts}")
    _require(expert_ids.device == x.device, RuntimeError,
             lambda: f"expert_ids is on {expert_ids.device} but x is on {x.device}; move them "
             "to the same device")


#: The device-side message for an expert id outside ``[0, num_experts)``.
EXPERT_ID_OUT_OF_RANGE = (
    "compileops.permute_by_expert: expert_ids holds an id outside [0, num_experts) (run "
    "eagerly under compileops.strict_offset_checks() to see it)"
)


def check_expert_id_values(expert_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ``IndexError`` naming the first expert id outside ``[0, num_experts)`` (an id
    out of range would silently route its row nowhere, or to expert 0). Reads the ids on the
    host on CPU tensors, and elsewhere with strict offset checks, when running eagerly (the
    rule of :func:`check_offsets_eagerly`); otherwise (CUDA without strict checks, and
    everything compiled) checks them on the device with no host sync: a device-side assert
    on CUDA, a ``RuntimeError`` naming ``expert_ids`` when compiled on CPU."""
    if expert_ids.numel() == 0:
        return
    if not host_value_checks(expert_ids):
        ok = ((expert_ids >= 0) & (expert_ids < num_experts)).all()
        torch._assert_async(ok, EXPERT_ID_OUT_OF_RANGE)
        return
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    if bool(bad.any()):
        first = int(expert_ids.reshape(-1)[bad.reshape(-1)][0])
        raise IndexError(
            f"expert_ids holds expert {first}, out of range for num_experts = {num_experts} "
            f"(valid ids are 0..{num_experts - 1})"
        )


def check_row_scale(x: torch.Tensor, row_scale: torch.Tensor) -> None:
    """``grouped_linear(..., row_scale=)``: a floating ``[M]`` tensor on x's device."""
    _require(x.dim() == 2, RuntimeError,
             lambda: f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    _require(isinstance(row_scale, torch.Tensor), TypeError,
             lambda: f"row_scale must be a tensor [M], got {type(row_scale).__name__}")
    _require(row_scale.dim() == 1 and row_scale.shape[0] == x.shape[0], ValueError,
             lambda: f"row_scale must be [M] = [{x.shape[0]}] (one scale per row of x), got "
             f"shape {tuple(row_scale.shape)}")
    _require(row_scale.is_floating_point(), TypeError,
             lambda: f"row_scale must be a floating-point tensor, got {row_scale.dtype}")
    _require(row_scale.device == x.device, RuntimeError,
             lambda: f"row_scale is on {row_scale.device} but x is on {x.device}; move them to "
             "the same device")


def check_row_scaled_args(x, weight, offsets, row_scale) -> None:
    """``compileops::grouped_linear_row_scaled``: the forward's arguments (no bias) and a
    ``row_scale [M]`` in x's dtype (the public ``grouped_linear(..., row_scale=)`` casts it)."""
    check_forward_args(x, weight, offsets, None, False)
    check_row_scale(x, row_scale)
    _require(row_scale.dtype == x.dtype, TypeError,
             lambda: f"row_scale must have x's dtype {x.dtype} here, got {row_scale.dtype}")


def check_unpermute_args(y_sorted: torch.Tensor, order: torch.Tensor,
                         weights: torch.Tensor) -> None:
    """``unpermute_and_combine``: y_sorted ``[T*k, D]``, order ``[T*k]`` int32/int64,
    weights ``[T, k]`` floating, one device."""
    for name, t, dim, doc in (("y_sorted", y_sorted, 2, "[T*k, D]"), ("order", order, 1, "[T*k]"),
                              ("weights", weights, 2, "[T, k]")):
        _require(t.dim() == dim, RuntimeError,
                 lambda: f"{name} must be {dim}-D {doc}, got shape {tuple(t.shape)}")
    _require(order.dtype in (torch.int32, torch.int64), RuntimeError,
             lambda: f"order must be int32 or int64, got {order.dtype}")
    _require(weights.is_floating_point(), RuntimeError,
             lambda: f"weights must be a floating-point tensor, got {weights.dtype}")
    _require(
        order.shape[0] == y_sorted.shape[0]
        and order.shape[0] == weights.shape[0] * weights.shape[1],
        ValueError,
        lambda: f"y_sorted [T*k, D] = {tuple(y_sorted.shape)}, order [T*k] = "
        f"{tuple(order.shape)} and weights [T, k] = {tuple(weights.shape)} disagree on T*k",
    )
    for name, t in (("order", order), ("weights", weights)):
        _require(t.device == y_sorted.device, RuntimeError,
                 lambda: f"{name} is on {t.device} but y_sorted is on {y_sorted.device}; move "
                 "them to the same device")


#: The device-side message for an ``order`` that is not a permutation (no host sync there, so
#: it cannot name the entry; :func:`check_order_values` does, on the host).
ORDER_NOT_A_PERMUTATION = (
    "compileops.unpermute_and_combine: order is not a permutation of 0..T*k-1 (pass the order "
    "permute_by_expert returned; run eagerly under compileops.strict_offset_checks() to see "
    "the bad entry)"
)


def check_order_values(order: torch.Tensor) -> None:
    """Raise naming the first entry that keeps ``order [n]`` from being a permutation of
    ``0..n-1``: ``IndexError`` for one outside ``[0, n)``, ``ValueError`` for a value held
    twice. Reads ``order`` on the host (a device sync on GPUs)."""
    o = order.detach().to("cpu", torch.int64)
    n = o.numel()
    outside = (o < 0) | (o >= n)
    if bool(outside.any()):
        i = int(outside.nonzero()[0])
        raise IndexError(
            f"unpermute_and_combine: order must be a permutation of 0..{n - 1} (the order "
            f"permute_by_expert returned), but order[{i}] = {int(o[i])} is outside [0, {n})")
    counts = torch.bincount(o, minlength=n)
    if bool((counts > 1).any()):
        value = int((counts > 1).nonzero()[0])
        first, second = (int(i) for i in (o == value).nonzero()[:2, 0])
        absent = int((counts == 0).nonzero()[0])
        raise ValueError(
            f"unpermute_and_combine: order must be a permutation of 0..{n - 1} (the order "
            f"permute_by_expert returned), but it holds {value} twice (order[{first}] and "
            f"order[{second}]) and lacks {absent}")


def check_order_eagerly(order: torch.Tensor) -> bool:
    """:func:`check_order_values` under the rule of :func:`check_offsets_eagerly` (on CPU
    tensors, elsewhere with strict offset checks, never while compiling); whether it ran."""
    if host_value_checks(order):
        check_order_values(order)
        return True
    return False


def check_kernel_dtype(op: str, t: torch.Tensor) -> None:
    """The Triton kernels take bf16, fp16 and fp32; fp64 (the ground truth of the numerical
    contract) runs on the reference backend only, and the error says how to get it."""
    if t.dtype in KERNEL_DTYPES:  # a dtype is never symbolic; the common case costs one test
        return
    raise TypeError(
        f"compileops::{op}: the triton backend runs bf16, fp16 and fp32, got {t.dtype}; "
        "fp64 runs on the reference backend: with compileops.use_backend('reference'): ...")
