"""Whole SwiGLU MoE layer, compiled, forward and forward + backward: compileops vs torch._grouped_mm.

What a user trains: router -> top-k -> ``permute_by_expert`` -> gate/up grouped GEMM with SwiGLU
-> down grouped GEMM scaled by the router probability -> ``unpermute_and_combine``, bf16,
compiled ``fullgraph=True`` (default mode), static and ``dynamic=True``. Both layers share the
routing code, the weights and the inputs; only the expert GEMMs differ:

* ``compileops``: ``grouped_linear_swiglu`` (SwiGLU in the GEMM's epilogue; by default it keeps
  the pre-activations for the backward) and ``grouped_linear(..., row_scale=p)`` (the
  probability is the template's epilogue; its gradient comes from the dX product).
* ``compileops-recompute``: the same with ``recompute=True`` (no stored pre-activations; the
  backward recomputes the gate/up GEMM): its cost and the memory it saves.
* ``grouped_mm``: ``torch._grouped_mm`` + ``F.silu(gate) * up``, the anchor.

Weights are scaled 1/sqrt(fan_in) (uniform, as ``nn.Linear``); inputs are unit normal. Routing is
``uniform`` (a plain router: near-equal expert loads) or ``skewed`` (router logits offset by
``-1.5 * log(1 + e)``: a few hot experts). Forward is timed with gradients enabled (the training
forward, which saves what the backward needs); forward + backward is ``autograd.grad`` of the
output against a fixed random cotangent, for x and every weight. Peak memory is the largest
``max_memory_allocated`` over one forward + backward, above what was allocated before it.

    python benchmarks/bench_moe_layer.py                       # every shape
    python benchmarks/bench_moe_layer.py --shapes mixtral --routing skewed --modes static

Results: ``$COMPILEOPS_BENCH_OUT/moe_layer.csv`` (or benchmarks/out/) and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import inspect
import math
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
from benchmarks.harness import bench_ms, environment_line, out_dir  # noqa: E402
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    dim: int  # D: model width
    hidden: int  # H: expert intermediate width (gate/up are [2H, D], down is [D, H])
    experts: int
    top_k: int
    tokens: int


SHAPES = {
    "mixtral": Shape("Mixtral-8x7B", 4096, 14336, 8, 2, 8192),
    "qwen3-30b": Shape("Qwen3-30B-A3B", 2048, 768, 128, 8, 8192),
    # DeepSeek-V3 under expert parallelism: one rank's shard of 32 of the 256 experts, top-8.
    "deepseek-v3": Shape("DeepSeek-V3 EP shard (32 experts)", 7168, 2048, 32, 8, 4096),
    "qwen3-235b": Shape("Qwen3-235B-A22B", 4096, 1536, 128, 8, 8192),
}


def _supports_recompute() -> bool:
    return "recompute" in inspect.signature(compileops.grouped_linear_swiglu).parameters


class MoELayer(torch.nn.Module):
    """x ``[T, D]`` -> ``[T, D]``; ``impl`` picks the expert GEMMs, everything else is shared."""

    def __init__(self, shape: Shape, impl: str, skew: float, device, dtype=torch.bfloat16):
        super().__init__()
        self.shape, self.impl = shape, impl
        d, h, e = shape.dim, shape.hidden, shape.experts
        gen = torch.Generator(device="cpu").manual_seed(0)

        def uniform(*size, fan_in):
            bound = 1.0 / math.sqrt(fan_in)
            return (torch.rand(*size, generator=gen) * 2 - 1).mul_(bound).to(device, dtype)

        self.router = torch.nn.Parameter(uniform(e, d, fan_in=d))
        self.gate_up = torch.nn.Parameter(uniform(e, 2 * h, d, fan_in=d))  # [G, 2H, D]
        self.down = torch.nn.Parameter(uniform(e, d, h, fan_in=h))  # [G, D, H]
        self.register_buffer("router_bias",
                             -skew * torch.log1p(torch.arange(e, dtype=torch.float32)).to(device))

    def route(self, x):
        logits = F.linear(x, self.router).float() + self.router_bias
        probs, ids = torch.topk(torch.softmax(logits, dim=-1), self.shape.top_k, dim=-1)
        return probs / probs.sum(-1, keepdim=True), ids

    def forward(self, x):
        probs, ids = self.route(x)
        xs, order, offsets = permute_by_expert(x, ids, self.shape.experts)
        p_sorted = probs.reshape(-1)[order]
        if self.impl == "grouped_mm":
            gu = torch._grouped_mm(xs, self.gate_up.transpose(-2, -1), offs=offsets)
            gate, up = gu.chunk(2, dim=-1)
            h = F.silu(gate) * up
            y = torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offsets)
            y = y * p_sorted[:, None].to(x.dtype)
        else:
            kwargs = {"recompute": True} if self.impl == "compileops-recompute" else {}
            h = compileops.grouped_linear_swiglu(xs, self.gate_up, offsets, **kwargs)
            y = compileops.grouped_linear(h, self.down, offsets, row_scale=p_sorted)
        return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)


def expert_loads(layer: MoELayer, x: torch.Tensor) -> str:
    with torch.no_grad():
        _, ids = layer.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=layer.shape.experts).float()
    return f"max/mean load {counts.max().item() / counts.mean().item():.2f}"


def gemm_flops(shape: Shape) -> float:
    """Forward FLOPs of the two expert GEMMs (routed rows = tokens * top_k)."""
    rows = shape.tokens * shape.top_k
    return 2 * rows * shape.dim * 2 * shape.hidden + 2 * rows * shape.hidden * shape.dim


@dataclasses.dataclass
class Result:
    shape: str
    routing: str
    mode: str
    impl: str
    fw_ms: float
    fwbw_ms: float
    peak_gib: float
    note: str


def measure(compiled, layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    params = [p for p in layer.parameters()]
    xg = x.detach().requires_grad_(True)

    def fw():
        return compiled(xg)

    def fwbw():
        out = compiled(xg)
        return torch.autograd.grad(out, [xg, *params], dy)

    fwbw()  # compiles forward and backward on the first call
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = fwbw()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del grads
    return bench_ms(fw), bench_ms(fwbw), peak


SKEW = {"uniform": 0.0, "skewed": 1.5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--routing", nargs="*", default=list(SKEW), choices=list(SKEW))
    parser.add_argument("--modes", nargs="*", default=["static", "dynamic"],
                        choices=["static", "dynamic"])
    parser.add_argument("--impls", nargs="*",
                        default=["grouped_mm", "compileops", "compileops-recompute"])
    parser.add_argument("--csv", default=os.path.join(out_dir(), "moe_layer.csv"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_layer needs a CUDA device")
    impls = [i for i in args.impls if i != "compileops-recompute" or _supports_recompute()]
    print(environment_line(), flush=True)
    results: list[Result] = []
    for key in args.shapes:
        shape = SHAPES[key]
        gen = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(shape.tokens, shape.dim, generator=gen).to("cuda", torch.bfloat16)
        dy = torch.randn(shape.tokens, shape.dim, generator=gen).to("cuda", torch.bfloat16)
        for mode in args.modes:
            for impl in impls:
                # One compile per (shape, mode, impl); the routings only change a buffer.
                torch._dynamo.reset()
                layer = MoELayer(shape, impl, 0.0, "cuda")
                compiled = torch.compile(layer, fullgraph=True, dynamic=mode == "dynamic")
                for routing in args.routing:
                    layer.router_bias.copy_(-SKEW[routing] * torch.log1p(
                        torch.arange(shape.experts, dtype=torch.float32, device="cuda")))
                    note = expert_loads(layer, x)
                    try:
                        fw_ms, fwbw_ms, peak = measure(compiled, layer, x, dy)
                    except Exception as exc:  # report and go on: one failure must not end the run
                        print(f"{shape.name} {routing} {mode} {impl}: FAILED {type(exc).__name__}: "
                              f"{str(exc)[:300]}", flush=True)
                        fw_ms = fwbw_ms = peak = float("nan")
                        note = f"failed: {type(exc).__name__}"
                    r = Result(shape.name, routing, mode, impl, fw_ms, fwbw_ms, peak, note)
                    results.append(r)
                    tflops = 3 * gemm_flops(shape) / (fwbw_ms * 1e-3) / 1e12
                    print(f"{r.shape} | {routing} | {mode} | {impl}: fw {fw_ms:.3f} ms, "
                          f"fw+bw {fwbw_ms:.3f} ms ({tflops:.0f} TFLOP/s expert GEMMs), "
                          f"peak {peak:.2f} GiB | {note}", flush=True)
                del layer, compiled
                gc.collect()
                torch.cuda.empty_cache()
    write(results, args.csv)


def write(results: list[Result], path: str) -> None:
    anchor = {(r.shape, r.routing, r.mode): r for r in results if r.impl == "grouped_mm"}
    lines = ["| shape | routing | mode | impl | fw ms | fw+bw ms | peak GiB | fw vs grouped_mm "
             "| fw+bw vs grouped_mm | peak vs grouped_mm |", "|" + "---|" * 10]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "routing", "mode", "impl", "fw_ms", "fwbw_ms", "peak_gib",
                    "fw_speedup", "fwbw_speedup", "peak_ratio", "note", "environment"])
        for r in results:
            a = anchor.get((r.shape, r.routing, r.mode))
            ratios = ((a.fw_ms / r.fw_ms, a.fwbw_ms / r.fwbw_ms, r.peak_gib / a.peak_gib)
                      if a else (float("nan"),) * 3)
            w.writerow([r.shape, r.routing, r.mode, r.impl, f"{r.fw_ms:.4f}", f"{r.fwbw_ms:.4f}",
                        f"{r.peak_gib:.3f}", *(f"{v:.3f}" for v in ratios), r.note,
                        environment_line()])
            lines.append(f"| {r.shape} | {r.routing} | {r.mode} | {r.impl} | {r.fw_ms:.3f} | "
                         f"{r.fwbw_ms:.3f} | {r.peak_gib:.2f} | {ratios[0]:.2f}x | "
                         f"{ratios[1]:.2f}x | {ratios[2]:.2f} |")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
