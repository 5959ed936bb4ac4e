"""Host-side cost of one embedding backward call (GPU): cProfile over back-to-back calls.

    python3 benchmarks/tuning/profile_embedding_host.py [--calls 20]

Prints host ms per call for the op (torch.ops.compileops.embedding_backward) and for the
kernel launcher it calls, with the cached launches of ``compileops._launch`` on and off,
then the top functions by own time. When the host time per call
nears the GPU time (~0.53 ms on an H100), do_bench measures the host, not the GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import compileops  # noqa: E402,F401
from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from compileops import _launch  # noqa: E402
from compileops.embedding import kernels  # noqa: E402

V, D, N = 151936, 4096, 16384


def host_ms(fn, calls: int) -> float:
    """Host ms per call: the best of 5 bursts of ``calls`` back-to-back calls, each burst
    short enough (a few launches per call) not to fill the GPU's launch queue."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
        torch.cuda.synchronize()
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    ids = zipf_ids(N, V).cuda()
    grad = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    op = lambda: torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16)  # noqa: E731
    direct = lambda: kernels.embedding_backward(grad, ids, V, None, torch.bfloat16)  # noqa: E731
    for cached in (True, False):
        _launch.enabled = cached
        for name, fn in (("op", op), ("kernels.embedding_backward", direct)):
            for _ in range(5):
                fn()
            print(f"{name}, cached launches {'on' if cached else 'off'}: host "
                  f"{host_ms(fn, args.calls):.3f} ms/call", flush=True)
    _launch.enabled = True
    # The launcher's host steps one at a time (cached launches on).
    flat_ids = ids.reshape(-1)
    config = kernels.BackwardConfig()
    tiles = config.resolve(grad, torch.bfloat16)
    sorted_ids, order = kernels.sort_ids(flat_ids, V)
    touched = kernels.touched_map(flat_ids, V)
    out = torch.empty(V, D, device="cuda", dtype=torch.bfloat16)
    main_stream = torch.cuda.current_stream()
    # A high-priority stream, as the two-stream schedule's side stream.
    side = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])

    def fork_join():
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            pass
        main_stream.wait_stream(side)

    steps = {
        "BackwardConfig.resolve": lambda: config.resolve(grad, torch.bfloat16),
        "touched map (zeros + index_fill_)": lambda: kernels.touched_map(flat_ids, V),
        "id counts (zeros + 1 launch)": lambda: kernels.id_counts(flat_ids, V),
        "Triton sort (3 empties, 2 launches)": lambda: kernels.sort_ids(flat_ids, V),
        "run programs launch": lambda: kernels.launch_backward_kernel(
            sorted_ids, order, None, grad, out, None, tiles, kernels.RUN_PROGRAMS),
        "fill launch": lambda: kernels.launch_backward_kernel(
            sorted_ids, sorted_ids, touched, grad, out, None, tiles, kernels.FILL_PROGRAMS),
        "stream fork + join": fork_join,
        "torch.empty(V, D)": lambda: torch.empty(V, D, device="cuda", dtype=torch.bfloat16),
    }
    for name, fn in steps.items():
        fn()
        print(f"  step {name}: host {host_ms(fn, args.calls) * 1e3:.1f} us/call", flush=True)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(args.calls):
        op()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
