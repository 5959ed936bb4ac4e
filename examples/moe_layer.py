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
    python examples/moe_layer.py --fp8 rowwise --fp8-fast-accum --cache-fp8-weights

``--fp8``: the expert products in e4m3 (forward and dX; dW in the weights' dtype), the
fastest training setup on Hopper being rowwise scaling with ``fp8_fast_accum=True`` and, with
several micro-batches per optimizer step, ``cache_fp8_weights=True`` (the weights' e4m3
copies made once per step; ``benchmarks/RESULTS.md`` has the measurements and the costs).
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

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, dtype=torch.float32,
                 **fp8_options):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        # fp8=..., fp8_fast_accum=..., cache_fp8_weights=...: passed to both projections.
        self.fp8_options = fp8_options
        self.router = torch.nn.Linear(dim, experts, bias=False, dtype=dtype)
        # Gate rows [:hidden] and up rows [hidden:] of one fused weight per expert.
        self.gate_up = compileops.nn.GroupedLinear(experts, dim, 2 * hidden, bias=False, dtype=dtype)
        self.down = compileops.nn.GroupedLinear(experts, hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = torch.topk(torch.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        xs, order, offsets = permute_by_expert(x, ids, self.experts)
        h = compileops.grouped_linear_swiglu(xs, self.gate_up.weight, offsets,
                                             **self.fp8_options)
        # Router-probability scaling: the product's epilogue; its backward needs no [T*k, D]
        # activation (grouped_linear's row_scale).
        y = compileops.grouped_linear(h, self.down.weight, offsets,
                                      row_scale=probs.reshape(-1)[order], **self.fp8_options)
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
    parser.add_argument("--fp8", choices=["rowwise", "blockwise"], default=None,
                        help="the expert products in e4m3 with this scaling")
    parser.add_argument("--fp8-fast-accum", action="store_true",
                        help="with --fp8 rowwise: accumulate over the whole K loop in the MMA")
    parser.add_argument("--cache-fp8-weights", action="store_true",
                        help="with --fp8: keep each weight's e4m3 copy until it changes")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    fp8_options = {}
    if args.fp8:
        fp8_options = dict(fp8=args.fp8, fp8_fast_accum=args.fp8_fast_accum,
                           cache_fp8_weights=args.cache_fp8_weights)
    elif args.fp8_fast_accum or args.cache_fp8_weights:
        parser.error("--fp8-fast-accum and --cache-fp8-weights need --fp8")
    # fp8 takes 16-bit (or fp32) activations; bf16 where the GPU runs it.
    dtype = torch.bfloat16 if args.fp8 and device == "cuda" else torch.float32
    layer = MoELayer(dim=32, hidden=48, experts=4, top_k=2, dtype=dtype,
                     **fp8_options).to(device)

    if args.triton_on_cpu and device == "cpu":
        # Compile only (forward): the kernels Inductor would emit for a GPU.
        with torch.no_grad():
            report(inductor_kernels(layer, torch.randn(16, 32), triton=True))
        return
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens in (16, 40):
        x = torch.randn(tokens, 32, device=device, dtype=dtype, requires_grad=True)
        out = compiled(x)
        eager = layer(x)
        out.sum().backward()
        err = (out - eager).abs().max().item()
        print(f"tokens={tokens}: out {tuple(out.shape)}, max |compiled - eager| = {err:.2e}")
    report(inductor_kernels(layer, torch.randn(16, 32, device=device, dtype=dtype),
                            dynamic=True))


if __name__ == "__main__":
    main()
