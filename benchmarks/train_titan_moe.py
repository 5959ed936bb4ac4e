"""MoE training in torchtitan's own trainer (``torchtitan.train``, its real loop) on one GPU or
several (``--gpus``, ``--ep``):
torchtitan's experts against compileops', bf16 and fp8, at two expert shapes.

For each shape (``benchmarks/titan_moe_spec.py``: Qwen3-30B-A3B's experts, width 2048, 128
experts of hidden 768, top-8; DeepSeek-V3's 32-expert shard, width 7168, hidden 2048, top-8)
it runs, alternating, in this order:

* ``titan-bf16``: torchtitan's ``GroupedExperts`` (``torch._grouped_mm``);
* ``compileops-bf16``: ``--model.converters compileops_moe``;
* ``titan-fp8``: torchtitan's fp8 grouped GEMMs with torchao (0.2.2's
  ``quantize.grouped_mm.float8``, or with torchao 0.18 torchtitan 0.3's recipe through the
  spec's ``titan_float8_experts``; skipped, and said so, without torchao);
* ``compileops-fp8``: ``--model.converters compileops_moe_fp8`` (rowwise, weight cache, fast
  accumulation).

``--impls`` can add ``compileops-bf16-pair`` (``--model.converters compileops_moe_pair``: bf16
with the gate and up products reading w1 and w3 where they are, ``gate_up="pair"``) and
``compileops-fp8-dw`` (``--model.converters compileops_moe_fp8_dw``: ``compileops-fp8`` with
the weight gradients in fp8 too).

Each run is ``torchrun --standalone --nproc_per_node <--gpus> -m torchtitan.train`` (FSDP2 over
the GPUs, expert parallelism of degree ``--ep``) with
``benchmarks/titan_moe.toml`` (compile on, synthetic data, AdamW), its log kept in
``--out``. From torchtitan's per-step log line it takes the loss, the tokens per second and
the peak reserved memory; it writes every step to ``titan_moe_steps.csv``, and per run the
median tokens/s and step time over the steps after ``--warmup``, the peak memory, the mean loss
of the last 50 steps, and the ratios to ``titan-bf16`` to ``titan_moe.md`` (and a loss plot,
``titan_moe_loss.png``, where matplotlib is installed).

Made for torchtitan 0.2.2 on torch 2.11 (the layout it registers converters for); run from
the repository root, with the carried wheels on ``PYTHONPATH``::

    python benchmarks/train_titan_moe.py --steps 300 --out /tmp/titan_moe

``--estimate`` prints the expected time of each run and does nothing else: the experts'
FLOPs at ``--assumed-tflops`` plus ``--compile-s`` of compiling per run.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the harness beside it
    sys.path.insert(0, str(ROOT))
from benchmarks.harness import stop_process_group  # noqa: E402
TOML = ROOT / "benchmarks" / "titan_moe.toml"

#: flavor -> (width, expert hidden, experts, top-k, default layers)
SHAPES = {
    "qwen3-30b-a3b-experts": (2048, 768, 128, 8, 4),
    "dsv3-experts": (7168, 2048, 32, 8, 2),
}
IMPLS = {
    "titan-bf16": [],
    "compileops-bf16": ["--model.converters", "compileops_moe"],
    # torchtitan 0.2.2's own fp8 MoE converter needs a torchao with MoETrainingConfig;
    # with newer torchao (0.18) the spec's "titan_float8_experts" applies torchtitan 0.3's
    # recipe (_titan_fp8_args picks).
    "titan-fp8": None,
    "compileops-fp8": ["--model.converters", "compileops_moe_fp8"],
    "compileops-bf16-pair": ["--model.converters", "compileops_moe_pair"],
    "compileops-fp8-dw": ["--model.converters", "compileops_moe_fp8_dw"],
}
#: The runs made unless ``--impls`` names others: the four the comparison is about.
DEFAULT_IMPLS = ["titan-bf16", "compileops-bf16", "titan-fp8", "compileops-fp8"]
STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+).*?memory:\s*([\d.]+)GiB"
                       r".*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_log(text: str) -> list[dict]:
    """torchtitan's per-step lines -> ``[{step, loss, memory_gib, tps}]``."""
    rows = []
    for line in ANSI.sub("", text).splitlines():
        m = STEP_LINE.search(line)
        if m and "validate" not in line:
            rows.append({"step": int(m.group(1)), "loss": float(m.group(2)),
                         "memory_gib": float(m.group(3)),
                         "tps": float(m.group(4).replace(",", ""))})
    return rows


