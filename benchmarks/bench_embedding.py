"""Embedding benchmark: Qwen3-8B table (151936 x 4096 bf16), 16384 Zipf-distributed tokens.

Anchors in the same process: eager ``F.embedding``, ``torch.compile(F.embedding)`` (Inductor's
own lowering), a device-to-device copy of the same bytes (the floor); for the backward: eager
``embedding_dense_backward``, Inductor's compiled (atomic) backward, and the compiled backward
under ``torch.use_deterministic_algorithms(True)``.

    python benchmarks/bench_embedding.py [--tokens 16384] [--sweep]

``--sweep`` also times a few other launch options of the kernels (``ForwardConfig`` tiles,
``BackwardConfig`` schedules); ``benchmarks/tuning/sweep_embedding_bw.py`` has the full
backward sweep.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# Inductor compiles the anchors in this process; without worker subprocesses, no compile pool
# is left competing for the host while the (host-heavy) backward op is timed.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
from benchmarks.harness import Row, bench_ms, copy_bandwidth_gbps, floor_ms, out_dir, report  # noqa: E402
from compileops.embedding import kernels  # noqa: E402

V, D = 151936, 4096


def zipf_ids(n: int, vocab: int, exponent: float = 1.1, seed: int = 0) -> torch.Tensor:
    """Zipf-like ids: rank r drawn with p ~ 1/r^s, ranks scattered over the vocab."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    drawn = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=gen)
    scatter = torch.randperm(vocab, generator=gen)
    return scatter[drawn]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--sweep", action="store_true",
                        help="also time other launch options (ForwardConfig, BackwardConfig)")
    args = parser.parse_args()
    dev = "cuda"
    n = args.tokens
    torch.manual_seed(0)
    weight = torch.randn(V, D, device=dev, dtype=torch.bfloat16)
    ids = zipf_ids(n, V).to(dev)
    unique = int(torch.unique(ids).numel())
    top = int(torch.bincount(ids, minlength=V).max())
    print(f"tokens {n}, unique ids {unique}, most frequent id repeats {top} times", flush=True)
    gbps = copy_bandwidth_gbps(dev)
    print(f"measured copy bandwidth {gbps:.0f} GB/s", flush=True)

    rows: list[Row] = []
    elem = weight.element_size()

    # ---------------------------------------------------------------- forward, bf16 out
    case = f"forward bf16 [{n} x {D}]"
    fw_bytes = n * D * elem * 2 + n * ids.element_size()
    floor = floor_ms(bytes_moved=fw_bytes)
    src = torch.empty(n, D, device=dev, dtype=torch.bfloat16).uniform_()
    dst = torch.empty_like(src)
    rows.append(Row(case, "copy of the same bytes (floor)", bench_ms(lambda: dst.copy_(src)), fw_bytes, floor_ms=floor))
    rows.append(Row(case, "eager F.embedding", bench_ms(lambda: F.embedding(ids, weight)), fw_bytes, floor_ms=floor))
    inductor_fw = torch.compile(lambda i, w: F.embedding(i, w))
    rows.append(Row(case, "torch.compile(F.embedding)", bench_ms(lambda: inductor_fw(ids, weight)), fw_bytes, floor_ms=floor))
    rows.append(Row(case, "compileops eager (Triton)", bench_ms(lambda: compileops.embedding(ids, weight)), fw_bytes, floor_ms=floor))
    ours_fw = torch.compile(lambda i, w: compileops.embedding(i, w), fullgraph=True)
    rows.append(Row(case, "compileops compiled (lowering)", bench_ms(lambda: ours_fw(ids, weight)), fw_bytes, floor_ms=floor))
    if args.sweep:
        for cfg in [kernels.ForwardConfig(2, 1024, 4), kernels.ForwardConfig(4, 1024, 8),
                    kernels.ForwardConfig(16, 256, 4)]:
            ms = bench_ms(lambda: kernels.embedding_forward(ids, weight, config=cfg))
            rows.append(Row(case, "compileops Triton", ms, fw_bytes, floor_ms=floor, note=f"{cfg}"))

    # Uniform ids: almost no repeated rows, so no L2 reuse; the honest bandwidth figure.
    case = f"forward bf16, uniform ids [{n} x {D}]"
    uniform = torch.randint(0, V, (n,), device=dev)
    rows.append(Row(case, "copy of the same bytes (floor)", bench_ms(lambda: dst.copy_(src)), fw_bytes, floor_ms=floor))
    rows.append(Row(case, "eager F.embedding", bench_ms(lambda: F.embedding(uniform, weight)), fw_bytes, floor_ms=floor))
    rows.append(Row(case, "torch.compile(F.embedding)", bench_ms(lambda: inductor_fw(uniform, weight)), fw_bytes, floor_ms=floor))
    rows.append(Row(case, "compileops eager (Triton)", bench_ms(lambda: compileops.embedding(uniform, weight)), fw_bytes, floor_ms=floor))
    rows.append(Row(case, "compileops compiled (lowering)", bench_ms(lambda: ours_fw(uniform, weight)), fw_bytes, floor_ms=floor))

    # ---------------------------------------------------------------- forward, fp32 out
    case = f"forward fp32 out [{n} x {D}]"
    fw32_bytes = n * D * (elem + 4) + n * ids.element_size()
    floor = floor_ms(bytes_moved=fw32_bytes)
    rows.append(Row(case, "eager F.embedding(...).float()", bench_ms(lambda: F.embedding(ids, weight).float()), fw32_bytes, floor_ms=floor))
    inductor_fw32 = torch.compile(lambda i, w: F.embedding(i, w).float())
    rows.append(Row(case, "torch.compile(F.embedding(...).float())", bench_ms(lambda: inductor_fw32(ids, weight)), fw32_bytes, floor_ms=floor))
    rows.append(Row(case, "compileops eager (Triton)", bench_ms(lambda: compileops.embedding(ids, weight, out_dtype=torch.float32)), fw32_bytes, floor_ms=floor))
    ours_fw32 = torch.compile(lambda i, w: compileops.embedding(i, w, out_dtype=torch.float32), fullgraph=True)
    rows.append(Row(case, "compileops compiled (lowering)", bench_ms(lambda: ours_fw32(ids, weight)), fw32_bytes, floor_ms=floor))

    # ---------------------------------------------------------------- fused gather + scale + cast
    case = f"gather*scale->bf16 [{n} x {D}]"
    scale = D ** 0.5

    def stem_eager(i, w):
        return (F.embedding(i, w).float() * scale).to(torch.bfloat16)

    def stem_ours(i, w):
        return (compileops.embedding(i, w, out_dtype=torch.float32) * scale).to(torch.bfloat16)

    floor = floor_ms(bytes_moved=fw_bytes)
    rows.append(Row(case, "eager PyTorch", bench_ms(lambda: stem_eager(ids, weight)), fw_bytes, floor_ms=floor))
    inductor_stem = torch.compile(stem_eager)
    rows.append(Row(case, "torch.compile (Inductor lowering)", bench_ms(lambda: inductor_stem(ids, weight)), fw_bytes, floor_ms=floor))
    ours_stem = torch.compile(stem_ours, fullgraph=True)
    rows.append(Row(case, "compileops compiled (one fused kernel)", bench_ms(lambda: ours_stem(ids, weight)), fw_bytes, floor_ms=floor))

    # ---------------------------------------------------------------- backward
    case = f"backward -> bf16 [{V} x {D}]"
    grad = torch.randn(n, D, device=dev, dtype=torch.bfloat16)
    # Dense grad table written once (untouched rows zeroed) plus the grads read once.
    bw_bytes = V * D * elem + n * D * elem
    floor = floor_ms(bytes_moved=bw_bytes)
    rows.append(Row(case, "eager embedding_dense_backward", bench_ms(
        lambda: torch.ops.aten.embedding_dense_backward(grad, ids, V, -1, False)), bw_bytes, floor_ms=floor))
    inductor_bw = torch.compile(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, V, -1, False))
    rows.append(Row(case, "torch.compile (Inductor, atomic)", bench_ms(lambda: inductor_bw(grad, ids)), bw_bytes, floor_ms=floor))
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True)
    try:
        det_bw = torch.compile(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, V, -1, False))
        rows.append(Row(case, "torch.compile + use_deterministic_algorithms", bench_ms(lambda: det_bw(grad, ids)), bw_bytes, floor_ms=floor))
    finally:
        torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()
    rows.append(Row(case, "compileops (sort + ordered fp32 sums)", bench_ms(
        lambda: torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16)), bw_bytes, floor_ms=floor))
    grad_uniform = grad
    rows.append(Row(case + ", uniform ids", "eager embedding_dense_backward", bench_ms(
        lambda: torch.ops.aten.embedding_dense_backward(grad_uniform, uniform, V, -1, False)), bw_bytes, floor_ms=floor))
    rows.append(Row(case + ", uniform ids", "torch.compile (Inductor, atomic)", bench_ms(
        lambda: inductor_bw(grad_uniform, uniform)), bw_bytes, floor_ms=floor))
    rows.append(Row(case + ", uniform ids", "compileops (sort + ordered fp32 sums)", bench_ms(
        lambda: torch.ops.compileops.embedding_backward(grad_uniform, uniform, V, None, torch.bfloat16)), bw_bytes, floor_ms=floor))
    # Host time per call of our op (20 calls, no sync between them): when it nears the GPU
    # time above, do_bench measured the host, not the kernels.
    for name, host_ids in (("Zipf", ids), ("uniform", uniform)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            torch.ops.compileops.embedding_backward(grad, host_ids, V, None, torch.bfloat16)
        print(f"backward op host time ({name} ids): "
              f"{(time.perf_counter() - start) / 20 * 1e3:.3f} ms/call", flush=True)
        torch.cuda.synchronize()
    zeros_only = bench_ms(lambda: torch.zeros(V, D, device=dev, dtype=torch.bfloat16))
    rows.append(Row(case, "(part: zero-filled V x D bf16 table)", zeros_only, V * D * elem, floor_ms=floor))
    sort_only = bench_ms(lambda: kernels.sort_ids(ids.reshape(-1), V))
    rows.append(Row(case, "(part: the op's stable sort of ids)", sort_only, floor_ms=floor))
    if args.sweep:
        # A few backward schedules; benchmarks/tuning/sweep_embedding_bw.py has the full sweep.
        for cfg in (kernels.BackwardConfig(), kernels.BackwardConfig(hot_first=False),
                    kernels.BackwardConfig(sort="torch"), kernels.BackwardConfig(streams=False)):
            for name, sweep_ids in (("Zipf", ids), ("uniform", uniform)):
                ms = bench_ms(lambda: kernels.embedding_backward(
                    grad, sweep_ids, V, None, torch.bfloat16, cfg))
                rows.append(Row(case, "compileops", ms, bw_bytes, floor_ms=floor,
                                note=f"{name} ids; {cfg}"))

    report("Embedding (Qwen3-8B table, Zipf ids)", rows, csv_path=os.path.join(out_dir(), "embedding.csv"))
    by = {(r.case, r.impl): r.ms for r in rows}

    def ratio(case_prefix, a, b):
        key_a = next(k for k in by if k[0].startswith(case_prefix) and k[1] == a)
        key_b = next(k for k in by if k[0].startswith(case_prefix) and k[1] == b)
        return by[key_b] / by[key_a]

    print("\nAcceptance figures:")
    for label in ("forward bf16 [", "forward bf16, uniform"):
        print(f"  {label}: {ratio(label, 'compileops compiled (lowering)', 'copy of the same bytes (floor)'):.3f} of copy bandwidth (compiled), "
              f"{ratio(label, 'compileops eager (Triton)', 'copy of the same bytes (floor)'):.3f} (eager Triton); "
              f"vs Inductor: {ratio(label, 'compileops compiled (lowering)', 'torch.compile(F.embedding)'):.3f}x")
    print(f"  forward bf16 vs Inductor lowering: {ratio('forward bf16', 'compileops compiled (lowering)', 'torch.compile(F.embedding)'):.3f}x (compiled), "
          f"{ratio('forward bf16', 'compileops eager (Triton)', 'torch.compile(F.embedding)'):.3f}x (eager Triton)")
    print(f"  fused gather+scale+cast vs eager: {ratio('gather', 'compileops compiled (one fused kernel)', 'eager PyTorch'):.2f}x")
    ours_bw = 'compileops (sort + ordered fp32 sums)'
    print(f"  backward (Zipf) vs Inductor compiled: {ratio('backward', ours_bw, 'torch.compile (Inductor, atomic)'):.2f}x; "
          f"vs eager: {ratio('backward', ours_bw, 'eager embedding_dense_backward'):.3f}x; "
          f"vs deterministic compiled: {ratio('backward', ours_bw, 'torch.compile + use_deterministic_algorithms'):.2f}x")
    uni = f"backward -> bf16 [{V} x {D}], uniform"
    print(f"  backward (uniform) vs Inductor compiled: {ratio(uni, ours_bw, 'torch.compile (Inductor, atomic)'):.2f}x; "
          f"vs eager: {ratio(uni, ours_bw, 'eager embedding_dense_backward'):.3f}x")


if __name__ == "__main__":
    main()
