"""Probe (GPU): the MoE layer's dW products reading the routed tokens through the
permutation's index instead of from a permuted copy.

The layer permutes its tokens to expert order (``x[rows]``, ``[T * top_k, D]``) and keeps the
copy for the gate/up dW; the backward gathers dY the same way for the down dW. The dW
kernel can read both through the index (``grouped_linear_wgrad``'s ``x_rows`` /
``dy_rows``), so the copies need not exist. This times, at each MoE layer's shape (uniform
top-k routing, bf16, no bias):

* ``copy``: the gather (``index_select``) plus the dW kernel on the copy (what runs now);
* ``kernel on copy``: the dW kernel alone, the copy made beforehand;
* ``gathered``: the dW kernel reading through the index;

in ``--rounds`` alternating rounds (medians), and checks the gathered dW is the copy's bit
for bit. The copy's bytes are what the gathered form saves in memory.

    python3 benchmarks/tuning/probe_wgrad_gathered.py [--shapes qwen3-30b ...] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_grouped_linear import time_alternating  # noqa: E402
from benchmarks.bench_moe_layer import SHAPES  # noqa: E402
from compileops.grouped_linear import kernels  # noqa: E402


def routed_rows(tokens: int, experts: int, top_k: int, device, gen):
    """``(rows [tokens * top_k]`` int64 source token of each row in expert order, ``offsets
    [experts]`` int32 cumulative ends): uniform random top-k choices, stably sorted."""
    scores = torch.rand(tokens, experts, generator=gen)
    choice = scores.topk(top_k, dim=1).indices.flatten()
    order = torch.argsort(choice, stable=True)
    counts = torch.bincount(choice, minlength=experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return (order // top_k).to(device), offsets.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, one call each (checks the script runs)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    print("| layer | dW | copy + kernel ms | kernel on copy ms | gathered ms | "
          "gathered / (copy + kernel) | copy MiB | same bits |\n|---|---|---|---|---|---|---|---|")
    for key in args.shapes:
        shape = SHAPES[key]
        tokens, dim, hidden = shape.tokens, shape.dim, shape.hidden
        if args.smoke:
            tokens, dim, hidden = 64, 32, 48
        rows, offsets = routed_rows(tokens, shape.experts, shape.top_k, device, gen)
        m = rows.shape[0]

        def randn(*size):
            return (torch.randn(*size, generator=gen) / size[-1] ** 0.5).to(device, dtype)

        x, dy = randn(tokens, dim), randn(tokens, dim)
        d_pre, h_scaled = randn(m, 2 * hidden), randn(m, hidden)
        cases = {
            # gate/up: dW [E, 2H, D] = dPre^T x[rows]
            "gate/up": (lambda: kernels.grouped_linear_wgrad(
                            d_pre, x.index_select(0, rows), offsets, dtype, dtype,
                            with_db=False)[0],
                        x.index_select(0, rows),
                        lambda copy: kernels.grouped_linear_wgrad(
                            d_pre, copy, offsets, dtype, dtype, with_db=False)[0],
                        lambda: kernels.grouped_linear_wgrad(
                            d_pre, x, offsets, dtype, dtype, with_db=False, x_rows=rows)[0]),
            # down: dW [E, D, H] = dY[rows]^T (h * p)
            "down": (lambda: kernels.grouped_linear_wgrad(
                         dy.index_select(0, rows), h_scaled, offsets, dtype, dtype,
                         with_db=False)[0],
                     dy.index_select(0, rows),
                     lambda copy: kernels.grouped_linear_wgrad(
                         copy, h_scaled, offsets, dtype, dtype, with_db=False)[0],
                     lambda: kernels.grouped_linear_wgrad(
                         dy, h_scaled, offsets, dtype, dtype, with_db=False, dy_rows=rows)[0]),
        }
        for name, (with_copy, copy, on_copy, gathered) in cases.items():
            same = torch.equal(gathered(), with_copy())
            fns = {"copy": with_copy, "on copy": lambda: on_copy(copy), "gathered": gathered}
            times = time_alternating(fns, 1 if args.smoke else args.rounds, args.smoke)
            print(f"| {shape.name} | {name} | {times['copy']:.3f} | {times['on copy']:.3f} | "
                  f"{times['gathered']:.3f} | {times['gathered'] / times['copy']:.3f} | "
                  f"{copy.numel() * copy.element_size() / 2**20:.0f} | {same} |", flush=True)
            del copy, fns
        del x, dy, d_pre, h_scaled, cases
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
