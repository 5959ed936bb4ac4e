"""The MoE permutation's row copy compiled two ways, at the benchmark layers' shapes: as a
gather (``x[order // k]``: each sorted row read from its token, so every token row is read
``k`` times from all over ``x``) and as a scatter (each token row read once and written to
its ``k`` sorted positions, ``permute_by_expert``'s form). Each writes the bf16 rows and,
for the fp8 layer, their e4m3 codes (quantised at the token rows). A plain device copy of
the bytes written gives the bandwidth reference.

    python benchmarks/tuning/probe_permute_scatter.py [--rounds 5]

Needs a CUDA device. Prints a table (medians over alternating rounds, us and GB/s of the
bytes each form must move at least); writes nothing.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_moe_layer import SHAPES


def _gather(x, q, order, top_k):
    token = order // top_k
    return x[token], q[token]


def _scatter(x, q, order, top_k):
    rows = order.numel()
    slots = torch.empty_like(order).scatter_(0, order, torch.arange(rows, device=order.device))
    slots = slots.view(x.shape[0], top_k)
    xs, qs = x.new_empty(rows, x.shape[1]), q.new_empty(rows, q.shape[1])
    xs[slots] = x.unsqueeze(1).expand(-1, top_k, -1)
    qs[slots] = q.unsqueeze(1).expand(-1, top_k, -1)
    return xs, qs


def _time_us(fn, reps=20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator(device="cpu").manual_seed(0)
    print("| layer | form | us | GB/s of the least bytes | same bits |\n|---|---|---|---|---|")
    for shape in SHAPES.values():
        t, k, d = shape.tokens, shape.top_k, shape.dim
        x = torch.randn(t, d, generator=gen).to("cuda", torch.bfloat16)
        q = (x.float() / 8).to(torch.float8_e4m3fn)
        ids = torch.stack([torch.randperm(shape.experts, generator=gen)[:k] for _ in range(t)])
        order = torch.sort(ids.reshape(-1).cuda(), stable=True)[1]
        forms = {"gather": torch.compile(_gather), "scatter": torch.compile(_scatter)}
        expected = _gather(x, q, order, k)
        same = {}
        for name, fn in forms.items():
            got = fn(x, q, order, k)
            same[name] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                             for a, b in zip(got, expected))
        out = torch.empty(t * k * d * 3, dtype=torch.uint8, device="cuda")
        src = torch.empty_like(out)
        forms["device copy"] = lambda *a: out.copy_(src)
        times = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, fn in forms.items():
                times[name].append(_time_us(lambda: fn(x, q, order, k)))
        least = t * k * d * 3 + t * d * 3  # the copies written, the token rows read once
        for name in forms:
            us = statistics.median(times[name])
            bytes_ = 2 * t * k * d * 3 if name == "device copy" else least
            print(f"| {shape.name} | {name} | {us:.1f} | {bytes_ / us / 1e3:.0f} | "
                  f"{same.get(name, '')} |")


if __name__ == "__main__":
    main()
