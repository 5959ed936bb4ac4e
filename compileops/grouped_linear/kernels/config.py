"""Tile configs of the grouped linear kernels: :class:`Config`, the tuning API, and the
host-side heuristics that pick one per launch (host ints only, never a device read).

Why the defaults are what they are, with the measurements: ``benchmarks/RESULTS.md``
(grouped linear). ``benchmarks/tuning/sweep_grouped_linear.py`` times the alternatives.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton


@dataclasses.dataclass(frozen=True)
class Config:
    """The tile config of one grouped linear launch.

    Pass one as ``config=`` to :func:`~compileops.grouped_linear.kernels.mjagged_gemm` or
    :func:`~compileops.grouped_linear.kernels.grouped_linear_wgrad` to override the
    heuristics (:func:`choose_config`, :func:`choose_wgrad_config`). An opt-in variant asked
    for by an explicit config raises if it fails to launch (a sweep must not time a
    fallback); from a default config it falls back (see ``kernels/tma.py``).

    Tiles and schedule:

    * ``block_m, block_n, block_k``: M-jagged products (forward, dX, SwiGLU): output tile
      ``block_m x block_n``, reduction step ``block_k``. dW: ``block_m`` is the row chunk
      each dW tile reduces over, the output tile is ``block_n x block_k``.
    * ``num_warps, num_stages``: Triton launch options (``num_stages``: the software
      pipeline's operand buffers).
    * ``programs_per_sm``: persistent programs per SM; above 1, co-resident programs hide
      each other's prologue and epilogue.
    * ``group_m``: M-jagged: M-tiles per L2 super-group (``locate_tile``).
    * ``group_n``: dW: N-tiles per super-block, swept N-tile fastest; 1: K-tile fastest
      (``kjagged_tile_coords``).
    * ``flatten``: pipeline across consecutive tiles. M-jagged: ``tl.range(flatten=True)``
      over the persistent tile loop. dW (with ``ragged_tma``, the static schedule and no
      db): one loop over all of a program's row chunks (``kjagged_flat_loop``).
    * ``dynamic_tiles``: dW: tiles handed out by an integer ticket counter instead of a
      fixed stride, so programs that drew small groups take more tiles.

    Opt-in TMA variants: eager launches on sm90+ with TMA-able strides only; the pointer
    path and the Inductor template ignore them, and a launch drops one where it does not
    apply (``mjagged_tma_store``, ``wgrad_variant_flags``):

    * ``tma_store``: output tiles leave by TMA (async bulk copies). dW: when
      ``N % block_n == 0`` and dW is 16-bit; M-jagged: through a ragged descriptor that
      drops the rows past the tile's group.
    * ``ragged_tma``: dW: each group's partial last row chunk through zero-filling ragged
      descriptors, instead of a masked pointer loop.
    * ``epilogue_subtile``: dW with ``tma_store``: the store in two
      ``[block_n, block_k / 2]`` halves (half the shared-memory staging buffer).

    The schedule (``programs_per_sm``, ``dynamic_tiles``, dW's ``flatten``), the tile order
    (``group_m``, ``group_n``) and the TMA variants never change a result's bits; the block
    sizes set the reduction order.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    flatten: bool = False
    programs_per_sm: int = 1
    group_m: int = 8
    group_n: int = 1
    ragged_tma: bool = False
    tma_store: bool = False
    epilogue_subtile: bool = False
    dynamic_tiles: bool = False


# Batch-invariant mode: one fixed config for the M-jagged products, whatever the group sizes.
BATCH_INVARIANT_CONFIG = Config(64, 64, 32, num_warps=4, num_stages=3)
# CPU tensors run under Triton's interpreter, one numpy op per tile statement: small tiles.
INTERPRETER_CONFIG = Config(16, 32, 32, num_warps=1, num_stages=1)


def choose_config(m_total: int, groups: int, n: int, k: int, dtype: torch.dtype,
                  device: torch.device, *, batch_invariant: bool = False,
                  swiglu: bool = False) -> Config:
    """M-jagged tile config from the mean group size ``M / G`` (host ints only).

    Small groups (decode-like MoE, many experts) get short M tiles so little work is
    masked. Larger groups in 16-bit get 128 x 256 tiles (the intensity Hopper's wgmma needs
    to stay off the L2-bandwidth limit) with the persistent loop flattened, so the next
    tile's loads overlap this tile's epilogue, and four operand stages (192 KB of shared
    memory); SwiGLU holds two accumulators, so its tiles are 128 x 128 and not flattened.
    ``batch_invariant`` returns the fixed :data:`BATCH_INVARIANT_CONFIG` (on CPU, the
    interpreter's config).
    """
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    if batch_invariant:
        return BATCH_INVARIANT_CONFIG
    mean = m_total / max(groups, 1)
    small = dtype == torch.float32
    if mean <= 16:
        return Config(16, 128, 64 if not small else 32, num_warps=4, num_stages=4)
    if mean <= 64:
        return Config(64, 128, 64 if not small else 32, num_warps=4, num_stages=4)
    if small:
        return Config(128, 128 if n >= 128 else 64, 32, num_warps=8, num_stages=2)
    if swiglu:
        return Config(128, 128, 64, num_warps=8, num_stages=3)
    if n <= 128:
        return Config(128, 128, 64, num_warps=8, num_stages=3, flatten=True)
    return Config(128, 256, 64, num_warps=8, num_stages=4, flatten=True)


# dW defaults, 16-bit inputs on a GPU. Where a variant flag does not apply to a launch (no
# TMA: pre-sm90 GPUs, COMPILEOPS_GROUPED_TMA=0, unaligned strides; for tma_store also
# N % block_n != 0, a non-16-bit or unaligned dW) the launch drops it (wgrad_variant_flags).
#
# Long groups (M / G >= 1024): 64-row chunks into 128 x 256 dW tiles, three operand stages,
# ragged TMA loads, TMA stores of whole dW tiles (216064 B of shared memory on sm_90, limit
# 232448: no subtiling needed), super-blocks of 8 N-tiles (a large group's X_g outgrows L2,
# and the super-blocks share its column blocks across N-tiles), and without db the
# flattened chunk loop.
WGRAD_LONG_CONFIG = Config(64, 128, 256, num_warps=8, num_stages=3, flatten=True,
                           ragged_tma=True, tma_store=True, group_n=8)
# Mid groups (512 <= M / G < 1024): the long tile with a fourth operand stage, its dW tile
# stored in two halves (32 KB staging; 231712 B in all).
WGRAD_MID_CONFIG = Config(64, 128, 256, num_warps=8, num_stages=4, flatten=True,
                          ragged_tma=True, tma_store=True, epilogue_subtile=True, group_n=8)
# Short groups (few chunks per tile): 128 x 128 dW tiles, two programs per SM (100608 B
# each), so one's prologue and epilogue overlap the other's loop; ragged TMA loads.
WGRAD_SHORT_CONFIG = Config(64, 128, 128, num_warps=4, num_stages=3, programs_per_sm=2,
                            ragged_tma=True)
WGRAD_FP32_CONFIG = Config(32, 128, 64, num_warps=8, num_stages=3)


def choose_wgrad_config(m_total: int, groups: int, n: int, k: int, dtype: torch.dtype,
                        device: torch.device) -> Config:
    """dW (K-jagged) config from the mean group size ``M / G``: :data:`WGRAD_LONG_CONFIG`
    from 1024 rows per group, :data:`WGRAD_MID_CONFIG` from 512, else
    :data:`WGRAD_SHORT_CONFIG` (see the comments above them); fp32 and the interpreter get
    configs without variant flags."""
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return WGRAD_FP32_CONFIG
    mean = m_total / max(groups, 1)
    if mean >= 1024:
        return WGRAD_LONG_CONFIG
    if mean >= 512:
        return WGRAD_MID_CONFIG
    return WGRAD_SHORT_CONFIG


def input_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 unless ``torch.backends.cuda.matmul.allow_tf32``; tf32 is ignored for
    16-bit inputs (they use the tensor cores' native precision)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def interpreter_dot(t: torch.Tensor) -> bool:
    """CPU tensors run under Triton's interpreter, whose ``tl.dot`` needs two work-arounds
    (:func:`compileops.grouped_linear.kernels.mjagged.tile_dot`): triton 3.6 multiplies bf16
    tiles as raw integer bits, so tiles are upcast to fp32; and numpy's matmul (OpenBLAS) may
    round a row differently by its position in the tile, which would break bitwise batch
    invariance, so the M-jagged product is an explicit product-and-sum. GPUs run the MMA."""
    return t.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def num_programs(device_index: Optional[int], device_type: str) -> int:
    """Persistent grid size: one program per SM on GPUs, 4 in the interpreter."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 4


def grid_size(device: torch.device, cfg: Config) -> int:
    """Programs of a persistent launch with ``cfg`` on ``device``."""
    base = num_programs(device.index if device.type == "cuda" else None, device.type)
    return base * cfg.programs_per_sm


def group_block(groups: int) -> int:
    """Lanes of the per-group tables (``G_BLOCK``): a power of two above ``groups``, one lane
    per group plus the tail lane."""
    return triton.next_power_of_2(groups + 1)
