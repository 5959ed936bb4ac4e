"""Tile configs of the mLSTM kernels and the host-side heuristics that pick them.

Why the defaults are what they are: ``benchmarks/RESULTS.md`` (mLSTM), swept with
``benchmarks/tuning/sweep_mlstm.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from compileops._launch import cdiv
from compileops.mlstm.heads import head_tile, is_wide_head  # noqa: F401  (re-exported)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """``block_m`` query rows per program, key tiles of ``block_n`` (``block_m`` a multiple
    of ``block_n``), and the Triton launch options."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_m % self.block_n:
            raise ValueError(f"block_m ({self.block_m}) must be a multiple of block_n "
                             f"({self.block_n})")

    def capped(self, max_block_m: int) -> "ForwardConfig":
        """This config with its query tile (and key tile) no longer than ``max_block_m``
        (0: no cap)."""
        if not max_block_m or self.block_m <= max_block_m:
            return self
        return dataclasses.replace(self, block_m=max_block_m,
                                   block_n=min(self.block_n, max_block_m))


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """dK/dV programs: ``block_n`` key rows, query tiles of ``block_m``, on ``num_warps`` /
    ``num_stages``. dQ programs: ``block_m`` query rows, key tiles of ``dq_block_n``, on
    ``dq_num_warps`` / ``dq_num_stages`` (each None: the dK/dV value). ``block_m`` a multiple
    of both key tiles. The norm preprocess: tiles of ``block_rows`` rows on ``norm_warps``,
    each program looping over a span of rows so that about ``norm_programs`` programs run
    (:func:`norm_rows_per_program`)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: Rows per tile of the norm-backward preprocess.
    block_rows: int = 16
    dq_block_n: Optional[int] = None
    dq_num_warps: Optional[int] = None
    dq_num_stages: Optional[int] = None
    norm_warps: int = 4
    norm_programs: int = 8192

    def __post_init__(self):
        for name, tile in (("block_n", self.block_n), ("dq_block_n", self.dq_tile)):
            if self.block_m % tile:
                raise ValueError(f"block_m ({self.block_m}) must be a multiple of {name} "
                                 f"({tile})")

    @property
    def dq_tile(self) -> int:
        return self.block_n if self.dq_block_n is None else self.dq_block_n

    @property
    def dq_warps(self) -> int:
        return self.num_warps if self.dq_num_warps is None else self.dq_num_warps

    @property
    def dq_stages(self) -> int:
        return self.num_stages if self.dq_num_stages is None else self.dq_num_stages

    def capped(self, max_block_m: int) -> "BackwardConfig":
        """This config with its query tile (and key tiles) no longer than ``max_block_m``
        (0: no cap)."""
        if not max_block_m or self.block_m <= max_block_m:
            return self
        return dataclasses.replace(self, block_m=max_block_m,
                                   block_n=min(self.block_n, max_block_m),
                                   dq_block_n=min(self.dq_tile, max_block_m))


@dataclasses.dataclass(frozen=True)
class StateConfig:
    """The chunk-state walks of :mod:`.chunkwise` (forward states and their gradients): each
    program carries a ``[DQK, block_v]`` state tile through the chunks, taking each chunk's
    rows ``sub`` at a time (``sub`` a power of two; capped at the chunk length), on
    ``num_warps`` / ``num_stages``."""

    block_v: int = 64
    sub: int = 64
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        for name in ("block_v", "sub"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    def capped(self, chunk: int) -> "StateConfig":
        """This config with sub-blocks no longer than the chunk."""
        return self if self.sub <= chunk else dataclasses.replace(self, sub=chunk)


def norm_rows_per_program(batch_heads: int, seq: int, cfg: BackwardConfig) -> int:
    """Rows each norm-preprocess program walks: a multiple of ``cfg.block_rows``, so that
    the grid ``(B * NH, cdiv(S, span))`` has about ``cfg.norm_programs`` programs (at least
    one block of rows each). A function of the shape only: the partial sums' order, and so
    the weight and bias gradients, are reproducible."""
    blocks = max(1, -(-seq // cfg.block_rows))
    per_head = max(1, min(blocks, cfg.norm_programs // max(1, batch_heads)))
    return cfg.block_rows * -(-blocks // per_head)


# Triton's interpreter runs one numpy op per tile statement: small tiles keep CPU tests fast.
INTERPRETER_FORWARD = ForwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
INTERPRETER_BACKWARD = BackwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                      block_rows=16, norm_warps=1)


#: Bytes of shared memory a 16-bit forward config may plan for its tiles (the H100 allows 227
#: KB per block; the rest is Triton's scratch for layout conversions and reductions).
_SHARED_MEMORY_BUDGET = 190_000


def forward_shared_bytes(cfg: ForwardConfig, dqk: int, dv: int, with_state: bool) -> int:
    """Estimated shared memory of a 16-bit forward config: the q tile, ``num_stages``
    buffers of k and v tiles, and the ``[DQK, DV]`` state tile of the chunkwise form."""
    block_dqk, block_dv = head_tile(dqk), head_tile(dv)
    tiles = cfg.block_m * block_dqk + cfg.num_stages * cfg.block_n * (block_dqk + block_dv)
    return 2 * (tiles + (block_dqk * block_dv if with_state else 0))


# H100, bf16, DQK=128 / DV=256, 65k tokens, training forward (h saved), stabiliser from the
# gates' prefix max (benchmarks/tuning/probe_mlstm_forward.py): 128 x 64 tiles on 8 warps, 3
# stages: 2.12 / 3.18 / 5.34 ms at S = 1024 / 2048 / 4096, against 2.25 / 3.42 / 5.74 for
# 128 x 32 (3 stages) and 2.17 / 3.28 / 5.59 for 128 x 32 (4 stages); 64-row tiles are
# 1.5-1.8x slower, 128 x 128 spills. Still the best with the one-loop forward (2026-11-26,
# S = 1024): 1.65 ms against 1.70-1.74 for 128 x 32 and 1.82 for 128 x 64 on 2 stages. The
# first candidate whose tiles fit (:func:`forward_shared_bytes`) is taken: wider heads, and
# the chunkwise form's state tile, take the smaller ones.
_FORWARD_16BIT_CANDIDATES = (
    ForwardConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    ForwardConfig(block_m=128, block_n=32, num_warps=8, num_stages=3),
    ForwardConfig(block_m=128, block_n=32, num_warps=8, num_stages=2),
    ForwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ForwardConfig(block_m=64, block_n=16, num_warps=4, num_stages=2),
)


def choose_forward_config(q: torch.Tensor, dqk: int, dv: int, *, with_state: bool = False,
                          max_block_m: int = 0) -> ForwardConfig:
    """The forward's config for head dims ``dqk``, ``dv`` on q's device. ``with_state``: the
    chunkwise form (a state tile per program); ``max_block_m``: the chunk length, when it
    caps the query tile."""
    if q.device.type == "cpu":
        cfg = INTERPRETER_FORWARD
    elif q.dtype == torch.float64:
        cfg = ForwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    elif q.dtype == torch.float32:
        cfg = ForwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    else:
        candidates = [c.capped(max_block_m) for c in _FORWARD_16BIT_CANDIDATES]
        return next((c for c in candidates
                     if forward_shared_bytes(c, dqk, dv, with_state) <= _SHARED_MEMORY_BUDGET),
                    candidates[-1])
    return cfg.capped(max_block_m)


#: The state walks' value tiles are the widest that still give this many programs (the
#: batch, heads and value tiles are the whole grid; each program walks a row's chunks in
#: order). H200, xLSTM-7B's head (DQK 256, one 256-column value slice), S = 8192, the
#: forward walk on whole-chunk sub-blocks, 8 warps, 1 stage: at B = 8 (NH 8) 128 columns, 128
#: programs, 0.70 ms (64 columns: 1.07, 32: 1.74); at B = 1 32 columns, 64 programs, 0.43 ms
#: (16: 0.41, 64: 0.50, 128: 0.59).
STATE_WALK_MIN_PROGRAMS = 64


def choose_state_config(q: torch.Tensor, chunk: int, dqk: int, dv: int, *,
                        backward: bool = False) -> StateConfig:
    """The config of the chunk-state walk (``backward``: the state gradients' walk) for
    ``q [B, NH, S, DQK]``, chunks of ``chunk`` rows and value width ``dv``.

    Measured on an H200 (bf16, 65,536 tokens unless said; ``benchmarks/tuning/
    sweep_mlstm_states.py``), per walk, against the 64-column, 64-row, 4-warp, 1-stage
    tiles that were the rule before:

    * DQK 128, DV 256 (NH 16), chunk 128: 128 value columns read each k (q) row half as
      often as 64. Forward: 64-row sub-blocks on 4 warps, 1 stage, 0.65 / 0.64 / 0.65 / 0.63
      ms at S = 1024 / 2048 / 4096 / 8192 against 1.05 / 1.04 at the first two (whole-chunk
      sub-blocks spill the weighted k tile on 4 warps: 1.72 ms). Backward: whole-chunk
      sub-blocks on 2 stages (the chunk loop pipelined), 0.55 / 0.54 / 0.56 ms at S = 1024 /
      2048 / 8192 against 0.98 / 0.97; 64-row sub-blocks, for chunks of 64, on 1 stage: 0.67
      (2 stages: 0.77).
    * DQK 256 (xLSTM-7B), chunk 128, S = 8192, B = 8: whole-chunk sub-blocks on 8 warps,
      forward 1 stage 0.70 ms (against 0.90), backward 2 stages 0.79 (against 1.14).

    Only the value tile follows the batch (:data:`STATE_WALK_MIN_PROGRAMS`), and it changes
    no bit of the result: each value column's state is computed alike in any tile, so the
    batch invariance of the chunkwise form holds (tests/mlstm/test_chunkwise.py).
    """
    sub = {torch.float64: 16, torch.float32: 32}.get(q.dtype, 64)
    if q.device.type == "cpu":
        return StateConfig(block_v=min(32, head_tile(dv)), sub=sub, num_warps=1).capped(chunk)
    if q.dtype in (torch.float64, torch.float32):
        # Narrow value tiles: more programs for the sequential walk, a small register state.
        return StateConfig(block_v=min(64, head_tile(dv)), sub=sub).capped(chunk)
    rows = q.shape[0] * q.shape[1] if q.dim() == 4 else 1
    block_v = min(128, head_tile(dv))
    while block_v > 16 and rows * cdiv(dv, block_v) < STATE_WALK_MIN_PROGRAMS:
        block_v //= 2
    stages = 2 if backward and chunk >= 128 else 1
    if head_tile(dqk) > 128:
        return StateConfig(block_v=block_v, sub=128, num_warps=8,
                           num_stages=stages).capped(chunk)
    if backward:
        return StateConfig(block_v=block_v, sub=128, num_stages=stages).capped(chunk)
    return StateConfig(block_v=block_v, sub=64).capped(chunk)


def choose_backward_config(q: torch.Tensor, dqk: int, dv: int, *,
                           with_state: bool = False) -> BackwardConfig:
    """The backward's config for head dims ``dqk``, ``dv`` on q's device. ``with_state``: the
    chunkwise form, whose dQ and dK/dV programs also read the ``[DQK, DV]`` state (gradient)
    tile of their chunk."""
    if q.device.type == "cpu":
        return INTERPRETER_BACKWARD
    if q.dtype == torch.float64:
        return BackwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if q.dtype == torch.float32:
        return BackwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if not is_wide_head(dqk, dv):
        # H100, bf16, DQK=128 / DV=256, 65k tokens, head-major grids (probe_mlstm.py
        # --breakdown): dK/dV 64 x 64 on 8 warps, 2 stages: 4.71 / 13.93 ms at S = 1024 /
        # 4096 (64 x 32 on 4 warps 5.38 / 15.52, 3 stages slower); dQ 64 x 32 on 4 warps, 3
        # stages: 1.41 / 4.06 ms against 2.67 / 8.14 on dK/dV's config. Norm preprocess: see
        # benchmarks/RESULTS.md (mLSTM). The chunkwise form's dK/dV, which also reads the
        # state-gradient tile, on 1 stage: 2.38 / 2.36 ms against 2.64 / 2.62 on 2 at S = 2048
        # / 4096 (H200, benchmarks/tuning/sweep_mlstm_backward.py).
        return BackwardConfig(block_m=64, block_n=64, num_warps=8,
                              num_stages=1 if with_state else 2,
                              dq_block_n=32, dq_num_warps=4, dq_num_stages=3,
                              block_rows=8, norm_warps=1)
    # Heads wider than DQK 128 + DV 256: xLSTM-7B's 256 + 256 per value slice. 64 keys on 2
    # stages would need 263,168 bytes of shared memory there, over the H100's and H200's
    # 232,448 (sm90, triton 3.6). H200, bf16, NH 8, 65k tokens, both value slices, per step
    # (``benchmarks/tuning/sweep_mlstm_backward.py``, CUDA time of the kernels):
    if with_state:
        # Chunkwise, S = 8192: dK/dV 64 x 64 on 8 warps, 1 stage: 4.54 ms (64 x 32 on 8 warps,
        # 2 stages: 7.50; on 4 warps: 10.56; 3 stages: 97.9); dQ 64-key tiles on 8 warps, 2
        # stages: 2.08 ms (32 keys on 4 warps, 3 stages: 6.12), the state tile's product
        # wanting the wider warp group.
        return BackwardConfig(block_m=64, block_n=64, num_warps=8, num_stages=1,
                              dq_block_n=64, dq_num_warps=8, dq_num_stages=2,
                              block_rows=8, norm_warps=1)
    # Parallel, S = 1024: dK/dV 64 x 32 on 4 warps, 2 stages: 6.58 ms (on 8 warps: 8.42; 64 x
    # 64 on 8 warps, 1 stage: 9.23); dQ 16-key tiles on 4 warps, 3 stages: 2.17 ms (32 keys:
    # 2.57; on 8 warps: 4.35).
    return BackwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2,
                          dq_block_n=16, dq_num_warps=4, dq_num_stages=3,
                          block_rows=8, norm_warps=1)
