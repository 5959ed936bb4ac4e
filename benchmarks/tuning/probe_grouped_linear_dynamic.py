"""Probe: the compiled grouped linear under dynamic=True against eager, per shape: correctness
(max |diff| to the eager kernel) and time, static and dynamic. A regression check for the
dynamic-shape path (GPU only); the optional label prefixes each line.

    python benchmarks/tuning/probe_grouped_linear_dynamic.py [label]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import compileops  # noqa: E402
from benchmarks.harness import bench_ms  # noqa: E402

SHAPES = {"mixtral": (8, 16384, 4096, 14336), "qwen3_down": (128, 65536, 768, 2048),
          "deepseek_v3": (32, 32768, 7168, 2048), "small": (4, 1000, 256, 384)}


def main():
    variant = sys.argv[1] if len(sys.argv) > 1 else "default"
    for name, (g, m, k, n) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        sizes = torch.full((g,), m // g, dtype=torch.int64)
        sizes[-1] += m - int(sizes.sum())
        offs = torch.cumsum(sizes, 0).to(torch.int32).cuda()
        eager = compileops.grouped_linear(x, w, offs)
        for dynamic in (False, True):
            torch._dynamo.reset()
            f = torch.compile(lambda a, b, o: compileops.grouped_linear(a, b, o), fullgraph=True,
                              dynamic=dynamic)
            out = f(x, w, offs)
            diff = (out.float() - eager.float()).abs().max().item()
            ms = bench_ms(lambda: f(x, w, offs))
            print(f"{variant} {name} dynamic={dynamic}: max|compiled - eager| {diff:.3e}, "
                  f"{ms:.4f} ms, {2 * m * n * k / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
