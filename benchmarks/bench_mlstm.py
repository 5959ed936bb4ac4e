"""mLSTM with its multi-head layernorm: compileops vs the mlstm_kernels (TFLA) anchors.

Setup (REFERENCE.md section 3, the anchors' published setting): 65,536 tokens per batch,
S in 512, 1024, 2048, 4096 with B = 65536 // S, NH=16, DQK=128, DV=256, bf16. Data: q, k, v
unit normal (so q.k / sqrt(DQK) is O(1)), igate unit normal, fgate = unit normal + 3 (forget
gates near 1, as in trained models), norm weight 1 + 0.1 * normal (bf16), a fixed random
cotangent. Every implementation computes the cell and the per-head layernorm over DV with a
weight, output ``[B, S, NH * DV]``:

* ``compileops``: ``compileops.mlstm(..., norm_weight=w)`` (the norm fused), eager and
  ``torch.compile(fn, fullgraph=True)`` static and ``dynamic=True``;
* ``limit_chunk``, ``xl_chunk``: mlstm_kernels ``chunkwise--triton_limit_chunk`` (chunk 64)
  and ``chunkwise--triton_xl_chunk`` (TFLA, chunk 128), eager, each followed by a separate
  multi-head layernorm in plain torch ops (fp32 statistics, then the weight);
  ``xl_chunk[DISABLE_LLVM_OPT=1]``: xl_chunk compiled with LLVM's optimiser off, the upstream
  workaround for triton 3.6's compiler abort, run by default only when xl_chunk imports but
  gives no number at any S;
* ``--raw``: no norm anywhere; every implementation returns raw h ``[B, NH, S, DV]`` and is
  differentiated against a ``[B, NH, S, DV]`` cotangent. Mind what each computes then: TFLA's
  backward leaves out the normaliser's gradient (exact only when a norm follows), ours
  includes it.
* ``reference``: ``compileops.mlstm.reference.mlstm`` (materialises ``S x S``) compiled static,
  forward without gradients, skipped when ``B * NH * S^2 * 4`` bytes exceed ``--ref-limit-gb``.

Passes: ``fw`` (the training forward: inputs require grad, so it saves what the backward
needs) and ``fwbw`` (``autograd.grad`` of the output against the fixed cotangent, for q, k,
v, both gates and the norm weight). Time: ``harness.bench_ms`` (``do_bench`` median, L2
flushed); peak: ``max_memory_allocated`` over one call minus what was allocated before it
(inputs excluded). TFLOP/s (the compileops[parallel] rows only; the chunkwise form does fewer FLOPs): causal forward ``B * NH * S^2 * (DQK + DV)``,
backward 2.5x that (fw+bw 3.5x).

Each implementation runs in its own subprocess (a compiler abort or a hang ends that
subprocess only, never the run), with a time limit per (impl, mode, S) job. A failure is a
status, never a number: ``import-failed: ...``, ``aborted rc=...``, ``timeout ...``,
``error: ...``, ``oom``, ``skipped: memory``. After an abort or a timeout the same impl and
mode is not retried at the larger S (``--retry-after-abort`` retries).

    python benchmarks/bench_mlstm.py                       # GPU, the full run (~5 min on an H100)
    python benchmarks/bench_mlstm.py --quick               # S=1024, eager + static, 2 impls
    python benchmarks/bench_mlstm.py --impls compileops limit_chunk --modes eager --seqs 2048
    python benchmarks/bench_mlstm.py --device cpu --tiny   # CPU dry run (Triton interpreter)

Output: a markdown table on stdout (with speed-up and peak ratio vs the faster anchor), and CSV
rows appended to ``benchmarks/results/mlstm_<gpu>.csv`` (``--csv``; CPU runs go to
``benchmarks/out/``), and to ``$COMPILEOPS_BENCH_OUT/mlstm_<gpu>.csv`` as well when it is set.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ANCHORS = {  # impl -> (mlstm_kernels name, chunk size, extra environment)
    "limit_chunk": ("chunkwise--triton_limit_chunk", 64, {}),
    "xl_chunk": ("chunkwise--triton_xl_chunk", 128, {}),
    "xl_chunk[DISABLE_LLVM_OPT=1]": ("chunkwise--triton_xl_chunk", 128, {"DISABLE_LLVM_OPT": "1"}),
}
# compileops[parallel] / compileops[chunkwise<N>]: one form forced (kernel=, chunk_size=);
# plain compileops is kernel="auto".
# compileops[packed16]: kernel="auto" with cu_seqlens, 16 documents of random lengths
# (fixed seed) packed in the row (B must be 1: S = 65536).
# compileops[fastgates]: kernel="auto" with compileops.mlstm.set_fast_gate_gradients(True)
# (the 16-bit forget-gate gradient's older, less accurate sums): what the accurate sums cost.
OURS = ["compileops", "compileops[parallel]", "compileops[chunkwise64]",
        "compileops[chunkwise128]", "compileops[chunkwise256]", "compileops[packed16]",
        "compileops[fastgates]"]
IMPLS = OURS + ["limit_chunk", "xl_chunk", "xl_chunk[DISABLE_LLVM_OPT=1]", "reference"]
DEFAULT_IMPLS = ["compileops", "limit_chunk", "xl_chunk", "reference"]
MODES = ["eager", "static", "dynamic"]
PASSES = ["fw", "fwbw"]
CSV_COLUMNS = ["date", "device", "torch", "triton", "impl", "mode", "S", "B", "pass", "ms",
               "tflops", "peak_gib", "status"]
TINY = dict(tokens=64, seqs=[16, 32], heads=2, dqk=16, dv=32, anchor_chunk=16)
TAG = "@@"  # prefix of the child's protocol lines on its stdout


# --------------------------------------------------------------------------------------------
# Child: runs the jobs of one implementation and prints one protocol line per result.
# --------------------------------------------------------------------------------------------

def _emit(kind: str, **payload) -> None:
    print(TAG + json.dumps({"kind": kind, **payload}), flush=True)


def _short(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:160]}"


def _install_einops_shim() -> bool:
    """mlstm_kernels imports einops at module level (its native kernels, and xl_chunk's gate
    preprocess, which only splits the sequence axis into chunks). Without einops installed,
    a stand-in supporting that one pattern lets the Triton kernels import. Returns True when
    the stand-in is used."""
    import importlib.util
    import types

    if importlib.util.find_spec("einops") is not None:
        return False

    def rearrange(x, pattern, **sizes):
        lhs, rhs = (" ".join(s.split()) for s in pattern.split("->"))
        if lhs == "b nh (nc l)" and rhs == "b nh nc l":
            return x.reshape(*x.shape[:-1], sizes["nc"], sizes["l"])
        raise NotImplementedError(f"einops stand-in: pattern {pattern!r}")

    shim = types.ModuleType("einops")
    shim.rearrange = rearrange
    sys.modules["einops"] = shim
    return True


def multihead_layernorm(h, weight, eps: float):
    """The anchors' separate norm, plain torch ops: ``h [B, NH, S, DV]`` -> per-head
    layernorm over DV in fp32, times the weight -> ``[B, S, NH * DV]`` in h's dtype."""
    import torch.nn.functional as F

    b, nh, s, dv = h.shape
    y = F.layer_norm(h.transpose(1, 2).float(), (dv,), eps=eps)
    return (y.reshape(b, s, nh * dv) * weight.float()).to(h.dtype)


