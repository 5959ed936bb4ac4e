"""Backend registry: which implementation an op runs eagerly on a given device.

Two backends exist:

* ``reference``: the plain-PyTorch ground truth of each family (``<family>/reference.py``).
  Always available.
* ``triton``: the family's Triton kernels (the ``<family>/kernels/`` package). Available on CUDA/ROCm
  devices when Triton is installed, and on CPU tensors when ``TRITON_INTERPRET=1`` (Triton's
  interpreter; this is how the CPU test suite runs the kernels without a GPU). The
  interpreter runs the kernels' logic, not the GPU's bf16 rounding: its casts to bf16 round
  toward zero (triton 3.6 to 3.9), so a bf16 result there can be a last bit low; use the
  reference backend on CPU for values. Its fp64 -> bf16 casts store wrong values; the one
  kernel cast so (the embedding's, fp64 table or gradient to bf16) is staged in fp64 there
  (``_launch.interpreter_casts_wrongly``).

Each device type has a priority list; the first available backend wins unless
:func:`use_backend` forces one. Forcing a backend that cannot run on the tensors' device is
an error, never a silent fallback.

This module decides the *eager* implementation only. Under ``torch.compile`` the Inductor
lowerings (``compileops.lowerings``) take over where they exist.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import logging
import os

import torch

from compileops import _log

logger = _log.get_logger("backends")

BACKENDS = ("reference", "triton")

# Device kinds are "cuda", "rocm" (a HIP build of torch reports its GPUs as "cuda") and "cpu".
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "reference"),
    "rocm": ("triton", "reference"),
    "cpu": ("triton", "reference"),
}

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "compileops_forced_backend", default=None
)


class BackendUnavailableError(RuntimeError):
    """A backend was requested for a device it cannot run on."""


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_kind(device: torch.device | str) -> str:
    device_type = (device if isinstance(device, torch.device) else torch.device(device)).type
    if device_type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    return device_type


def why_unavailable(name: str, device: torch.device | str) -> str | None:
    """``None`` when ``name`` can run on ``device``, else the reason it cannot."""
    return _why_unavailable_on(name, device_kind(device))


def _why_unavailable_on(name: str, kind: str) -> str | None:
    """:func:`why_unavailable` for a device of ``kind`` (:func:`device_kind`)."""
    if name not in BACKENDS:
        return f"unknown backend {name!r}; choose one of {BACKENDS}"
    if name == "reference":
        return None
    if not _triton_installed():
        return "the triton backend needs the 'triton' package, which is not installed"
    if kind in ("cuda", "rocm"):
        return None
    if kind == "cpu":
        if triton_interpret_enabled():
            return None
        return (
            "the triton backend runs on CPU tensors only under Triton's interpreter; "
            "set TRITON_INTERPRET=1 before importing compileops"
        )
    return f"the triton backend does not support device type {kind!r}"


def available(name: str, device: torch.device | str) -> bool:
    return why_unavailable(name, device) is None


def select(op: str, device: torch.device | str) -> str:
    """The backend ``op`` runs with on ``device``: forced by :func:`use_backend`, else by priority."""
    forced = _forced.get()
    if forced is not None:
        reason = why_unavailable(forced, device)
        if reason is not None:
            raise BackendUnavailableError(
                f"compileops::{op}: backend {forced!r} was forced by use_backend() but "
                f"cannot run on {torch.device(device)}: {reason}"
            )
        _log_choice(op, device, forced, forced_by_user=True)
        return forced
    kind = device_kind(device)  # once: select runs on every eager call of every op
    for name in PRIORITY.get(kind, ("reference",)):
        if _why_unavailable_on(name, kind) is None:
            _log_choice(op, device, name)
            return name
    raise BackendUnavailableError(f"compileops::{op}: no backend can run on {device}")


def _log_choice(op: str, device: torch.device | str, name: str, *,
                forced_by_user: bool = False) -> None:
    """One line per op, backend and reason, not per call. The reference backend is a fallback
    from the kernels (INFO); the kernels are the expected pick (DEBUG). The reason is worked
    out only when the line will be printed: this runs on every eager call."""
    level = logging.INFO if name == "reference" else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    why = "forced by use_backend()" if forced_by_user else _why_picked(name, device)
    _log.log_once(logger, level, "%s: %s backend on %s (%s)", op, name, device_kind(device), why)


def _why_picked(name: str, device: torch.device | str) -> str:
    """The backends ahead of ``name`` in the device's priority list, and why each cannot run."""
    ahead = PRIORITY.get(device_kind(device), ("reference",))
    skipped = [f"{other}: {why_unavailable(other, device)}"
               for other in ahead[:ahead.index(name)]]
    return "; ".join(skipped) if skipped else "first in priority"


