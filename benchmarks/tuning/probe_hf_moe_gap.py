"""Probe (GPU): the Hugging Face Qwen3-MoE step, compileops experts backend against
transformers' ``grouped_mm``, taken apart: the experts call alone per layer, a profile by
kernel kind, and (``--step``) the whole step's kernels.

Written when ``bench_hf_moe.py`` (4 layers at Qwen3-30B-A3B widths, 4 x 2048 tokens) measured
the step at 0.93x. 2026-11-26 on an H100 it found the experts call alone 1.10-1.18x faster
(fw+bw, on every layer's captured routing and on a uniform one) and the step at 1.05x: the
rest of the step (attention, the 151,936-word head) is the same on both sides.

1. ``experts``: the experts call alone, compiled (``fullgraph``), both backends on the same
   module, on the inputs each of the model's layers really gives its experts (captured from
   an eager forward; the randomly initialised router sends layers 1-3 a skewed load with
   empty experts) and on a uniform routing (the standalone layer's case). Forward (training,
   gradients on) and forward + backward (``backward()`` into ``.grad``, set to None each
   time, as the bench). CUDA events, medians, the two backends alternated case by case.
2. ``profile``: one compiled forward + backward of the most skewed layer per backend under
   ``torch.profiler``: the kernels by device time, summed by kind.
3. ``--step``: the whole compiled model step of ``bench_hf_moe.py`` per backend (CUDA
   events), its kernels summed by kind, and the kernels whose time differs most. Compiles the
   model twice: about two more minutes.

If (1) shows ours ahead per layer, the gap is outside the experts call (3 tells where); if
ours is behind only on the captured (skewed) inputs, it is the grouped GEMMs' response to
that load; the profile names the kernel.

    python benchmarks/tuning/probe_hf_moe_gap.py            # (1) + (2), under a minute on an H100
    python benchmarks/tuning/probe_hf_moe_gap.py --step     # + (3)
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import compileops  # noqa: E402,F401
import compileops.integrations.transformers as cit  # noqa: E402  (registers "compileops")
from benchmarks.bench_hf_moe import sync, time_steps  # noqa: E402

BACKENDS = ("compileops", "grouped_mm")


def log(msg: str) -> None:
    print(msg, flush=True)


def median_ms(fn, device, warmup: int, iters: int) -> float:
    """The median of ``bench_hf_moe.time_steps`` (CUDA events, or wall clock)."""
    return statistics.median(time_steps(fn, device, warmup, iters))


def implementation(name: str):
    """The experts function a backend name stands for (called directly: no dispatch)."""
    from transformers.integrations import moe

    return cit.experts_forward if name == "compileops" else moe.ALL_EXPERTS_FUNCTIONS[name]


def build(args, device, dtype):
    from benchmarks.bench_hf_moe import build_model

    ns = types.SimpleNamespace(tiny=args.tiny, layers=args.layers)
    return build_model(ns, device, dtype)


def capture_expert_inputs(model, ids):
    """``[(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])]`` per layer, from an eager
    forward with transformers' grouped_mm experts (no gradients)."""
    captured = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda mod, a: captured.append(tuple(t.detach().clone() for t in a[:3])))
        for layer in model.model.layers]
    model.set_experts_implementation("grouped_mm")
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return captured


