"""Tile-config sweep for the mLSTM kernels (GPU): what the heuristics in
``compileops.mlstm.kernels.choose_forward_config`` / ``choose_backward_config`` are based on.

At S = 1024 and 4096 (B * S = 65536, NH=16, DQK=128, DV=256, bf16; the data of
``bench_mlstm.py``) it times

* ``fw``: ``kernels.mlstm_forward`` with the norm fused and h saved (the training forward),
  one launch per :class:`ForwardConfig`;
* ``bw``: the kernel part of the op's backward (``op._kernel_backward``): ``norm_backward``
  (with the per-row normaliser terms), ``cell_backward`` (the dQ and the dK/dV programs), per
  :class:`BackwardConfig`;

over the grid ``block_m, block_n`` in {32, 64, 128} with ``block_m % block_n == 0``,
``num_warps`` in {4, 8}, ``num_stages`` in {1, 2, 3} (36 configs per pass), plus the
heuristic's own choice. Each result is compared with the heuristic config's (relative L2
error of out, or of dq, dk, dv); a mismatch is flagged, not ranked.

Compiling 72 kernels one by one would take longer than the sweep, so worker processes
(``--jobs``) first compile every config at a small S (same specialisation, so the main
process finds them in Triton's cache). The workers also isolate compiler failures: a config
that raises (error class recorded) or aborts its worker (``aborted rc=...``) is not timed.
``--budget-s`` bounds the whole sweep; configs left when it runs out are listed as skipped.

    python benchmarks/tuning/sweep_mlstm.py                        # GPU, ~4 min on an H100
    python benchmarks/tuning/sweep_mlstm.py --seqs 4096 --passes bw
    python benchmarks/tuning/sweep_mlstm.py --device cpu --tiny    # CPU dry run (interpreter)

Uses the documented tuning API: the config dataclasses and launchers of
``compileops.mlstm.kernels``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "@@"
TINY = dict(tokens=64, seqs=[16, 32], heads=2, dqk=16, dv=32, blocks=[16, 32], warps=[4],
            stages=[1, 2], worker_seq=32)
MISMATCH = 2e-2  # relative L2 error vs the heuristic config above which a result is flagged


def _emit(kind: str, **payload) -> None:
    print(TAG + json.dumps({"kind": kind, **payload}), flush=True)


def grid(blocks, warps, stages) -> list:
    return [(bm, bn, w, s) for bm in blocks for bn in blocks if bm % bn == 0
            for w in warps for s in stages]


def _setup_env(cfg: dict) -> None:
    if cfg["device"] == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, ROOT)


class Case:
    """Inputs of one (S, B) and the kernel calls of both passes."""

    def __init__(self, cfg: dict, s: int, b: int):
        import torch

        from compileops.mlstm import kernels, op, reference

        self.torch, self.kernels, self.op = torch, kernels, op
        device = torch.device(cfg["device"])
        dtype = getattr(torch, cfg["dtype"])
        nh, dqk, dv = cfg["heads"], cfg["dqk"], cfg["dv"]
        gen = torch.Generator(device=device).manual_seed(1000 + s)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

        self.q = randn(b, nh, s, dqk).to(dtype)
        self.k = randn(b, nh, s, dqk).to(dtype)
        self.v = randn(b, nh, s, dv).to(dtype)
        igate = randn(b, nh, s).to(dtype)
        fgate = (randn(b, nh, s) + 3.0).to(dtype)
        self.w = (1.0 + 0.1 * randn(nh * dv)).to(dtype)
        self.cot = randn(b, s, nh * dv).to(dtype)
        self.acc = reference.gate_dtype(dtype)
        # The op's gate inputs, as compileops.mlstm prepares them.
        self.igate = igate.to(self.acc).contiguous()
        if hasattr(reference, "log_forget_cumsum"):
            self.logf = reference.log_forget_cumsum(fgate.to(self.acc)).contiguous()
        else:
            self.logf = torch.cumsum(torch.nn.functional.logsigmoid(fgate.to(self.acc)),
                                     dim=-1).contiguous()
        self.eps = self.norm_eps = 1e-6
        self.default_fw = kernels.choose_forward_config(self.q, dqk, dv)
        self.default_bw = kernels.choose_backward_config(self.q, dqk, dv)
        self._saved = None

    def fw(self, config):
        return self.kernels.mlstm_forward(
            self.q, self.k, self.v, self.igate, self.logf, self.w, None, True, self.norm_eps,
            self.eps, False, True, config=config)

    def bw(self, config):
        if self._saved is None:  # the forward's saved tensors, from the heuristic config
            _, h, m, b = self.fw(self.default_fw)
            self._saved = (h, m, b)
        h, m, b = self._saved
        dh, r, beta, dm, _, _ = self.kernels.norm_backward(
            self.cot, h, self.w, m, b, True, self.norm_eps, self.eps, False, config)
        return self.kernels.cell_backward(self.q, self.k, self.v, dh, self.igate, self.logf, m,
                                          r, beta, config)

    def make_config(self, pass_: str, c):
        cls = self.kernels.ForwardConfig if pass_ == "fw" else self.kernels.BackwardConfig
        return cls(block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3])

    def run(self, pass_: str, config):
        return self.fw(config) if pass_ == "fw" else self.bw(config)

    @staticmethod
    def outputs(pass_: str, result) -> list:
        return [result[0]] if pass_ == "fw" else list(result[:3])


def _error(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:120]}"


# --------------------------------------------------------------------------------------------
# Compile workers
# --------------------------------------------------------------------------------------------

def worker_main(cfg: dict) -> None:
    _setup_env(cfg)
    import torch

    s = cfg["worker_seq"]
    case = Case(cfg, s, 1)
    for pass_, c in cfg["items"]:
        _emit("try", item=[pass_, c])
        try:
            case.run(pass_, case.make_config(pass_, c))
            if cfg["device"] == "cuda":
                torch.cuda.synchronize()
            _emit("ok", item=[pass_, c])
        except Exception as exc:  # a config may not compile or not fit: record its class
            _emit("err", item=[pass_, c], error=_error(exc))


def _reader(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def precompile(items: list, cfg: dict, jobs: int, timeout: float) -> dict:
    """Compiles ``items`` ((pass, config tuple)) in ``jobs`` worker processes. Returns
    ``{item: "ok" | error string}``; items not reached before ``timeout`` are absent."""
    status: dict = {}
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if cfg["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    shares = [items[i::jobs] for i in range(jobs)]
    deadline = time.monotonic() + timeout
    live = []  # [proc, queue, remaining items, current item, items finished]

    def start(share):
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker",
             json.dumps(dict(cfg, items=share))],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
            start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        live.append([proc, lines, list(share), None, 0])

    for share in shares:
        if share:
            start(share)
    while live and time.monotonic() < deadline:
        for entry in list(live):
            proc, lines, remaining, current, finished = entry
            try:
                line = lines.get(timeout=0.05)
            except queue.Empty:
                continue
            if line is None:  # the worker ended
                rc = proc.wait()
                live.remove(entry)
                if current is not None:  # it died compiling this one
                    status[current] = f"aborted rc={rc}"
                    print(f"  compile {current[0]} {current[1]}: aborted rc={rc}", flush=True)
                    remaining.remove(current)
                elif not finished:  # it died before its first config: do not restart it
                    for item in remaining:
                        status[item] = f"worker failed rc={rc}"
                    print(f"  a compile worker failed to start (rc={rc})", flush=True)
                    continue
                if remaining:
                    start(remaining)
                continue
            if not line.startswith(TAG):
                continue
            msg = json.loads(line[len(TAG):])
            item = (msg["item"][0], tuple(msg["item"][1]))
            if msg["kind"] == "try":
                entry[3] = item
            else:
                status[item] = "ok" if msg["kind"] == "ok" else msg["error"]
                if msg["kind"] == "err":
                    print(f"  compile {item[0]} {item[1]}: {msg['error']}", flush=True)
                remaining.remove(item)
                entry[3] = None
                entry[4] += 1
    for proc, *_ in live:  # past the deadline
        _kill(proc)
        proc.wait()
    return status


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sweep(args, cfg: dict, configs: list, compiled: dict, start: float) -> None:
    _setup_env(cfg)
    import torch

    is_cuda = cfg["device"] == "cuda"
    if is_cuda:
        from benchmarks.harness import bench_ms

        def timed(fn):
            return bench_ms(fn, warmup=args.warmup, rep=args.rep)
    else:
        def timed(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    skipped = 0
    for s in cfg["seqs"]:
        b = cfg["tokens"] // s
        case = Case(cfg, s, b)
        fw_flops = b * cfg["heads"] * s * s * (cfg["dqk"] + cfg["dv"])
        for pass_ in args.passes:
            flops = fw_flops * (1.0 if pass_ == "fw" else 2.5)
            default = case.default_fw if pass_ == "fw" else case.default_bw
            dkey = (default.block_m, default.block_n, default.num_warps, default.num_stages)
            print(f"-- S={s} B={b} {pass_} (heuristic: {dkey})", flush=True)
            expected = [t.clone() for t in case.outputs(pass_, case.run(pass_, default))]
            rows, failures = [], {}
            for c in [dkey] + [c for c in configs if c != dkey]:
                label = "heuristic" if c == dkey else ""
                state = compiled.get((pass_, c), "ok") if c != dkey else "ok"
                if state != "ok":
                    failures[c] = state
                    continue
                if time.monotonic() - start > args.budget_s:
                    failures[c] = "skipped: budget"
                    skipped += 1
                    continue
                try:
                    config = case.make_config(pass_, c)
                    got = case.outputs(pass_, case.run(pass_, config))
                    err = max(rel_err(g, e) for g, e in zip(got, expected))
                    del got
                    ms = timed(lambda: case.run(pass_, config))
                except Exception as exc:
                    failures[c] = _error(exc)
                    print(f"  {c}: {failures[c]}", flush=True)
                    continue
                tflops = flops / (ms * 1e-3) / 1e12
                flag = "MISMATCH" if err > MISMATCH else ""
                rows.append((ms, c, tflops, err, flag or label))
                print(f"  bm={c[0]:<3} bn={c[1]:<3} w={c[2]} st={c[3]}: {ms:9.3f} ms "
                      f"{tflops:7.1f} TFLOP/s  rel err {err:.1e} {flag or label}", flush=True)
            good = sorted(r for r in rows if r[4] != "MISMATCH")
            base = next((r for r in rows if r[1] == dkey), None)
            print(f"   best {pass_} at S={s}:", flush=True)
            for ms, c, tflops, err, label in good[:5]:
                vs = ("the heuristic" if c == dkey else
                      f"{base[0] / ms:.2f}x the heuristic" if base else "")
                print(f"     {c}: {ms:.3f} ms, {tflops:.1f} TFLOP/s, {vs}", flush=True)
            if failures:
                counts: dict = {}
                for why in failures.values():
                    key = why.split(":")[0] if not why.startswith(("aborted", "skipped")) else why
                    counts[key] = counts.get(key, 0) + 1
                summary = ", ".join(f"{k} x{n}" for k, n in counts.items())
                print(f"   not timed: {len(failures)} ({summary})", flush=True)
                for c, why in failures.items():
                    if not why.startswith("skipped"):
                        print(f"     {c}: {why}", flush=True)
            del expected
            if is_cuda:
                torch.cuda.empty_cache()
        del case
    if skipped:
        print(f"-- budget of {args.budget_s:.0f} s ran out: {skipped} timings skipped", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and grid (CPU dry run)")
    parser.add_argument("--seqs", type=int, nargs="*", default=None, help="default 1024 4096")
    parser.add_argument("--tokens", type=int, default=None, help="B * S (default 65536)")
    parser.add_argument("--passes", nargs="*", default=["fw", "bw"], choices=["fw", "bw"])
    parser.add_argument("--blocks", type=int, nargs="*", default=None, help="default 32 64 128")
    parser.add_argument("--warps", type=int, nargs="*", default=None, help="default 4 8")
    parser.add_argument("--stages", type=int, nargs="*", default=None, help="default 1 2 3")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--jobs", type=int, default=None,
                        help="compile workers (default min(8, CPUs); 0: no precompile)")
    parser.add_argument("--precompile-timeout", type=float, default=None,
                        help="seconds for the compile phase (default 120; CPU 600)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="whole-sweep budget in seconds (default 230; CPU 1200)")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=60, help="do_bench repetition time, ms")
    parser.add_argument("--list-configs", action="store_true", help="print the grid and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return 0
    tiny = args.tiny
    cpu = args.device == "cpu"
    configs = grid(args.blocks or (TINY["blocks"] if tiny else [32, 64, 128]),
                   args.warps or (TINY["warps"] if tiny else [4, 8]),
                   args.stages or (TINY["stages"] if tiny else [1, 2, 3]))
    if args.list_configs:
        print(json.dumps(configs))
        return 0
    cfg = dict(device=args.device, dtype=args.dtype,
               seqs=args.seqs or (TINY["seqs"] if tiny else [1024, 4096]),
               tokens=args.tokens or (TINY["tokens"] if tiny else 65536),
               heads=TINY["heads"] if tiny else 16, dqk=TINY["dqk"] if tiny else 128,
               dv=TINY["dv"] if tiny else 256, worker_seq=TINY["worker_seq"] if tiny else 256)
    args.budget_s = args.budget_s or (1200.0 if cpu else 230.0)
    timeout = args.precompile_timeout or (600.0 if cpu else 120.0)
    jobs = args.jobs if args.jobs is not None else min(8, os.cpu_count() or 1)
    start = time.monotonic()
    print(f"sweep_mlstm: S {cfg['seqs']}, {cfg['tokens']} tokens, NH={cfg['heads']} "
          f"DQK={cfg['dqk']} DV={cfg['dv']} {cfg['dtype']} on {args.device}; "
          f"{len(configs)} configs x {args.passes}", flush=True)
    compiled: dict = {}
    if jobs > 0:
        items = [(p, c) for c in configs for p in args.passes]
        compiled = precompile(items, cfg, jobs, timeout)
        bad = sum(v != "ok" for v in compiled.values())
        print(f"-- compiled {len(compiled) - bad}/{len(items)} in {time.monotonic() - start:.0f} s"
              f" with {jobs} workers ({bad} failed, {len(items) - len(compiled)} not reached)",
              flush=True)
        if not cpu:  # a config the workers did not reach could abort this process: leave it
            for item in items:
                compiled.setdefault(item, "skipped: not compiled in time")
    sweep(args, cfg, configs, compiled, start)
    print(f"-- sweep wall time {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
