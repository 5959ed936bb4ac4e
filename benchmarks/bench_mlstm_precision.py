"""mLSTM bf16 precision: each form's output and gradients against fp64, on long rows.

For each form (``kernel="parallel"``, ``"chunkwise"``), sequence length, gate distribution
and norm (raw h, or the fused multi-head layernorm with a weight), the inputs are drawn in
fp64 (a fixed seed), rounded to bf16, and ``compileops.mlstm`` runs forward and backward in
bf16 (eager) against a bf16 cotangent. The ground truth is fp64 autograd through
``compileops.mlstm.reference.mlstm`` on the same rounded inputs and cotangent, one
(batch, head) at a time so that its ``S x S`` matrices stay small. Printed: the relative L2
error ``||got - want|| / ||want||`` of the output and of every gradient (dq, dk, dv,
d(igate), d(fgate), and the norm weight's when normed).

Gate distributions (pre-activations, ``(igate mean, std, fgate mean, std)``): those of
``tests/mlstm/test_precision.py`` (the test checks that the two lists agree).

Defaults: B 2, NH 4, DQK 128, DV 256, S 1024 and 8192 (B 1 at 8192: ``--long-batch``), both
forms, the four distributions, raw and normed. About a minute on an H200, most of it the
first call's compiles.

    python benchmarks/bench_mlstm_precision.py                        # the full table
    python benchmarks/bench_mlstm_precision.py --forms chunkwise --seqs 1024 --norms raw
    python benchmarks/bench_mlstm_precision.py --gates ig0_fg-1 --seqs 8192
    python benchmarks/bench_mlstm_precision.py --device cpu --tiny    # interpreter dry run

Output: a markdown table on stdout, and CSV rows appended to
``benchmarks/results/mlstm_precision_<gpu>.csv`` (``--csv``; CPU runs go to
``benchmarks/out/``), and to ``$COMPILEOPS_BENCH_OUT/mlstm_precision_<gpu>.csv`` as well
when it is set.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ``name -> (igate mean, igate std, fgate mean, fgate std)``: input gates spread wide with
#: forget gates mostly open (far keys count), and forget gates at N(-1, 1) and N(0, 1).
GATES = {
    "ig-1x2_fg3": (-1.0, 2.0, 3.0, 1.0),
    "ig0_fg-1": (0.0, 1.0, -1.0, 1.0),
    "ig0_fg0": (0.0, 1.0, 0.0, 1.0),
    "ig-1x2_fg0": (-1.0, 2.0, 0.0, 1.0),
}
#: Not run by default: unit-normal input gates with forget gates at N(3, 1), the inputs of
#: ``benchmarks/bench_mlstm.py``.
EXTRA_GATES = {"ig0_fg3": (0.0, 1.0, 3.0, 1.0)}
ALL_GATES = {**GATES, **EXTRA_GATES}
FORMS = ["parallel", "chunkwise"]
NORMS = ["raw", "normed"]
GRADS = ["dq", "dk", "dv", "digate", "dfgate", "dweight"]
CSV_COLUMNS = ["date", "device", "torch", "triton", "form", "S", "B", "NH", "DQK", "DV",
               "chunk", "gates", "norm", "out", *GRADS, "worst_grad", "seconds", "note"]
TINY = dict(seqs=[32, 64], batch=1, long_batch=1, heads=2, dqk=16, dv=32, chunk=16)


def draw_inputs(b, nh, s, dqk, dv, gates, normed, seed):
    """fp64 inputs on the CPU from a fixed seed: ``(q, k, v, igate, fgate, weight or None,
    cotangent)``; the cotangent is ``[B, S, NH * DV]`` when normed, else ``[B, NH, S, DV]``."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    ig_mean, ig_std, fg_mean, fg_std = gates
    q, k, v = randn(b, nh, s, dqk), randn(b, nh, s, dqk), randn(b, nh, s, dv)
    igate = randn(b, nh, s) * ig_std + ig_mean
    fgate = randn(b, nh, s) * fg_std + fg_mean
    weight = randn(nh * dv) if normed else None
    grad = randn(*((b, s, nh * dv) if normed else (b, nh, s, dv)))
    return q, k, v, igate, fgate, weight, grad


