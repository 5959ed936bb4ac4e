"""Tile configs of the mLSTM kernels and the host-side heuristics that pick them.

Why the defaults are what they are: ``benchmarks/RESULTS.md`` (mLSTM), swept with
``benchmarks/tuning/sweep_mlstm.py``.
"""
from __future__ import annotations

import dataclasses

import torch


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


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """dQ programs: ``block_m`` query rows, key tiles of ``block_n``. dK/dV programs:
    ``block_n`` key rows, query tiles of ``block_m``. ``block_m`` a multiple of ``block_n``."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    #: Rows per program of the norm-backward preprocess.
    block_rows: int = 16

    def __post_init__(self):
        if self.block_m % self.block_n:
            raise ValueError(f"block_m ({self.block_m}) must be a multiple of block_n "
                             f"({self.block_n})")


# Triton's interpreter runs one numpy op per tile statement: small tiles keep CPU tests fast.
INTERPRETER_FORWARD = ForwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
INTERPRETER_BACKWARD = BackwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                      block_rows=16)


def choose_forward_config(q: torch.Tensor, dqk: int, dv: int) -> ForwardConfig:
    """The forward's config for head dims ``dqk``, ``dv`` on q's device."""
    if q.device.type == "cpu":
        return INTERPRETER_FORWARD
    if q.dtype == torch.float64:
        return ForwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if q.dtype == torch.float32:
        return ForwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    # H100, bf16, DQK=128 / DV=256, 65k tokens (benchmarks/tuning/probe_mlstm.py, factorised
    # decay): 128 x 32 tiles on 8 warps, 3 stages: 2.39 ms at S=1024 and 6.23 at S=4096,
    # against 2.95 / 9.38 for 64 x 64 (8 warps, 3 stages) and 3.34 / 7.00 for 128 x 64
    # (2 stages); 128 x 64 with 4 stages and 128 x 128 need more than 227 KB shared memory.
    return ForwardConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)


def choose_backward_config(q: torch.Tensor, dqk: int, dv: int) -> BackwardConfig:
    """The backward's config for head dims ``dqk``, ``dv`` on q's device."""
    if q.device.type == "cpu":
        return INTERPRETER_BACKWARD
    if q.dtype == torch.float64:
        return BackwardConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if q.dtype == torch.float32:
        return BackwardConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    # H100, bf16, DQK=128 / DV=256 (probe_mlstm.py, factorised decay): 64 x 64 on 8 warps,
    # 2 stages: 13.7 ms at S=1024, 37.9 at S=4096; 64 x 32 on 4 warps 14.1 / 40.9; 128 x 32
    # on 8 warps 16.7 / 36.9; 3 stages are slower; 128 x 64 needs 338 KB of shared memory.
    return BackwardConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
