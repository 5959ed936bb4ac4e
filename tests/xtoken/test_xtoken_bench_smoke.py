"""The GPU benchmark script's --smoke mode runs every code path at tiny sizes on CPU."""
import csv
import os
import sys


def test_benchmark_smoke(tmp_path, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.syspath_prepend(root)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_xtoken.py", "--smoke"])
    from benchmarks import bench_xtoken

    assert bench_xtoken.main(["--smoke"]) == 0  # nonzero: a correctness check failed
    with open(tmp_path / "bench_xtoken.csv") as f:
        rows = list(csv.DictReader(f))
    impls = {r["impl"] for r in rows}
    for impl in ("compileops chunk_sums", "compileops chunk_average", "compileops project",
                 "compileops project backward", "one-hot bmm", "torch.sparse.mm"):
        assert impl in impls, (impl, impls)
    assert all(r["ms"] not in ("", "nan") for r in rows if r["impl"].startswith("compileops"))
