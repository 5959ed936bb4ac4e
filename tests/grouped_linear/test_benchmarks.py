"""The grouped linear benchmark scripts, run in subprocesses (tests never import
``benchmarks/``): the benchmark's --smoke mode runs every code path at tiny sizes on CPU; the
tuning sweep lists its configs with distinct labels and the configs other tests build; the
probe parses its command line."""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from compileops.grouped_linear import kernels
from compileops.grouped_linear.kernels.kjagged import check_wgrad_variant
from tests.grouped_linear._helpers import (
    MJAGGED_STORE_VARIANTS,
    ROOT,
    mjagged_store_config,
    sweep_configs,
    sweep_listing,
)


def run_script(path, *args, env=None, returncode=0):
    """The script's stdout (its stderr where it must fail with ``returncode``)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, path), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == returncode, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout if returncode == 0 else proc.stderr


def test_moe_layer_benchmark_fp8_smoke(tmp_path):
    """--fp8 rowwise with fp8 layers named in --impls runs those (the torchao one needs CUDA:
    said, not run); --fp8-fast-accum reaches the label; the cached layer with fp8 dW."""
    out = run_script("benchmarks/bench_moe_layer.py", "--smoke", "--modes", "static",
                     "--routing", "skewed", "--impls", "grouped_mm", "compileops-fp8-cached-dw",
                     "torchao-fp8", "--fp8", "rowwise", "--fp8-fast-accum",
                     env=dict(os.environ, COMPILEOPS_BENCH_OUT=str(tmp_path)))
    with open(tmp_path / "moe_layer.csv") as f:
        rows = list(csv.DictReader(f))
    cached_label = "compileops-fp8-cached-dw (rowwise, fast accum)"
    assert {r["impl"] for r in rows} == {"grouped_mm", cached_label}
    assert all(not r["note"].startswith("failed") for r in rows), rows
    cached = next(r for r in rows if r["impl"] == cached_label)
    assert "fp8 weight copies" in cached["note"], cached  # the memory they hold, reported
    assert "torchao-fp8: not run" in out


def test_moe_layer_benchmark_fp8_alone_adds_both_fp8_layers():
    """--fp8 adds the compileops and torchao fp8 layers to --impls that name none."""
    import benchmarks.bench_moe_layer as bench

    assert bench.fp8_impls(["grouped_mm", "compileops"], "rowwise") == [
        "grouped_mm", "compileops", "compileops-fp8", "torchao-fp8"]
    assert bench.fp8_impls(["grouped_mm", "compileops-fp8-cached"], "rowwise") == [
        "grouped_mm", "compileops-fp8-cached"]
    assert bench.fp8_impls(["grouped_mm"], None) == ["grouped_mm"]


# The torchao fp8 layer with torchao's GEMM replaced by torch._grouped_mm: the padding to
# 16-row groups and the gather back must give the grouped_mm layer exactly.
_PADDED_LAYER_CHECK = """
import sys, types, torch
fake = types.ModuleType("fp8_grouped_mm")
fake._to_fp8_rowwise_then_scaled_grouped_mm = (
    lambda a, b, offs, pad_token_groups_for_grouped_mm: torch._grouped_mm(a, b, offs=offs))
for name in ("torchao", "torchao.prototype", "torchao.prototype.moe_training"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["torchao.prototype.moe_training.fp8_grouped_mm"] = fake
from benchmarks.bench_moe_layer import SMOKE_SHAPES, MoELayer, set_routing
shape = SMOKE_SHAPES["tiny"]
plain, padded = (MoELayer(shape, impl, 0.0, "cpu") for impl in ("grouped_mm", "torchao-fp8"))
for routing in ("uniform", "skewed"):
    set_routing(plain, routing)
    set_routing(padded, routing)
    x = torch.randn(shape.tokens, shape.dim).bfloat16()
    a, b = plain(x), padded(x)
    dy = torch.randn_like(a)
    ga = torch.autograd.grad(a, [plain.gate_up, plain.down], dy)
    gb = torch.autograd.grad(b, [padded.gate_up, padded.down], dy)
    assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(ga, gb)), routing
print("ok")
"""


def run_check(code):
    """``code`` in a fresh interpreter at the repository root (tests never import
    ``benchmarks/``); it must print "ok" last."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_moe_layer_benchmark_torchao_padding_is_exact():
    run_check(_PADDED_LAYER_CHECK)