def uniform_routing(hidden, num_experts: int, top_k: int, seed: int = 0):
    """The standalone layer's routing: a random router over unit-normal logits."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(hidden.shape[0], num_experts, generator=gen).to(hidden.device)
    probs, idx = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return idx, (probs / probs.sum(-1, keepdim=True)).to(hidden.dtype)


def load_note(idx, num_experts: int) -> str:
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts).float()
    return (f"{int((counts > 0).sum())}/{num_experts} experts used, max/mean "
            f"{(counts.max() / counts.mean()).item():.2f}, top-8 share "
            f"{(counts.topk(min(8, num_experts)).values.sum() / counts.sum()).item():.2f}")


def _short(kernel: str) -> str:
    return re.sub(r"\s+", " ", kernel)[:110]


def kernel_kind(name: str) -> str:
    n = name.lower()
    if n.startswith("triton_tem"):
        return "Inductor template (compileops M-jagged)"
    if "kjagged" in n:
        return "compileops dW (extern)"
    if "mjagged" in n or "compileops" in n:
        return "compileops eager kernel (extern)"
    if n.startswith("triton_"):
        return "Inductor fused (" + n.split("_")[1] + ")"
    if "grouped" in n or ("cutlass" in n and "group" in n):
        return "_grouped_mm (CUTLASS)"
    if "sort" in n or "radix" in n or "cub::" in n:
        return "sort"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n:
        return "dense GEMM"
    if "index" in n or "scatter" in n or "gather" in n:
        return "aten index/scatter"
    if "memset" in n or "fill" in n or "memcpy" in n:
        return "memset/copy"
    return "other"


def profile_kernels(fn, device, reps: int = 3) -> dict[str, tuple[int, float]]:
    """``{kernel name: (calls, total device ms)}`` per call of ``fn``, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if device.type != "cuda":
            t = e.self_cpu_time_total
        if t and t > 0:
            out[e.key] = (e.count // reps, t / reps / 1e3)
    return out


def print_profiles(title: str, profs: dict[str, dict[str, tuple[int, float]]], top: int) -> None:
    names = list(profs)
    log(f"\n### {title}: device ms per call, summed by kind")
    kinds = collections.defaultdict(lambda: [0.0] * len(names))
    for i, name in enumerate(names):
        for kernel, (_, ms) in profs[name].items():
            kinds[kernel_kind(kernel)][i] += ms
    log("| kind | " + " | ".join(names) + " | diff |")
    log("|---|" + "---|" * (len(names) + 1))
    for kind, v in sorted(kinds.items(), key=lambda kv: -max(kv[1])):
        log(f"| {kind} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {v[0] - v[-1]:+.3f} |")
    tot = [sum(ms for _, ms in profs[n].values()) for n in names]
    log("| total | " + " | ".join(f"{x:.3f}" for x in tot) + f" | {tot[0] - tot[-1]:+.3f} |")
    for name in names:
        rows = sorted(profs[name].items(), key=lambda kv: -kv[1][1])[:top]
        log(f"\n{name}: top {top} kernels (calls per call of the step, ms)")
        for kernel, (calls, ms) in rows:
            log(f"  {ms:8.3f} ms  x{calls:<3d} {_short(kernel)}")


def experts_part(args, model, captured, device) -> None:
    cfg = model.config
    experts = model.model.layers[0].mlp.experts
    params = [experts.gate_up_proj, experts.down_proj]
    cases = [("uniform", captured[0][0], *uniform_routing(captured[0][0], cfg.num_experts,
                                                           cfg.num_experts_per_tok))]
    cases += [(f"layer {i}", h, idx, w) for i, (h, idx, w) in enumerate(captured)]
    for name, _, idx, _ in cases:
        log(f"routing {name}: {load_note(idx, cfg.num_experts)}")
    gen = torch.Generator(device="cpu").manual_seed(2)
    dy = torch.randn(captured[0][0].shape, generator=gen).to(device, captured[0][0].dtype)

    compiled = {b: torch.compile(lambda h, i, w, _f=implementation(b): _f(experts, h, i, w),
                                 fullgraph=True) for b in args.backends}

    def runner(backend, h, idx, w, backward: bool):
        hx = h.detach().requires_grad_(True)
        wx = w.detach().requires_grad_(True)

        def fw():
            return compiled[backend](hx, idx, wx)

        def fwbw():
            for p in params:
                p.grad = None
            hx.grad = wx.grad = None
            compiled[backend](hx, idx, wx).backward(dy)

        return fwbw if backward else fw

    t0 = time.perf_counter()
    for b in args.backends:  # compile forward and backward
        runner(b, *cases[0][1:], True)()
    sync(device)
    log(f"compiled the experts call for {', '.join(args.backends)} in "
        f"{time.perf_counter() - t0:.1f} s")

    log("\n### experts call alone, compiled: ms (median of "
        f"{args.iters}; ratio = grouped_mm / compileops)")
    log("| routing | " + " | ".join(f"{b} fw | {b} fw+bw" for b in args.backends)
        + " | fw ratio | fw+bw ratio |")
    log("|---|" + "---|" * (2 * len(args.backends) + 2))
    sums = collections.defaultdict(float)
    for name, h, idx, w in cases:
        res = {}
        for b in args.backends:
            res[b] = (median_ms(runner(b, h, idx, w, False), device, args.warmup, args.iters),
                      median_ms(runner(b, h, idx, w, True), device, args.warmup, args.iters))
            if name != "uniform":
                sums[b, 0] += res[b][0]
                sums[b, 1] += res[b][1]
        cells = " | ".join(f"{res[b][0]:.3f} | {res[b][1]:.3f}" for b in args.backends)
        ratios = ""
        if len(args.backends) == 2:
            a, g = res["compileops"], res["grouped_mm"]
            ratios = f" | {g[0] / a[0]:.3f} | {g[1] / a[1]:.3f}"
        log(f"| {name} | {cells}{ratios} |")
    cells = " | ".join(f"{sums[b, 0]:.3f} | {sums[b, 1]:.3f}" for b in args.backends)
    log(f"| sum of the {len(captured)} layers | {cells} |" + (" |" * 2))

    # The most skewed layer, profiled.
    worst = max(range(len(captured)), key=lambda i: torch.bincount(
        captured[i][1].reshape(-1), minlength=cfg.num_experts).max().item())
    h, idx, w = captured[worst]
    profs = {b: profile_kernels(runner(b, h, idx, w, True), device) for b in args.backends}
    print_profiles(f"experts fw+bw, layer {worst}", profs, args.top)


def step_part(args, model, ids, device) -> None:
    from benchmarks.bench_hf_moe import compile_model, make_step

    times, profs = {}, {}
    for b in args.backends:
        compiled, counter = compile_model(model, b)
        step = make_step(compiled, ids)
        t0 = time.perf_counter()
        step()
        sync(device)
        log(f"{b}: step compiled in {time.perf_counter() - t0:.1f} s, "
            f"{counter.frame_count} frame(s)")
        times[b] = median_ms(step, device, args.warmup, args.iters)
        profs[b] = profile_kernels(step, device, reps=2)
        log(f"{b}: {times[b]:.2f} ms/step")
        del compiled, step
        for p in model.parameters():
            p.grad = None
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_profiles("whole step (forward + loss + backward)", profs, args.top)
    if len(args.backends) == 2:
        a, g = profs["compileops"], profs["grouped_mm"]
        diff = {k: a.get(k, (0, 0.0))[1] - g.get(k, (0, 0.0))[1] for k in set(a) | set(g)}
        log("\nkernels whose time differs most (compileops - grouped_mm, ms per step)")
        for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
            log(f"  {d:+8.3f}  {_short(k)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (CPU dry run)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="default 4 (tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 32)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per profile")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--step", action="store_true", help="also the whole compiled step")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (a CPU dry run: --device cpu --tiny)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)

    import transformers

    from benchmarks.harness import environment_line

    log(environment_line())
    log(f"transformers {transformers.__version__} | Qwen3-MoE "
        f"{'tiny' if args.tiny else '30B-A3B widths'}, {args.layers} layers | "
        f"{args.batch} x {args.seq} tokens | {dtype}")
    model = build(args, device, dtype)
    gen = torch.Generator().manual_seed(1)  # the bench's batch
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen)
    ids = ids.to(device)
    captured = capture_expert_inputs(model, ids)
    experts_part(args, model, captured, device)
    if args.step:
        step_part(args, model, ids, device)
    from compileops.grouped_linear.kernels import tma

    failed = {k.value: sorted(v) for k, v in tma._failed.items() if v}
    log(f"\ncompileops launch fallbacks recorded: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
