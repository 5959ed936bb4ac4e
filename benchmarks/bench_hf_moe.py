"""A Hugging Face Qwen3-MoE training step, compiled: the compileops experts backend against
transformers' own ``grouped_mm`` backend, in one process, on one model.

The model is ``Qwen3MoeForCausalLM`` at Qwen3-30B-A3B's real widths (hidden 2048, 128 experts
of width 768, top-8, 32 query / 4 KV heads of 128, vocabulary 151936) with a few layers
(``--layers``, default 4), random init, bf16 weights. One step is forward + loss +
backward (``model(ids, labels=ids).loss.backward()``; gradients set to None between steps; no
optimizer, which would cost the same for both). The model is compiled with ``torch.compile``
(default mode, static shapes) once per backend; the backend is switched on the same model with
``model.set_experts_implementation(name)``, so both runs share weights, batch and everything
but the experts:

* ``compileops``: ``compileops.integrations.transformers`` (sync-free routing, SwiGLU fused in
  the gate/up grouped GEMM, compileops Triton templates under Inductor);
* ``grouped_mm``: transformers' default (``torch.nn.functional.grouped_mm`` or
  ``torch._grouped_mm``).

Before timing, one step of each on the same batch is compared (loss and gradient norms of the
embedding, a router and an expert weight): both run bf16 GEMMs with different summation orders
and a few tokens may pick other experts after that, so the check allows a loose relative
difference and exits non-zero beyond it. Timing: median of ``--iters`` steps after ``--warmup``
(CUDA events). Peak memory: ``max_memory_allocated`` over one step.

    python benchmarks/bench_hf_moe.py                         # H100: 4 layers, 4 x 2048 tokens
    python benchmarks/bench_hf_moe.py --layers 8 --batch 8
    python benchmarks/bench_hf_moe.py --device cpu --tiny     # dry run: tiny widths, fp32, CPU

Needs ``pip install -e ".[hf]"`` (transformers >= 5.7). Results: a markdown table on stdout and
``$COMPILEOPS_BENCH_OUT/hf_moe.csv`` (or benchmarks/out/).
"""
from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402,F401
import compileops.integrations.transformers as cit  # noqa: E402  (registers "compileops")
from benchmarks.harness import environment_line, out_dir, sync, time_calls_ms  # noqa: E402

BACKENDS = ("compileops", "grouped_mm")

# Qwen3-30B-A3B's widths (config.json of Qwen/Qwen3-30B-A3B); --layers sets the depth.
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    tie_word_embeddings=False,
)


def build_model(args, device, dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    widths = dict(TINY if args.tiny else QWEN3_30B_A3B)
    if "rope_theta" in widths:  # transformers 5 keeps it in rope_parameters
        widths["rope_parameters"] = {"rope_type": "default", "rope_theta": widths.pop("rope_theta")}
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, use_cache=False, **widths)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=dtype)
    model.train()
    return model


def make_step(model, ids):
    def step():
        for p in model.parameters():
            p.grad = None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    return step


