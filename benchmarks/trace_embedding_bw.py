"""In-kernel trace of the embedding backward: when run and fill programs start, and when
each long run's chain starts and ends, from %globaltimer.

Needs the instrumentation patch (kept out of the kernel; apply it on a GPU machine only):

    patch -p1 < benchmarks/results/trace_embedding_bw_instrumentation.patch
    python3 benchmarks/trace_embedding_bw.py [--calls 5] [--config JSON]

Zipf benchmark case; ``--config``: keyword arguments of ``kernels.embedding_backward``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402,F401
from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from compileops.embedding import kernels  # noqa: E402

V, D, N = 151936, 4096, 16384
REC = kernels.TRACE_RECORDS.value
RUNS = kernels.TRACE_RUNS.value
I64_MAX = 2**63 - 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--config", default="")
    parser.add_argument("--uniform", action="store_true")
    args = parser.parse_args()
    cfg = json.loads(args.config) if args.config else {}
    torch.manual_seed(0)
    ids = (torch.randint(0, V, (N,)) if args.uniform else zipf_ids(N, V)).cuda()
    grad = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    hot = cfg.get("hot_first", cfg.get("streams", True))  # the schedule's own order
    counts_map = kernels._id_counts(ids, V) if hot else None
    s_ids, _ = kernels._sort_ids(ids, V, "triton", counts_map)
    s_host = s_ids.cpu()
    counts = torch.bincount(ids, minlength=V).cpu()
    flush = torch.zeros(64 << 20, dtype=torch.int32, device="cuda")
    trace = torch.zeros(8 + 4 * REC + RUNS + 200000, dtype=torch.int64, device="cuda")
    run_programs = (N // 4) * (D // 512)
    fill_programs = V // 2
    print(f"{torch.cuda.get_device_name()} | config {cfg} | run programs {run_programs}, "
          f"fill programs {fill_programs}", flush=True)
    ref = kernels.embedding_backward(grad, ids, V, None, torch.bfloat16, **cfg)
    for call in range(args.calls + 2):
        trace.zero_()
        trace[0] = I64_MAX
        trace[2] = I64_MAX
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = kernels.embedding_backward(grad, ids, V, None, torch.bfloat16, trace=trace, **cfg)
        end.record()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        if call < 2:
            continue
        t = trace.cpu()
        origin = min(int(t[0]), int(t[2]))
        us = lambda x: (int(x) - origin) / 1e3  # noqa: E731
        print(f"\ncall {call - 2}: event time {start.elapsed_time(end) * 1e3:.1f} us; "
              f"run programs {us(t[0]):.1f} .. {us(t[1]):.1f} us; "
              f"fill programs {us(t[2]):.1f} .. {us(t[3]):.1f} us")
        n = min(int(t[4]), REC)
        rec = t[8:8 + 4 * n].view(n, 4)
        chains = {}
        for long_start, t0, t1, sm in rec.tolist():
            row = int(s_host[long_start])
            c = chains.setdefault(row, [int(counts[row]), long_start, t0, t1, 0, set()])
            c[2] = min(c[2], t0)
            c[3] = max(c[3], t1)
            c[4] = max(c[4], t1 - t0)
            c[5].add(sm)
        top = sorted(chains.items(), key=lambda kv: -kv[1][0])[:8]
        print(f"  long-path programs recorded: {n}; last long chain end "
              f"{max((us(c[3]) for c in chains.values()), default=0):.1f} us")
        print("  hottest chains: id, length, sorted start, first start .. last end (us), "
              "longest program (us)")
        for row, (length, pos, t0, t1, longest, sms) in top:
            print(f"    {row:7d} {length:5d} {pos:6d} {us(t0):8.1f} .. {us(t1):8.1f}  "
                  f"{longest / 1e3:7.1f}")
        late = sorted(chains.values(), key=lambda c: -c[3])[:5]
        print("  chains ending last: length, sorted start, start .. end (us)")
        for length, pos, t0, t1, longest, sms in late:
            print(f"    {length:5d} {pos:6d} {us(t0):8.1f} .. {us(t1):8.1f}")
        base = 8 + 4 * REC
        run_starts = t[base:base + run_programs]
        fill_starts = t[base + RUNS:base + RUNS + fill_programs]
        for name, starts in (("run", run_starts), ("fill", fill_starts)):
            qs = [0.0, 0.1, 0.26, 0.5, 0.75, 0.9, 0.99, 1.0]
            picks = [min(len(starts) - 1, int(q * len(starts))) for q in qs]
            print(f"  {name} program start by pid quantile: " + ", ".join(
                f"{q:.2f}:{us(starts[p]):.0f}" for q, p in zip(qs, picks)))


if __name__ == "__main__":
    main()
