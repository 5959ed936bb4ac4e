"""Grouped linear (MoE grouped GEMM) benchmark: compileops vs torch._grouped_mm and friends.

Shapes (G, M, K, N), bf16, balanced and Dirichlet(1)-skewed group sizes:
Mixtral, DeepSeek-V3 EP shard, Qwen3-MoE up and down (benchmarks/README.md). Per shape and split:

* fwd: compileops.grouped_linear (eager Triton, and compiled static and ``dynamic=True``) vs
  torch._grouped_mm, a loop of F.linear
  (per-group sizes read once on the host *outside* the timed region), a dense mm of the same
  FLOPs, and optionally torch.compile(F.grouped_mm, mode="max-autotune") (``--compile-anchor``,
  slow to compile);
* dX and dW: compileops.grouped_linear_dx / grouped_linear_wgrad vs torch._grouped_mm; dW
  twice, without db (``with_db=False``: a layer with no trainable bias, the anchor's work)
  and with it (``+db``: the column sums in the same kernel);
* fused: torch.compile(compileops grouped linear + bias + SwiGLU) vs _grouped_mm + eager
  bias and SwiGLU.

The implementations of one pass are timed in ``--rounds`` alternating rounds (median of
each). TFLOP/s and speed-up vs ``torch._grouped_mm`` are reported (harness.report), CSV to
harness.out_dir(). Default run targets ~4 minutes on an H100; ``--shapes`` and ``--splits``
limit it. ``--smoke`` runs tiny sizes on CPU (Triton interpreter) to exercise every path.

    python benchmarks/bench_grouped_linear.py                 # GPU, all shapes
    python benchmarks/bench_grouped_linear.py --shapes qwen3_up --splits skewed
    python benchmarks/bench_grouped_linear.py --smoke         # CPU, seconds
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
from benchmarks import harness  # noqa: E402
from compileops.grouped_linear.routing import dirichlet_offsets  # noqa: E402

SHAPES = {
    "mixtral": (8, 16384, 4096, 14336),
    "deepseek_v3": (32, 32768, 7168, 2048),
    "qwen3_up": (128, 65536, 2048, 1536),
    "qwen3_down": (128, 65536, 768, 2048),
}
SMOKE_SHAPES = {"tiny": (4, 64, 32, 48)}


def make_offsets(groups: int, m: int, split: str, device, seed: int = 0) -> torch.Tensor:
    """int32 cumulative ends; balanced, or Dirichlet(1) skewed. Multiples of 16 rows in the
    balanced case; skewed sizes are arbitrary (torch._grouped_mm accepts any on sm90)."""
    if split != "balanced":
        return dirichlet_offsets(groups, m, seed=seed, device=device)
    sizes = torch.full((groups,), m // groups, dtype=torch.int64)
    sizes[-1] += m - int(sizes.sum())
    return torch.cumsum(sizes, 0).to(torch.int32).to(device)


def timer(fn, smoke: bool) -> float:
    if smoke:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return harness.bench_ms(fn, warmup=5, rep=30)


def time_alternating(fns: dict, rounds: int, smoke: bool) -> dict:
    """Median ms of each ``fns`` entry over ``rounds`` rounds, the entries taking turns in
    every round: a GPU's clock drifts with its power draw over a run, and turns keep that
    drift out of the ratios."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn, smoke))
    return {name: statistics.median(ts) for name, ts in times.items()}


_FUSED: dict = {}


_COMPILED: dict = {}


def _plain(x, w, offs):
    return compileops.grouped_linear(x, w, offs)


