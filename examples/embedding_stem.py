"""A transformer stem with compileops.nn.Embedding, compiled end to end.

Shows: the drop-in module (torch.nn.Embedding checkpoints load as is), the fp32 path that
upcasts only gathered rows, lookup + scale + cast fused into one kernel, and the
deterministic backward. Runs on CPU or GPU:

    python examples/embedding_stem.py
"""
import argparse
import math

import torch

import compileops
from compileops import testing


class Stem(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, dtype=torch.bfloat16):
        super().__init__()
        self.embed = compileops.nn.Embedding(vocab, dim, dtype=dtype, out_dtype=torch.float32)
        self.scale = math.sqrt(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed(ids) * self.scale).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available on this machine")
    vocab, dim = (151936, 4096) if device == "cuda" else (1000, 64)
    stem = Stem(vocab, dim).to(device)
    # A torch.nn.Embedding checkpoint loads unchanged.
    stem.embed.load_state_dict(torch.nn.Embedding(vocab, dim, dtype=torch.bfloat16).state_dict())
    ids = torch.randint(0, vocab, (4, 256), device=device)

    compiled = torch.compile(stem, fullgraph=True, dynamic=True)
    out = compiled(ids)
    out.float().sum().backward()
    print("output", tuple(out.shape), out.dtype, "| grad", tuple(stem.embed.weight.grad.shape),
          stem.embed.weight.grad.dtype)
    print("kernels (forward, then backward):")
    print(testing.inductor_kernels(stem, ids, backward=True))
    testing.assert_deterministic(stem, [ids], runs=3)
    print("backward bitwise reproducible over 3 runs")


if __name__ == "__main__":
    main()
