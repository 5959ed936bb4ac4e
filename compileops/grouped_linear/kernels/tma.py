"""TMA (sm90+ tensor memory accelerator) pieces: device-side descriptors, ragged row
descriptors, when a launch may take them, and the per-device fallback when one fails.

The eager M-jagged kernel loads its A and weight tiles through descriptors
(:func:`make_descriptors`) where :func:`tma_applies`; with ``Config.tma_store`` it stores
the output tiles through a ragged descriptor (:func:`store_rows_below`) where
:func:`mjagged_tma_store` allows. The dW kernel loads whole row chunks by TMA where
:func:`wgrad_tma_applies`, and takes the ``Config`` variants ``ragged_tma`` /
``tma_store`` / ``epilogue_subtile`` where ``kjagged.wgrad_variant_flags`` allows.
``COMPILEOPS_GROUPED_TMA=0`` turns TMA off. The interpreter emulates descriptors, so the
CPU tests run these paths too.

Fallback: if a TMA launch on a GPU fails to compile or load (one of
:data:`TMA_LAUNCH_ERRORS`), the failure is recorded for that device (:class:`Fallback`),
logged once on the ``compileops`` logger, and that device launches without it from then on.
A variant asked for by an explicit ``config`` re-raises instead (a sweep must not time a
fallback). Any other exception propagates, Triton's ``OutOfResources`` included: a tile
whose stages do not fit in shared memory is retried with fewer (:mod:`.stages`), not
without TMA.
"""
from __future__ import annotations

import enum
import logging
import os
from typing import TYPE_CHECKING, Callable

import torch
import triton
import triton.language as tl
from triton.errors import TritonError
from triton.runtime.errors import OutOfResources

if TYPE_CHECKING:
    from compileops.grouped_linear.kernels.config import Config

logger = logging.getLogger("compileops")


# ---------------------------------------------------------------------------------------
# Device-side descriptors (@triton.jit)


@triton.jit
def make_descriptors(a_ptr, b_ptr, M, K, G, B_N, stride_am, stride_bg, stride_b1,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     B_KN: tl.constexpr):
    """Device-side TMA descriptors of the M-jagged operands: A ``[M, K]``, row stride
    ``stride_am``, unit column stride, ``[BLOCK_M, BLOCK_K]`` boxes; the weight
    ``[G, K, B_N]`` (``B_KN``) or ``[G, B_N, K]``, strides ``(stride_bg, stride_b1, 1)``,
    ``[1, BLOCK_K, BLOCK_N]`` or ``[1, BLOCK_N, BLOCK_K]`` boxes."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    b_desc = weight_descriptor(b_ptr, G, K, B_N, stride_bg, stride_b1, BLOCK_N, BLOCK_K, B_KN)
    return a_desc, b_desc


@triton.jit
def weight_descriptor(b_ptr, G, K, B_N, stride_bg, stride_b1, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, B_KN: tl.constexpr):
    """The weight's descriptor: ``[G, K, B_N]`` (``B_KN``) or ``[G, B_N, K]``, strides
    ``(stride_bg, stride_b1, 1)``, ``[1, BLOCK_K, BLOCK_N]`` or ``[1, BLOCK_N, BLOCK_K]``
    boxes. Also a second weight's (``mjagged_tile``'s ``SECOND_WEIGHT``), with the first
    one's strides (for dX, ``K`` its own rows)."""
    if B_KN:
        desc = tl.make_tensor_descriptor(b_ptr, shape=[G, K, B_N],
                                         strides=[stride_bg, stride_b1, 1],
                                         block_shape=[1, BLOCK_K, BLOCK_N])
    else:
        desc = tl.make_tensor_descriptor(b_ptr, shape=[G, B_N, K],
                                         strides=[stride_bg, stride_b1, 1],
                                         block_shape=[1, BLOCK_N, BLOCK_K])
    return desc


@triton.jit
def trailing_columns_descriptor(a_ptr, M, K, K2, stride_am, BLOCK_M: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """A's columns ``[K, K + K2)`` as their own ``[M, K2]`` matrix (unit column stride), in
    ``[BLOCK_M, BLOCK_K]`` boxes: dX of a gate/up pair reads the up half of dY through it.
    Its base, ``K`` elements into A, must be 16-byte aligned (the launcher checks)."""
    return tl.make_tensor_descriptor(a_ptr + K, shape=[M, K2], strides=[stride_am, 1],
                                     block_shape=[BLOCK_M, BLOCK_K])


@triton.jit
def load_b_tile(b_desc, g, n0, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                B_KN: tl.constexpr):
    """``[BLOCK_K, BLOCK_N]`` tile of B_g at ``(k0, n0)`` through :func:`make_descriptors`'
    weight descriptor (transposed in registers when the weight is ``[G, N, K]``)."""
    if B_KN:
        return b_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)  # [BLOCK_K, BLOCK_N]
    else:
        return b_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T  # [BLOCK_K, BLOCK_N]