# What each active use_backend() replaced, innermost last. A ContextVar, so every thread and
# every asyncio task has its own stack: one use_backend instance may be shared (a decorator
# run by several threads or tasks at once) and entered again inside itself, and each exit
# restores what was forced in the thread or task that exits. (Keeping contextvars tokens on
# the instance did not: a thread popped another thread's token and reset() refused it.)
_replaced: contextvars.ContextVar[tuple[str | None, ...]] = contextvars.ContextVar(
    "compileops_forced_backend_replaced", default=()
)


class use_backend(contextlib.ContextDecorator):
    """Force every compileops op to run with backend ``name``.

    Usable as ``with compileops.use_backend("reference"):``, ``async with``, or as a decorator
    of a function or a coroutine function. It holds no state of its own between enter and
    exit, so one instance may be shared by threads and asyncio tasks, nested in itself, and
    left by an exception: each thread or task sees only its own ``with`` blocks, and leaving
    a block restores the backend forced before it in that thread or task. New threads start
    with no backend forced (a thread does not inherit its creator's context); asyncio tasks
    inherit the backend forced where they were created.

    Unknown names raise ``ValueError`` at once; a backend unavailable for the tensors'
    device raises :class:`BackendUnavailableError` when an op runs.
    """

    def __init__(self, name: str):
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
        self.name = name

    def __enter__(self) -> "use_backend":
        _replaced.set((*_replaced.get(), _forced.get()))
        _forced.set(self.name)
        return self

    def __exit__(self, *exc) -> None:
        replaced = _replaced.get()
        if not replaced:
            raise RuntimeError(
                "compileops.use_backend: leaving a block that was not entered in this thread "
                "or asyncio task"
            )
        _forced.set(replaced[-1])
        _replaced.set(replaced[:-1])

    async def __aenter__(self) -> "use_backend":
        return self.__enter__()

    async def __aexit__(self, *exc) -> None:
        self.__exit__(*exc)

    def __call__(self, func):
        if inspect.iscoroutinefunction(func):
            # ContextDecorator would leave the block as soon as the coroutine is created,
            # before any of its body runs.
            @functools.wraps(func)
            async def forced(*args, **kwargs):
                with self:
                    return await func(*args, **kwargs)

            return forced
        return super().__call__(func)

    def __repr__(self) -> str:
        return f"use_backend({self.name!r})"


def keep_forward_backend(backward, setup_context):
    """``(backward, setup_context)`` that run the backward under the backend the forward was
    forced to with :func:`use_backend`: for ``register_autograd`` (custom ops) and
    :func:`keeps_forward_backend` (``torch.autograd.Function`` subclasses).

    The forced backend is a context variable, and autograd runs the backward of CUDA tensors on
    its own device thread, which does not see it: without this, a backward run inside ``with
    use_backend("reference"):`` got the Triton kernels. While compiling nothing is recorded
    (Dynamo cannot trace a context variable read; compiled code does not select backends).
    """

    def setup(ctx, inputs, output):
        ctx.forward_backend = None if torch.compiler.is_compiling() else _forced.get()
        setup_context(ctx, inputs, output)

    def run_backward(ctx, *grads):
        forced = getattr(ctx, "forward_backend", None)
        if forced is None or _forced.get() == forced:
            return backward(ctx, *grads)
        with use_backend(forced):
            return backward(ctx, *grads)

    return run_backward, setup


def keeps_forward_backend(cls):
    """Class decorator of a ``torch.autograd.Function`` (written with ``setup_context``) whose
    backward calls compileops ops: its backward runs under the backend its forward was forced
    to (:func:`keep_forward_backend`), as the custom ops' do. Every autograd Function of the
    package wears it (``tests/test_backend_threads.py`` checks)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"keeps_forward_backend decorates torch.autograd.Function subclasses, "
                        f"got {cls!r}")
    if "setup_context" not in vars(cls):
        raise TypeError(f"{cls.__name__} must define setup_context (forward without ctx)")
    run_backward, setup = keep_forward_backend(cls.backward, cls.setup_context)
    cls.setup_context = staticmethod(setup)
    cls.backward = staticmethod(run_backward)
    cls.keeps_forward_backend = True
    return cls


def register_autograd(op, backward, setup_context) -> None:
    """``op.register_autograd(backward, setup_context=...)`` through
    :func:`keep_forward_backend`: what every compileops op registers."""
    run_backward, setup = keep_forward_backend(backward, setup_context)
    op.register_autograd(run_backward, setup_context=setup)
