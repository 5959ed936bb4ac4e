"""The self-check report behind ``python -m compileops``.

Each op family contributes a small demo (``compileops/<family>/selfcheck.py`` exposing
``demo(device) -> Demo``, the dataclass in ``compileops/_demo.py``), imported here and listed in
:data:`FAMILY_DEMOS`; the families never import this module. For each demo the report
compiles the model with ``fullgraph=True`` and prints graph breaks, recompiles over several
sizes under ``dynamic=True``, for every compileops op whether Inductor lowered it and which
kernel it fused into, the error against the reference, and eager and compiled time.

The times are of tiny demo inputs and come with their spread, but with no "compiled is N x
faster" verdict: at these sizes the ratio says more about the machine than about the code.
On 2 CPUs shared with other processes (load average 8), the embedding demo's compiled call
(an Inductor C++ kernel whose OpenMP threads wait for a free core) took 20-30 ms where it
takes 0.07 ms, so two runs of the same code read "35.90x slower" and "no difference". The
report warns when the machine is loaded (:func:`load_note`); ``benchmarks/`` measures speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import time
from types import ModuleType
from typing import Any, Callable, Sequence

import torch

from compileops._demo import Demo
from compileops._version import __version__
from compileops.embedding import selfcheck as embedding_demo
from compileops.grouped_linear import selfcheck as grouped_linear_demo
from compileops.mlstm import selfcheck as mlstm_demo
from compileops.xtoken import selfcheck as xtoken_demo

# One module per family, each with demo(device) -> Demo; later families append theirs.
FAMILY_DEMOS: list[ModuleType] = [embedding_demo, xtoken_demo, grouped_linear_demo, mlstm_demo]


@dataclasses.dataclass
class DemoResult:
    family: str
    graph_breaks: int
    frames_compiled: int
    sizes_tried: int
    op_status: dict[str, str]
    relative_error: float
    error_ok: bool
    eager: Timing
    compiled: Timing


@dataclasses.dataclass
class Timing:
    """Wall-clock time of one call, over ``runs`` calls after warm-up: the median and the
    interquartile range, in milliseconds."""
    median_ms: float
    low_ms: float  # 25th percentile
    high_ms: float  # 75th percentile
    runs: int

    def __str__(self) -> str:
        return f"{self.median_ms:.3f} ms [{self.low_ms:.3f}-{self.high_ms:.3f}]"


def _time_pair(eager_fn: Callable[[], Any], compiled_fn: Callable[[], Any],
               device: torch.device, *, warmup: int = 3, min_runs: int = 20,
               max_runs: int = 2000, budget_s: float = 1.0) -> tuple[Timing, Timing]:
    """Time two callables, alternating calls so that whatever else the machine is doing
    weighs on both alike: ``warmup`` calls of each first (compiles, autotuning, allocator
    growth), then at least ``min_runs`` calls of each, more until ``budget_s`` has passed."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e3

    for _ in range(warmup):
        eager_fn()
        compiled_fn()
    sync()
    samples: tuple[list[float], list[float]] = ([], [])
    deadline = time.perf_counter() + budget_s
    while len(samples[0]) < min_runs or (time.perf_counter() < deadline
                                         and len(samples[0]) < max_runs):
        samples[0].append(timed(eager_fn))
        samples[1].append(timed(compiled_fn))

    def summary(values: list[float]) -> Timing:
        low, median, high = statistics.quantiles(values, n=4)
        return Timing(median, low, high, len(values))

    return summary(samples[0]), summary(samples[1])


def load_note(load: float | None, cpus: int) -> str:
    """A warning for the report when the machine runs more than it has CPUs (``load``: the
    1-minute load average, None where the platform has none): the times then move with
    the other processes from run to run. ``""`` otherwise."""
    if load is None or load <= cpus:
        return ""
    return (f"load average {load:.1f} on {cpus} CPU(s): other processes share this machine, "
            "so the times below vary from run to run")


def _machine_load() -> tuple[float | None, int]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        return os.getloadavg()[0], cpus or 1
    except (AttributeError, OSError):  # no load average on this platform
        return None, cpus or 1


_KERNEL_NAME = re.compile(r"\b((?:cpp|triton)_\w+?)(?:_\d+)?\b")


def _op_status(op: str, all_ops: Sequence[str], sources: Sequence[str]) -> str:
    """How Inductor compiled ``compileops::op``: an extern call, or which kernel(s) hold it."""
    code = "\n".join(sources)
    if re.search(rf"torch\.ops\.compileops\.{op}\.default\(", code):
        return "extern call (runs our op as is; not lowered)"
    # Kernel names list their origin ops; drop longer op names that contain this one
    # (embedding_backward contains embedding) before looking for it.
    longer = [o for o in all_ops if o != op and op in o]

    def holds_op(kernel: str) -> bool:
        for other in longer:
            kernel = kernel.replace(other, "")
        return re.search(rf"_{op}(_|$)", kernel) is not None

    kernels = sorted({k for k in _KERNEL_NAME.findall(code) if holds_op(k)})
    if kernels:
        return "lowered, fused into " + ", ".join(kernels)
    return "not found in the compiled code"


