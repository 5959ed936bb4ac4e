"""Helpers shared by the mLSTM forward and backward kernel bodies."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Exponentials are exp2: gates are multiplied by log2(e) as they load.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def mma(a, b, acc, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with a ``[M, K]``, b ``[K, N]``, acc ``[M, N]`` in the accumulation
    dtype. ``UPCAST`` (16-bit tiles under Triton's interpreter, whose ``tl.dot`` multiplies
    bf16 as raw bits in triton 3.6): the tiles go to fp32 first. On GPUs: the MMA."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee",
                      out_dtype=acc.dtype)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=acc.dtype)


@triton.jit
def head_scale(scale, DQK: tl.constexpr, ACC: tl.constexpr):
    """``1 / sqrt(DQK)`` in ``ACC``. Triton passes a Python float argument as fp32, so the
    launcher's ``scale`` arrives rounded to fp32; fp64 kernels derive it again in fp64
    (correctly rounded, as Python's ``1.0 / math.sqrt(DQK)``), fp32 and 16-bit kernels keep
    the argument (the same bits, and the same compiled code, as before this helper)."""
    if ACC == tl.float64:
        scale = 1.0 / tl.sqrt(tl.full((), DQK, dtype=ACC))
    return scale


@triton.jit
def load_tile(base, rows, row_stride, cols, col_stride, n_rows, N_COLS: tl.constexpr,
              BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """``[len(rows), BLOCK_COLS]`` tile of a row-major view at ``base``; rows at or past
    ``n_rows`` (when ``CHECK_ROWS``) and columns past ``N_COLS`` read as 0."""
    ptrs = base + rows[:, None] * row_stride + cols[None, :] * col_stride
    if CHECK_ROWS:
        if BLOCK_COLS != N_COLS:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS),
                           other=0.0)
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    if BLOCK_COLS != N_COLS:
        return tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    return tl.load(ptrs)


@triton.jit
def column_term_max(igate_ptr, logf_ptr, start, end, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """``max_{start <= j < end} (igate_j - logf_j)`` (log2 units; ``-inf`` when empty) of one
    row's gates at ``igate_ptr``, ``logf_ptr``: the reference of the factorised decay left of
    a query tile. Wide blocks of ``BLOCK`` gates, so that the scan is a few loads."""
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=ACC)
    for first in range(start, end, BLOCK):
        cols = first + lanes
        ok = cols < end
        term = (tl.load(igate_ptr + cols, mask=ok, other=0.0)
                - tl.load(logf_ptr + cols, mask=ok, other=0.0)) * LOG2E
        best = tl.maximum(best, tl.where(ok, term, float("-inf")))
    return tl.max(best, axis=0)


def accumulation_dtype(dtype: torch.dtype):
    """Triton dtype of gate sums, stabilisers and norm statistics: fp64 for fp64, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def input_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 unless ``torch.backends.cuda.matmul.allow_tf32``; 16-bit inputs use
    the tensor cores' native precision whatever this says."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def upcast_dots(t: torch.Tensor) -> bool:
    """16-bit tiles under Triton's interpreter (CPU tensors) are multiplied in fp32."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def head_major_tile(num_tiles):
    """``(bh, i)`` of this program in a flat grid of ``B * NH * num_tiles`` programs, ``i`` in
    ``[0, num_tiles)``: the tiles of one (batch, head) are consecutive programs.

    Why flat and head-major: a head's query tiles all read its keys and values (its key tiles
    its queries, in the backward). Launched together, they read them from L2; with the head
    on the fastest grid axis, as before, the programs in flight belonged to ~132 different
    heads, and each tile of a head came a wave of ``B * NH`` programs later, long after its
    K and V had left L2, so every tile re-read them from HBM. One grid axis (up to 2**31 - 1
    programs) also keeps any ``B * NH`` and S launchable; a second axis stops at 65,535."""
    pid = tl.program_id(0)
    return pid // num_tiles, pid % num_tiles
