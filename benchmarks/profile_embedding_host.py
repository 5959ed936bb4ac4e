"""Host-side cost of one embedding backward call (GPU): cProfile over back-to-back calls.

    python3 benchmarks/profile_embedding_host.py [--calls 200]

Prints host ms per call for the op (torch.ops.compileops.embedding_backward) and for the
kernel launcher it calls, then the top functions by own time. When the host time per call
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compileops  # noqa: E402,F401
from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from compileops.embedding import kernels  # noqa: E402

V, D, N = 151936, 4096, 16384


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    ids = zipf_ids(N, V).cuda()
    grad = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    op = lambda: torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16)  # noqa: E731
    direct = lambda: kernels.embedding_backward(grad, ids, V, None, torch.bfloat16)  # noqa: E731
    for name, fn in (("op", op), ("kernels.embedding_backward", direct)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        host = (time.perf_counter() - start) / args.calls * 1e3
        torch.cuda.synchronize()
        print(f"{name}: host {host:.3f} ms/call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        op()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