def run_demo(demo: Demo, device: torch.device) -> DemoResult:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from compileops.lowerings import _compat

    torch._dynamo.reset()
    counters.clear()
    # Graph breaks and recompiles: dynamic shapes over several token counts.
    counter = CompileCounterWithBackend("inductor")
    dyn = torch.compile(demo.model, backend=counter, dynamic=True)
    sizes = (3, 5, 8)
    for n in sizes:
        dyn(*demo.resized_args(n))
    graph_breaks = sum(counters["graph_break"].values())
    graphs_compiled = counters["stats"]["unique_graphs"]

    # Lowering status, forward and backward, from the generated code.
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache():
        compiled = torch.compile(demo.model, fullgraph=True)

        def fw_bw():
            out = compiled(*demo.args)
            if out.requires_grad:
                out.float().sum().backward()
            return out

        out, sources = _compat.run_and_get_code(fw_bw)
    status = {op: _op_status(op, demo.ops, sources) for op in demo.ops}

    from compileops.testing import error_report

    expected = demo.reference(*demo.args)
    report = error_report(out.detach(), expected)
    with torch.no_grad():
        eager, compiled_time = _time_pair(lambda: demo.model(*demo.args),
                                          lambda: compiled(*demo.args), device)
    return DemoResult(
        family=demo.family,
        graph_breaks=graph_breaks,
        # Graphs, not backend calls: Dynamo restarting a trace once (it does so to specialise a
        # float argument such as eps under dynamic=True) calls the backend twice for one graph.
        frames_compiled=graphs_compiled,
        sizes_tried=len(sizes),
        op_status=status,
        relative_error=report.relative_error,
        error_ok=report.relative_error <= demo.max_relative_error,
        eager=eager,
        compiled=compiled_time,
    )


def format_result(r: DemoResult, max_rel: float) -> str:
    lines = [
        f"== {r.family} ==",
        f"  graph breaks:      {r.graph_breaks}",
        f"  frames compiled:   {r.frames_compiled} over {r.sizes_tried} token counts "
        f"(dynamic=True; 1 means no recompiles)",
    ]
    for op, status in r.op_status.items():
        lines.append(f"  compileops::{op}: {status}")
    verdict = "ok" if r.error_ok else "TOO LARGE"
    lines += [
        f"  error vs reference: {r.relative_error:.2e} relative (allowed {max_rel:.0e}) {verdict}",
        f"  time per call, median [interquartile range] of {r.eager.runs} calls each, "
        f"after warm-up (tiny inputs: not a speed comparison):",
        f"    eager {r.eager}, compiled {r.compiled}",
    ]
    return "\n".join(lines)


_DESCRIPTION = """\
Check that compileops works on this machine. For each op family (embedding, cross-tokenizer
distillation, grouped linear, mLSTM) a small model is compiled with torch.compile and run,
forward and backward. The report shows, per family: graph breaks (should be 0); how many
graphs were compiled over several input sizes with dynamic=True (1 means no recompiles);
how Inductor compiled each compileops op (fused into a generated kernel, or called as is);
the error against the plain-PyTorch reference; and the time per call, eager and compiled
(tiny inputs: they show that both paths run, not which is faster). Exits with status 1 if
any family fails."""


def _device(text: str) -> torch.device:
    """argparse type for --device: a valid torch device that exists on this machine."""
    try:
        device = torch.device(text)
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} ({err})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                "CUDA is not available on this machine (torch "
                f"{torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text}: the self-check runs on cpu or cuda")
    return device


def main(argv: Sequence[str] | None = None) -> int:
    from compileops import backends

    parser = argparse.ArgumentParser(prog="python -m compileops", description=_DESCRIPTION)
    parser.add_argument("--device", type=_device,
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    args = parser.parse_args(argv)
    device = args.device
    print(f"compileops {__version__} | torch {torch.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"eager backend on {device.type}: {backends.select('selfcheck', device)}")
    note = load_note(*_machine_load())
    if note:
        print(note)
    failures = 0
    for family_demo in FAMILY_DEMOS:
        demo = family_demo.demo(device)
        result = run_demo(demo, device)
        print(format_result(result, demo.max_relative_error))
        healthy = (
            result.graph_breaks == 0
            and result.frames_compiled == 1
            and result.error_ok
            and all(not s.startswith("not found") for s in result.op_status.values())
        )
        failures += not healthy
    print("self-check: " + ("all families healthy" if not failures else f"{failures} family(ies) FAILED"))
    return 1 if failures else 0
