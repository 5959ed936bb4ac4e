"""benchmarks/bench_xlstm_block.py runs its --tiny smoke test on CPU (a subprocess: tests never
import ``benchmarks/``) and writes a row per implementation it can run."""
import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", minversion="5.7")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_smoke_run_writes_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # reference backend
    env.update(COMPILEOPS_BENCH_OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_xlstm_block.py"), "--device",
         "cpu", "--tiny", "--impls", "compileops", "floor", "--modes", "static", "eager"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "| shape | mode | impl | fw+bw ms | peak GiB | vs xl_chunk | status |" in proc.stdout
    with open(tmp_path / "xlstm_block.csv") as f:
        rows = list(csv.DictReader(f))
    ok = {(r["impl"], r["mode"]) for r in rows if r["status"] == "ok"}
    assert ok == {(impl, mode) for impl in ("compileops", "floor")
                  for mode in ("static", "eager")}, rows
    assert all(float(r["ms"]) > 0 for r in rows)