def reference_grads(q, k, v, igate, fgate, weight, grad):
    """fp64 autograd through the reference, one (batch, head) at a time: ``(out, [dq, dk,
    dv, digate, dfgate] + [dweight when normed])``."""
    import torch

    from compileops.mlstm import reference

    b, nh, s, _ = q.shape
    dv_len = v.shape[-1]
    normed = weight is not None
    out = torch.empty_like(grad)
    grads = [torch.empty_like(t) for t in (q, k, v, igate, fgate)]
    dweight = torch.zeros_like(weight) if normed else None
    for bi in range(b):
        for hi in range(nh):
            cols = slice(hi * dv_len, (hi + 1) * dv_len)
            leaves = [t[bi:bi + 1, hi:hi + 1].detach().clone().requires_grad_(True)
                      for t in (q, k, v, igate, fgate)]
            if normed:
                w = weight[cols].detach().clone().requires_grad_(True)
                o, _, _ = reference.mlstm(*leaves, norm_weight=w)
                g = grad[bi:bi + 1, :, cols]
                out[bi:bi + 1, :, cols] = o.detach()
                parts = torch.autograd.grad(o, leaves + [w], g)
                dweight[cols] += parts[-1]
            else:
                o, _, _ = reference.mlstm(*leaves)
                g = grad[bi:bi + 1, hi:hi + 1]
                out[bi:bi + 1, hi:hi + 1] = o.detach()
                parts = torch.autograd.grad(o, leaves, g)
            for full, part in zip(grads, parts):
                full[bi:bi + 1, hi:hi + 1] = part
    return out, grads + ([dweight] if normed else [])


def ours(form, chunk, q, k, v, igate, fgate, weight, grad):
    """``compileops.mlstm`` in the inputs' dtype, forward and backward: ``(out, grads)``."""
    import torch

    import compileops

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, igate, fgate)]
    w = weight.detach().clone().requires_grad_(True) if weight is not None else None
    out = compileops.mlstm(*leaves, norm_weight=w, kernel=form,
                           chunk_size=chunk if form == "chunkwise" else None)
    grads = torch.autograd.grad(out, leaves + ([w] if w is not None else []), grad)
    return out.detach(), list(grads)


def relative_l2(got, want) -> float:
    import torch

    diff = torch.linalg.vector_norm((got.double() - want).flatten())
    norm = torch.linalg.vector_norm(want.flatten())
    return float(diff / norm) if norm > 0 else float(diff)


def measure(cfg: dict, s: int, b: int, gate_name: str, norm: str) -> list[dict]:
    """One row per form for one (S, gates, norm): the reference once, then each form."""
    import torch

    dtype = torch.bfloat16
    dev = cfg["device"]
    normed = norm == "normed"
    t0 = time.monotonic()
    drawn = draw_inputs(b, cfg["heads"], s, cfg["dqk"], cfg["dv"], ALL_GATES[gate_name], normed,
                        cfg["seed"])
    # Round once: the reference and our kernels see the same bf16 values.
    rounded = [None if t is None else t.to(dtype).to(dev) for t in drawn]
    want_out, want = reference_grads(*[None if t is None else t.double() for t in rounded])
    ref_seconds = time.monotonic() - t0
    rows = []
    for form in cfg["forms"]:
        t1 = time.monotonic()
        got_out, got = ours(form, cfg["chunk"], *rounded)
        errors = [relative_l2(g, w) for g, w in zip(got, want)]
        row = dict(form=form, S=s, B=b, gates=gate_name, norm=norm,
                   out=relative_l2(got_out, want_out),
                   **dict(zip(GRADS, errors)), worst_grad=max(errors),
                   seconds=time.monotonic() - t1 + ref_seconds / len(cfg["forms"]))
        rows.append(row)
    return rows


def gpu_tag(device: str) -> str:
    for tag in ("H100", "H200", "B200", "A100"):
        if tag in device:
            return tag.lower()
    return "cpu" if device == "cpu" else "gpu"


def csv_paths(device_name: str, cpu: bool, explicit) -> list:
    name = f"mlstm_precision_{gpu_tag(device_name)}.csv"
    first = explicit or os.path.join(ROOT, "benchmarks", "out" if cpu else "results", name)
    paths = [first]
    extra = os.environ.get("COMPILEOPS_BENCH_OUT")
    if extra and os.path.abspath(os.path.join(extra, name)) != os.path.abspath(first):
        paths.append(os.path.join(extra, name))
    return paths


