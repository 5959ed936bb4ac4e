"""benchmarks/bench_xlstm_hf.py runs its --tiny smoke test on CPU (a subprocess: tests never
import ``benchmarks/``) and writes a row per implementation and case."""
import csv
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", minversion="5.7")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_smoke_run_writes_every_case(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # reference backend
    env.update(COMPILEOPS_BENCH_OUT=str(tmp_path), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_xlstm_hf.py"), "--device", "cpu",
         "--tiny", "--warmup", "0", "--iters", "1"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "| case | impl | ms | tokens/s | speed-up vs native | status |" in proc.stdout
    assert "check compileops vs native: prefill logits relative L2" in proc.stdout
    with open(tmp_path / "xlstm_hf.csv") as f:
        rows = list(csv.DictReader(f))
    cases = {(r["impl"], r["case"]) for r in rows if r["status"] == "ok"}
    for impl in ("native", "compileops"):
        for case in ("prefill S=64", "decode B=1", "decode B=4"):
            assert (impl, case) in cases, (impl, case, rows)
