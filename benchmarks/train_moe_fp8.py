"""fp8 MoE training converges as bf16 does: one small MoE language model trained twice on the
same bytes, once with the expert GEMMs in bf16 and once with ``fp8=...``, loss curves side by
side.

The corpus ships with the package: the bytes of compileops' own Python sources and docs
(``compileops/**/*.py``, sorted by path), a byte-level language modelling task with no
download; the last 5% are held out. The model: byte embedding plus an embedding of the
previous byte (the only mixing across positions), then ``--blocks`` residual blocks of RMSNorm
and a SwiGLU MoE layer (router, top-k, ``permute_by_expert``, ``grouped_linear_swiglu`` and
``grouped_linear`` with the router probability as ``row_scale``, ``unpermute_and_combine``),
a final RMSNorm and the byte head. Parameters and the AdamW state are fp32; the activations
and the expert weights enter the GEMMs in bf16, and with ``--recipes rowwise`` (or
``blockwise``) the expert products take ``fp8=`` (forward and dX in e4m3, dW in bf16, the
router probability in the down projection's epilogue as ``row_scale``); ``rowwise-fast`` is
``fp8="rowwise"`` with ``fp8_fast_accum=True``, and ``rowwise-fast-dw`` that with
``fp8_weight_grad=True`` (dW in e4m3 too). Every run starts from the same
weights and reads the same batches; the model is compiled (``fullgraph=True``).

Reported: the training loss and the gradients' total norm (all parameters, before the
optimizer step) at every step (CSV), the loss's mean over the last 50 steps per recipe
and the relative difference to bf16's, the held-out loss at the end, ms a step, and an SVG of
the curves (``moe_fp8_convergence.svg``).

    python benchmarks/train_moe_fp8.py                      # GPU: 1000 steps, bf16 and rowwise
    python benchmarks/train_moe_fp8.py --recipes none rowwise blockwise
    python benchmarks/train_moe_fp8.py --device cpu --smoke # tiny, 3 steps (tests run this)
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine  # noqa: E402
from benchmarks.harness import environment_line, out_dir, write_csv  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSV_COLUMNS = ["recipe", "step", "loss", "grad_norm"]


@dataclasses.dataclass(frozen=True)
class Size:
    dim: int
    hidden: int
    experts: int
    top_k: int
    blocks: int
    batch: int
    seq: int


GPU_SIZE = Size(dim=512, hidden=1024, experts=16, top_k=2, blocks=4, batch=32, seq=256)
SMOKE_SIZE = Size(dim=32, hidden=32, experts=4, top_k=2, blocks=1, batch=2, seq=16)


def corpus() -> torch.Tensor:
    """uint8 bytes of compileops' Python sources, sorted by path (the same on every machine
    with the same checkout)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "compileops", "**", "*.py"), recursive=True))
    data = b"".join(open(p, "rb").read() for p in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class MoE(torch.nn.Module):
    def __init__(self, size: Size, recipe):
        super().__init__()
        d, h, e = size.dim, size.hidden, size.experts
        self.size, self.recipe = size, recipe
        self.norm = torch.nn.RMSNorm(d)
        self.router = torch.nn.Parameter(torch.randn(e, d) / math.sqrt(d))
        self.gate_up = torch.nn.Parameter((torch.rand(e, 2 * h, d) * 2 - 1) / math.sqrt(d))
        self.down = torch.nn.Parameter((torch.rand(e, d, h) * 2 - 1) / math.sqrt(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, D] bf16
        normed = self.norm(x.float())
        logits = F.linear(normed, self.router)
        probs, ids = torch.topk(torch.softmax(logits, dim=-1), self.size.top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        xs, order, offsets = permute_by_expert(normed.to(x.dtype), ids, self.size.experts)
        p_sorted = probs.reshape(-1)[order]
        w_gu, w_down = self.gate_up.to(x.dtype), self.down.to(x.dtype)
        if self.recipe is None:
            h = compileops.grouped_linear_swiglu(xs, w_gu, offsets)
            y = compileops.grouped_linear(h, w_down, offsets, row_scale=p_sorted)
        else:
            scaling, *options = self.recipe.split("-")
            opts = dict(fp8=scaling, fp8_fast_accum="fast" in options,
                        fp8_weight_grad="dw" in options)
            h = compileops.grouped_linear_swiglu(xs, w_gu, offsets, **opts)
            y = compileops.grouped_linear(h, w_down, offsets, row_scale=p_sorted, **opts)
        return x + unpermute_and_combine(y, order, torch.ones_like(probs),
                                          order_is_permutation=True)


class ByteMoELM(torch.nn.Module):
    def __init__(self, size: Size, recipe):
        super().__init__()
        self.byte = torch.nn.Embedding(256, size.dim)
        self.previous = torch.nn.Embedding(257, size.dim)  # 256: no previous byte
        self.blocks = torch.nn.ModuleList(MoE(size, recipe) for _ in range(size.blocks))
        self.norm = torch.nn.RMSNorm(size.dim)
        self.head = torch.nn.Linear(size.dim, 256, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        prev = F.pad(ids[:, :-1].long(), (1, 0), value=256)
        x = (self.byte(ids.long()) + self.previous(prev)).flatten(0, 1).to(torch.bfloat16)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x.float()))
        return F.cross_entropy(logits, targets.long().reshape(-1))


def batches(data: torch.Tensor, size: Size, steps: int, seed: int, device):
    """``steps`` batches of ``(ids, targets)`` ``[batch, seq]``, drawn with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - size.seq - 1, (steps, size.batch), generator=gen)
    offsets = torch.arange(size.seq + 1)
    for row in starts:
        window = data[row[:, None] + offsets].to(device)
        yield window[:, :-1], window[:, 1:]


def train(recipe, args, size: Size, train_data, held_out, device) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ByteMoELM(size, recipe).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    step_fn = torch.compile(model, fullgraph=True) if args.compile else model
    losses, grad_norms, start = [], [], None
    for step, (ids, targets) in enumerate(batches(train_data, size, args.steps, 1, device)):
        if step == min(10, args.steps - 1):  # after the compiles
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, timed = time.perf_counter(), args.steps - step
        loss = step_fn(ids, targets)
        loss.backward()
        # The total norm, on the device (no host sync); an infinite limit clips nothing.
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / timed
    losses = [v.item() for v in losses]
    grad_norms = [v.item() for v in grad_norms]
    with torch.no_grad():
        held = [step_fn(i, t).item() for i, t in batches(held_out, size, args.eval_batches, 2,
                                                           device)]
    return dict(losses=losses, grad_norms=grad_norms, held_out=sum(held) / len(held), ms=ms)


def svg(curves: dict, path: str, every: int) -> None:
    """A plain SVG of the loss curves (means over windows of ``every`` steps)."""
    width, height, pad = 640, 360, 40
    smoothed = {r: [sum(v[i:i + every]) / len(v[i:i + every]) for i in range(0, len(v), every)]
                for r, v in curves.items()}
    lo = min(min(v) for v in smoothed.values())
    hi = max(max(v) for v in smoothed.values())
    n = max(len(v) for v in smoothed.values())
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="13">training loss (mean of {every} steps) '
             f'against step; {lo:.3f} to {hi:.3f}</text>']
    for (recipe, values), colour in zip(smoothed.items(), colours):
        points = " ".join(
            f"{pad + i * (width - 2 * pad) / max(1, n - 1):.1f},"
            f"{height - pad - (v - lo) / max(hi - lo, 1e-9) * (height - 2 * pad):.1f}"
            for i, v in enumerate(values))
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                     f'points="{points}"/>')
        lines.append(f'<text x="{width - 150}" y="{40 + 16 * list(smoothed).index(recipe)}" '
                     f'font-size="12" fill="{colour}">{recipe}</text>')
    lines.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 steps")
    parser.add_argument("--recipes", nargs="+", default=["none", "rowwise"],
                        choices=["none", "rowwise", "rowwise-fast", "rowwise-fast-dw", "blockwise"])
    parser.add_argument("--steps", type=int, default=None, help="default 1000 (smoke: 3)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=None, help="default 16 (smoke: 1)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args()
    device = torch.device(args.device)
    size = SMOKE_SIZE if args.smoke else GPU_SIZE
    args.steps = args.steps or (3 if args.smoke else 1000)
    args.eval_batches = args.eval_batches or (1 if args.smoke else 16)
    data = corpus()
    split = int(data.numel() * 0.95)
    print(environment_line())
    print(f"corpus: {data.numel():,} bytes of compileops/**/*.py; {size}; {args.steps} steps, "
          f"AdamW lr {args.lr} (warm-up {args.warmup}), "
          f"{'compiled' if args.compile else 'eager'}", flush=True)
    results, rows = {}, []
    for name in args.recipes:
        recipe = None if name == "none" else name
        got = train(recipe, args, size, data[:split], data[split:], device)
        label = "bf16" if recipe is None else f"fp8 {recipe}"
        results[label] = got
        rows += [dict(recipe=label, step=i, loss=v, grad_norm=n)
                 for i, (v, n) in enumerate(zip(got["losses"], got["grad_norms"]))]
        tail = got["losses"][-50:]
        print(f"{label:14s} first {got['losses'][0]:.4f}  last-50 mean {sum(tail) / len(tail):.4f}"
              f"  held-out {got['held_out']:.4f}  {got['ms']:.1f} ms a step", flush=True)
    base = results.get("bf16")
    if base is not None:
        base_tail = sum(base["losses"][-50:]) / len(base["losses"][-50:])
        for label, got in results.items():
            if label == "bf16":
                continue
            tail = sum(got["losses"][-50:]) / len(got["losses"][-50:])
            print(f"{label} vs bf16: last-50 training loss {100 * (tail / base_tail - 1):+.2f}%, "
                  f"held-out {100 * (got['held_out'] / base['held_out'] - 1):+.2f}%")
    print(f"csv: {write_csv('moe_fp8_convergence.csv', CSV_COLUMNS, rows)}")
    path = os.path.join(out_dir(), "moe_fp8_convergence.svg")
    svg({k: v["losses"] for k, v in results.items()}, path, max(1, args.steps // 100))
    print(f"svg: {path}")


if __name__ == "__main__":
    main()
