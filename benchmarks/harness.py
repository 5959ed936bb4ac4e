"""Shared benchmark harness: timing, floors, and the markdown/CSV report.

Method (benchmarks/README.md, "Method"): ``triton.testing.do_bench`` medians after warm-up, fresh random
inputs larger than L2, anchors timed in the same process, and every row reported against its
floor: bytes over the measured copy bandwidth, FLOPs over the measured bf16 matmul rate.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import platform
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

import torch


@dataclasses.dataclass
class Row:
    case: str
    impl: str
    ms: float
    bytes_moved: float = 0.0
    flops: float = 0.0
    floor_ms: float = float("nan")
    note: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes_moved / (self.ms * 1e-3) / 1e9 if self.bytes_moved else float("nan")

    @property
    def tflops(self) -> float:
        return self.flops / (self.ms * 1e-3) / 1e12 if self.flops else float("nan")

    @property
    def floor_ratio(self) -> float:
        """floor / measured: 1.0 means at the hardware floor."""
        return self.floor_ms / self.ms if self.ms else float("nan")


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` (device events, L2 flushed by do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def sync(device) -> None:
    """Wait for ``device`` (a no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_calls_ms(fn: Callable[[], object], device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn()`` after ``warmup`` calls: CUDA
    events on a GPU, the wall clock elsewhere. For whole steps (a model's forward, a
    training step) where do_bench's L2 flush between calls is not wanted."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


_copy_bandwidth_cache: dict[str, float] = {}


def copy_bandwidth_gbps(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    if device not in _copy_bandwidth_cache:
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
        dst = torch.empty_like(src)
        ms = bench_ms(lambda: dst.copy_(src))
        _copy_bandwidth_cache[device] = 2 * nbytes / (ms * 1e-3) / 1e9
        del src, dst
    return _copy_bandwidth_cache[device]


_matmul_rate_cache: dict[str, float] = {}


def bf16_matmul_tflops(device: str = "cuda", n: int = 8192) -> float:
    """Measured dense bf16 matmul rate on random data."""
    if device not in _matmul_rate_cache:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        ms = bench_ms(lambda: a @ b)
        _matmul_rate_cache[device] = 2 * n**3 / (ms * 1e-3) / 1e12
    return _matmul_rate_cache[device]


def floor_ms(*, bytes_moved: float = 0.0, flops: float = 0.0, device: str = "cuda") -> float:
    """The larger of bytes/bandwidth and flops/matmul-rate, in ms."""
    t_bytes = bytes_moved / (copy_bandwidth_gbps(device) * 1e9) * 1e3 if bytes_moved else 0.0
    t_flops = flops / (bf16_matmul_tflops(device) * 1e12) * 1e3 if flops else 0.0
    return max(t_bytes, t_flops)


def environment_line() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return (
        f"{datetime.date.today().isoformat()} | {gpu} | torch {torch.__version__} | "
        f"triton {triton_version} | python {platform.python_version()} | "
        f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}"
    )


def report(title: str, rows: list[Row], *, csv_path: Optional[str] = None,
           baseline_impl: Optional[str] = None) -> str:
    """Markdown table (printed and returned); CSV written to ``csv_path`` if given.

    ``baseline_impl`` adds a speed-up column relative to that impl within each case.
    """
    baseline = {r.case: r.ms for r in rows if r.impl == baseline_impl}
    header = ["case", "impl", "ms", "GB/s", "TFLOP/s", "floor ms", "of floor"]
    if baseline_impl:
        header.append(f"speed-up vs {baseline_impl}")
    lines = [f"### {title}", "", environment_line(), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def fmt(x: float, spec: str) -> str:
        return "" if x != x else format(x, spec)

    for r in rows:
        cells = [r.case, r.impl + (f" ({r.note})" if r.note else ""), fmt(r.ms, ".4f"),
                 fmt(r.gbps, ".0f"), fmt(r.tflops, ".1f"), fmt(r.floor_ms, ".4f"),
                 fmt(r.floor_ratio, ".2f")]
        if baseline_impl:
            base = baseline.get(r.case)
            cells.append(fmt(base / r.ms, ".2f") + "x" if base else "")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text, flush=True)
    if csv_path:
        os.makedirs(os.path.dirname(csv_path) or ".", exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["case", "impl", "ms", "gbps", "tflops", "floor_ms", "floor_ratio", "note"])
            for r in rows:
                w.writerow([r.case, r.impl, r.ms, r.gbps, r.tflops, r.floor_ms, r.floor_ratio, r.note])
    return text


def append_csv(path: str, columns: list, line: list) -> None:
    """Append ``line`` to the CSV at ``path``, writing ``columns`` first if it is new."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(columns)
        w.writerow(line)


def write_csv(name: str, columns: list, rows: list) -> str:
    """``rows`` (dicts) as ``out_dir()/name`` with ``columns``; returns the path."""
    path = os.path.join(out_dir(), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def out_dir() -> str:
    """Where CSVs go: ``$COMPILEOPS_BENCH_OUT`` when set, else benchmarks/out."""
    return (os.environ.get("COMPILEOPS_BENCH_OUT")
            or os.path.join(os.path.dirname(__file__), "out"))


def stop_process_group(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Ends ``proc`` (started with ``start_new_session=True``) and every process it started
    (compile workers, torchrun's worker): with ``grace_s`` > 0, SIGTERM and that long for
    ``proc`` to exit first; then SIGKILL to the whole group, which also ends a process of it
    that outlived ``proc``."""
    if grace_s > 0:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
