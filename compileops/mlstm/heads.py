"""Head widths as the mLSTM kernels tile them (host ints only; no Triton import, so the
public API can ask without loading the kernels)."""
from __future__ import annotations

from compileops._launch import next_power_of_2


def head_tile(dim: int) -> int:
    """The tile width of a head dim (``BLOCK_DQK`` / ``BLOCK_DV``): the next power of two, at
    least 16 (the MMA's smallest). The launchers, the lowering and the shared-memory
    estimate all pad with this."""
    return max(16, next_power_of_2(int(dim)))


def is_wide_head(dqk: int, dv: int) -> bool:
    """Heads whose tiles are wider than DQK 128 + DV 256 (xLSTM-7B's 256 + 256 per value
    slice): they take their own backward configs."""
    return head_tile(dqk) + head_tile(dv) > 384