def append_csv(path: str, line: list) -> None:
    """One row of :data:`CSV_COLUMNS` appended (``benchmarks.harness.append_csv``, imported
    here: the harness imports torch)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks.harness import append_csv as append

    append(path, CSV_COLUMNS, line)


def _fmt(x) -> str:
    return "" if x is None else f"{x:.2e}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", nargs="*", default=FORMS, choices=FORMS)
    parser.add_argument("--seqs", type=int, nargs="*", default=None,
                        help="sequence lengths (default 1024 8192; --tiny: 32 64)")
    parser.add_argument("--gates", nargs="*", default=list(GATES), choices=list(ALL_GATES))
    parser.add_argument("--norms", nargs="*", default=NORMS, choices=NORMS)
    parser.add_argument("--batch", type=int, default=None, help="B (default 2)")
    parser.add_argument("--long-batch", type=int, default=None,
                        help="B at S >= 4096 (default 1: the fp64 reference's time)")
    parser.add_argument("--heads", type=int, default=None, help="NH (default 4)")
    parser.add_argument("--dqk", type=int, default=None, help="default 128")
    parser.add_argument("--dv", type=int, default=None, help="default 256")
    parser.add_argument("--chunk", type=int, default=None,
                        help="the chunkwise form's chunk_size (default: the library's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes (with --device cpu: Triton's interpreter, a dry run)")
    parser.add_argument("--note", default="",
                        help="free text for the CSV rows' note column (which tree, say)")
    parser.add_argument("--csv", default=None,
                        help="CSV to append to (default benchmarks/results/"
                             "mlstm_precision_<gpu>.csv; CPU: benchmarks/out/)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # Before compileops defines its kernels: they run under Triton's interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    import torch
    import triton

    tiny = TINY if args.tiny else {}
    cfg = dict(
        device=args.device, forms=args.forms, seed=args.seed,
        heads=args.heads or tiny.get("heads", 4), dqk=args.dqk or tiny.get("dqk", 128),
        dv=args.dv or tiny.get("dv", 256), chunk=args.chunk or tiny.get("chunk"),
    )
    seqs = args.seqs or tiny.get("seqs", [1024, 8192])
    batch = args.batch or tiny.get("batch", 2)
    long_batch = args.long_batch or tiny.get("long_batch", 1)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    env = [datetime.date.today().isoformat(), device_name, torch.__version__,
           triton.__version__]
    paths = csv_paths(device_name, args.device == "cpu", args.csv)
    if args.device == "cpu":
        print("Triton's interpreter truncates fp32 to bf16 where GPUs round to nearest: these "
              "CPU figures are about twice a GPU's.", flush=True)
    print(f"bench_mlstm_precision: forms {args.forms}, S {seqs}, gates {args.gates}, "
          f"{args.norms}, B {batch} (S >= 4096: {long_batch}), NH {cfg['heads']}, DQK "
          f"{cfg['dqk']}, DV {cfg['dv']}, chunk {cfg['chunk'] or 'default'}, bf16 on "
          f"{device_name}", flush=True)
    start = time.monotonic()
    rows = []
    for s in seqs:
        b = long_batch if s >= 4096 else batch
        for gate_name in args.gates:
            for norm in args.norms:
                for r in measure(cfg, s, b, gate_name, norm):
                    rows.append(r)
                    print(f"  {r['form']} S={s} B={b} {gate_name} {norm}: out {_fmt(r['out'])}"
                          f", worst gradient {_fmt(r['worst_grad'])} ({r['seconds']:.1f} s)",
                          flush=True)
                    line = env + [r["form"], s, b, cfg["heads"], cfg["dqk"], cfg["dv"],
                                  cfg["chunk"] or "", gate_name, norm, _fmt(r["out"]),
                                  *[_fmt(r.get(g)) for g in GRADS], _fmt(r["worst_grad"]),
                                  f"{r['seconds']:.2f}", args.note]
                    for path in paths:
                        append_csv(path, line)
    print(f"-- wall time {time.monotonic() - start:.0f} s", flush=True)
    header = ["form", "S", "B", "gates", "norm", "out", *GRADS, "worst grad"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(
            [r["form"], str(r["S"]), str(r["B"]), r["gates"], r["norm"], _fmt(r["out"]),
             *[_fmt(r.get(g)) for g in GRADS], _fmt(r["worst_grad"])]) + " |")
    print("\n".join(lines), flush=True)
    for form in cfg["forms"]:
        for s in seqs:
            mine = [r for r in rows if r["form"] == form and r["S"] == s]
            if not mine:
                continue
            other = max(max(r[g] for g in GRADS if g != "dfgate" and r.get(g) is not None)
                        for r in mine)
            print(f"worst {form} S={s}: output {max(r['out'] for r in mine):.2e}, gradients "
                  f"but dfgate {other:.2e}, dfgate {max(r['dfgate'] for r in mine):.2e}",
                  flush=True)
    print(f"CSV: {len(rows)} rows appended to {', '.join(paths)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