def child_main(cfg: dict) -> None:
    import gc

    import torch

    device = torch.device(cfg["device"])
    is_cuda = device.type == "cuda"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    _emit("env", device=torch.cuda.get_device_name() if is_cuda else "cpu",
          torch=torch.__version__, triton=triton_version)
    dtype = getattr(torch, cfg["dtype"])
    nh, dqk, dv = cfg["heads"], cfg["dqk"], cfg["dv"]
    eps = norm_eps = 1e-6

    if is_cuda:
        sys.path.insert(0, ROOT)
        from benchmarks.harness import bench_ms

        def timed(fn):
            return bench_ms(fn, warmup=cfg["warmup"], rep=cfg["rep"])
    else:
        def timed(fn):  # the interpreter: meaningless times, one call
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

    def peak(fn):
        if not is_cuda:
            return None
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        result = (torch.cuda.max_memory_allocated() - base) / 2**30
        del out
        return result

    def inputs(s: int, b: int, grad: bool):
        gen = torch.Generator(device=device).manual_seed(1000 + s)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

        q = randn(b, nh, s, dqk).to(dtype)
        k = randn(b, nh, s, dqk).to(dtype)
        v = randn(b, nh, s, dv).to(dtype)
        ig = randn(b, nh, s).to(dtype)
        fg = (randn(b, nh, s) + 3.0).to(dtype)
        w = (1.0 + 0.1 * randn(nh * dv)).to(dtype)
        if cfg["raw"]:  # h itself: no norm weight to differentiate
            cot = randn(b, nh, s, dv).to(dtype)
            leaves = [t.requires_grad_(grad) for t in (q, k, v, ig, fg)]
        else:
            cot = randn(b, s, nh * dv).to(dtype)
            leaves = [t.requires_grad_(grad) for t in (q, k, v, ig, fg, w)]
        return leaves, cot

    # The implementation, built once per child.
    impl = cfg["impl"]
    build_error = None
    note = ""
    kernel = None
    if impl in ANCHORS:
        name, chunk, _ = ANCHORS[impl]
        chunk = cfg.get("anchor_chunk") or chunk
        try:
            if _install_einops_shim():
                note = " (einops stand-in)"
            from mlstm_kernels.torch import get_mlstm_kernel

            kernel = get_mlstm_kernel(name)
        except BaseException as exc:  # ImportError, or the registry lacking the name
            build_error = "import-failed: " + _short(exc)

        def plain(q, k, v, ig, fg, w=None):
            h = kernel(q, k, v, ig, fg, chunk_size=chunk, eps=eps)
            return h if w is None else multihead_layernorm(h, w, norm_eps)
    elif impl == "reference":
        try:
            from compileops.mlstm import reference
        except BaseException as exc:
            build_error = "import-failed: " + _short(exc)

        def plain(q, k, v, ig, fg, w=None):
            return reference.mlstm(q, k, v, ig, fg, norm_weight=w, norm_eps=norm_eps,
                                   eps=eps)[0]
    else:
        try:
            import compileops
        except BaseException as exc:
            build_error = "import-failed: " + _short(exc)

        form = impl[len("compileops["):-1] if impl.startswith("compileops[") else "auto"
        kernel = "chunkwise" if form.startswith("chunkwise") else (
            "auto" if form in ("packed16", "fastgates") else form)
        if form == "fastgates" and build_error is None:
            compileops.mlstm.set_fast_gate_gradients(True)
        chunk = int(form[len("chunkwise"):]) if form.startswith("chunkwise") else None
        packing = {}

        def documents(seq, device):
            """16 random document ends in the row, the same for every call."""
            if seq not in packing:
                gen = torch.Generator().manual_seed(0)
                cuts = torch.randperm(seq - 1, generator=gen)[:15].add(1).sort().values
                packing[seq] = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq])]).to(
                    device, torch.int32)
            return packing[seq]

        def plain(q, k, v, ig, fg, w=None):
            cu = documents(q.shape[2], q.device) if form == "packed16" else None
            return compileops.mlstm(q, k, v, ig, fg, norm_weight=w, norm_eps=norm_eps, eps=eps,
                                    kernel=kernel, chunk_size=chunk, cu_seqlens=cu)

    compiled = {}
    last_mode = None
    for job_impl, mode, s in cfg["jobs"]:
        b = cfg["tokens"] // s
        passes = ["fw"] if impl == "reference" else cfg["passes"]
        _emit("job", impl=job_impl, mode=mode, S=s)

        def row(pass_, ms=None, peak_gib=None, status="ok"):
            _emit("row", impl=job_impl, mode=mode, S=s, B=b, **{"pass": pass_}, ms=ms,
                  peak_gib=peak_gib, status=status)

        if build_error:
            for p in passes:
                row(p, status=build_error)
            _emit("done")
            continue
        if impl == "reference" and b * nh * s * s * 4 > cfg["ref_limit_gb"] * 1e9:
            row("fw", status=f"skipped: memory (S x S fp32 = {b * nh * s * s * 4 / 1e9:.1f} GB)")
            _emit("done")
            continue
        if mode != last_mode:  # a fresh Dynamo cache per mode: static and dynamic never mix
            torch._dynamo.reset()
            compiled.clear()
            last_mode = mode
        if mode == "eager":
            fn = plain
        else:
            fn = compiled.setdefault(mode, torch.compile(plain, fullgraph=True,
                                                         dynamic=mode == "dynamic"))
        try:
            leaves, cot = inputs(s, b, grad=impl != "reference")
            if impl == "compileops[packed16]":  # drawn eagerly: the compiled call reads it
                documents(s, leaves[0].device)
        except BaseException as exc:
            for p in passes:
                row(p, status=("oom" if isinstance(exc, torch.OutOfMemoryError)
                               else "error: " + _short(exc)))
            _emit("done")
            continue
        for p in passes:
            if p == "fw":
                if impl == "reference":
                    def call():
                        with torch.no_grad():
                            return fn(*leaves)
                else:
                    def call():
                        return fn(*leaves)
            else:
                def call():
                    return torch.autograd.grad(fn(*leaves), leaves, cot)
            try:
                if is_cuda or mode != "eager":
                    call()  # compiles (static/dynamic), autotunes, warms the kernels
                if is_cuda:
                    torch.cuda.synchronize()
                pk = peak(call)
                ms = timed(call)
                row(p, ms=ms, peak_gib=pk, status="ok" + note)
            except BaseException as exc:  # one failure must not end the child's other jobs
                if isinstance(exc, KeyboardInterrupt):
                    raise
                status = ("oom" if isinstance(exc, torch.OutOfMemoryError)
                          else "error: " + _short(exc))
                print(f"{job_impl} {mode} S={s} {p}: {status}", flush=True)
                row(p, status=status)
            finally:
                if is_cuda:
                    gc.collect()
                    torch.cuda.empty_cache()
        del leaves, cot
        _emit("done")


