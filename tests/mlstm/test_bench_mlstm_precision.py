"""benchmarks/bench_mlstm_precision.py: its --tiny dry run on the CPU (a subprocess: the script
sets TRITON_INTERPRET itself) prints the table and appends one CSV row per form, length, gate
distribution and norm; its gate distributions are the precision tests'."""
import csv
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.bench_mlstm_precision import CSV_COLUMNS, GATES  # noqa: E402
from tests.mlstm.test_precision import GATE_IDS, GATES as TEST_GATES  # noqa: E402


def test_gate_distributions_are_the_precision_tests():
    assert GATES == dict(zip(GATE_IDS, TEST_GATES))


def test_tiny_dry_run_writes_a_row_per_case(tmp_path):
    out = tmp_path / "precision.csv"
    env = {k: v for k, v in os.environ.items() if k != "COMPILEOPS_BENCH_OUT"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_mlstm_precision.py"),
         "--device", "cpu", "--tiny", "--seqs", "32", "--gates", "ig0_fg-1", "--csv",
         str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| form | S | B | gates | norm | out | dq | dk | dv | digate | dfgate | dweight |" \
        in run.stdout, run.stdout
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_COLUMNS
    assert sorted((r["form"], r["norm"]) for r in rows) == [
        ("chunkwise", "normed"), ("chunkwise", "raw"), ("parallel", "normed"),
        ("parallel", "raw")]
    for r in rows:
        assert r["S"] == "32" and r["gates"] == "ig0_fg-1", r
        names = ["out", "dq", "dk", "dv", "digate", "dfgate"] + (
            ["dweight"] if r["norm"] == "normed" else [])
        # bf16 against fp64: small, but not zero (a row of zeros would pass a bound).
        assert all(0 < float(r[n]) < 0.1 and math.isfinite(float(r[n])) for n in names), r
        assert r["dweight"] == "" or r["norm"] == "normed"
