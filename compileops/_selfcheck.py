"""The self-check report behind ``python -m compileops``.

Each op family contributes a small demo (``compileops/<family>/selfcheck.py`` exposing
``demo(device) -> Demo``, the dataclass in ``compileops/_demo.py``), imported here and listed in
:data:`FAMILY_DEMOS`; the families never import this module. For each demo the report
compiles the model with ``fullgraph=True`` and prints graph breaks, recompiles over several
sizes under ``dynamic=True``, for every compileops op whether Inductor lowered it and which
kernel it fused into, the error against the reference, and eager vs compiled time.
"""
from __future__ import annotations

import dataclasses
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
    eager_ms: float
    compiled_ms: float


def _time_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 10) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


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
        eager_ms = _time_ms(lambda: demo.model(*demo.args), device)
        compiled_ms = _time_ms(lambda: compiled(*demo.args), device)
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
        eager_ms=eager_ms,
        compiled_ms=compiled_ms,
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
        f"  eager {r.eager_ms:.3f} ms, compiled {r.compiled_ms:.3f} ms "
        f"({r.eager_ms / r.compiled_ms:.2f}x)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from compileops import backends

    parser = argparse.ArgumentParser(prog="python -m compileops", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print(f"compileops {__version__} | torch {torch.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"eager backend on {device.type}: {backends.select('selfcheck', device)}")
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
