"""Launch options of the embedding kernels: the tuning API.

:class:`ForwardConfig` is the gather's tile shape. :class:`BackwardConfig` is everything a
caller of :func:`~compileops.embedding.kernels.embedding_backward` may choose: the schedule
(streams, sort, id order, how untouched rows are found) and the kernel's tile sizes. Every
field's default is the shipped default; ``None`` means "derived from the grad", resolved by
:meth:`BackwardConfig.resolve` into the :class:`BackwardTiles` that one launch of the
backward kernel takes. No option changes the result: every choice gives bitwise the same
gradient (the reference's). See ``docs/architecture.md`` for how the kernels and the ops fit
together.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..._launch import cdiv, next_power_of_2

SORTS = ("auto", "triton", "torch")
FILLS = ("search", "map")


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Tile of one forward program: ``block_tok`` ids x ``block_col`` columns."""

    block_tok: int
    block_col: int
    num_warps: int = 4

    @staticmethod
    def default(dim: int, elem_size: int) -> "ForwardConfig":
        """16-byte accesses, ~16 KB moved per program."""
        block_col = min(next_power_of_2(dim), max(16, 4096 // elem_size))
        block_tok = max(1, min(16, (16384 // elem_size) // block_col))
        return ForwardConfig(block_tok, block_col, 4)


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """One launch of ``embedding_backward_kernel``, every default resolved for one grad
    ``[n_tokens, D]`` and output dtype (:meth:`BackwardConfig.resolve`)."""

    run_block: int  # sorted positions per run program
    unroll: int  # longest run summed by the short-run path
    tile: int  # rows per step of the long-run path
    block_col: int  # columns per run program (at most the dim's next power of two)
    num_warps: int  # of the run and fill programs
    maxnreg: Optional[int]  # register cap (CUDA only)
    fill_rows: int  # rows per fill program
    fill_chunk: int  # rows per fill store
    fill_col: int  # columns per fill store (at most the dim's next power of two)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Options of the embedding backward. The defaults are the shipped configuration.

    Schedule:

    * ``streams`` (``None``: on for CUDA tensors): the two-stream schedule. The fill of
      untouched rows reads a touched-row map built from the unsorted ids and runs on the
      current stream, while a high-priority side stream sorts the ids and runs the run
      programs; the current stream then waits for the side stream. Off: one launch after
      the sort.
    * ``sort``: ``"auto"`` (the two-launch Triton sort on CUDA up to 65536 ids and tables
      below 2**31 rows, else ``torch.sort``), ``"triton"`` or ``"torch"``. The same sorted
      order either way.
    * ``hot_first`` (``None``: on in the two-stream schedule with the Triton sort): sort
      the ids by decreasing count, so that the run programs, launched in sorted order,
      start the longest (latency-bound) runs first. Needs the Triton sort and a touched map
      (the two-stream schedule, or ``fill="map"``).
    * ``fill`` (one-launch schedule): ``"search"`` finds untouched rows by binary search
      in the sorted ids; ``"map"`` builds a touched-row map first (two more launches).

    Tile sizes of the backward kernel (powers of two; ``None``: derived from the grad's
    element size so that nothing spills registers on sm_90, see :meth:`resolve`):

    * ``run_block``: sorted positions per run program; ``unroll``: the longest run summed
      by the short-run path (``>= run_block - 1``), longer runs take the long path;
      ``tile``: rows per long-path step.
    * ``block_col``: columns per run program; ``num_warps`` (``None``: 8 for 1024+ columns,
      4 for 512, else 2); ``maxnreg`` (CUDA only; ``None``: the compiler's choice): a
      register cap, which also makes ptxas issue all of a long-path step's row loads
      before its adds.
    * ``fill_rows`` (``None``: ~16 KB of rows) rows per fill program, ``fill_col`` columns
      per fill store.
    """

    streams: Optional[bool] = None
    sort: str = "auto"
    hot_first: Optional[bool] = None
    fill: str = "search"
    run_block: Optional[int] = None
    unroll: Optional[int] = None
    tile: Optional[int] = None
    block_col: int = 512
    num_warps: Optional[int] = None
    maxnreg: Optional[int] = 128
    fill_rows: Optional[int] = None
    fill_col: int = 1024

    def __post_init__(self) -> None:
        if self.sort not in SORTS:
            raise ValueError(f"unknown sort {self.sort!r}: expected one of {SORTS}")
        if self.fill not in FILLS:
            raise ValueError(f"unknown fill {self.fill!r}: expected 'search' or 'map'")

    def resolve(self, flat_grad: torch.Tensor, out_dtype: torch.dtype) -> BackwardTiles:
        """The checked tiles for a grad ``[n_tokens, D]`` and a ``[V, D]`` output of
        ``out_dtype``."""
        n_tokens, dim = flat_grad.shape
        unit_cols = flat_grad.stride(1) == 1 or dim == 1
        tiles = _resolve(self, flat_grad.element_size(), unit_cols, dim,
                         out_dtype.itemsize)
        # Sorted positions are int32 in the kernel, and loads reach up to two steps past
        # the last one.
        if n_tokens >= 2**31 - 2 * max(tiles.tile, tiles.unroll) - _POSITION_HEADROOM:
            raise ValueError(f"embedding_backward supports < 2**31 tokens, got {n_tokens}")
        return tiles


DEFAULT_BACKWARD = BackwardConfig()

# Headroom below 2**31 for the int32 sorted positions.
_POSITION_HEADROOM = 4096


@functools.lru_cache(maxsize=256)
def _resolve(config: BackwardConfig, elem: int, unit_cols: bool, dim: int,
             out_elem: int) -> BackwardTiles:
    run_block = config.run_block or (max(1, 8 // elem) if unit_cols else 1)
    # 32 rows per long-path step for 16-bit grads, the same bytes per step for others;
    # 4 when the grad's columns are not contiguous.
    tile = config.tile or ((32 if elem == 2 else max(1, 32 // elem)) if unit_cols else 4)
    unroll = config.unroll or max(4, run_block - 1)
    if unroll < max(1, run_block - 1):
        raise ValueError(f"unroll ({unroll}) must be >= max(1, run_block - 1) ({run_block - 1})")
    for name, value in (("run_block", run_block), ("tile", tile),
                        ("fill_rows", config.fill_rows or 1), ("block_col", config.block_col),
                        ("fill_col", config.fill_col)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    block_col = min(next_power_of_2(dim), config.block_col)
    fill_col = min(next_power_of_2(dim), config.fill_col)
    fill_rows = config.fill_rows
    if fill_rows is None:  # ~16 KB of rows per fill program: 2 rows at D=4096 bf16
        fill_rows = max(1, min(64, next_power_of_2(cdiv(1 << 14, dim * out_elem))))
    # Rows per store: at most 8192 elements (64 per thread with 4 warps): no register spills.
    fill_chunk = min(fill_rows, max(1, next_power_of_2(8192 // fill_col)))
    num_warps = config.num_warps or (8 if block_col >= 1024 else 4 if block_col >= 512 else 2)
    return BackwardTiles(run_block=run_block, unroll=unroll, tile=tile, block_col=block_col,
                         num_warps=num_warps, maxnreg=config.maxnreg, fill_rows=fill_rows,
                         fill_chunk=fill_chunk, fill_col=fill_col)


def device_options(device: torch.device) -> dict:
    """Compile options of every eager embedding launch on ``device``. ``debug=True`` keeps
    the device-side id asserts; integer-overflow sanitising stays off (the choice Inductor
    makes for its own indirect-indexing asserts)."""
    if device.type == "cuda" and not torch.version.hip:
        return {"debug": True, "sanitize_overflow": False}
    return {}
