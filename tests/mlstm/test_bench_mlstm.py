"""benchmarks/bench_mlstm.py's CSV rows name what was run: raw h and a non-default head shape
(rows of xLSTM-7B's head were otherwise indistinguishable from the default head's)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_mlstm import impl_suffix  # noqa: E402


def test_csv_impl_names_raw_h_and_the_head_shape():
    default = dict(raw=False, heads=16, dqk=128, dv=256)
    assert impl_suffix(default) == ""
    assert impl_suffix(dict(default, raw=True)) == " (raw h)"
    assert impl_suffix(dict(default, heads=8, dqk=256, dv=512)) == " (NH 8, DQK 256, DV 512)"
    assert impl_suffix(dict(raw=True, heads=16, dqk=128, dv=512)) == \
        " (raw h) (NH 16, DQK 128, DV 512)"


def test_state_walk_sweep_dry_run_on_the_cpu():
    """benchmarks/tuning/sweep_mlstm_states.py --device cpu --tiny: every grid config of both
    walks runs under the interpreter and agrees with the default (a subprocess: the sweep
    sets TRITON_INTERPRET itself)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "tuning", "sweep_mlstm_states.py"),
         "--device", "cpu", "--tiny"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    tables = [line for line in run.stdout.splitlines() if line.startswith("## ")]
    assert [t.split(",")[0] for t in tables] == ["## states", "## grads"], run.stdout
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "|---" not in
            line and "block_v" not in line]
    assert len(rows) == 4, run.stdout
    assert not any("MISMATCH" in r or "Error" in r for r in rows), run.stdout
