"""Run a function on N CPU processes in a gloo group on 127.0.0.1 (the distributed tests).

``run_ranks(fn, world)`` spawns ``world`` processes; each joins the group, calls ``fn(rank,
world)`` (a module-level function, so it pickles) and reports what it returns, or the
traceback it raised. Returns ``({rank: result}, [exit codes])``.
"""
from __future__ import annotations

import datetime
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, results, group_timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    try:
        results[rank] = fn(rank, world)
    except BaseException:
        results[rank] = {"error": traceback.format_exc()}
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *, timeout_s: float = 90,
              group_timeout_s: float = 30) -> tuple[dict, list]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_entry,
                             args=(r, world, port, fn, results, group_timeout_s))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()
        return dict(results), [p.exitcode for p in procs]
