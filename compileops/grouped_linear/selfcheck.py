"""Self-check demo for the grouped linear family: an MoE expert MLP (fused gate/up SwiGLU,
down projection, router-probability scaling) over expert-sorted rows. The probability is
written as a product, as users write it; compiled, it runs as the down projection's
``row_scale`` (``grouped_linear_row_scaled``, ``lowerings/user_patterns.py``)."""
from __future__ import annotations

import torch

from compileops._demo import Demo
from compileops.grouped_linear import reference
from compileops.grouped_linear.api import grouped_linear, grouped_linear_swiglu
from compileops.grouped_linear.routing import dirichlet_offsets


class ExpertMLP(torch.nn.Module):
    """x ``[M, D]`` rows sorted by expert, offsets int32 ``[E]``, probs ``[M]`` -> ``[M, D]``."""

    def __init__(self, experts: int, dim: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w_up = torch.nn.Parameter((torch.randn(experts, 2 * hidden, dim, generator=gen) / dim**0.5).to(dtype))
        self.w_down = torch.nn.Parameter((torch.randn(experts, dim, hidden, generator=gen) / hidden**0.5).to(dtype))

    def forward(self, x, offsets, probs):
        h = grouped_linear_swiglu(x, self.w_up, offsets, None)
        return grouped_linear(h, self.w_down, offsets, None) * probs[:, None].to(x.dtype)


def demo(device: torch.device) -> Demo:
    on_gpu = device.type == "cuda"
    experts, dim, hidden = (8, 1024, 2048) if on_gpu else (4, 32, 32)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = ExpertMLP(experts, dim, hidden, dtype).to(device)
    gen = torch.Generator().manual_seed(1)

    def args_for(tokens: int) -> tuple:
        x = torch.randn(tokens, dim, generator=gen).to(dtype)
        ends = dirichlet_offsets(experts, tokens, generator=gen)
        probs = torch.rand(tokens, generator=gen)
        return x.to(device), ends.to(device), probs.to(device)

    def ref(x, offsets, probs):
        h = reference.swiglu(reference.grouped_linear_forward(
            x.double(), model.w_up.detach().double(), offsets))
        y = reference.grouped_linear_forward(h, model.w_down.detach().double(), offsets)
        return (y * probs.double()[:, None]).to(dtype)

    return Demo(
        family="grouped_linear",
        model=model,
        args=args_for(4096 if on_gpu else 48),
        reference=ref,
        ops=["grouped_linear_row_scaled", "grouped_linear_swiglu_with_preact",
             "grouped_linear_dx", "grouped_linear_wgrad"],
        max_relative_error=2e-2 if on_gpu else 1e-5,
        resized_args=args_for,
    )
