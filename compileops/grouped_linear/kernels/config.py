"""Tile configs of the grouped linear kernels: :class:`Config`, the tuning API, and the
host-side heuristics that pick one per launch (host ints only, never a device read).

The pick depends on the device, described by a :class:`DeviceSpec` (name, SM count, shared
memory per block, compute capability): :func:`device_spec` reads it from a GPU, and tests or
offline tools pass one (:data:`H100_SXM`, :data:`H200`) to ask "what would run on that part"
on a CPU machine. Configs measured on one part live in :data:`TUNED`, one row per device
name; a part without a row (or a case its row does not list) gets the generic rule, bounded
by the part's shared memory. Nothing measured on one part is assumed on another.

Why the defaults are what they are, with the measurements: ``benchmarks/RESULTS.md``
(grouped linear). ``benchmarks/tuning/sweep_grouped_linear.py`` times the alternatives and
prints the :data:`TUNED` row its results support (``--table-row``).
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
    * ``warp_specialize``: M-jagged: Triton's warp specialisation of the persistent tile
      loop (``tl.range(warp_specialize=True)``): producer warps issue the TMA loads while
      the MMA warps compute and store, so a tile's epilogue overlaps the next tile's loads.
      Hopper's warp specialisation takes no ``flatten``; on sm90 with triton 3.6 it built
      with 8 warps and failed in Triton's warp-specialisation pass with 4. Opt-in (no
      default config uses it): in the fast-accumulation sweep it made the SwiGLU product
      4-6% faster at three of four layers and the plain products slower, and the compiled
      layer with it on SwiGLU moved within the spread between machines (benchmarks/RESULTS.md,
      fp8).

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
    warp_specialize: bool = False


# Batch-invariant mode: one fixed config for the M-jagged products, whatever the group sizes.
BATCH_INVARIANT_CONFIG = Config(64, 64, 32, num_warps=4, num_stages=3)
# CPU tensors run under Triton's interpreter, one numpy op per tile statement: small tiles.
INTERPRETER_CONFIG = Config(16, 32, 32, num_warps=1, num_stages=1)


# ---------------------------------------------------------------------------------------
# The device a config is picked for


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What the config heuristics know of a device.

    * ``name``: ``torch.cuda.get_device_name()`` (the :data:`TUNED` key);
    * ``sm_count``: streaming multiprocessors (the persistent grid is one program per SM
      times ``Config.programs_per_sm``);
    * ``smem_per_block``: the shared memory one program may use, in bytes (the opt-in
      maximum; it bounds the operand stages);
    * ``capability``: the CUDA compute capability, ``(0, 0)`` for the interpreter (TMA
      descriptors need ``(9, 0)`` or above).
    """

    name: str
    sm_count: int
    smem_per_block: int
    capability: tuple[int, int] = (0, 0)

    @property
    def interpreter(self) -> bool:
        """Triton's interpreter on CPU tensors (no GPU)."""
        return self.capability == (0, 0)


# Descriptions of the parts the project runs on, for tests and offline planning (what
# device_spec() reads on each: 132 SMs, 227 KB of opt-in shared memory per block, sm_90).
H100_SXM = DeviceSpec("NVIDIA H100 80GB HBM3", 132, 232448, (9, 0))
H200 = DeviceSpec("NVIDIA H200", 132, 232448, (9, 0))
# CPU tensors under Triton's interpreter: four programs (num_programs).
INTERPRETER = DeviceSpec("Triton interpreter (CPU)", 4, 0, (0, 0))


@functools.lru_cache(maxsize=None)
def _cuda_spec(index: int) -> DeviceSpec:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    if not smem:  # older torch: ask Triton's driver
        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return DeviceSpec(props.name, props.multi_processor_count, int(smem),
                      (props.major, props.minor))


def device_spec(device) -> DeviceSpec:
    """The :class:`DeviceSpec` of ``device`` (a ``torch.device``; a ``DeviceSpec`` is
    returned as is). CUDA devices are queried once per index; CPU tensors run under the
    interpreter (:data:`INTERPRETER`)."""
    if isinstance(device, DeviceSpec):
        return device
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_spec(device.index if device.index is not None
                          else torch.cuda.current_device())
    return INTERPRETER


