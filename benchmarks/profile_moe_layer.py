"""One compiled MoE layer step (``bench_moe_layer.py``'s layer, forward + backward) under
``torch.profiler``: every GPU kernel of the step in launch order with its time, their sum
against the step's wall time (what the GPU waits for the host), how long the GPU sat idle
before each kernel, and the peak memory after the forward and after the backward.

Whether the step is bound by the host: the host's time to launch the steps (the loop's time
before the final sync) against their wall time, and how many host-device synchronisations a
step makes (torch's sync debug mode). The profiler records GPU activity only: recording
the host's ops as well slows the host, which shows as GPU idle wherever the host is the
bound.

    python benchmarks/profile_moe_layer.py --shape qwen3-30b --impl compileops-fp8-cached \\
        --fp8-fast-accum [--routing skewed] [--dynamic]

Needs a CUDA device. Prints a table; writes nothing.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from benchmarks.bench_moe_layer import SHAPES, MoELayer, set_routing


def _step(compiled, xg, params, dy):
    out = compiled(xg)
    return torch.autograd.grad(out, [xg, *params], dy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b")
    parser.add_argument("--impl", default="compileops-fp8-cached")
    parser.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument("--fp8-fast-accum", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    layer = MoELayer(shape, args.impl, 0.0, device, fp8="rowwise",
                     fp8_fast_accum=args.fp8_fast_accum)
    set_routing(layer, args.routing)
    compiled = torch.compile(layer, fullgraph=True, dynamic=args.dynamic)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(shape.tokens, shape.dim, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(shape.tokens, shape.dim, generator=gen).to(device, torch.bfloat16)
    xg = x.requires_grad_(True)
    params = list(layer.parameters())
    for _ in range(3):
        _step(compiled, xg, params, dy)
    torch.cuda.synchronize()

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = compiled(xg)
    torch.cuda.synchronize()
    forward_peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    grads = torch.autograd.grad(out, [xg, *params], dy)
    torch.cuda.synchronize()
    step_peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del out, grads

    start = time.perf_counter()
    for _ in range(args.steps):
        _step(compiled, xg, params, dy)
    launched = time.perf_counter()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    host_ms = (launched - start) * 1e3 / args.steps

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(compiled, xg, params, dy)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    torch.cuda.synchronize()

    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            _step(compiled, xg, params, dy)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    per_step = len(kernels) // args.steps
    last = kernels[-per_step:] if per_step else []
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / args.steps
    print(f"{shape.name} | {args.routing} | {'dynamic' if args.dynamic else 'static'} | "
          f"{args.impl}{' fast accum' if args.fp8_fast_accum else ''}")
    print(f"step wall {wall_ms:.3f} ms (unprofiled), GPU kernels {busy_ms:.3f} ms a step, "
          f"{per_step} kernels a step; peak after forward {forward_peak:.3f} GiB, after "
          f"backward {step_peak:.3f} GiB")
    print(f"host: {host_ms:.3f} ms a step to launch {args.steps} steps unsynchronised "
          f"({'host-bound' if host_ms > 0.9 * wall_ms else 'the GPU is the bound'}); "
          f"{len(syncs)} host-device synchronisations in a step"
          + (f", the first: {syncs[0][:120]}" if syncs else ""))
    # The host timeline as the GPU saw it: how long the GPU sat idle before each kernel
    # (waiting for the host to launch it, or for the backward to start).
    gaps = [0.0] + [max(0.0, b.time_range.start - a.time_range.end)
                    for a, b in zip(last, last[1:])]
    print(f"GPU idle between the last step's kernels: {sum(gaps) / 1e3:.3f} ms")
    print("| # | kernel (last step, launch order) | us | idle before, us |\n|---|---|---|---|")
    for i, (e, gap) in enumerate(zip(last, gaps)):
        print(f"| {i} | {e.name[:90]} | {e.time_range.elapsed_us():.0f} | {gap:.0f} |")


if __name__ == "__main__":
    main()
