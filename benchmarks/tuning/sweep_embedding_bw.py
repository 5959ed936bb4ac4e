"""Sweep of the embedding backward's launch options (``BackwardConfig``) on one GPU, in one
process.

    python3 benchmarks/tuning/sweep_embedding_bw.py [--budget-s 150]

``--smoke`` runs the same code on the CPU (Triton interpreter) with a tiny case and a
wall-clock timer, to check the script itself without a GPU.

Case: table V=151936 x D=4096 bf16, 16384 tokens, grad [16384, 4096] bf16 -> grad_weight
[V, D] bf16. Zipf ids are bench_embedding.py's (``zipf_ids(16384, V)``, seed 0); uniform ids
come from ``torch.randint`` after ``torch.manual_seed(0)``.

Every configuration is first checked bitwise equal (torch.equal) to the default one, which
is itself checked against the plain-PyTorch reference; one that fails to compile, to run or
to match is reported and skipped. Then: a table of medians (do_bench, L2 flushed), the
parts in isolation (int32 cast, stable sorts, memset, touched map, the kernel alone with the
sort precomputed, and its run programs and fill programs launched alone: where the time
goes), and the best configuration. Optional configurations are skipped once ``--budget-s``
seconds have passed, so the run stays within ~3 minutes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "--smoke" in sys.argv:  # before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compileops  # noqa: E402,F401  (registers the ops)
from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from benchmarks.harness import bench_ms  # noqa: E402
from compileops.embedding import kernels, reference  # noqa: E402

V, D, N = 151936, 4096, 16384

# (name, BackwardConfig fields). The first entry is the default. One knob changed at a time
# (most telling first, in case the time budget cuts the list), then a few combinations.
CONFIGS: list[tuple[str, dict]] = [
    ("default", {}),
    ("sort torch", {"sort": "torch"}),
    ("sort torch, streams off", {"sort": "torch", "streams": False}),
    ("id order (hot_first off)", {"hot_first": False}),
    ("run_block 8, unroll 8", {"run_block": 8, "unroll": 8}),
    ("block_col 1024 (8 warps)", {"block_col": 1024}),
    ("tile 16", {"tile": 16}),
    ("fill_rows 4", {"fill_rows": 4}),
    ("fill_rows 8", {"fill_rows": 8}),
    ("fill_rows 1", {"fill_rows": 1}),
    ("fill_rows 4, fill_col 512", {"fill_rows": 4, "fill_col": 512}),
    ("fill_rows 4, fill_col 2048", {"fill_rows": 4, "fill_col": 2048}),
    ("fill_col 4096 (whole rows per store)", {"fill_col": 4096}),
    ("fill_rows 16, fill_col 512", {"fill_rows": 16, "fill_col": 512}),
    ("streams off (one launch after the sort)", {"streams": False}),
    ("streams off, fill map", {"streams": False, "fill": "map"}),
    ("streams off, hot first (fill map)",
     {"streams": False, "fill": "map", "hot_first": True, "sort": "triton"}),
    ("tile 32, block_col 256", {"tile": 32, "block_col": 256}),
    ("tile 64, block_col 256", {"tile": 64, "block_col": 256}),
    ("block_col 2048 (8 warps)", {"block_col": 2048}),
    ("fill_rows 16", {"fill_rows": 16}),
    ("fill_rows 32", {"fill_rows": 32}),
    ("8 warps", {"num_warps": 8}),
    ("maxnreg None (no register cap)", {"maxnreg": None}),
    ("maxnreg 96", {"maxnreg": 96}),
    ("run_block 2", {"run_block": 2}),
]
UNIFORM_TOP = 6  # besides the default, time uniform ids for the best Zipf configs


def graph_ms(fn) -> float:
    """do_bench median of a CUDA graph replay of one ``fn()`` call (its streams captured):
    the GPU time alone, free of the host's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    ms = bench_ms(graph.replay)
    del graph
    return ms