def compile_model(model, backend: str):
    """A fresh compiled wrapper for ``backend``; counts Dynamo frames (1 = no graph break)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model.set_experts_implementation(backend)
    counter = CompileCounterWithBackend("inductor")
    return torch.compile(model, backend=counter), counter


def reference_grads(model) -> dict[str, torch.Tensor]:
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
             "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach().float().clone() for n in names if params[n].grad is not None}


def check(results: dict, loss_tol: float, grad_tol: float) -> bool:
    """Compare the first step of each backend with the first backend's; print and judge."""
    (base_name, (base_loss, base_grads)), *others = results.items()
    ok = True
    for name, (loss, grads) in others:
        loss_rel = abs(loss - base_loss) / max(abs(base_loss), 1e-12)
        print(f"check {name} vs {base_name}: loss {loss:.6f} vs {base_loss:.6f} "
              f"(relative {loss_rel:.2e}, tolerance {loss_tol:g})")
        ok &= loss_rel <= loss_tol
        for n, g in base_grads.items():
            rel = ((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
            print(f"  grad {n}: relative norm difference {rel:.2e} (tolerance {grad_tol:g})")
            ok &= rel <= grad_tol
    print("check:", "OK" if ok else "MISMATCH")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (dry run)")
    parser.add_argument("--layers", type=int, default=None, help="default 4 (tiny: 2)")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 32)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                        help="weights and activations; default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (cpu: 1)")
    parser.add_argument("--iters", type=int, default=None, help="default 20 (cpu: 3)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--embedding", action="store_true",
                        help="also swap in compileops.nn.Embedding for the compileops run")
    parser.add_argument("--no-check", action="store_true", help="skip the cross-check")
    parser.add_argument("--loss-tol", type=float, default=None, help="default 2e-2 (fp32: 1e-4)")
    parser.add_argument("--grad-tol", type=float, default=None, help="default 1e-1 (fp32: 1e-3)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --device cpu --tiny for a dry run")
    args.layers = args.layers or (2 if args.tiny else 4)
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    args.warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    args.iters = args.iters or (20 if device.type == "cuda" else 3)
    lowp = dtype != torch.float32
    loss_tol = args.loss_tol or (2e-2 if lowp else 1e-4)
    grad_tol = args.grad_tol or (1e-1 if lowp else 1e-3)

    import transformers

    print(environment_line())
    print(f"transformers {transformers.__version__} | Qwen3-MoE "
          f"{'tiny' if args.tiny else '30B-A3B widths'}, {args.layers} layers | "
          f"{args.batch} x {args.seq} tokens | {args.dtype} | forward + loss + backward")

    model = build_model(args, device, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen)
    ids = ids.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:,.1f} M")

    rows, first_steps = [], {}
    for backend in args.backends:
        if backend == "compileops" and args.embedding:
            cit.apply(model, experts=False)
        compiled, counter = compile_model(model, backend)
        step = make_step(compiled, ids)
        t0 = time.perf_counter()
        loss = step()  # compiles forward and backward
        sync(device)
        compile_s = time.perf_counter() - t0
        first_steps[backend] = (loss.item(), reference_grads(model))
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            step()
            sync(device)
            peak_gib = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        else:
            peak_gib = float("nan")
        times = time_calls_ms(step, device, args.warmup, args.iters)
        ms = statistics.median(times)
        tokens_s = args.batch * args.seq / (ms * 1e-3)
        rows.append(dict(backend=backend, ms=ms, min_ms=min(times), tokens_per_s=tokens_s,
                         peak_gib=peak_gib, frames=counter.frame_count, compile_s=compile_s))
        print(f"{backend}: {ms:.2f} ms/step (median of {len(times)}, min {min(times):.2f}), "
              f"{tokens_s:,.0f} tokens/s, peak {peak_gib:.2f} GiB above the weights, "
              f"{counter.frame_count} compiled frame(s), first step {compile_s:.1f} s",
              flush=True)
        del compiled, step
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print()
    print("| backend | ms/step | min ms | tokens/s | peak GiB | compiled frames |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['ms']:.2f} | {r['min_ms']:.2f} | {r['tokens_per_s']:,.0f} "
              f"| {r['peak_gib']:.2f} | {r['frames']} |")
    by_name = {r["backend"]: r for r in rows}
    if {"compileops", "grouped_mm"} <= by_name.keys():
        ratio = by_name["grouped_mm"]["ms"] / by_name["compileops"]["ms"]
        print(f"\nratio grouped_mm / compileops = {ratio:.3f}x "
              f"({'compileops faster' if ratio > 1 else 'grouped_mm faster'})")
    path = os.path.join(out_dir(), "hf_moe.csv")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"csv: {path}")
    if not args.no_check and len(first_steps) > 1 and not check(first_steps, loss_tol, grad_tol):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
