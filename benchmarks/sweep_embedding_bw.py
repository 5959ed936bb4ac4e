"""Sweep of the embedding backward kernel variants on one GPU, in one process.

    python3 benchmarks/sweep_embedding_bw.py [--budget-s 150]

``--smoke`` runs the same code on the CPU (Triton interpreter) with a tiny case and a
wall-clock timer, to check the script itself without a GPU.

Case: table V=151936 x D=4096 bf16, 16384 tokens, grad [16384, 4096] bf16 -> grad_weight
[V, D] bf16. Zipf ids are bench_embedding.py's (``zipf_ids(16384, V)``, seed 0); uniform ids
come from ``torch.randint`` after ``torch.manual_seed(0)``.

Every variant is first checked bitwise equal (torch.equal) to the default configuration,
which is itself checked against the plain-PyTorch reference; a variant that fails to compile,
to run or to match is reported and skipped. Then: a table of medians (do_bench, L2 flushed),
the parts in isolation (int32 cast, stable sort, memset, touched map, the kernel alone with
the sort precomputed, and diagnostic launches of it that skip the long runs, the fill or
the run programs: where the time goes), and the best configuration. Optional configurations are skipped once
``--budget-s`` seconds have passed, so the run stays within ~3 minutes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:  # before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compileops  # noqa: E402,F401  (registers the ops)
from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from benchmarks.harness import bench_ms  # noqa: E402
from compileops.embedding import kernels, reference  # noqa: E402

V, D, N = 151936, 4096, 16384

# (name, kwargs of kernels.embedding_backward). The first entry is the default; "legacy" is
# the previous kernel with its measured defaults. One knob changed at a time (most telling
# first, in case the time budget cuts the list), then a few combinations.
_REG32 = {"long_body": "registers", "long_block_col": 32, "long_warps": 1, "long_tile": 64}
CONFIGS: list[tuple[str, dict]] = [
    ("default", {}),
    ("legacy (previous kernel)", {"impl": "legacy"}),
    # torch.sort (cub radix sort, ~57 us for 16K ids) instead of the two-launch Triton sort.
    ("sort torch (the previous default)", {"sort": "torch"}),
    ("sort torch, streams off", {"sort": "torch", "streams": False}),
    # Hot-first order: the run programs run in sorted order, and an in-kernel trace (H100,
    # 2026-11-22) showed the run phase and the fill nearly serialised (run programs 0-230 us,
    # fill 180-580 us), the run phase ending with chains whose ids sort late (the 673-entry
    # chain, at 92% of the sorted order, started at 167 us). Sorting by decreasing count
    # starts the longest chains first.
    ("hot first", {"hot_first": True}),
    ("hot first, run_block 8, unroll 8", {"hot_first": True, "run_block": 8, "unroll": 8}),
    ("hot first, block_col 1024 (8 warps)", {"hot_first": True, "block_col": 1024}),
    ("hot first, tile 16", {"hot_first": True, "tile": 16}),
    ("hot first, long kernel registers 32 cols tile 64, long_min 255, fork",
     {**_REG32, "hot_first": True, "long_kernel": True, "long_min": 255, "long_fork": True}),
    ("hot first, fill_rows 4", {"hot_first": True, "fill_rows": 4}),
    # Only the hottest chains on the long-run kernel's narrow register body, on their own
    # stream. The chains make almost no progress while the fill saturates memory (sweep k:
    # fill + short runs 0.439 ms, plus the hottest chain alone in the main kernel's shape,
    # 88 us, is the whole 0.529 ms), so the idea was a faster hottest chain. Sweep l: all
    # slower (0.583-1.077 ms against 0.529).
    ("hot chains only: registers 32 cols tile 64, long_min 1023, fork",
     {**_REG32, "long_kernel": True, "long_min": 1023, "long_fork": True}),
    ("hot chains only: registers 32 cols tile 64, long_min 511, fork",
     {**_REG32, "long_kernel": True, "long_min": 511, "long_fork": True}),
    ("hot chains only: registers 32 cols tile 64, long_min 255, fork",
     {**_REG32, "long_kernel": True, "long_min": 255, "long_fork": True}),
    ("hot chains only: registers 32 cols tile 128, long_min 1023, fork",
     {**_REG32, "long_tile": 128, "long_kernel": True, "long_min": 1023, "long_fork": True}),
    ("hot chains only: registers 16 cols tile 128, long_min 1023, fork",
     {**_REG32, "long_block_col": 16, "long_tile": 128, "long_kernel": True, "long_min": 1023,
      "long_fork": True}),
    ("hot chains only: registers 64 cols 2 warps tile 64, long_min 1023, fork",
     {**_REG32, "long_block_col": 64, "long_warps": 2, "long_kernel": True, "long_min": 1023,
      "long_fork": True}),
    ("hot chains only: registers 32 cols tile 64, long_min 1023, no fork",
     {**_REG32, "long_kernel": True, "long_min": 1023}),
    # The long-run kernel's register body on narrow column blocks (the chain probe's fastest
    # shape alone: 32 columns, 1 warp, 64 rows per step).
    ("long kernel registers 32 cols tile 64, long_min 63",
     {**_REG32, "long_kernel": True, "long_min": 63}),
    ("long kernel registers 32 cols tile 64, long_min 63, long_fork",
     {**_REG32, "long_kernel": True, "long_min": 63, "long_fork": True}),
    # The fill's shape (the bulk of the bytes; the fill-only launch, 0.373 ms, is as fast as
    # a memset of the table, 0.380).
    ("fill_rows 8 (the previous default)", {"fill_rows": 8}),
    ("fill_rows 4", {"fill_rows": 4}),
    ("fill_rows 1", {"fill_rows": 1}),
    ("fill_rows 4, fill_col 512", {"fill_rows": 4, "fill_col": 512}),
    ("fill_rows 4, fill_col 2048", {"fill_rows": 4, "fill_col": 2048}),
    ("fill_col 4096 (whole rows per store)", {"fill_col": 4096}),
    ("fill_rows 4, fill_evict evict_first", {"fill_rows": 4, "fill_evict": "evict_first"}),
    ("fill_rows 16, fill_col 512", {"fill_rows": 16, "fill_col": 512}),
    ("streams off (one launch after the sort)", {"streams": False}),
    ("streams off, runs_per_fill 4", {"streams": False, "runs_per_fill": 4}),
    # The separate, software-pipelined long-run kernel (rows in flight per chain: (stages - 1)
    # x long_tile). long_min 63: only runs of 64+ entries go to it (24 in the Zipf case), in
    # 64-position blocks, so ~16x fewer of its programs find nothing and exit; shorter runs
    # stay on the main kernel's long path (at most 4 steps).
    ("long kernel (long_tile 16, long_block_col 1024, 3 stages, 4 warps)", {"long_kernel": True}),
    ("long kernel, long_min 63", {"long_kernel": True, "long_min": 63}),
    ("long kernel, long_min 63, 4 stages", {"long_kernel": True, "long_min": 63, "long_stages": 4}),
    ("long kernel, long_min 63, long_tile 32, long_block_col 256, 1 warp, 6 stages",
     {"long_kernel": True, "long_min": 63, "long_tile": 32, "long_block_col": 256,
      "long_warps": 1, "long_stages": 6}),
    ("long kernel, long_min 63, long_tile 32, long_block_col 512, 2 warps, 4 stages",
     {"long_kernel": True, "long_min": 63, "long_tile": 32, "long_block_col": 512,
      "long_warps": 2, "long_stages": 4}),
    ("long kernel, long_min 63, long_fork (own stream, beside the run programs)",
     {"long_kernel": True, "long_min": 63, "long_fork": True}),
    ("long kernel, streams off", {"long_kernel": True, "streams": False}),
    ("tile 32, block_col 256", {"tile": 32, "block_col": 256}),
    ("tile 64, block_col 256", {"tile": 64, "block_col": 256}),
    ("tile 32, block_col 512", {"tile": 32, "block_col": 512}),
    ("block_col 2048 (8 warps)", {"block_col": 2048}),
    ("fill_rows 16", {"fill_rows": 16}),
    ("4 warps", {"num_warps": 4}),
    ("first sweep's default (4 warps, fill_rows 32)", {"num_warps": 4, "fill_rows": 32}),
    ("4 warps", {"num_warps": 4}),
    ("fill_rows 32", {"fill_rows": 32}),
    ("prefetch 256 (L2 prefetch of long runs)", {"prefetch": 256}),
    ("fill_evict evict_first", {"fill_evict": "evict_first"}),
    ("runs_per_fill 4", {"runs_per_fill": 4}),
    ("runs_per_fill 16", {"runs_per_fill": 16}),
    ("runs_per_fill 64", {"runs_per_fill": 64}),
    ("tile 32", {"tile": 32}),
    ("tile 32, block_col 512, 4 warps", {"tile": 32, "block_col": 512, "num_warps": 4}),
    ("fill_rows 4", {"fill_rows": 4}),
    ("fill_rows 16", {"fill_rows": 16}),
    ("maxnreg None (no register cap)", {"maxnreg": None}),
    ("maxnreg 96", {"maxnreg": 96}),
    ("run_block 2", {"run_block": 2}),
    ("run_block 8, unroll 8", {"run_block": 8, "unroll": 8}),
    ("block_col 512 (4 warps)", {"block_col": 512}),
    ("block_col 2048 (8 warps)", {"block_col": 2048}),
    ("long_mode tile (4 warps: whole tile columns per thread)", {"long_mode": "tile", "num_warps": 4}),
    ("fill map (touched map, +2 launches)", {"fill": "map"}),
]
_seen: set = set()
CONFIGS = [c for c in CONFIGS if not (c[0] in _seen or _seen.add(c[0]))]  # first one wins
# Timed without a correctness check (their output is wrong by design): the default kernel
# alone (sort precomputed) skipping one part, to show where the time goes.
DIAGNOSTICS = [(1, "long runs skipped"), (2, "fill skipped"), (3, "run programs skipped (fill only)")]
UNIFORM_TOP = 6  # besides default and legacy, time uniform ids for the best Zipf configs


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
        CONFIGS = CONFIGS[:2] + [c for c in CONFIGS[2:] if re.search(args.only, c[0])]
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
        return kernels.embedding_backward(grad, ids, V, None, torch.bfloat16, **cfg)

    # ---------------------------------------------------------------- correctness anchors
    # The baseline every variant must match bitwise: the default configuration (or, should it
    # fail to compile or run, the legacy kernel), itself checked against the reference.
    default_out = {}
    for base_name, base_cfg in CONFIGS[:2]:
        try:
            for name, ids in id_sets.items():
                default_out[name] = run(ids, base_cfg)
            break
        except Exception as exc:
            print(f"baseline {base_name} FAILED {type(exc).__name__}: {str(exc)[:800]}", flush=True)
            traceback.print_exc(limit=3)
            default_out = {}
    if not default_out:
        raise SystemExit("neither the default nor the legacy kernel runs: nothing to compare")
    print(f"baseline for the bitwise checks: {base_name}", flush=True)
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
    anchor("part: stable Triton sort (compileops/embedding/sort.py), int64 ids",
           lambda: kernels.id_sort.stable_sort_ids(zipf),
           lambda: kernels.id_sort.stable_sort_ids(uniform))
    anchor("part: zero-fill, torch.zeros(V, D) bf16", lambda: torch.zeros(V, D, device=dev, dtype=torch.bfloat16))
    anchor("part: touched map (zeros(V) int8 + index_fill_)",
           lambda: kernels._touched_map(zipf, V), lambda: kernels._touched_map(uniform, V))
    prepared = {name: kernels._sort_ids(ids, V) for name, ids in id_sets.items()}
    out_buf = torch.empty(V, D, device=dev, dtype=torch.bfloat16)

    def kernel_alone(id_name, cfg, diag=0):
        # The prepared sorts are in id order: the kernel alone always runs in id order.
        sorted_ids, order = prepared[id_name]
        kw = {k: v for k, v in cfg.items()
              if k not in ("impl", "fill", "streams", "sort", "hot_first")}
        launch_kw = kernels.backward_config(grad, **kw)
        touched = kernels._touched_map(id_sets[id_name], V) if cfg.get("fill") == "map" else None
        return lambda: kernels.launch_backward_kernel(
            sorted_ids, order, touched, grad, out_buf, None, diag=diag, **launch_kw)

    try:
        check = kernel_alone("Zipf", {})
        check()
        assert torch.equal(out_buf, default_out["Zipf"]), "kernel-alone output differs from the baseline"
        anchor("part: the kernel alone, default config (sort precomputed)",
               kernel_alone("Zipf", {}), kernel_alone("uniform", {}))
    except Exception as exc:
        print(f"  kernel-alone FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    for diag, what in DIAGNOSTICS:
        try:
            anchor(f"diagnostic: the kernel alone, default config, {what} (output wrong)",
                   kernel_alone("Zipf", {}, diag), kernel_alone("uniform", {}, diag))
        except Exception as exc:
            print(f"  diagnostic {diag} FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)

    # The fill-only launch (touched map; what the two-stream schedule runs on the current
    # stream), against the memset above.
    try:
        fill_kw = kernels.backward_config(grad)
        fills = []
        for id_name in ("Zipf", "uniform"):
            touched = kernels._touched_map(id_sets[id_name], V)
            stand_in = prepared[id_name][0]
            fills.append(lambda touched=touched, stand_in=stand_in: kernels.launch_backward_kernel(
                stand_in, stand_in, touched, grad, out_buf, None, programs=2, **fill_kw))
        anchor("part: the fill-only launch (touched map)", *fills)
    except Exception as exc:
        print(f"  fill-only FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)

    # The long-run kernel alone (no fill, no run programs): the hot-id chains' own time.
    reg = {"long_body": "registers", "long_warps": 1}
    for label, cfg in (("long_min = unroll", {}), ("long_min 63", {"long_min": 63}),
                       ("registers 32 cols tile 64, long_min 63",
                        {**reg, "long_block_col": 32, "long_tile": 64, "long_min": 63}),
                       ("registers 64 cols tile 32, long_min 63",
                        {**reg, "long_block_col": 64, "long_tile": 32, "long_min": 63}),
                       ("registers 64 cols tile 32, long_min 255",
                        {**reg, "long_block_col": 64, "long_tile": 32, "long_min": 255}),
                       ("registers 32 cols tile 64, long_min 1023",
                        {**reg, "long_block_col": 32, "long_tile": 64, "long_min": 1023})):
        try:
            launch_kw = kernels.backward_config(grad, long_kernel=True, **cfg)

            def long_alone(id_name, launch_kw=launch_kw):
                sorted_ids, order = prepared[id_name]
                return lambda: kernels.launch_long_runs_kernel(
                    sorted_ids, order, grad, out_buf, None, **kernels._long_launch_args(launch_kw))

            anchor(f"part: the long-run kernel alone, {label} (sort precomputed; output partial)",
                   long_alone("Zipf"), long_alone("uniform"), always=True)
        except Exception as exc:
            print(f"  long-run kernel alone FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)

    # ---------------------------------------------------------------- variants
    print("\nvariants (bitwise check vs default, then do_bench median):", flush=True)
    for i, (name, cfg) in enumerate(CONFIGS):
        if i >= 2 and time.time() - t0 > args.budget_s:
            results.setdefault(name, {})["Zipf"] = "skipped"
            print(f"  {name}: skipped (time budget)", flush=True)
            continue
        time_config(name, cfg, "Zipf")
    for round_ in range(2, args.rounds + 1):
        for name, cfg in [CONFIGS[0]] + CONFIGS[2:]:
            time_config(f"{name} (round {round_})", cfg, "Zipf")
    for name, cfg in CONFIGS[:2]:
        time_config(name, cfg, "uniform")
    named = dict(CONFIGS)
    ranked = sorted((r["Zipf"], n) for n, r in results.items()
                    if n in named and isinstance(r.get("Zipf"), float))
    for _, name in [x for x in ranked if x[1] not in ("default", "legacy (previous kernel)")][:UNIFORM_TOP]:
        if time.time() - t0 > args.budget_s + 15:
            break
        time_config(name, dict(CONFIGS)[name], "uniform")

    # ---------------------------------------------------------------- report
    best = ranked[0] if ranked else None
    if best and best[1] not in ("default", "legacy (previous kernel)"):
        cfg = dict(CONFIGS)[best[1]]
        if cfg.get("impl") != "legacy" and cfg.get("fill") != "map" and not cfg.get("hot_first"):
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