def fmt_ms(ms) -> str:
    return f"{ms:8.4f}" if isinstance(ms, float) else f"{ms:>8}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="skip optional configurations after this many seconds")
    parser.add_argument("--only", default=None,
                        help="regex: time only the configurations whose name matches (and the default)")
    parser.add_argument("--skip-parts", action="store_true",
                        help="skip the anchors and parts section")
    parser.add_argument("--graphs", action="store_true",
                        help="also time each configuration as a CUDA graph replay (GPU time only, "
                             "no host launch cost)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the default and the --only configurations this many times, "
                             "alternating (Zipf ids), to separate a small gain from drift")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny case on the CPU (Triton interpreter): checks the script only")
    args = parser.parse_args()
    t0 = time.time()
    global CONFIGS
    if args.only:
        import re
        CONFIGS = CONFIGS[:1] + [c for c in CONFIGS[1:] if re.search(args.only, c[0])]
    global V, D, N, bench_ms
    if args.smoke:
        V, D, N = 300, 32, 256
        dev = "cpu"

        def bench_ms(fn):  # noqa: F811  (no CUDA events on the CPU)
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
    else:
        dev = "cuda"
    torch.manual_seed(0)
    zipf = zipf_ids(N, V).to(dev)
    uniform = torch.randint(0, V, (N,), device=dev)
    grad = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    counts = torch.bincount(zipf, minlength=V)
    device_name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (smoke test)"
    print(f"{device_name} | torch {torch.__version__} | "
          f"triton {__import__('triton').__version__}", flush=True)
    print(f"Zipf ids: {int((counts > 0).sum())} unique, hottest repeats {int(counts.max())} times; "
          f"uniform ids: {int(torch.unique(uniform).numel())} unique", flush=True)
    id_sets = {"Zipf": zipf, "uniform": uniform}

    def run(ids, cfg):
        return kernels.embedding_backward(grad, ids, V, None, torch.bfloat16,
                                          kernels.BackwardConfig(**cfg))

    # ---------------------------------------------------------------- correctness anchors
    # The baseline every configuration must match bitwise: the default one, itself checked
    # against the reference.
    base_name = CONFIGS[0][0]
    default_out = {name: run(ids, CONFIGS[0][1]) for name, ids in id_sets.items()}
    for name, ids in id_sets.items():
        want = reference.embedding_backward(grad, ids, V, None, torch.bfloat16)
        ok = torch.equal(default_out[name], want)
        note = " (expected on the CPU: the interpreter truncates fp32->bf16)" if args.smoke and not ok else ""
        print(f"{base_name} vs reference ({name} ids): {'bitwise equal' if ok else 'MISMATCH'}{note}",
              flush=True)
        if not ok:
            diff = (default_out[name].float() - want.float()).abs()
            print(f"  max abs diff {float(diff.max()):.3e}, rows differing "
                  f"{int((diff.amax(1) > 0).sum())}", flush=True)
        del want
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()

    results: dict[str, dict[str, object]] = {}  # config name -> {id set: ms or error}

    def time_config(name, cfg, id_name):
        ids = id_sets[id_name]
        try:
            out = run(ids, cfg)
            sync()
            if not torch.equal(out, default_out[id_name]):
                results.setdefault(name, {})[id_name] = "MISMATCH"
                print(f"  {name} [{id_name}]: NOT bitwise equal to the baseline, not timed", flush=True)
                return
            del out
            ms = bench_ms(lambda: run(ids, cfg))
            results.setdefault(name, {})[id_name] = ms
            # Host time per call: 20 back-to-back calls, no sync between them (the GPU queue
            # absorbs them); if it nears the GPU time, do_bench measures the host.
            sync()
            start = time.perf_counter()
            calls = 1 if args.smoke else 20
            for _ in range(calls):
                run(ids, cfg)
            host_ms = (time.perf_counter() - start) / calls * 1e3
            sync()
            graph = ""
            if args.graphs and dev == "cuda":
                graph = f"; CUDA graph replay {graph_ms(lambda: run(ids, cfg)):.4f} ms"
            print(f"  {name} [{id_name}]: {ms:.4f} ms  (host {host_ms:.3f} ms/call{graph}; "
                  f"{time.time() - t0:.0f} s)", flush=True)
        except Exception as exc:  # compile or launch failure: report, keep going
            results.setdefault(name, {})[id_name] = "FAILED"
            print(f"  {name} [{id_name}]: FAILED {type(exc).__name__}: {str(exc)[:600]}", flush=True)
            traceback.print_exc(limit=2)
            try:
                sync()
            except Exception:
                pass

    # ---------------------------------------------------------------- anchors and parts
    print("\nanchors and parts:", flush=True)
    if args.skip_parts:
        print("  skipped (--skip-parts)", flush=True)
    anchors: list[tuple[str, object, object]] = []

    def anchor(label, fn_zipf, fn_uniform=None, always=False):
        if args.skip_parts and not always:
            return
        row = [label]
        for fn in (fn_zipf, fn_uniform):
            if fn is None:
                row.append("")
                continue
            try:
                row.append(bench_ms(fn))
            except Exception as exc:
                row.append("FAILED")
                print(f"  {label}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        anchors.append(tuple(row))
        print(f"  {label}: {row[1]} / {row[2]}", flush=True)

    aten = torch.ops.aten.embedding_dense_backward
    anchor("eager aten.embedding_dense_backward",
           lambda: aten(grad, zipf, V, -1, False), lambda: aten(grad, uniform, V, -1, False))
    try:
        if args.smoke or args.skip_parts:
            raise RuntimeError("skipped (smoke test or --skip-parts)")
        inductor = torch.compile(lambda g, i: aten(g, i, V, -1, False))
        inductor(grad, zipf)
        inductor(grad, uniform)
        anchor("torch.compile(aten.embedding_dense_backward) (Inductor, atomics)",
               lambda: inductor(grad, zipf), lambda: inductor(grad, uniform))
    except Exception as exc:
        print(f"  Inductor anchor FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    anchor("compileops op (torch.ops.compileops.embedding_backward, default)",
           lambda: torch.ops.compileops.embedding_backward(grad, zipf, V, None, torch.bfloat16),
           lambda: torch.ops.compileops.embedding_backward(grad, uniform, V, None, torch.bfloat16))
    anchor("part: ids int64 -> int32 cast", lambda: zipf.to(torch.int32))
    zipf32, uniform32 = zipf.to(torch.int32), uniform.to(torch.int32)
    anchor("part: stable torch.sort of int32 ids",
           lambda: torch.sort(zipf32, stable=True), lambda: torch.sort(uniform32, stable=True))
    anchor("part: stable Triton sort (kernels.stable_sort_ids), int64 ids",
           lambda: kernels.stable_sort_ids(zipf), lambda: kernels.stable_sort_ids(uniform))
    anchor("part: zero-fill, torch.zeros(V, D) bf16", lambda: torch.zeros(V, D, device=dev, dtype=torch.bfloat16))
    anchor("part: touched map (zeros(V) int8 + index_fill_)",
           lambda: kernels.touched_map(zipf, V), lambda: kernels.touched_map(uniform, V))
    anchor("part: id counts (zeros(V) int32 + one launch)",
           lambda: kernels.id_counts(zipf, V), lambda: kernels.id_counts(uniform, V))
    prepared = {name: kernels.sort_ids(ids, V) for name, ids in id_sets.items()}
    out_buf = torch.empty(V, D, device=dev, dtype=torch.bfloat16)
    stand_in = torch.empty(1, dtype=torch.int32, device=dev)

    def kernel_alone(id_name, cfg, programs=kernels.ALL_PROGRAMS):
        # The prepared sorts are in id order: the kernel alone always runs in id order.
        # ALL_PROGRAMS: one launch, untouched rows found by search (or the map with
        # fill="map"); RUN_PROGRAMS: the run programs only; FILL_PROGRAMS: the fill programs
        # only, with the touched map (as in the two-stream schedule).
        sorted_ids, order = prepared[id_name]
        config = kernels.BackwardConfig(**cfg)
        tiles = config.resolve(grad, torch.bfloat16)
        touched = None
        if programs == kernels.FILL_PROGRAMS or cfg.get("fill") == "map":
            touched = kernels.touched_map(id_sets[id_name], V)
        if programs == kernels.FILL_PROGRAMS:
            sorted_ids = order = stand_in
        return lambda: kernels.launch_backward_kernel(
            sorted_ids, order, touched, grad, out_buf, None, tiles, programs)

    try:
        check = kernel_alone("Zipf", {})
        check()
        assert torch.equal(out_buf, default_out["Zipf"]), "kernel-alone output differs from the baseline"
        anchor("part: the kernel alone, default config (sort precomputed)",
               kernel_alone("Zipf", {}), kernel_alone("uniform", {}))
    except Exception as exc:
        print(f"  kernel-alone FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    for programs, what in ((kernels.RUN_PROGRAMS, "run programs only (output partial)"),
                           (kernels.FILL_PROGRAMS, "fill programs only, touched map (output partial)")):
        try:
            anchor(f"part: the kernel alone, default config, {what}",
                   kernel_alone("Zipf", {}, programs), kernel_alone("uniform", {}, programs))
        except Exception as exc:
            print(f"  {what} FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)

    # ---------------------------------------------------------------- variants
    print("\nvariants (bitwise check vs default, then do_bench median):", flush=True)
    for i, (name, cfg) in enumerate(CONFIGS):
        if i >= 1 and time.time() - t0 > args.budget_s:
            results.setdefault(name, {})["Zipf"] = "skipped"
            print(f"  {name}: skipped (time budget)", flush=True)
            continue
        time_config(name, cfg, "Zipf")
    for round_ in range(2, args.rounds + 1):
        for name, cfg in CONFIGS:
            time_config(f"{name} (round {round_})", cfg, "Zipf")
    time_config(*CONFIGS[0], "uniform")
    named = dict(CONFIGS)
    ranked = sorted((r["Zipf"], n) for n, r in results.items()
                    if n in named and isinstance(r.get("Zipf"), float))
    for _, name in [x for x in ranked if x[1] != "default"][:UNIFORM_TOP]:
        if time.time() - t0 > args.budget_s + 15:
            break
        time_config(name, dict(CONFIGS)[name], "uniform")

    # ---------------------------------------------------------------- report
    best = ranked[0] if ranked else None
    if best and best[1] != "default":
        cfg = dict(CONFIGS)[best[1]]
        if not cfg.get("hot_first"):
            try:
                anchor(f"part: the kernel alone, best config ({best[1]})",
                       kernel_alone("Zipf", cfg), kernel_alone("uniform", cfg))
            except Exception as exc:
                print(f"  kernel-alone (best) FAILED {type(exc).__name__}: {exc}", flush=True)

    print(f"\n### embedding backward sweep, V={V} x D={D} bf16, {N} tokens "
          f"({device_name})\n", flush=True)
    print("| config | kwargs | Zipf ms | uniform ms |")
    print("|---|---|---|---|")
    for name, cfg in CONFIGS:
        r = results.get(name, {})
        print(f"| {name} | `{cfg}` | {fmt_ms(r.get('Zipf', ''))} | {fmt_ms(r.get('uniform', ''))} |")
    print("\n| anchor / part | Zipf ms | uniform ms |")
    print("|---|---|---|")
    for label, a, b in anchors:
        print(f"| {label} | {fmt_ms(a)} | {fmt_ms(b)} |")
    if best:
        print(f"\nbest Zipf config: {best[1]} {dict(CONFIGS)[best[1]]} -> {best[0]:.4f} ms "
              f"(uniform: {results[best[1]].get('uniform', 'not timed')})")
        if isinstance(results.get("default", {}).get("Zipf"), float):
            print(f"default: {results['default']['Zipf']:.4f} ms Zipf, "
                  f"{results['default'].get('uniform')} uniform")
    print(f"total wall time {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
