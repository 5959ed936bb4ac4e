"""How torchtitan's experts' gate/up projections compile on compileops, two ways: one fused
SwiGLU kernel on ``torch.cat([w1, w3], 1)`` (what ``_swiglu`` of the torchtitan integration
does) or two grouped-linear products and the SwiGLU written out. Counts the nodes of the
forward and backward graphs AOTAutograd hands the backend (custom ops, and all nodes), and
times the compiled forward + backward on CPU (the reference backend), both per call.

    python benchmarks/titan_swiglu_graph.py [--rows 512 --dim 256 --hidden 128 --experts 8]

The graphs say which form is simpler; the CPU times are only a check that neither is
pathological (the GPU choice is measured on a GPU).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F

import compileops
from compileops.grouped_linear import grouped_linear, grouped_linear_swiglu


def fused(x, w1, w3, offsets):
    return grouped_linear_swiglu(x, torch.cat([w1, w3], dim=1), offsets)


def separate(x, w1, w3, offsets):
    return F.silu(grouped_linear(x, w1, offsets)) * grouped_linear(x, w3, offsets)


def graphs(fn, args):
    """``{"forward": Counter, "backward": Counter}`` of op names in the AOT graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen = {}

    def recorder(kind):
        def compiler(gm, example_inputs):
            seen[kind] = collections.Counter(
                str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    out.float().square().sum().backward()
    return seen


def timed(fn, args, reps: int) -> float:
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        compiled(*args).float().square().sum().backward()
    start = time.perf_counter()
    for _ in range(reps):
        compiled(*args).float().square().sum().backward()
    return (time.perf_counter() - start) / reps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.rows, a.dim, generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(a.experts, a.hidden, a.dim, generator=g).bfloat16().requires_grad_()
              for _ in range(2))
    offsets = compileops.grouped_linear.routing.dirichlet_offsets(a.experts, a.rows)
    with compileops.backends.use_backend("reference"):
        for name, fn in (("fused (cat + grouped_linear_swiglu)", fused),
                         ("separate (2 x grouped_linear + silu * mul)", separate)):
            seen = graphs(fn, (x, w1, w3, offsets))
            ms = 1000 * timed(fn, (x, w1, w3, offsets), a.reps)
            print(f"{name}: {ms:.1f} ms forward + backward (CPU, reference backend)")
            for kind in ("forward", "backward"):
                ops = seen[kind]
                custom = {k: v for k, v in ops.items() if k.startswith("compileops.")}
                print(f"  {kind}: {sum(ops.values())} nodes, custom ops {custom}")


if __name__ == "__main__":
    main()
