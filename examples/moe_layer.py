"""A SwiGLU mixture-of-experts layer on compileops grouped linear, compiled whole.

router -> top-k -> sync-free permutation to expert order (+ int32 offsets on the device)
-> grouped gate/up projection with SwiGLU fused in the kernel -> grouped down projection
with the router probability applied as the template's epilogue -> un-permute and combine.

Compiled with ``fullgraph=True, dynamic=True``: no graph break, no recompile across token
counts, no host sync. Runs on CPU (C++ backend: the grouped ops are extern calls of our
kernels) or on CUDA (Triton templates with fused epilogues). ``--triton-on-cpu`` shows the
Triton kernels Inductor would emit on a GPU (compile only: the softmax's exp goes through libdevice,
which Triton's CPU interpreter lacks).

    python examples/moe_layer.py            # CPU
    python examples/moe_layer.py --triton-on-cpu
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine  # noqa: E402
from compileops.testing import inductor_kernels  # noqa: E402


class MoELayer(torch.nn.Module):
    """x ``[T, D]`` -> ``[T, D]``: ``sum_j p_j(x) * expert_{e_j}(x)`` over the top-k experts."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, dtype=torch.float32):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = torch.nn.Linear(dim, experts, bias=False, dtype=dtype)
        # Gate rows [:hidden] and up rows [hidden:] of one fused weight per expert.
        self.gate_up = compileops.nn.GroupedLinear(experts, dim, 2 * hidden, bias=False, dtype=dtype)
        self.down = compileops.nn.GroupedLinear(experts, hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = torch.topk(torch.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        xs, order, offsets = permute_by_expert(x, ids, self.experts)
        h = compileops.grouped_linear_swiglu(xs, self.gate_up.weight, offsets)
        # Router-probability scaling: the template's epilogue; its backward needs no [T*k, D]
        # activation (grouped_linear's row_scale).
        y = compileops.grouped_linear(h, self.down.weight, offsets,
                                      row_scale=probs.reshape(-1)[order])
        return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)


def report(kernels: str) -> None:
    lines = kernels.splitlines()
    templates = [k for k in lines if k.startswith("triton_tem_")]
    externs = [k for k in lines if "compileops" in k]
    print("fused template kernels:",
          templates or "(none: C++ backend, grouped ops are extern calls)")
    print("extern compileops calls:", externs or "(none)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-on-cpu", action="store_true",
                        help="emit Triton for CPU tensors (as on a GPU) and print the kernels")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    layer = MoELayer(dim=32, hidden=48, experts=4, top_k=2).to(device)

    if args.triton_on_cpu and device == "cpu":
        # Compile only (forward): the kernels Inductor would emit for a GPU.
        with torch.no_grad():
            report(inductor_kernels(layer, torch.randn(16, 32), triton=True))
        return
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens in (16, 40):
        x = torch.randn(tokens, 32, device=device, requires_grad=True)
        out = compiled(x)
        eager = layer(x)
        out.sum().backward()
        err = (out - eager).abs().max().item()
        print(f"tokens={tokens}: out {tuple(out.shape)}, max |compiled - eager| = {err:.2e}")
    report(inductor_kernels(layer, torch.randn(16, 32, device=device), dynamic=True))


if __name__ == "__main__":
    main()