# dW configs, 16-bit inputs on a GPU: the generic rule's picks (choose_wgrad_config), measured
# on the H100 (TUNED's row cites them). Where a variant flag does not apply to a launch (no
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


# ---------------------------------------------------------------------------------------
# Measured picks per device
#
# One row per device name (torch.cuda.get_device_name()); each names where it was measured.
# A row lists only the cases its sweeps measured; the others, and parts without a row, get
# the generic rule (_generic_config; choose_wgrad_config's constants above). To add or update
# a row, run on that part
#     python benchmarks/tuning/sweep_grouped_linear.py --layer-shapes --passes swiglu fwd dX \
#         --table-row
# which prints the row the sweep's results support (benchmarks/README.md, "tuning/").
#
# Cases (16-bit inputs on a GPU; fp32, small groups and batch-invariant mode stay generic):
#   "swiglu"      the fused gate/up SwiGLU product, more than 64 rows per group
#   "fwd"         forward and dX, more than 64 rows per group, more than 128 output columns
#   "fwd_narrow"  the same with at most 128 output columns
#   "wgrad_long" / "wgrad_mid" / "wgrad_short"  dW, 1024+ / 512-1023 / fewer rows per group
TUNED: dict[str, dict[str, Config]] = {
    # H100 80GB HBM3 (SXM), torch 2.11 / triton 3.6: the 2026-11-21/22 sweeps on the
    # grouped-linear bench shapes (benchmarks/RESULTS.md, "Grouped linear" and its tried-and-
    # dropped list): 128 x 256 flattened, four stages (K <= 1024 included); SwiGLU 128 x 128
    # not flattened; dW long / mid / short as above. "fwd_narrow" was not swept (generic).
    "NVIDIA H100 80GB HBM3": {
        "swiglu": Config(128, 128, 64, num_warps=8, num_stages=3),
        "fwd": Config(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
        "wgrad_long": WGRAD_LONG_CONFIG,
        "wgrad_mid": WGRAD_MID_CONFIG,
        "wgrad_short": WGRAD_SHORT_CONFIG,
    },
    # H200 (141 GB), torch 2.11 / triton 3.6, 2026-11-27: `sweep_grouped_linear.py
    # --layer-shapes --passes swiglu fwd dX --table-row` over the MoE layers' own GEMMs
    # (balanced and skewed splits): the H100's fwd tile (1.09x torch._grouped_mm on average);
    # SwiGLU with TMA stores (1.23x _grouped_mm + eager SwiGLU). dW not swept: generic.
    "NVIDIA H200": {
        "swiglu": Config(128, 128, 64, num_warps=8, num_stages=3, tma_store=True),
        "fwd": Config(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    },
}


def tuned_config(spec: DeviceSpec, case: str) -> Optional[Config]:
    """The :data:`TUNED` config of ``case`` on ``spec``'s part, or None (generic rule)."""
    return TUNED.get(spec.name, {}).get(case)


# Shared memory kept free of operand stages for the epilogue (layout conversion, barriers):
# on sm_90 the four-stage 128 x 256 x 64 tile (192 KB of stages) runs in 227 KB.
EPILOGUE_SMEM_RESERVE = 32 * 1024


def operand_stage_bytes(cfg: Config, element_size: int, *, swiglu: bool = False) -> int:
    """Shared memory of one M-jagged operand stage: an A tile ``[block_m, block_k]`` and one
    B tile ``[block_k, block_n]`` (two with SwiGLU: gate and up)."""
    b_tiles = 2 if swiglu else 1
    return (cfg.block_m + b_tiles * cfg.block_n) * cfg.block_k * element_size


def _stages_that_fit(cfg: Config, spec: DeviceSpec, element_size: int, want: int, *,
                     swiglu: bool = False) -> int:
    """``want`` operand stages, fewer where ``spec``'s shared memory (less
    :data:`EPILOGUE_SMEM_RESERVE` for the epilogue) holds fewer; at least 2."""
    budget = spec.smem_per_block - EPILOGUE_SMEM_RESERVE
    fit = budget // max(operand_stage_bytes(cfg, element_size, swiglu=swiglu), 1)
    return max(2, min(want, fit))


def _generic_config(mean: float, n: int, dtype: torch.dtype, spec: DeviceSpec,
                    swiglu: bool, k: int = 0, fp8_fast_accum: bool = False,
                    out_size: int = 2) -> Config:
    """The rule for a part (or case) without a :data:`TUNED` entry, from the mean group size
    and the part's shared memory: the tile shapes Hopper's wgmma wants, with as many operand
    stages as the part holds (the narrower tile where the wide one would get fewer than 3)."""
    small = dtype == torch.float32
    if dtype.itemsize == 1:
        return _generic_fp8_config(mean, spec, swiglu, k, fp8_fast_accum, out_size)
    bk = 32 if small else 64
    if mean <= 16:
        cfg = Config(16, 128, bk, num_warps=4, num_stages=4)
    elif mean <= 64:
        cfg = Config(64, 128, bk, num_warps=4, num_stages=4)
    elif small:
        cfg = Config(128, 128 if n >= 128 else 64, bk, num_warps=8, num_stages=2)
    elif swiglu:
        cfg = Config(128, 128, bk, num_warps=8, num_stages=3)
    elif n <= 128:
        cfg = Config(128, 128, bk, num_warps=8, num_stages=3, flatten=True)
    else:
        cfg = Config(128, 256, bk, num_warps=8, num_stages=4, flatten=True)
        if _stages_that_fit(cfg, spec, dtype.itemsize, 4) < 3:
            cfg = Config(128, 128, bk, num_warps=8, num_stages=3, flatten=True)
    stages = _stages_that_fit(cfg, spec, dtype.itemsize, cfg.num_stages, swiglu=swiglu)
    return dataclasses.replace(cfg, num_stages=stages)


#: The fast-accumulation fp8 tile of the plain products (forward, dX) where it fits.
FP8_FAST_ACCUM_WIDE = Config(128, 256, 128, num_warps=8, num_stages=3, flatten=True)


def _flattened_epilogue_fits(cfg: Config, spec: DeviceSpec, out_size: int) -> bool:
    """Whether an e4m3 tile loop flattened across tiles fits ``spec``'s shared memory with
    its output tile (``out_size`` bytes an element) beside the operand stages. Flattened,
    the stages stay live while a tile's epilogue converts the output through shared memory,
    so the two add up: on an H200 the 128 x 256 tile with 3 stages (144 KB) and an fp32
    output (128 KB) asked for 272 KB, more than the 227 KB a block gets, and failed to
    launch; with a bf16 output (64 KB) it runs."""
    stages = cfg.num_stages * operand_stage_bytes(cfg, 1)
    return stages + cfg.block_m * cfg.block_n * out_size <= spec.smem_per_block


#: fp8 products with at most this many K take the flattened persistent loop: few K steps
#: of 128 per tile, so overlapping a tile's epilogue with the next tile's loads pays.
FP8_FLATTEN_MAX_K = 2048


def _generic_fp8_config(mean: float, spec: DeviceSpec, swiglu: bool, k: int,
                        fast_accum: bool = False, out_size: int = 2) -> Config:
    """e4m3 operands, K steps of 128 (the bytes of 16-bit's 64); ``out_size``: the bytes of
    an output element.

    With fast accumulation (the MMA sums in place, one fp32 accumulator per output tile):
    128 x 256 tiles, 3 stages, the persistent loop flattened at every K; SwiGLU (a gate and
    an up accumulator, 128 x 128 each) 3 stages, not flattened. From
    ``sweep_grouped_linear_fp8.py --scalings rowwise --fast-accum`` over every
    ``bench_moe_layer.py`` product on an H100 (benchmarks/RESULTS.md, fp8): the down
    products (forward and dX) 4-15% faster than 128 x 128 at each of the four layers, SwiGLU
    at Qwen3-30B-A3B 12% faster unflattened and the same elsewhere. The wide tile only where
    its stages and the output tile fit in shared memory together
    (:func:`_flattened_epilogue_fits`): with fp32 outputs they do not, and the product takes
    the default accumulation's tile.

    With the default accumulation: 128 x 128 output tiles,
    4 stages (3 for SwiGLU), flattened where K <= :data:`FP8_FLATTEN_MAX_K`. From the tile
    sweep of every ``bench_moe_layer.py`` product on an H200 (benchmarks/RESULTS.md, fp8):
    flattening won at K = 768-2048 (Qwen3-30B-A3B down 0.93x against 0.80x bf16
    ``_grouped_mm``, Qwen3-235B-A22B down 1.06x against 0.98x) and lost at K >= 4096
    (Mixtral down 1.07x against 1.25x); 128 x 64 and 64 x 128 tiles lost everywhere. The fp8
    MMA adds each K step's products into a second accumulator that is then added to the
    fp32 one (:func:`.mjagged.tile_dot`), so a tile holds twice the accumulator registers:
    128 x 256 spills and ran at half 128 x 128's rate or less."""
    if mean <= 64:
        cfg = Config(64, 64 if swiglu else 128, 128, num_warps=4, num_stages=4)
    elif fast_accum and swiglu:
        cfg = Config(128, 128, 128, num_warps=8, num_stages=3)
    elif fast_accum and _flattened_epilogue_fits(FP8_FAST_ACCUM_WIDE, spec, out_size):
        cfg = FP8_FAST_ACCUM_WIDE
    else:
        cfg = Config(128, 128, 128, num_warps=8, num_stages=3 if swiglu else 4,
                     flatten=0 < k <= FP8_FLATTEN_MAX_K)
    return dataclasses.replace(
        cfg, num_stages=_stages_that_fit(cfg, spec, 1, cfg.num_stages, swiglu=swiglu))


def mjagged_case(m_total: int, groups: int, n: int, dtype: torch.dtype, *,
                 swiglu: bool = False) -> Optional[str]:
    """The :data:`TUNED` case of an M-jagged product (forward, dX, SwiGLU), or None where
    the generic rule always decides (fp32, fp8, 64 rows per group or fewer)."""
    # fp8 has no measured rows yet: the generic rule, with fp8's K step.
    if dtype in (torch.float32, torch.float8_e4m3fn) or m_total / max(groups, 1) <= 64:
        return None
    if swiglu:
        return "swiglu"
    return "fwd_narrow" if n <= 128 else "fwd"


def choose_config(m_total: int, groups: int, n: int, k: int, dtype: torch.dtype,
                  device, *, batch_invariant: bool = False, swiglu: bool = False,
                  fp8_fast_accum: bool = False,
                  out_dtype: Optional[torch.dtype] = None) -> Config:
    """M-jagged tile config from the mean group size ``M / G`` (host ints only) for
    ``device`` (a ``torch.device`` or a :class:`DeviceSpec`).

    Small groups (decode-like MoE, many experts) get short M tiles so little work is
    masked. Larger groups in 16-bit take the part's :data:`TUNED` entry, else the generic
    rule: 128 x 256 tiles (the intensity Hopper's wgmma needs to stay off the L2-bandwidth
    limit) with the persistent loop flattened, so the next tile's loads overlap this tile's
    epilogue, and as many operand stages as the part's shared memory holds, up to four
    (192 KB); SwiGLU holds two accumulators, so its tiles are 128 x 128 and not flattened.
    ``batch_invariant`` returns the fixed :data:`BATCH_INVARIANT_CONFIG` (in the
    interpreter, its config). ``fp8_fast_accum`` (e4m3 operands): the rowwise product whose
    MMA accumulates over the whole K loop, which holds half the accumulator registers and
    takes wider tiles (:func:`_generic_fp8_config`). ``out_dtype``: the product's output
    dtype (default: the operands' dtype, 16-bit for e4m3 operands), which a tile's epilogue
    holds in shared memory.
    """
    spec = device_spec(device)
    if spec.interpreter:
        return INTERPRETER_CONFIG
    if batch_invariant:
        return BATCH_INVARIANT_CONFIG
    case = mjagged_case(m_total, groups, n, dtype, swiglu=swiglu)
    tuned = tuned_config(spec, case) if case else None
    if tuned is not None:
        return tuned
    out_size = (out_dtype.itemsize if out_dtype is not None
                else 2 if dtype.itemsize == 1 else dtype.itemsize)
    return _generic_config(m_total / max(groups, 1), n, dtype, spec, swiglu, k, fp8_fast_accum,
                           out_size)


def wgrad_case(m_total: int, groups: int) -> str:
    """The :data:`TUNED` case of a 16-bit dW launch, by the mean group size."""
    mean = m_total / max(groups, 1)
    return "wgrad_long" if mean >= 1024 else "wgrad_mid" if mean >= 512 else "wgrad_short"


# The generic dW rule's configs, by case (TMA stores and four stages need sm90's shared
# memory: on a part with less, the generic rule drops to WGRAD_SHORT_CONFIG).
_GENERIC_WGRAD = {"wgrad_long": WGRAD_LONG_CONFIG, "wgrad_mid": WGRAD_MID_CONFIG,
                  "wgrad_short": WGRAD_SHORT_CONFIG}
# Shared memory the long and mid dW configs need on sm_90 (see the comments above them).
_WGRAD_LONG_SMEM = 231712


def choose_wgrad_config(m_total: int, groups: int, n: int, k: int, dtype: torch.dtype,
                        device) -> Config:
    """dW (K-jagged) config from the mean group size ``M / G`` for ``device`` (a
    ``torch.device`` or a :class:`DeviceSpec`): the part's :data:`TUNED` entry, else
    :data:`WGRAD_LONG_CONFIG` from 1024 rows per group, :data:`WGRAD_MID_CONFIG` from 512,
    else :data:`WGRAD_SHORT_CONFIG` (see the comments above them; the first two only where
    the part's shared memory holds them); fp32 and the interpreter get configs without
    variant flags."""
    spec = device_spec(device)
    if spec.interpreter:
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return WGRAD_FP32_CONFIG
    case = wgrad_case(m_total, groups)
    tuned = tuned_config(spec, case)
    if tuned is not None:
        return tuned
    if case != "wgrad_short" and spec.smem_per_block < _WGRAD_LONG_SMEM:
        return WGRAD_SHORT_CONFIG
    return _GENERIC_WGRAD[case]


#: fp8 dW with fast accumulation, from 1024 rows per group: 128-row chunks (128 e4m3 codes,
#: the bytes of 16-bit's 64) and 128 x 256 dW tiles, 8 warps, 3 stages (48 KB each). From a
#: sweep of the fp8 dW of every ``bench_moe_layer.py`` product on an H100 (quantisation
#: included, uniform groups): 9-12% faster than the 16-bit pick at Mixtral-8x7B (2048 rows
#: per expert) and DeepSeek-V3's gate/up (1024), 3% at its down projection; at 512 rows per
#: expert (Qwen3-30B-A3B, Qwen3-235B-A22B) 0.7-3.3% slower, so those keep the 16-bit pick.
FP8_WGRAD_LONG_CONFIG = Config(128, 128, 256, num_warps=8, num_stages=3)


def choose_fp8_wgrad_config(m_total: int, groups: int, n: int, k: int, device, *,
                            fast_accum: bool) -> Config:
    """fp8 dW (e4m3 operands, :func:`~.fp8_wgrad.grouped_linear_wgrad_fp8`) config:
    :data:`FP8_WGRAD_LONG_CONFIG` with fast accumulation from 1024 rows per group where the
    part's shared memory holds at least two of its stages, else the 16-bit dW's pick
    (:func:`choose_wgrad_config`; its TMA variant flags are not used). Without fast
    accumulation the partial sums go to fp32 every ``block_m`` rows, so the row chunk sets
    the error: it stays the 16-bit pick's (64 rows), which is what the accuracy figures in
    ``fp8_wgrad_op.py`` were measured with."""
    spec = device_spec(device)
    if spec.interpreter:
        return INTERPRETER_CONFIG
    cfg = FP8_WGRAD_LONG_CONFIG
    stage = cfg.block_m * (cfg.block_n + cfg.block_k)  # e4m3: one byte a code
    fit = (spec.smem_per_block - EPILOGUE_SMEM_RESERVE) // stage
    if fast_accum and m_total >= 1024 * max(groups, 1) and fit >= 2:
        return dataclasses.replace(cfg, num_stages=min(cfg.num_stages, fit))
    return choose_wgrad_config(m_total, groups, n, k, torch.bfloat16, device)


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


def grid_size(device, cfg: Config) -> int:
    """Programs of a persistent launch with ``cfg`` on ``device`` (a ``torch.device`` or a
    :class:`DeviceSpec`)."""
    if isinstance(device, DeviceSpec):
        return device.sm_count * cfg.programs_per_sm
    base = num_programs(device.index if device.type == "cuda" else None, device.type)
    return base * cfg.programs_per_sm


def group_block(groups: int) -> int:
    """Lanes of the per-group tables (``G_BLOCK``): a power of two above ``groups``, one lane
    per group plus the tail lane."""
    return triton.next_power_of_2(groups + 1)
