"""Self-check demo for the embedding family: lookup, scale, cast, as in a transformer stem."""
from __future__ import annotations

import math

import torch

from compileops._demo import Demo
from compileops.embedding.module import Embedding


class EmbeddingStem(torch.nn.Module):
    """ids ``[B, S]`` -> ``[B, S, D]`` bf16: bf16 table, fp32 scale by sqrt(D), cast back."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = Embedding(vocab, dim, dtype=torch.bfloat16, out_dtype=torch.float32)
        self.scale = math.sqrt(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed(ids) * self.scale).to(torch.bfloat16)


def demo(device: torch.device) -> Demo:
    vocab, dim = (32000, 1024) if device.type == "cuda" else (1000, 64)
    model = EmbeddingStem(vocab, dim).to(device)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def ids_for(tokens: int) -> tuple:
        return (torch.randint(0, vocab, (2, tokens), generator=gen).to(device),)

    def reference(ids: torch.Tensor) -> torch.Tensor:
        table = model.embed.weight.detach().double()
        return (table[ids] * model.scale).to(torch.bfloat16)

    return Demo(
        family="embedding",
        model=model,
        args=ids_for(512 if device.type == "cuda" else 64),
        reference=reference,
        ops=["embedding", "embedding_backward"],
        max_relative_error=0.0,  # a gather then the same fp32 math: bitwise
        resized_args=ids_for,
    )