# --------------------------------------------------------------------------------------------
# Parent: no CUDA context of its own; runs the children, collects, reports.
# --------------------------------------------------------------------------------------------

class Collector:
    """Results by (impl, mode, S, pass); each row is appended to the CSV files as it arrives,
    so a run cut short keeps what it measured."""

    def __init__(self, cfg: dict, args):
        self.cfg, self.args = cfg, args
        self.rows: dict = {}  # (impl, mode, S, pass) -> dict
        self.env: dict = {}
        self.env_measured = False
        self.paths: list = []
        self.written = 0

    def set_env(self, env: dict, measured: bool = True) -> None:
        """``env``: device, torch and triton as a child reported them (``measured``), or a
        stand-in until one does."""
        if measured and not self.env_measured:
            self.env, self.env_measured = env, True
        elif not self.env:
            self.env = env
        if not self.paths:
            name = f"mlstm_{gpu_tag(self.env.get('device', self.args.device))}.csv"
            folder = "results" if self.args.device == "cuda" else "out"
            self.paths = [self.args.csv or os.path.join(ROOT, "benchmarks", folder, name)]
            out = os.environ.get("COMPILEOPS_BENCH_OUT")
            if out and os.path.abspath(os.path.join(out, name)) != os.path.abspath(self.paths[0]):
                self.paths.append(os.path.join(out, name))

    def add(self, r: dict) -> None:
        key = (r["impl"], r["mode"], r["S"], r["pass"])
        r["tflops"] = (flops(r["S"], r["B"], self.cfg, r["pass"]) / (r["ms"] * 1e-3) / 1e12
                       if r["impl"] == "compileops[parallel]" and r.get("ms") else None)
        self.rows[key] = r
        ms = f"{r['ms']:.3f} ms" if r.get("ms") is not None else ""
        tf = f", {r['tflops']:.1f} TFLOP/s" if r["tflops"] is not None else ""
        pk = f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""
        print(f"  {r['impl']} | {r['mode']} | S={r['S']} B={r['B']} | {r['pass']}: {ms}{tf}{pk} "
              f"[{r['status']}]", flush=True)
        self.set_env({"device": self.args.device, "torch": "?", "triton": "?"}, measured=False)
        env = self.env
        line = [datetime.date.today().isoformat(), env["device"], env["torch"], env["triton"],
                r["impl"] + impl_suffix(self.cfg), r["mode"], r["S"], r["B"],
                r["pass"], _fmt(r.get("ms"), ".4f"),
                _fmt(r["tflops"], ".1f"), _fmt(r.get("peak_gib"), ".3f"), r["status"]]
        for path in self.paths:
            append_csv(path, line)
        self.written += 1