def summarize(rows: list[dict], tokens_per_step: int, warmup: int) -> dict:
    timed = [r for r in rows if r["step"] > warmup] or rows
    tps = statistics.median(r["tps"] for r in timed) if timed else float("nan")
    last = [r["loss"] for r in rows[-50:]]
    return {"steps": len(rows), "tokens_per_s": tps,
            "step_ms": 1000 * tokens_per_step / tps if tps == tps and tps > 0 else float("nan"),
            "peak_memory_gib": max((r["memory_gib"] for r in rows), default=float("nan")),
            "final50_loss": statistics.fmean(last) if last else float("nan")}


def estimate_s(shape: str, layers: int, steps: int, tokens_per_step: int, tflops: float,
               compile_s: float) -> float:
    """Seconds for one run: the experts' forward and backward FLOPs (3 GEMMs, x3 for the
    backward) of every layer at ``tflops``, plus compiling, plus 10% for the rest."""
    dim, hidden, _, top_k, _ = SHAPES[shape]
    flops = 6 * tokens_per_step * top_k * 3 * dim * hidden * layers
    return compile_s + 1.1 * steps * flops / (tflops * 1e12)


def command(shape: str, impl: str, args, out: Path) -> list[str]:
    """The torchrun command of one run: ``args.gpus`` processes (one per GPU), FSDP2 over all
    of them (torchtitan's ``data_parallel_shard_degree = -1``) and expert parallelism of
    degree ``args.ep``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(args.gpus), "-m", "torchtitan.train", "--job.config_file", str(TOML),
            "--model.flavor", shape, "--training.steps", str(args.steps),
            "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq),
            "--training.dtype", args.param_dtype,
            "--parallelism.expert_parallel_degree", str(args.ep),
            "--job.dump_folder", str(out / f"{shape}-{impl}"),
            *(IMPLS[impl] if IMPLS[impl] is not None else _titan_fp8_args())]


def run_one(shape: str, impl: str, args, out: Path) -> tuple[list[dict], str]:
    layers = args.layers or SHAPES[shape][4]
    cmd = command(shape, impl, args, out)
    env = dict(os.environ, COMPILEOPS_TITAN_LAYERS=str(layers),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    log = out / f"{shape}-{impl}.log"
    start = time.time()
    code = run_logged(cmd, env, log, args.timeout)
    text = log.read_text()
    if code is None:
        status = f"timeout after {args.timeout:.0f} s: see {log.name}"
    else:
        status = "ok" if code == 0 else f"exit {code}: see {log.name}"
    print(f"{shape} {impl}: {status}, {time.time() - start:.0f} s", flush=True)
    return parse_log(text), status


def run_logged(cmd: list[str], env: dict, log: Path, timeout: float) -> Optional[int]:
    """Runs ``cmd`` with its output in ``log``: its exit code, or None when it ran past
    ``timeout`` seconds. It runs in its own process group, so that a run stopped at the
    limit goes with every process it started (torchrun's worker), and the next run starts
    on an idle GPU."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, grace_s=10)
            return None


def _has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


def _titan_fp8_args() -> list[str]:
    """torchtitan's own fp8 experts: 0.2.2's converter where torchao still has the API it
    imports, else torchtitan 0.3's recipe on the same experts (benchmarks/titan_moe_spec.py)."""
    try:
        from torchao.prototype.moe_training.conversion_utils import MoETrainingConfig  # noqa
    except ImportError:
        return ["--model.converters", "titan_float8_experts"]
    return ["--model.converters", "quantize.grouped_mm.float8",
            "--quantize.grouped_mm.float8.fqns", "experts"]


def write_report(out: Path, summary: list[dict], all_rows: list[dict]) -> str:
    """Writes every step to ``titan_moe_steps.csv`` and the per-run table to
    ``titan_moe.md``; returns the table."""
    with open(out / "titan_moe_steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["shape", "impl", "step", "loss", "memory_gib", "tps"])
        w.writeheader()
        w.writerows(all_rows)
    lines = ["| shape | run | tokens/s | step (ms) | peak reserved (GiB) | loss, last 50 | "
             "tokens/s vs titan-bf16 | loss vs titan-bf16 | steps | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        base = next((b for b in summary if b["shape"] == r["shape"]
                     and b["impl"] == "titan-bf16" and "tokens_per_s" in b), None)
        if "tokens_per_s" not in r:
            lines.append(f"| {r['shape']} | {r['impl']} | | | | | | | | {r['status']} |")
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else ""
        loss = (f"{100 * (r['final50_loss'] / base['final50_loss'] - 1):+.2f}%"
                if base else "")
        lines.append(f"| {r['shape']} | {r['impl']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['step_ms']:.1f} | {r['peak_memory_gib']:.2f} | "
                     f"{r['final50_loss']:.4f} | {speed} | {loss} | {r['steps']} | "
                     f"{r['status']} |")
    table = "\n".join(lines)
    (out / "titan_moe.md").write_text(table + "\n")
    return table


def plot_losses(out: Path, all_rows: list[dict]) -> None:
    """``titan_moe_loss.png``: loss against step, one panel per shape (needs matplotlib;
    nothing without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in all_rows))
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for impl in dict.fromkeys(r["impl"] for r in all_rows if r["shape"] == shape):
            pts = [(r["step"], r["loss"]) for r in all_rows
                   if r["shape"] == shape and r["impl"] == impl]
            ax.plot(*zip(*pts), label=impl, linewidth=0.8)
        ax.set_title(shape)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.savefig(out / "titan_moe_loss.png", dpi=120, bbox_inches="tight")


def _run_of(log: Path) -> tuple[str, str]:
    """``<shape>-<impl>.log`` (the names :func:`run_one` writes) -> ``(shape, impl)``."""
    for shape in SHAPES:
        for impl in IMPLS:
            if log.name == f"{shape}-{impl}.log":
                return shape, impl
    raise SystemExit(f"{log}: not a run log (<shape>-<impl>.log)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=list(IMPLS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of tokens/s")
    p.add_argument("--layers", type=int, default=0, help="0: the shape's default (4, 2)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="torchtitan's training.dtype: float32 (its default: fp32 weights, "
                        "bf16 autocast on one GPU) or bfloat16 (weights and optimizer state "
                        "in bf16; the only way compileops' fp8 weight cache can hit on one "
                        "GPU, where torchtitan applies no FSDP)")
    p.add_argument("--gpus", type=int, default=1,
                   help="processes, one per GPU (FSDP2 over all of them); torchtitan's tps "
                        "and memory are per GPU")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism degree (torchtitan's expert_parallel_degree; "
                        "it must divide --gpus)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", type=Path, default=Path("titan_moe_results"))
    p.add_argument("--estimate", action="store_true")
    p.add_argument("--from-logs", nargs="+", type=Path, default=[],
                   help="run nothing: rebuild the table, CSV and plot from these run logs "
                        "(<shape>-<impl>.log, as a run writes them)")
    p.add_argument("--assumed-tflops", type=float, default=300.0)
    p.add_argument("--compile-s", type=float, default=60.0)
    args = p.parse_args(argv)
    if args.gpus < 1 or args.ep < 1 or args.gpus % args.ep:
        p.error(f"--ep {args.ep} must divide --gpus {args.gpus} (both at least 1)")

    tokens = args.batch * args.seq
    if args.estimate:
        total = 0.0
        for shape in args.shapes:
            layers = args.layers or SHAPES[shape][4]
            s = estimate_s(shape, layers, args.steps, tokens, args.assumed_tflops,
                           args.compile_s)
            total += s * len(args.impls)
            print(f"{shape}: {layers} layers, {args.steps} steps of {tokens} tokens: about "
                  f"{s:.0f} s a run")
        print(f"all {len(args.shapes) * len(args.impls)} runs: about {total / 60:.1f} min")
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    summary, all_rows = [], []
    if args.from_logs:
        for log in args.from_logs:
            shape, impl = _run_of(log)
            rows = parse_log(log.read_text())
            all_rows += [{"shape": shape, "impl": impl, **r} for r in rows]
            summary.append({"shape": shape, "impl": impl, "status": f"log {log.name}",
                            **summarize(rows, tokens, args.warmup)})
    for shape in ([] if args.from_logs else args.shapes):
        for impl in args.impls:
            if impl == "titan-fp8" and not _has_torchao():
                summary.append({"shape": shape, "impl": impl, "status": "not run: no torchao"})
                continue
            rows, status = run_one(shape, impl, args, args.out)
            all_rows += [{"shape": shape, "impl": impl, **r} for r in rows]
            summary.append({"shape": shape, "impl": impl, "status": status,
                            **summarize(rows, tokens, args.warmup)})
            # after every run, so that a batch stopped from outside keeps what it measured
            write_report(args.out, summary, all_rows)
    print(write_report(args.out, summary, all_rows))
    plot_losses(args.out, all_rows)
    return 0 if all(r["status"] == "ok" or r["status"].startswith(("not run", "log "))
                    for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
