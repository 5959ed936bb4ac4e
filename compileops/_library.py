"""The ``compileops`` torch.library namespace and helpers shared by every op family.

Every op is declared with :func:`custom_op` below, so all of them live under
``torch.ops.compileops.*`` and are functional (``mutates_args=()``): Inductor lowers
functional ops directly, while mutating ones would go through auto-functionalization.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

NAMESPACE = "compileops"

INDEX_DTYPES = (torch.int32, torch.int64)


def custom_op(name: str, *, tags: tuple = ()) -> Callable:
    """Declare ``compileops::<name>`` as a functional custom op (with ``tags``, e.g.
    ``torch.Tag.cudagraph_unsafe``)."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(), tags=tags)


def require(cond, message: Callable[[], str]) -> None:
    """``torch._check(cond, message)``: a RuntimeError with ``message()`` when ``cond`` is
    false, and a symbolic condition recorded for the compiler. A plain ``True`` (eager, and
    static shapes) returns at once: the ops' eager checks run on every call, and
    ``torch._check`` costs microseconds each even when it passes (a decode step runs a few
    dozen)."""
    if cond is True:
        return
    torch._check(cond, message)


def require_tensors(named: Iterable[tuple[str, object]], hints: dict | None = None) -> None:
    """A clear ``TypeError`` for an argument that is not a tensor (a Python list, say), where
    an op's schema would give torch's raw one. ``named``: ``(name, value)`` pairs; ``hints``:
    what to say after a name's message."""
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            hint = (hints or {}).get(name, "")
            raise TypeError(f"{name} must be a torch.Tensor{hint}, got {type(value).__name__}")


def check_index_dtype(t: torch.Tensor, what: str) -> None:
    """Precondition usable from fake functions and eager code alike."""
    require(
        t.dtype in INDEX_DTYPES,
        lambda: f"{what} must be int32 or int64, got {t.dtype}",
    )


def check_floating(t: torch.Tensor, what: str) -> None:
    require(
        t.is_floating_point(),
        lambda: f"{what} must be a floating-point tensor, got {t.dtype}",
    )


def check_same_device(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """All tensors on one device; the message names the two that differ."""
    named = list(named)
    first_name, first = named[0]
    for name, t in named[1:]:
        require(
            t.device == first.device,
            lambda: f"{name} is on {t.device} but {first_name} is on {first.device}; "
            "move them to the same device",
        )


def check_dim(t: torch.Tensor, dim: int, what: str, shape_doc: str) -> None:
    require(
        t.dim() == dim,
        lambda: f"{what} must be {dim}-D {shape_doc}, got shape {tuple(t.shape)}",
    )


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [*, D]`` as ``[prod(*), D]``: ``reshape(-1, D)`` cannot infer the rows of an empty
    tensor whose D is 0."""
    rows = 1
    for size in t.shape[:-1]:
        rows *= size
    return t.reshape(rows, t.shape[-1])