def test_fp8_sweep_smoke():
    """sweep_grouped_linear_fp8.py --smoke: every pass and scaling at a tiny layer on CPU, each
    config's product checked against bf16's."""
    out = run_script("benchmarks/tuning/sweep_grouped_linear_fp8.py", "--smoke")
    lines = [line for line in out.splitlines() if line.strip().startswith(("rowwise ", "blockwise "))]
    assert len(lines) == 3 * 2 * 2, out  # 3 products x 2 scalings x (default + 1 config)
    assert all(line.rstrip().endswith("ok") for line in lines), out
    listed = run_script("benchmarks/tuning/sweep_grouped_linear_fp8.py", "--list-configs")
    assert len(set(json.loads(listed))) == len(json.loads(listed)) > 1


def test_benchmark_smoke(tmp_path):
    run_script("benchmarks/bench_grouped_linear.py", "--smoke", "--splits", "skewed",
               env=dict(os.environ, COMPILEOPS_BENCH_OUT=str(tmp_path)))
    with open(tmp_path / "grouped_linear.csv") as f:
        rows = list(csv.DictReader(f))
    impls = {(r["case"].split()[-1], r["impl"]) for r in rows}
    for stage in ("fwd", "dX", "dW", "gl+bias+swiglu"):
        assert any(s == stage and impl.startswith("compileops") for s, impl in impls), stage


def test_moe_layer_benchmark_smoke(tmp_path):
    """bench_moe_layer.py --smoke: the layer compiled and timed on CPU at a tiny shape, both
    routings; every row carries the device's name and a peak column, in the CSV and in the
    markdown table."""
    out = run_script("benchmarks/bench_moe_layer.py", "--smoke", "--modes", "static",
                     "--impls", "grouped_mm", "compileops",
                     env=dict(os.environ, COMPILEOPS_BENCH_OUT=str(tmp_path)))
    with open(tmp_path / "moe_layer.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["routing"], r["impl"]) for r in rows} == {
        (routing, impl) for routing in ("uniform", "skewed") for impl in ("grouped_mm", "compileops")}
    for r in rows:
        assert r["device"] == "CPU (Triton interpreter, smoke)", r
        assert float(r["fw_ms"]) > 0 and float(r["fwbw_ms"]) > 0, r
        assert "peak_gib" in r and not r["note"].startswith("failed"), r
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| device | shape | routing | mode | impl |"), table[0]
    assert "peak GiB" in table[0] and len(table) == 1 + len(rows), table


