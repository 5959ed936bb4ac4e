"""What a user sees from the command line: ``python -m compileops`` and every example answer
``--help`` with help (and run nothing), refuse ``--device cuda`` on a machine without CUDA
with a one-line error rather than a traceback, and the self-check prints a speed ratio only
when it is outside the measured spread."""
import pathlib
import subprocess
import sys

import pytest
import torch

from compileops import _selfcheck

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_selfcheck_help_is_written_for_users():
    proc = _run("-m", "compileops", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m compileops")
    # No internals: Sphinx roles, module paths or private names.
    for internal in (":data:", ":func:", "FAMILY_DEMOS", "selfcheck.py", "_demo"):
        assert internal not in proc.stdout, internal
    assert "--device" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("script", ["-m compileops"] + [str(p.relative_to(ROOT))
                                                        for p in EXAMPLES
                                                        if "--device" in p.read_text()])
def test_device_cuda_without_cuda_is_a_clear_error(script):
    proc = _run(*script.split(), "--device", "cuda")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "CUDA is not available" in proc.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_help_prints_help_and_runs_nothing(example):
    proc = _run(str(example), "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]
    # The first docstring paragraph is the description.
    assert len(proc.stdout.splitlines()) >= 3


def test_speed_ratio_only_outside_the_spread():
    T = _selfcheck.Timing
    assert _selfcheck.speed_verdict(T(2.0, 1.9, 2.1, 50), T(1.0, 0.95, 1.05, 50)) == \
        "compiled 2.00x faster"
    assert _selfcheck.speed_verdict(T(1.0, 0.95, 1.05, 50), T(4.0, 3.0, 5.0, 50)) == \
        "compiled 4.00x slower"
    # Overlapping interquartile ranges: no ratio at all.
    verdict = _selfcheck.speed_verdict(T(1.0, 0.5, 3.0, 50), T(2.0, 1.0, 40.0, 50))
    assert "faster" not in verdict and "slower" not in verdict and "spread" in verdict


def test_timing_takes_warmup_and_alternates_calls():
    calls = []
    eager, compiled = _selfcheck._time_pair(lambda: calls.append("e"), lambda: calls.append("c"),
                                            torch.device("cpu"), warmup=2, min_runs=5,
                                            budget_s=0.0)
    assert calls == ["e", "c"] * 7
    assert eager.runs == compiled.runs == 5
    assert eager.low_ms <= eager.median_ms <= eager.high_ms


def test_moe_example_runs_the_fp8_training_setup():
    """``examples/moe_layer.py --fp8 rowwise --fp8-fast-accum --cache-fp8-weights`` compiles
    the layer with the fp8 ops, trains a step at two token counts with compiled matching
    eager, and refuses the fp8 options without ``--fp8``."""
    example = str(ROOT / "examples" / "moe_layer.py")
    proc = _run(example, "--fp8", "rowwise", "--fp8-fast-accum", "--cache-fp8-weights",
                timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grouped_linear_row_scaled_fp8" in proc.stdout, proc.stdout
    errors = [float(line.rsplit("=", 1)[1]) for line in proc.stdout.splitlines()
              if "max |compiled - eager|" in line]
    assert len(errors) == 2 and max(errors) < 1e-5, proc.stdout
    proc = _run(example, "--fp8-fast-accum", timeout=60)
    assert proc.returncode == 2 and "need --fp8" in proc.stderr, proc.stderr
