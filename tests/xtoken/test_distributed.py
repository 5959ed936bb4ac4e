"""dp_all_reduce_sum: without a process group, and in a 2-process gloo group on CPU."""
from __future__ import annotations

import torch
import torch.distributed as dist

from compileops.xtoken import dp_all_reduce_sum
from tests.gloo import run_ranks


def test_without_process_group_returns_fp32_copy():
    assert not dist.is_initialized()
    x = torch.tensor(7, dtype=torch.int64)
    out = dp_all_reduce_sum(x)
    assert out.dtype == torch.float32 and out.item() == 7.0
    y = torch.tensor(3.0)
    out = dp_all_reduce_sum(y)
    assert out is not y and out.data_ptr() != y.data_ptr()
    out += 1
    assert y.item() == 3.0
    assert dp_all_reduce_sum(5).item() == 5.0


def _all_reduce(rank: int, world: int):
    x = torch.tensor(float(rank + 1) * 10, dtype=torch.float32)
    out = dp_all_reduce_sum(x)
    return (out.item(), x.item(), out.dtype == torch.float32)


def test_two_process_gloo():
    results, exit_codes = run_ranks(_all_reduce, 2)
    assert all(code == 0 for code in exit_codes), exit_codes
    assert results == {0: (30.0, 10.0, True), 1: (30.0, 20.0, True)}
