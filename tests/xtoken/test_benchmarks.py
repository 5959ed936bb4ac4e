"""The GPU benchmark script's --smoke mode runs every code path at tiny sizes on CPU.

The script runs in a subprocess, as a user runs it: tests never import ``benchmarks/``.
"""
import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_xtoken.py")


def test_benchmark_smoke(tmp_path):
    env = dict(os.environ, COMPILEOPS_BENCH_OUT=str(tmp_path), TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, SCRIPT, "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    # exit code 1: a correctness check failed; 2: the script refused to run.
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    with open(tmp_path / "bench_xtoken.csv") as f:
        rows = list(csv.DictReader(f))
    impls = {r["impl"] for r in rows}
    for impl in ("compileops chunk_sums", "compileops chunk_average", "compileops project",
                 "compileops project backward", "one-hot bmm", "torch.sparse.mm"):
        assert impl in impls, (impl, impls)
    assert all(r["ms"] not in ("", "nan") for r in rows if r["impl"].startswith("compileops"))