def impl_suffix(cfg: dict) -> str:
    """What a CSV row's impl carries beyond the name: `` (raw h)`` with ``--raw``, and the
    head shape where it is not the default NH 16, DQK 128, DV 256 (rows of other heads are
    otherwise indistinguishable)."""
    suffix = " (raw h)" if cfg["raw"] else ""
    if (cfg["heads"], cfg["dqk"], cfg["dv"]) != (16, 128, 256):
        suffix += f" (NH {cfg['heads']}, DQK {cfg['dqk']}, DV {cfg['dv']})"
    return suffix


def _fmt(x, spec) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _reader(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


_LIVE: list = []  # the running child, ended with the parent on SIGTERM / Ctrl-C


def _on_sigterm(*_):
    raise KeyboardInterrupt


def _kill(proc: subprocess.Popen) -> None:
    """Ends the child and whatever it started (its own session: compile workers)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks.harness import stop_process_group

    stop_process_group(proc)


def run_group(impl: str, jobs: list, base_cfg: dict, args, col: Collector) -> None:
    """Runs ``jobs`` ((impl, mode, S) triples) in child processes, restarting a child after an
    abort or a timeout for the jobs left, and recording a status for what did not run."""
    pending = list(jobs)
    env = dict(os.environ)
    env.update(ANCHORS.get(impl, (None, None, {}))[2])
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if base_cfg["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    while pending:
        cfg = dict(base_cfg, impl=impl, jobs=pending)
        with tempfile.TemporaryFile(mode="w+") as err:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT,
                start_new_session=True)
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
            current, done_passes, timed_out = None, set(), False
            deadline = time.monotonic() + args.job_timeout + args.startup_timeout
            _LIVE.append(proc)
            while True:
                try:
                    line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        timed_out = True
                        _kill(proc)
                        break
                    continue
                if line is None:
                    break
                if not line.startswith(TAG):
                    print(f"  [{impl}] {line.rstrip()}", flush=True)
                    continue
                msg = json.loads(line[len(TAG):])
                kind = msg.pop("kind")
                if kind == "env":
                    col.set_env(msg)
                elif kind == "job":
                    current = (msg["impl"], msg["mode"], msg["S"])
                    done_passes = set()
                    deadline = time.monotonic() + args.job_timeout
                elif kind == "row":
                    col.add(msg)
                    done_passes.add(msg["pass"])
                elif kind == "done":
                    pending.remove(current)
                    current = None
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc = proc.wait()
            _LIVE.remove(proc)
            if not pending:
                break
            # The child ended with jobs left: an abort, a timeout, or a failure to start.
            if current is None:
                current = pending[0]
            status = (f"timeout (> {args.job_timeout:.0f} s)" if timed_out else f"aborted rc={rc}")
            err.seek(0)
            tail = err.read().strip().splitlines()[-15:]
            print(f"  [{impl}] child {status} during {current[1]} S={current[2]}; stderr tail:",
                  flush=True)
            for t in tail:
                print(f"  [{impl}]   {t}", flush=True)
        b = base_cfg["tokens"] // current[2]
        passes = ["fw"] if impl == "reference" else base_cfg["passes"]
        for p in passes:
            if p not in done_passes:
                col.add(dict(impl=current[0], mode=current[1], S=current[2], B=b,
                             ms=None, peak_gib=None, status=status, **{"pass": p}))
        pending.remove(current)
        if not args.retry_after_abort:
            for job in [j for j in pending if tuple(j[:2]) == tuple(current[:2])]:
                pending.remove(job)
                for p in passes:
                    col.add(dict(impl=job[0], mode=job[1], S=job[2], B=base_cfg["tokens"] // job[2],
                                 ms=None, peak_gib=None, status=f"{status} at S={current[2]} "
                                 "(not retried)", **{"pass": p}))


def flops(s: int, b: int, cfg: dict, pass_: str) -> float:
    fw = b * cfg["heads"] * s * s * (cfg["dqk"] + cfg["dv"])
    return fw if pass_ == "fw" else 3.5 * fw


def report(col: Collector, cfg: dict, order: list) -> None:
    anchors = [i for i in order if i in ANCHORS]
    env = col.env or {"device": "unknown", "torch": "?", "triton": "?"}
    what = "raw h, no norm" if cfg["raw"] else "+ multi-head layernorm"
    title = (f"### mLSTM {what} ({cfg['dtype']}, {cfg['tokens']} tokens, "
             f"NH={cfg['heads']}, DQK={cfg['dqk']}, DV={cfg['dv']})")
    lines = [title, "", f"{datetime.date.today().isoformat()} | {env['device']} | torch "
             f"{env['torch']} | triton {env['triton']} | command: "
             f"{' '.join(['python'] + sys.argv)}", "",
             "| S | B | pass | impl | mode | ms | TFLOP/s | peak GiB | vs faster anchor "
             "| peak vs anchor | status |", "|" + "---|" * 11]
    keys = sorted(col.rows, key=lambda k: (k[2], PASSES.index(k[3]), order.index(k[0])
                                           if k[0] in order else 99, MODES.index(k[1])))
    for key in keys:
        r = col.rows[key]
        impl, mode, s, p = key
        ok = [col.rows[(a, "eager", s, p)] for a in anchors if (a, "eager", s, p) in col.rows]
        ok = [a for a in ok if a.get("ms") is not None]
        best = min(ok, key=lambda a: a["ms"]) if ok else None
        speed = (f"{best['ms'] / r['ms']:.2f}x ({best['impl']})"
                 if best and r.get("ms") else "")
        mem = (f"{r['peak_gib'] / best['peak_gib']:.2f}"
               if best and r.get("peak_gib") is not None and best.get("peak_gib") else "")
        lines.append(f"| {s} | {r['B']} | {p} | {impl} | {mode} | {_fmt(r.get('ms'), '.3f')} | "
                     f"{_fmt(r['tflops'], '.1f')} | {_fmt(r.get('peak_gib'), '.2f')} | {speed} "
                     f"| {mem} | {r['status']} |")
    print("\n".join(lines), flush=True)


def append_csv(path: str, line: list) -> None:
    """One row of :data:`CSV_COLUMNS` appended (``benchmarks.harness.append_csv``, imported
    here: the harness imports torch)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks.harness import append_csv as append

    append(path, CSV_COLUMNS, line)


def gpu_tag(device: str) -> str:
    for tag in ("H100", "H200", "B200", "A100"):
        if tag in device:
            return tag.lower()
    return "cpu" if device == "cpu" else "gpu"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="*", default=None,
                        help="sequence lengths (default 512 1024 2048 4096; --tiny: 16 32)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per batch, B = tokens // S (default 65536; --tiny: 64)")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--dqk", type=int, default=None)
    parser.add_argument("--dv", type=int, default=None)
    parser.add_argument("--raw", action="store_true",
                        help="no norm: every implementation returns raw h [B, NH, S, DV] (TFLA's "
                             "backward then leaves out the normaliser's gradient; ours does not)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--impls", nargs="*", default=None, choices=IMPLS)
    parser.add_argument("--modes", nargs="*", default=None, choices=MODES,
                        help="modes of compileops (anchors: eager; reference: static)")
    parser.add_argument("--passes", nargs="*", default=PASSES, choices=PASSES)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes (with --device cpu: Triton's interpreter, a dry run)")
    parser.add_argument("--quick", action="store_true",
                        help="S=1024, eager + static, compileops + limit_chunk (~1 min)")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    parser.add_argument("--ref-limit-gb", type=float, default=20.0,
                        help="skip the reference when B*NH*S*S*4 bytes exceed this many GB")
    parser.add_argument("--job-timeout", type=float, default=None,
                        help="seconds per (impl, mode, S) job, compiles included "
                             "(default 180; CPU 900)")
    parser.add_argument("--startup-timeout", type=float, default=60.0,
                        help="extra seconds for a child's imports before its first job")
    parser.add_argument("--retry-after-abort", action="store_true",
                        help="after an abort or timeout, still run that impl/mode at later S")
    parser.add_argument("--no-xl-fallback", action="store_true",
                        help="do not run xl_chunk[DISABLE_LLVM_OPT=1] when xl_chunk aborts")
    parser.add_argument("--csv", default=None,
                        help="CSV to append to (default benchmarks/results/mlstm_<gpu>.csv; "
                             "CPU: benchmarks/out/mlstm_cpu.csv)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child_main(json.loads(args.child))
        return 0

    tiny = args.tiny
    seqs = args.seqs or ([1024] if args.quick else TINY["seqs"] if tiny
                         else [512, 1024, 2048, 4096])
    impls = args.impls or (["compileops", "limit_chunk"] if args.quick else DEFAULT_IMPLS)
    modes = args.modes or (["eager", "static"] if args.quick else MODES)
    cfg = dict(
        device=args.device, dtype=args.dtype, passes=args.passes, warmup=args.warmup,
        rep=args.rep, ref_limit_gb=args.ref_limit_gb,
        tokens=args.tokens or (TINY["tokens"] if tiny else 65536),
        heads=args.heads or (TINY["heads"] if tiny else 16),
        dqk=args.dqk or (TINY["dqk"] if tiny else 128),
        dv=args.dv or (TINY["dv"] if tiny else 256), raw=args.raw,
        anchor_chunk=TINY["anchor_chunk"] if tiny else None,
    )
    if args.job_timeout is None:
        args.job_timeout = 900.0 if args.device == "cpu" else 180.0
    bad = [s for s in seqs if cfg["tokens"] % s]
    if bad:
        parser.error(f"--tokens {cfg['tokens']} is not a multiple of S in {bad}")
    start = time.monotonic()
    print(f"bench_mlstm: impls {impls}, modes {modes}, S {seqs}, passes {args.passes}, "
          f"{cfg['tokens']} tokens, NH={cfg['heads']} DQK={cfg['dqk']} DV={cfg['dv']} "
          f"{cfg['dtype']} on {args.device}", flush=True)
    col = Collector(cfg, args)
    order = list(impls)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run_all(impls, modes, seqs, cfg, args, col, order)
    except KeyboardInterrupt:
        for proc in _LIVE:
            _kill(proc)
        print("-- interrupted: the table holds what was measured", flush=True)
    print(f"-- benchmark wall time {time.monotonic() - start:.0f} s", flush=True)
    report(col, cfg, order)
    print(f"CSV: {col.written} rows appended to {', '.join(col.paths) or '(none)'}", flush=True)
    return 0


def run_all(impls, modes, seqs, cfg, args, col, order) -> None:
    for impl in impls:
        if impl.startswith("compileops"):
            jobs = [(impl, m, s) for m in modes for s in seqs]
        elif impl == "reference":
            jobs = [(impl, "static", s) for s in seqs]
        else:
            jobs = [(impl, "eager", s) for s in seqs]
        t0 = time.monotonic()
        print(f"-- {impl}", flush=True)
        run_group(impl, jobs, cfg, args, col)
        print(f"-- {impl}: {time.monotonic() - t0:.0f} s", flush=True)
        if (impl == "xl_chunk" and not args.no_xl_fallback
                and "xl_chunk[DISABLE_LLVM_OPT=1]" not in impls):
            xl = [r for k, r in col.rows.items() if k[0] == "xl_chunk"]
            if xl and all(r["ms"] is None for r in xl) and not any(
                    r["status"].startswith("import-failed") for r in xl):
                fb = "xl_chunk[DISABLE_LLVM_OPT=1]"
                order.insert(order.index("xl_chunk") + 1, fb)
                print(f"-- {fb} (xl_chunk failed: the upstream workaround)", flush=True)
                t0 = time.monotonic()
                run_group(fb, [(fb, "eager", s) for s in seqs], cfg, args, col)
                print(f"-- {fb}: {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
