"""GPU timeline of the embedding backward: when each of its kernels starts and ends, per stream.

    python3 benchmarks/tuning/timeline_embedding_bw.py [--calls 5] [--config '{"streams": false}']

The benchmark's Zipf case (table 151936 x 4096 bf16, 16384 tokens). Each call follows a
device sync and an L2 flush (a 256 MB in-place add, which also marks where the call
begins). torch.profiler records the kernels (CUPTI); the script prints every kernel of each
call with its start and end in microseconds after the flush ended, its stream and its
name, then the medians over the calls. ``--config`` gives ``BackwardConfig`` fields as JSON
(default: the op, with the shipped defaults).

Why: do_bench gives one number per call; this shows which stream's work ends last (the
critical path) and how long each part takes beside the others, e.g. whether the hot-id
chains end after the fill.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import compileops  # noqa: E402,F401  (registers the ops)
from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from compileops.embedding import kernels  # noqa: E402

V, D, N = 151936, 4096, 16384
FLUSH_ELEMS = 64 << 20  # int32: 256 MB, more than L2


def kernel_events(trace_path: str) -> list[dict]:
    """Kernel records of a chrome trace: name, stream, start and end in microseconds."""
    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kept = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            start = float(e["ts"])
            kept.append(dict(name=e["name"], stream=e.get("args", {}).get("stream", "?"),
                             start=start, end=start + float(e.get("dur", 0.0))))
    return sorted(kept, key=lambda e: e["start"])


def split_calls(events: list[dict]) -> list[list[dict]]:
    """The kernels after each flush (the flush kernel: an elementwise add), flush excluded,
    times made relative to the flush's end."""
    calls: list[list[dict]] = []
    origin = None
    for e in events:
        if "add" in e["name"].lower() and e["end"] - e["start"] > 20.0:  # the 256 MB flush
            origin = e["end"]
            calls.append([])
            continue
        if origin is not None:
            calls[-1].append(dict(e, start=e["start"] - origin, end=e["end"] - origin))
    return [c for c in calls if c]


def short(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--config", default="",
                        help="JSON object of BackwardConfig fields (empty: the op with its "
                             "defaults)")
    parser.add_argument("--trace", default="", help="also keep the chrome trace at this path")
    args = parser.parse_args()
    torch.manual_seed(0)
    ids = zipf_ids(N, V).cuda()
    grad = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    flush = torch.zeros(FLUSH_ELEMS, dtype=torch.int32, device="cuda")
    config = kernels.BackwardConfig(**json.loads(args.config)) if args.config else None
    if config is None:
        def call():
            return torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16)
    else:
        def call():
            return kernels.embedding_backward(grad, ids, V, None, torch.bfloat16, config)
    for _ in range(args.warmup):
        call()
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{__import__('triton').__version__} | config {config or 'op defaults'}", flush=True)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            torch.cuda.synchronize()
            flush.add_(1)
            call()
            torch.cuda.synchronize()
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    calls = split_calls(kernel_events(path))
    if not calls:
        raise SystemExit("no kernels found after the flush markers")
    ends = []
    for i, kernels_of_call in enumerate(calls):
        print(f"\ncall {i}: start / end / duration (us after the flush), stream, kernel")
        for e in kernels_of_call:
            print(f"  {e['start']:8.1f} {e['end']:8.1f} {e['end'] - e['start']:8.1f}  "
                  f"s{e['stream']:<3} {short(e['name'])}")
        ends.append(max(e["end"] for e in kernels_of_call))
    # Medians by position (the calls launch the same kernels in the same order).
    width = min(len(c) for c in calls)
    print(f"\nmedian over {len(calls)} calls (kernels in launch-start order):")
    for k in range(width):
        starts = [c[k]["start"] for c in calls]
        stops = [c[k]["end"] for c in calls]
        e = calls[0][k]
        print(f"  {statistics.median(starts):8.1f} {statistics.median(stops):8.1f} "
              f"{statistics.median([b - a for a, b in zip(starts, stops)]):8.1f}  "
              f"s{e['stream']:<3} {short(e['name'])}")
    print(f"last kernel end, median: {statistics.median(ends):.1f} us (per call: "
          f"{', '.join(f'{x:.1f}' for x in ends)})")


if __name__ == "__main__":
    main()
