"""benchmarks/train_moe_fp8.py (the fp8 convergence run) runs its smoke test on CPU (a
subprocess: tests never import ``benchmarks/``): bf16 and rowwise fp8 train the same model from
the same weights on the same bytes, every step's loss and gradient norm are written, finite,
and the two runs' first losses agree to fp8's error; fp8 dW changes the first gradients; the
SVG of the curves is written."""
import csv
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_run_trains_every_recipe_asked_for(tmp_path):
    env = dict(os.environ, COMPILEOPS_BENCH_OUT=str(tmp_path),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "train_moe_fp8.py"), "--device", "cpu",
         "--smoke", "--steps", "2", "--recipes", "none", "rowwise", "rowwise-fast",
         "rowwise-fast-dw", "--no-compile"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "fp8 rowwise vs bf16: last-50 training loss" in proc.stdout, proc.stdout
    with open(tmp_path / "moe_fp8_convergence.csv") as f:
        rows = list(csv.DictReader(f))
    losses, grad_norms = {}, {}
    for r in rows:
        losses.setdefault(r["recipe"], []).append(float(r["loss"]))
        grad_norms.setdefault(r["recipe"], []).append(float(r["grad_norm"]))
    assert set(losses) == {"bf16", "fp8 rowwise", "fp8 rowwise-fast", "fp8 rowwise-fast-dw"}
    assert all(len(v) == 2 and all(math.isfinite(x) for x in v) for v in losses.values())
    # Same weights and bytes: the first step's losses differ by fp8's rounding only (the
    # loss of a uniform guess over 256 bytes is ln 256 = 5.55).
    assert abs(losses["bf16"][0] - losses["fp8 rowwise"][0]) < 0.05, losses
    # dW in e4m3 changes the first gradients, not the first loss. (Not the second loss
    # either, reliably: AdamW's first update is about lr * sign(gradient), which fp8's
    # rounding rarely flips.)
    assert losses["fp8 rowwise-fast-dw"][0] == losses["fp8 rowwise-fast"][0], losses
    assert all(len(v) == 2 and all(math.isfinite(x) and x > 0 for x in v)
               for v in grad_norms.values()), grad_norms
    assert grad_norms["fp8 rowwise-fast-dw"][0] != grad_norms["fp8 rowwise-fast"][0], grad_norms
    assert (tmp_path / "moe_fp8_convergence.svg").read_text().startswith("<svg")
