"""The GPU benchmark script's --smoke mode runs every code path at tiny sizes on CPU."""
import csv
import os
import sys


def test_benchmark_smoke(tmp_path, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.syspath_prepend(root)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_grouped_linear.py", "--smoke"])
    from benchmarks import bench_grouped_linear

    assert bench_grouped_linear.main(["--smoke", "--splits", "skewed"]) == 0
    with open(tmp_path / "grouped_linear.csv") as f:
        rows = list(csv.DictReader(f))
    impls = {(r["case"].split()[-1], r["impl"]) for r in rows}
    for stage in ("fwd", "dX", "dW", "gl+bias+swiglu"):
        assert any(s == stage and impl.startswith("compileops") for s, impl in impls), stage
