"""dp_all_reduce_sum: without a process group, and in a 2-process gloo group on CPU."""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from compileops.xtoken import dp_all_reduce_sum


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        x = torch.tensor(float(rank + 1) * 10, dtype=torch.float32)
        out = dp_all_reduce_sum(x)
        results[rank] = (out.item(), x.item(), out.dtype == torch.float32)
    finally:
        dist.destroy_process_group()


def test_two_process_gloo():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=90)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        assert dict(results) == {0: (30.0, 10.0, True), 1: (30.0, 20.0, True)}
