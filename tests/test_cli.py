"""What a user sees from the command line: ``python -m compileops`` and every example answer
``--help`` with help (and run nothing), refuse ``--device cuda`` on a machine without CUDA
with a one-line error rather than a traceback, and the self-check prints eager and compiled
times with their spread but no speed ratio (on a shared CPU it flipped between runs: "33x
slower", then "no difference"), warning when the machine is loaded."""
import pathlib
import re
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


def _result(eager, compiled):
    return _selfcheck.DemoResult(
        family="demo", graph_breaks=0, frames_compiled=1, sizes_tried=3,
        op_status={"embedding": "lowered, fused into cpp_fused_embedding"},
        relative_error=0.0, error_ok=True, eager=eager, compiled=compiled)


def test_report_gives_times_and_spreads_but_no_speed_ratio():
    """Spreads that do not overlap either way (the loaded first run's 0.8 against 28 ms, and
    the reverse): the report shows both times and their spread, never an "N x" verdict."""
    T = _selfcheck.Timing
    cases = [(T(0.782, 0.585, 0.914, 29), T(28.083, 23.807, 44.160, 29)),
             (T(2.0, 1.9, 2.1, 50), T(1.0, 0.95, 1.05, 50))]
    for eager, compiled in cases:
        text = _selfcheck.format_result(_result(eager, compiled), 1e-5)
        assert f"eager {eager}, compiled {compiled}" in text, text
        assert "not a speed comparison" in text, text
        for verdict in ("faster", "slower", "difference"):
            assert verdict not in text, text
        assert re.search(r"\d\s*x\b", text) is None, text


def test_load_note_only_when_the_machine_runs_more_than_it_has_cpus():
    assert _selfcheck.load_note(None, 2) == ""
    assert _selfcheck.load_note(1.9, 2) == ""
    note = _selfcheck.load_note(8.2, 2)
    assert note.startswith("load average 8.2 on 2 CPU(s)") and "vary from run to run" in note


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