def test_moe_layer_benchmark_user_forms_smoke(tmp_path):
    """The layers users write (the probability as a product, gate and up as two weights,
    written out or as the pair) compile, run forward and backward, and are timed (the
    library's own form, ``compileops``: test_moe_layer_benchmark_smoke)."""
    impls = ["compileops-pair", "compileops-user-mul", "compileops-user-two-weights"]
    run_script("benchmarks/bench_moe_layer.py", "--smoke", "--modes", "static", "--routing",
               "uniform", "--impls", *impls,
               env=dict(os.environ, COMPILEOPS_BENCH_OUT=str(tmp_path)))
    with open(tmp_path / "moe_layer.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["impl"] for r in rows] == impls
    assert not any(r["note"].startswith("failed") for r in rows), rows


@pytest.mark.parametrize("script", ["benchmarks/tuning/probe_grouped_linear_dw.py",
                                    "benchmarks/tuning/sweep_grouped_linear.py",
                                    "benchmarks/tuning/sweep_fp8_wgrad.py"])
def test_tuning_script_parses_its_command_line(script):
    assert "usage:" in run_script(script, "--help")


def test_fp8_wgrad_sweep_covers_the_picks():
    """sweep_fp8_wgrad.py's candidates include the quantiser's tiles and the long fp8 dW
    config the library picks, so a re-run of the sweep times the defaults against the rest."""
    from benchmarks.tuning import sweep_fp8_wgrad
    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels import fp8_wgrad

    tiles = sweep_fp8_wgrad.QUANTISER_TILES
    assert fp8_wgrad.AMAX_TILE in tiles and fp8_wgrad.CODES_TILE in tiles
    assert all(sweep_fp8_wgrad.ALIGN % rows == 0 for rows, _, _ in tiles)
    assert kernels.FP8_WGRAD_LONG_CONFIG in sweep_fp8_wgrad.PRODUCT_CONFIGS.values()
    assert "usage:" not in run_script("benchmarks/tuning/sweep_fp8_wgrad.py", "--list")
    # alignments the quantiser cannot take are refused before any GPU work
    for bad in ("48", "8", "256"):
        assert "--align takes powers of two" in run_script(
            "benchmarks/tuning/sweep_fp8_wgrad.py", "--align", bad, "--list", returncode=2)


def test_sweep_lists_the_wgrad_variants_with_distinct_labels():
    configs = sweep_configs("dW")
    labels = [label for _, label in configs]
    assert len(set(labels)) == len(labels), labels
    for flag, word in (("ragged_tma", " ragged"), ("tma_store", " tma-store"),
                       ("epilogue_subtile", "tma-store/2")):
        assert any(getattr(c, flag) for c, _ in configs), flag
        assert all((word in label) == getattr(c, flag) for c, label in configs), flag
    for cfg, _ in configs:
        check_wgrad_variant(cfg)
    no_db = [label for _, label in sweep_configs("dW no db")]
    assert no_db and all(label.endswith(" no db") for label in no_db), no_db
    # Per benchmark shape the default is listed, and it alone is labelled " (default)".
    defaults = set()
    for shape, entry in sweep_listing()["dW defaults"].items():
        default = kernels.Config(**entry["config"])
        defaults.add(default)
        assert default in [c for c, _ in configs], (shape, default)
        marked = [i for i, label in enumerate(entry["labels"]) if label.endswith(" (default)")]
        assert [configs[i][0] for i in marked] == [default], (shape, marked)
    cuda = kernels.H100_SXM  # a GPU description: no GPU needed
    for m, g in ((65536, 64), (65536, 128)):  # long and mid groups are among them
        assert kernels.choose_wgrad_config(m, g, 2048, 768, torch.bfloat16, cuda) in defaults


def test_sweep_lists_tma_store_configs_with_distinct_labels():
    for kind in ("fwd", "swiglu"):
        configs = sweep_configs(kind)
        labels = [label for _, label in configs]
        assert len(set(labels)) == len(labels), labels
        assert any(c.tma_store for c, _ in configs)
        assert all((" tma-store" in label) == c.tma_store for c, label in configs)
        for cfg, _ in configs:  # the M-jagged kernel has no other variant
            assert not (cfg.ragged_tma or cfg.epilogue_subtile), cfg


def test_mjagged_store_variants_are_the_sweeps():
    """The TMA-store configs test_codegen_sm90.py compiles and test_gpu.py runs are the ones
    the sweep times (fwd and dX share FWD_CONFIGS)."""
    for product, kind in (("fwd", "fwd"), ("dx", "fwd"), ("swiglu", "swiglu")):
        listed = {mjagged_store_config(name)[1] for name, (p, _, _) in
                  MJAGGED_STORE_VARIANTS.items() if p == product}
        assert listed == {c for c, _ in sweep_configs(kind) if c.tma_store}, product



# --epilogue: the same user-written operation after the down projection in every layer, so the
# anchor and compileops time the same work; each one changes the output (it is not dropped).
_EPILOGUE_CHECK = """
import torch, compileops
from benchmarks.bench_moe_layer import EPILOGUES, SMOKE_SHAPES, MoELayer
shape = SMOKE_SHAPES["tiny"]
x = torch.randn(shape.tokens, shape.dim, generator=torch.Generator().manual_seed(3)).bfloat16()
plain = {}
with compileops.use_backend("reference"):
    for epilogue in EPILOGUES:
        anchor, ours = (MoELayer(shape, impl, 0.0, "cpu", epilogue=epilogue)
                        for impl in ("grouped_mm", "compileops-user-mul"))
        a, b = anchor(x), ours(x)
        assert a.dtype == b.dtype == x.dtype, epilogue
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        plain[epilogue] = a
for epilogue in ("bias", "residual"):
    assert not torch.equal(plain[epilogue], plain["none"]), epilogue
try:
    MoELayer(shape, "grouped_mm", 0.0, "cpu", epilogue="gelu")
except ValueError as e:
    assert "epilogue must be one of" in str(e)
else:
    raise AssertionError("an unknown epilogue was accepted")
print("ok")
"""


def test_moe_layer_benchmark_epilogues_are_the_same_code_in_every_layer():
    run_check(_EPILOGUE_CHECK)