# Ragged row descriptors (the construction of triton.tools.ragged_tma, built on the device):
# a 4-D view [RAGGED_MAX, RAGGED_MAX, RAGGED_ROWS, cols] of a row-major [rows, cols] matrix
# with strides [2**34 - s, s, s, 1] (s: row stride). Coordinates (RAGGED_ROWS, end,
# RAGGED_ROWS - end + r, c) address row r (the first two terms cancel modulo 2**64), and the
# bound RAGGED_ROWS on the third makes the TMA unit zero-fill every row >= end: a group's
# last partial chunk needs no masked pointer path and never reads the next group's rows.
RAGGED_MAX = tl.constexpr(0x7FFF0000)
RAGGED_ROWS = tl.constexpr(0x40000000)  # rows of the matrix must stay below this


@triton.jit
def ragged_rows_descriptor(ptr, cols, stride_row, BLOCK_ROWS: tl.constexpr,
                           BLOCK_COLS: tl.constexpr):
    """Descriptor for :func:`load_rows_below` / :func:`store_rows_below`: ``[BLOCK_ROWS,
    BLOCK_COLS]`` boxes of a ``[rows, cols]`` matrix, row stride ``stride_row``, unit
    column stride."""
    stride = tl.cast(stride_row, tl.int64)  # an i32 argument when small: 2**34 needs i64
    return tl.make_tensor_descriptor(
        ptr, shape=[RAGGED_MAX, RAGGED_MAX, RAGGED_ROWS, cols],
        strides=[2**34 - stride, stride, stride, 1],
        block_shape=[1, 1, BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def load_rows_below(desc, row, end, col, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Rows ``[row, row + BLOCK_ROWS)`` x columns ``[col, col + BLOCK_COLS)`` through a
    :func:`ragged_rows_descriptor`; rows ``>= end`` (and columns past the matrix) read 0."""
    # The tensor first: RAGGED_ROWS - end would be a constexpr holding a tensor in triton
    # 3.9's interpreter, which then range-checks it against int32 and fails.
    box = desc.load([RAGGED_ROWS, end, row - end + RAGGED_ROWS, col])  # [1, 1, ROWS, COLS]
    return box.reshape(BLOCK_ROWS, BLOCK_COLS)


@triton.jit
def store_rows_below(desc, row, end, col, tile, BLOCK_ROWS: tl.constexpr,
                     BLOCK_COLS: tl.constexpr):
    """Writes ``tile [BLOCK_ROWS, BLOCK_COLS]`` to rows ``[row, row + BLOCK_ROWS)`` x columns
    ``[col, col + BLOCK_COLS)`` through a :func:`ragged_rows_descriptor` (the mirror of
    :func:`load_rows_below`): the TMA unit drops the elements of rows ``>= end`` and of
    columns past the matrix, so another program's rows past ``end`` are never written."""
    desc.store([RAGGED_ROWS, end, row - end + RAGGED_ROWS, col],
               tile.reshape(1, 1, BLOCK_ROWS, BLOCK_COLS))


# ---------------------------------------------------------------------------------------
# When a launch may take TMA (host metadata only: no device read)


def tma_env_enabled() -> bool:
    return os.environ.get("COMPILEOPS_GROUPED_TMA", "1") not in ("0", "")


def tma_device_ok(device: torch.device) -> bool:
    """TMA is on (not disabled, no earlier failure on this device), Triton has device-side
    descriptors and the device is an sm90+ CUDA GPU."""
    if not tma_env_enabled() or not hasattr(tl, "make_tensor_descriptor"):
        return False
    if device.type != "cuda" or torch.version.hip:
        return False
    if fell_back(Fallback.TMA, device):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def tma_compatible(t: torch.Tensor) -> bool:
    """A tensor a TMA descriptor can address: not empty, unit last stride, 16-byte aligned
    base and outer strides.

    An empty tensor (the weight ``[0, N, K]`` of zero groups) has a null base, which is
    "aligned", but a descriptor built over it stops the kernel with an illegal instruction on
    an H100 (the GPU property fuzzing found it: M = 2 rows, no groups, fp32). That error
    leaves the CUDA context unusable, so no fallback can follow it: such launches take the
    pointer path."""
    es = t.element_size()
    return (t.numel() > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((stride * es) % 16 == 0 for stride in t.stride()[:-1]))


def tma_applies(a: torch.Tensor, w: torch.Tensor, cfg: Config) -> bool:
    """TMA loads for an M-jagged launch: A and the weight TMA-compatible, a box row of at
    least 16 bytes, a GPU with the TMA unit (sm90+)."""
    if not tma_device_ok(a.device):
        return False
    return tma_compatible(a) and tma_compatible(w) and cfg.block_k * a.element_size() >= 16


def mjagged_tma_store(out: torch.Tensor, cfg: Config, tma: bool) -> bool:
    """``TMA_STORE`` for an M-jagged launch: ``cfg.tma_store`` on the TMA path, when ``out
    [M, N_OUT]`` is TMA-storable (unit column stride, 16-byte aligned base and row stride,
    a box row of at least 16 bytes) and its rows fit the ragged descriptor (``M <
    RAGGED_ROWS``). Otherwise the launch keeps the masked pointer store."""
    return (tma and cfg.tma_store and tma_compatible(out)
            and cfg.block_n * out.element_size() >= 16 and out.shape[0] < RAGGED_ROWS.value)


def wgrad_tma_applies(grad: torch.Tensor, x: torch.Tensor, cfg: Config) -> bool:
    """TMA loads for the dW kernel: dY and X TMA-compatible with a nonzero row stride (a
    stride-0 or transposed dY takes the pointer path), 16-byte box rows, an sm90+ GPU."""
    if not tma_device_ok(x.device):
        return False
    es = x.element_size()
    return (all(tma_compatible(t) and t.stride(0) > 0 for t in (grad, x))
            and cfg.block_k * es >= 16 and cfg.block_n * es >= 16)


def set_tma_allocator(device: torch.device) -> None:
    """Device-side descriptors need a small global scratch per launch; take it from torch's
    caching allocator (stream-ordered, so CUDA graph capture works)."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device=device))


# ---------------------------------------------------------------------------------------
# Per-device fallback


# What a TMA launch raises where the toolchain, the driver or the GPU cannot build or load
# it: Triton's compile errors (CompilationError, PTXASError: TritonError), and RuntimeError
# from an MLIR pass failure or the CUDA driver ("Triton Error [CUDA]: ..."). Neither a CUDA
# out-of-memory error nor Triton's OutOfResources (a tile's stages that do not fit in
# shared memory, which the pointer kernel needs as much: :mod:`.stages` retries with fewer)
# is one of them: they propagate.
TMA_LAUNCH_ERRORS = (TritonError, RuntimeError)


class Fallback(enum.Enum):
    """What a failed launch turns off on its device, from then on."""

    TMA = "TMA descriptors"  # every kernel: pointer loads and stores
    MJAGGED_TMA_STORE = "M-jagged TMA stores"  # TMA loads, pointer stores
    WGRAD_VARIANTS = "dW ragged TMA / TMA stores"  # the plain TMA dW kernel


_failed: dict[Fallback, set[int]] = {kind: set() for kind in Fallback}


def device_index(device: torch.device) -> int:
    """The CUDA index of ``device`` (the current device's where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def fell_back(kind: Fallback, device: torch.device) -> bool:
    """True once a launch on ``device`` failed and turned ``kind`` off there."""
    return device.type == "cuda" and device_index(device) in _failed[kind]


def clear_fallbacks() -> None:
    """Forget every recorded failure (tests)."""
    for devices in _failed.values():
        devices.clear()


def launch_or_fall_back(launch: Callable[[], None], kind: Fallback, device: torch.device, *,
                        explicit: bool, what: str, instead: str) -> bool:
    """Runs ``launch()``; True if it ran. If it raises one of :data:`TMA_LAUNCH_ERRORS`:
    re-raises when ``explicit`` (asked for by an explicit ``config``), else records ``kind``
    as failed on ``device``, logs a warning the first time and returns False (the caller
    then launches without it). Any other exception, a CUDA out-of-memory error and
    Triton's ``OutOfResources`` propagate."""
    try:
        launch()
        return True
    except TMA_LAUNCH_ERRORS as exc:
        if explicit or isinstance(exc, (torch.OutOfMemoryError, OutOfResources)):
            raise
        index = device_index(device)
        if index not in _failed[kind]:
            _failed[kind].add(index)
            logger.warning("compileops.grouped_linear: %s failed on cuda:%d (%s: %s); using %s "
                           "on this device from now on", what, index, type(exc).__name__, exc,
                           instead)
        return False