def run_case(name, shape, split, args, device, rows):
    groups, m, k, n = shape
    dtype = torch.bfloat16 if not args.smoke else torch.float32
    case = f"{name} {split}"
    offs = make_offsets(groups, m, split, device)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(groups, n, k, device=device, dtype=dtype) / k**0.5
    b = torch.randn(groups, n, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    flops = 2.0 * m * n * k
    have_gmm = device.type == "cuda" and hasattr(torch, "_grouped_mm")
    w_t = w.transpose(-2, -1)

    staged: dict = {}  # (stage, impl) -> (fn, note), timed together by flush()

    def add(stage, impl, fn, note=""):
        if impl.startswith("compileops"):
            fn()  # a broken compileops kernel must fail the run
        else:
            try:
                fn()
            except Exception as e:  # an anchor may not support a config: report, keep going
                print(f"  skip {stage}/{impl}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                return
        staged[(stage, impl)] = (fn, note)

    def flush():
        """Times the staged implementations of one pass in alternating rounds."""
        ms = time_alternating({key: fn for key, (fn, _) in staged.items()}, args.rounds,
                              args.smoke)
        for (stage, impl), (_, note) in staged.items():
            rows.append(harness.Row(case=f"{case} {stage}", impl=impl, ms=ms[(stage, impl)],
                                    flops=flops, note=note))
        staged.clear()

    # Forward
    add("fwd", "compileops", lambda: compileops.grouped_linear(x, w, offs))
    if have_gmm:
        add("fwd", "torch._grouped_mm", lambda: torch._grouped_mm(x, w_t, offs=offs))
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()  # host read, outside timing
    starts = [0] + list(torch.cumsum(torch.tensor(sizes), 0)[:-1].tolist())

    def loop_linear():
        return [F.linear(x[s:s + c], w[g]) for g, (s, c) in enumerate(zip(starts, sizes))]

    if not args.skip_loop:
        add("fwd", "loop of F.linear", loop_linear)
    a_dense = torch.randn(m, k, device=device, dtype=dtype)
    b_dense = torch.randn(k, n, device=device, dtype=dtype)
    add("fwd", "dense mm (same FLOPs)", lambda: a_dense @ b_dense)
    if not args.skip_compiled:
        # What a user of the functional API runs: the op compiled, static and dynamic=True
        # (every size symbolic). Both must stay at the eager kernel's speed.
        for dynamic in (False, True):
            compiled = _COMPILED.setdefault((name, dynamic), torch.compile(
                _plain, fullgraph=True, dynamic=dynamic))
            add("fwd", f"compileops compiled ({'dynamic=True' if dynamic else 'static'})",
                lambda compiled=compiled: compiled(x, w, offs))
    if args.compile_anchor and have_gmm:
        gmm = torch.compile(lambda a, bt, o: F.grouped_mm(a, bt, offs=o), mode="max-autotune",
                            fullgraph=True)
        add("fwd", "compile(F.grouped_mm) max-autotune", lambda: gmm(x, w_t, offs))
    flush()

    # dX: dY_g @ W_g
    add("dX", "compileops", lambda: torch.ops.compileops.grouped_linear_dx(dy, w, offs))
    if have_gmm:
        add("dX", "torch._grouped_mm", lambda: torch._grouped_mm(dy, w, offs=offs))
    flush()
    # dW: dY_g^T X_g (K-jagged). Our op without db (with_db=False: what a layer without a
    # trainable bias runs, as the MoE experts of these models are; the anchor's work) and
    # with db (a trainable bias: the column sums in the same kernel).
    add("dW", "compileops", lambda: torch.ops.compileops.grouped_linear_wgrad(
        dy, x, offs, dtype, dtype, False))
    add("dW", "compileops (+db)", lambda: torch.ops.compileops.grouped_linear_wgrad(
        dy, x, offs, dtype, dtype))
    if have_gmm:
        add("dW", "torch._grouped_mm", lambda: torch._grouped_mm(dy.t(), x, offs=offs))
    flush()

    # Fused grouped linear + bias + SwiGLU (compiled) vs _grouped_mm + eager epilogue.
    def ours(x, w, offs, b):
        return compileops.grouped_linear_swiglu(x, w, offs, b)

    if args.skip_fused:
        return
    # One compiled function per shape, shared by both splits (same shapes: no recompile).
    fused = _FUSED.setdefault(name, torch.compile(ours, fullgraph=True, dynamic=False))
    add("gl+bias+swiglu", "compileops compiled (fused)", lambda: fused(x, w, offs, b))
    if have_gmm:
        gid = torch.searchsorted(offs, torch.arange(m, device=device, dtype=torch.int32), right=True)
        gid = gid.clamp_max(groups - 1)

        def eager_epilogue():
            h = torch._grouped_mm(x, w_t, offs=offs) + b[gid]
            g_, u_ = h.chunk(2, dim=-1)
            return F.silu(g_) * u_

        add("gl+bias+swiglu", "torch._grouped_mm", eager_epilogue, note="+ eager bias, SwiGLU")
    flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=None, help=f"subset of {list(SHAPES)}")
    parser.add_argument("--splits", nargs="*", default=["balanced", "skewed"])
    parser.add_argument("--skip-compiled", action="store_true",
                        help="skip the compiled op (static and dynamic=True) in the forward pass")
    parser.add_argument("--compile-anchor", action="store_true",
                        help="also time torch.compile(F.grouped_mm, max-autotune) (slow to compile)")
    parser.add_argument("--skip-loop", action="store_true", help="skip the loop-of-F.linear anchor")
    parser.add_argument("--skip-fused", action="store_true",
                        help="skip the compiled grouped linear + bias + SwiGLU comparison")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating timing rounds per pass (median of each kind)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    table = SMOKE_SHAPES if args.smoke else SHAPES
    names = args.shapes or list(table)
    rows: list[harness.Row] = []
    torch.manual_seed(0)
    start = time.perf_counter()
    for name in names:
        for split in args.splits:
            print(f"-- {name} {split} {table[name]}", flush=True)
            run_case(name, table[name], split, args, device, rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"-- benchmark wall time {time.perf_counter() - start:.0f} s", flush=True)
    csv_path = os.path.join(harness.out_dir(), "grouped_linear.csv")
    harness.report("grouped linear (bf16)" if not args.smoke else "grouped linear smoke (CPU)",
                   rows, csv_path=csv_path, baseline_impl="torch._grouped_mm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
