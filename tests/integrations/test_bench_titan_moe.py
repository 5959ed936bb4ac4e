"""benchmarks/train_titan_moe.py's reading of torchtitan's log and its table, without a GPU
(the runs themselves need one: torchtitan's trainer on CUDA)."""
from __future__ import annotations

import pytest

from benchmarks import train_titan_moe as bench

# torchtitan 0.2.2's per-step line (components/metrics.py), colours off, and with colours.
LOG = """[titan] 2026-12-01 10:00:01,000 - root - INFO - step:  1  loss: 10.41235  grad_norm:  3.2100  memory: 41.20GiB(29.03%)  tps: 1,000  tflops: 10.00  mfu: 1.01%
[titan] 2026-12-01 10:00:02,000 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  9.00000  \x1b[33mgrad_norm:  3.0000  \x1b[36mmemory: 43.50GiB(30.60%)  \x1b[34mtps: 30,000  \x1b[36mtflops: 300.00  \x1b[35mmfu: 30.30%\x1b[39m
[titan] 2026-12-01 10:00:03,000 - root - INFO - validate step:  2  loss:  9.5000  memory: 43.50GiB(30.60%)  tps: 9,999
[titan] 2026-12-01 10:00:03,500 - root - INFO - step:  3  loss:  8.00000  grad_norm:  2.0000  memory: 43.00GiB(30.00%)  tps: 32,000  tflops: 320.00  mfu: 32.32%
"""


def test_parse_log_reads_every_training_step():
    rows = bench.parse_log(LOG)
    assert rows == [
        {"step": 1, "loss": 10.41235, "memory_gib": 41.2, "tps": 1000.0},
        {"step": 2, "loss": 9.0, "memory_gib": 43.5, "tps": 30000.0},
        {"step": 3, "loss": 8.0, "memory_gib": 43.0, "tps": 32000.0},
    ]


def test_summary_leaves_out_the_warmup_steps():
    s = bench.summarize(bench.parse_log(LOG), tokens_per_step=16384, warmup=1)
    assert s["tokens_per_s"] == 31000.0  # the median of steps 2 and 3
    assert s["step_ms"] == pytest.approx(1000 * 16384 / 31000)
    assert s["peak_memory_gib"] == 43.5
    assert s["final50_loss"] == pytest.approx((10.41235 + 9 + 8) / 3)


def test_estimate_counts_the_experts_flops():
    # Qwen3-30B-A3B experts, 1 layer, 1 step of 1000 tokens at 1 TFLOP/s, no compile:
    # 6 * 1000 tokens * 8 experts * 3 GEMMs * 2048 * 768 FLOPs, plus 10%
    s = bench.estimate_s("qwen3-30b-a3b-experts", 1, 1, 1000, 1.0, 0.0)
    assert s == pytest.approx(1.1 * 6 * 1000 * 8 * 3 * 2048 * 768 / 1e12)


def test_estimate_mode_runs_nothing(capsys):
    assert bench.main(["--estimate", "--steps", "300"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b-experts" in out and "dsv3-experts" in out and "8 runs" in out


def test_a_run_past_its_time_limit_is_stopped_with_every_process_it_started(tmp_path):
    # The child starts a grandchild (as torchrun starts its worker) and both would sleep
    # for a minute: the run returns None at the limit, and the grandchild is gone too.
    import os
    import sys
    import time

    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.time()
    code = bench.run_logged([sys.executable, "-c", script], dict(os.environ),
                            tmp_path / "run.log", timeout=3)
    assert code is None
    assert time.time() - start < 30
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the grandchild outlived its run")


def test_a_finished_run_returns_its_exit_code(tmp_path):
    import os
    import sys

    log = tmp_path / "run.log"
    assert bench.run_logged([sys.executable, "-c", "print('step'); raise SystemExit(3)"],
                            dict(os.environ), log, timeout=60) == 3
    assert log.read_text().strip() == "step"


def test_tables_rebuild_from_run_logs(tmp_path):
    for impl, tps in (("titan-bf16", "1,000"), ("compileops-bf16", "1,500")):
        text = "\n".join(
            f"[titan] - root - INFO - step: {i}  loss: {10 - i / 100:.5f}  grad_norm:  1.0  "
            f"memory: 20.00GiB(14.00%)  tps: {tps}  tflops: 1.00  mfu: 0.10%"
            for i in range(1, 61))
        (tmp_path / f"qwen3-30b-a3b-experts-{impl}.log").write_text(text)
    out = tmp_path / "out"
    logs = sorted(str(p) for p in tmp_path.glob("*.log"))[::-1]  # titan-bf16 first
    assert bench.main(["--from-logs", *logs, "--out", str(out)]) == 0
    table = (out / "titan_moe.md").read_text()
    row = next(line for line in table.splitlines() if "| compileops-bf16 |" in line)
    assert "| 1.500x |" in row and "| 60 |" in row


def test_command_runs_one_process_per_gpu_with_the_expert_parallel_degree(tmp_path):
    import argparse

    args = argparse.Namespace(gpus=4, ep=2, steps=10, batch=2, seq=128,
                              param_dtype="float32")
    cmd = bench.command("qwen3-30b-a3b-experts", "compileops-bf16", args, tmp_path)
    assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert cmd[cmd.index("--parallelism.expert_parallel_degree") + 1] == "2"
    assert cmd[-2:] == ["--model.converters", "compileops_moe"]


@pytest.mark.parametrize("gpus, ep", [(4, 3), (2, 0), (0, 1)])
def test_an_expert_parallel_degree_that_does_not_divide_the_gpus_is_refused(gpus, ep, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--gpus", str(gpus), "--ep", str(ep), "--estimate"])
    assert "must divide" in capsys.readouterr().err
