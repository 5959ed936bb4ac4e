"""Opt-in modes that change how ops check or compute, without changing their results' meaning.

Each mode has a process-wide default (off) that a setter changes, and a context manager that
overrides it for the current thread or task (a ``contextvars.ContextVar``, like
:class:`compileops.use_backend`), so a mode switched on in one test or one request never leaks
into another:

* **strict index checks** (embedding): ids are validated on the host before each eager call
  (one device sync), so a bad id raises ``IndexError`` naming it instead of a device assert.
* **strict offset checks** (grouped linear, and the mLSTM's ``cu_seqlens``): offsets are
  validated on the host before each eager CUDA call (one device sync).
* **batch-invariant mode** (grouped linear): one fixed tile config for the row-wise products
  (forward, SwiGLU, dX), so that a row's output is bitwise the same whatever the other rows
  and the group sizes, whichever config the heuristics or max-autotune would have picked
  (max-autotune can pick a config that sums over K in other steps, or ``torch._grouped_mm``).
  Read when a kernel launches eagerly and when Inductor lowers: switch it on before compiling.

  The promise is the Triton kernels': on a GPU, and on CPU tensors under Triton's interpreter
  (``TRITON_INTERPRET=1``, which runs one config in any mode). It does not hold on the
  reference backend (CPU tensors without the interpreter, or ``use_backend("reference")``),
  whose products are torch matmuls: a CPU BLAS blocks them by the batch size, so a row's last
  bits can change with it (fp32 forward rows, outputs of about 1, differed by up to 5e-6
  between batches of 7 and 1024 rows). Nor does it cover the fp8 products, whose tile config
  follows the group sizes. On an H200 (bf16 and fp32; forward, SwiGLU and dX; eager and
  compiled; 7 to 16384 rows over 8 groups) the default configs were bitwise invariant even
  without the mode: within one dtype they all sum over K in the same steps.

Strict checks are ignored while compiling (a host sync cannot be traced).

Threads: on CUDA, autograd runs the backward on its own device thread, which does not see a
context override of the forward's thread. Ops that read a mode in their backward save it in
``setup_context`` (the grouped linear does). Inductor compiles a backward graph lazily, on that
thread, so to compile a training step in batch-invariant mode set the process-wide default
(:func:`set_batch_invariant`) before the first step, rather than a ``with`` block.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch


class Mode:
    """One boolean mode: a process-wide default plus a per-context override."""

    def __init__(self, name: str):
        self.name = name
        self._default = False
        self._override: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
            f"compileops_{name}", default=None
        )

    def enabled(self) -> bool:
        override = self._override.get()
        return self._default if override is None else override

    def set_default(self, enabled: bool) -> None:
        self._default = bool(enabled)

    @contextlib.contextmanager
    def override(self, enabled: bool = True) -> Iterator[None]:
        token = self._override.set(bool(enabled))
        try:
            yield
        finally:
            self._override.reset(token)

    def __repr__(self) -> str:
        return f"Mode({self.name!r}, enabled={self.enabled()})"


STRICT_INDEX_CHECKS = Mode("strict_index_checks")
STRICT_OFFSET_CHECKS = Mode("strict_offset_checks")
BATCH_INVARIANT = Mode("batch_invariant")


def set_strict_index_checks(enabled: bool) -> None:
    """Process-wide default of strict embedding id checks (see the module docstring)."""
    STRICT_INDEX_CHECKS.set_default(enabled)


def strict_index_checks(enabled: bool = True):
    """``with compileops.strict_index_checks():`` strict embedding id checks in this context."""
    return STRICT_INDEX_CHECKS.override(enabled)


def set_strict_offset_checks(enabled: bool) -> None:
    """Process-wide default of strict grouped-linear offset checks (see the module docstring)."""
    STRICT_OFFSET_CHECKS.set_default(enabled)


def strict_offset_checks(enabled: bool = True):
    """``with compileops.strict_offset_checks():`` strict offset checks in this context."""
    return STRICT_OFFSET_CHECKS.override(enabled)


def host_value_checks(t: torch.Tensor) -> bool:
    """Whether checks that read ``t``'s values on the host run now: eagerly, on CPU tensors
    (free there) and elsewhere under strict offset checks (one device sync); never while
    compiling (``is_compiling()`` first: Dynamo cannot trace a ContextVar read). Where they
    do not run, the callers check on the device instead, or say what the user promises."""
    if torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or STRICT_OFFSET_CHECKS.enabled()


def set_batch_invariant(enabled: bool) -> None:
    """Process-wide default of batch-invariant mode (see the module docstring)."""
    BATCH_INVARIANT.set_default(enabled)


def batch_invariant(enabled: bool = True):
    """``with compileops.batch_invariant():`` batch-invariant mode in this context."""
    return BATCH_INVARIANT.override(enabled)


def is_batch_invariant() -> bool:
    return BATCH_INVARIANT.enabled()
