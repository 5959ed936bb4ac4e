"""Self-check demo for the mLSTM family: one xLSTM-7B mLSTM layer (projections, soft-capped
gates, the cell with its multi-head layernorm fused, output gate, out projection), forward
and backward, against the same layer in fp64 on the reference backend."""
from __future__ import annotations

import copy

import torch

from compileops.backends import use_backend
from compileops._demo import Demo
from compileops.mlstm.module import mLSTMLayer


def demo(device: torch.device) -> Demo:
    on_gpu = device.type == "cuda"
    # GPU: DQK 64, DV 128 in bf16; CPU: small, fp32.
    dim, heads = (512, 4) if on_gpu else (32, 2)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = mLSTMLayer(embedding_dim=dim, num_heads=heads).to(device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def args_for(tokens: int) -> tuple:
        return (torch.randn(2, tokens, dim, generator=gen).to(device=device, dtype=dtype),)

    def reference(x: torch.Tensor) -> torch.Tensor:
        exact = copy.deepcopy(model).double()
        with torch.no_grad(), use_backend("reference"):
            return exact(x.double())

    return Demo(
        family="mlstm",
        model=model,
        args=args_for(256 if on_gpu else 16),
        reference=reference,
        ops=["mlstm_parallel", "mlstm_parallel_backward"],
        max_relative_error=2e-2 if on_gpu else 1e-5,
        resized_args=args_for,
    )
