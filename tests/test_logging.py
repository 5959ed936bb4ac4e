"""The ``compileops`` logger (observability): one line per compiled op saying which
lowering, config and TMA variant it got and why; every extern call and reference-backend run
with its reason; every dynamic-shape guard; and nothing at all unless asked (COMPILEOPS_LOG or
the user's own logging configuration).

The compiled functions run (under Triton's interpreter, tests/conftest.py): Inductor's
``get_code`` cannot return from a graph with several outputs or symbolic sizes.
"""
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

import compileops
from compileops import _log
from compileops.grouped_linear import kernels as grouped_kernels
from compileops.mlstm.kernels import config as mlstm_config
from compileops.mlstm import reference as mlstm_reference
from compileops.lowerings import _compat
from compileops.lowerings import grouped_linear as grouped_lowering
from tests.grouped_linear._helpers import make_expert_inputs, moe_expert
from tests.mlstm.test_snapshots import _inputs as mlstm_inputs
from tests.mlstm.test_snapshots import gated_op
from tests.test_readme import _section_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def records(caplog, monkeypatch):
    """caplog wired straight to the ``compileops`` logger at DEBUG, so the test sees every
    record whether or not COMPILEOPS_LOG switched propagation off, and a fresh "once" memory
    (another test may have logged the same backend choice already)."""
    logger = logging.getLogger("compileops")
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(_log, "_logged_once", set())
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="compileops")
    yield caplog
    logger.removeHandler(caplog.handler)


def lines(caplog, logger: str, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == f"compileops.{logger}" and r.levelno == level]


def compile_and_run(fn, *args, triton: bool = True) -> None:
    """Compile ``fn(*args)`` with Inductor (Triton code for CPU tensors unless ``triton`` is
    off: then C++) and run it once."""
    torch._dynamo.reset()
    codegen = _compat.triton_codegen_on_cpu() if triton else _compat.inductor_config_patch()
    with _compat.fresh_inductor_cache(), codegen:
        torch.compile(fn, fullgraph=True)(*args)


def config_text(**values) -> str:
    return re.escape(_log.settings(**values))


# ---------------------------------------------------------------------------------------
# (a), (b): the template and its config, once per compiled op


def test_grouped_linear_logs_its_template_config_and_tma_variant(records):
    x, w, offs, b, p = make_expert_inputs([5, 0, 11, 3])
    compile_and_run(moe_expert, x, w, offs, b, p)
    cfg = grouped_kernels.INTERPRETER_CONFIG
    expected = (
        r"grouped_linear_swiglu: template compileops_grouped_linear \("
        + config_text(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m, FLATTEN=cfg.flatten,
                      WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, NUM_PROGS=4)
        + r", pointer loads\) for x \[21, 16\] float32, weight \[4, 24, 16\]: "
        r"the interpreter's small tiles \(CPU\); no TMA on cpu; "
        r"ALIGNED_ROWS=False ALIGNED_OUT=False$"
    )
    (line,) = lines(records, "grouped_linear")
    assert re.match(expected, line), line
    assert not lines(records, "guards"), "static shapes need no guard"


def test_mlstm_parallel_logs_its_template_and_config(records):
    q, k, v, igate, fgate, weight, o = mlstm_inputs()
    logf = mlstm_reference.log_forget_cumsum(fgate)
    compile_and_run(gated_op, q, k, v, igate, logf, weight, o)
    cfg = mlstm_config.INTERPRETER_FORWARD
    expected = (
        r"mlstm_parallel: template compileops_mlstm \("
        + config_text(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_DQK=16, BLOCK_DV=32,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        + r"\) for q \[2, 2, 40, 16\] float32, v \[2, 2, 40, 32\]: .*\(CPU\); "
        r"HAS_NORM=True SAVE_H=False SEQ_ALIGNED=False$"
    )
    (line,) = lines(records, "mlstm")
    assert re.match(expected, line), line


def test_embedding_logs_its_pointwise_gather(records):
    ids, weight = torch.randint(0, 10, (2, 3)), torch.randn(10, 8)
    compile_and_run(lambda i, w: compileops.embedding(i, w) * 2, ids, weight)
    (line,) = lines(records, "embedding")
    assert line.startswith("embedding: pointwise gather for ids [2, 3] int64, weight [10, 8]"), line
    assert "Triton: ids bounds-checked in the kernel" in line


# ---------------------------------------------------------------------------------------
# (c): fallbacks, with their reasons


def _grouped_linear_cpp():
    x, w, offs, b, _ = make_expert_inputs([3, 4])
    compile_and_run(compileops.grouped_linear, x, w, offs, b, triton=False)
    return "grouped_linear", "grouped_linear: extern call of the eager op for x [9, 16] float32", \
        "Inductor emits C++ for CPU tensors (cpu_backend='cpp')"


def mlstm_op(q, k, v, igate, logf):
    """The bare op, unnormed (no pointwise neighbours, whose fp64 Triton kernels the
    interpreter cannot run)."""
    return torch.ops.compileops.mlstm_parallel(q, k, v, igate, logf, None, None, False,
                                               1e-6, 1e-6, False, False)[0]


def _mlstm_fp64():
    q, k, v, igate, fgate, _, _ = mlstm_inputs(dtype=torch.float64)
    compile_and_run(mlstm_op, q, k, v, igate, mlstm_reference.log_forget_cumsum(fgate))
    return "mlstm", "mlstm_parallel: extern call of the eager op for q [2, 2, 40, 16] float64", \
        "fp64"


def _mlstm_head_dim_too_large():
    q, k, v = torch.randn(1, 1, 4, 264), torch.randn(1, 1, 4, 264), torch.randn(1, 1, 4, 8)
    igate, logf = torch.randn(1, 1, 4), torch.zeros(1, 1, 4)
    compile_and_run(mlstm_op, q, k, v, igate, logf)
    return "mlstm", "mlstm_parallel: extern call of the eager op for q [1, 1, 4, 264]", \
        "head dim 264 above the kernels' maximum 256"


@pytest.mark.parametrize("case", [_grouped_linear_cpp, _mlstm_fp64, _mlstm_head_dim_too_large],
                         ids=["cpp-backend", "fp64", "head-dim"])
def test_extern_fallback_logs_its_reason(records, case):
    # The extern call runs the eager op: the reference backend, as the kernels refuse fp64
    # and this head dim, and the interpreter cannot run every fp64 path.
    with compileops.use_backend("reference"):
        logger, start, reason = case()
    (line,) = lines(records, logger)
    assert line.startswith(start) and reason in line, line


def test_reference_backend_is_logged_once_per_op_and_reason(records):
    x, w, offs, b, _ = make_expert_inputs([3, 4])
    with compileops.use_backend("reference"):
        for _ in range(3):
            compileops.grouped_linear(x, w, offs, b)
    assert lines(records, "backends") == [
        "grouped_linear: reference backend on cpu (forced by use_backend())"]


def test_reference_backend_reason_names_what_the_kernels_lack(records, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, offs, b, _ = make_expert_inputs([3, 4])
    compileops.grouped_linear(x, w, offs, b)
    (line,) = lines(records, "backends")
    assert line.startswith("grouped_linear: reference backend on cpu (triton: the triton backend "
                           "runs on CPU tensors only under Triton's interpreter"), line


# ---------------------------------------------------------------------------------------
# (d): dynamic-shape guards


def test_dynamic_grouped_linear_logs_its_guards_once_per_compile(records):
    x, w, offs, b, p = make_expert_inputs([5, 0, 11, 3])
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(compileops.grouped_linear, fullgraph=True, dynamic=True)
        compiled(x, w, offs, b)
        compiled(x[:15], w, offs.clamp(max=15), b)  # another M: same graph, no new lines
    guards = lines(records, "guards")
    assert any(re.fullmatch(r"s\d+ == 4 on the number of groups G: .*recompiles", g)
               for g in guards), guards
    assert any(re.fullmatch(r"s\d+ % 16 == 0 on grouped linear input row stride "
                            r"\(first value 16\): .*recompiles", g) for g in guards), guards
    (line,) = lines(records, "grouped_linear")
    assert re.search(r"for x \[s\d+, s\d+\] float32, weight \[s\d+, s\d+, s\d+\]", line), line
    assert line.endswith("ALIGNED_ROWS=True ALIGNED_OUT=False"), line


def test_dynamic_mlstm_logs_the_sequence_length_guard(records):
    q, k, v, igate, fgate, weight, o = mlstm_inputs(seq=48)
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        torch.compile(gated_op, fullgraph=True, dynamic=True)(
            q, k, v, igate, mlstm_reference.log_forget_cumsum(fgate), weight, o)
    guards = lines(records, "guards")
    assert any(re.fullmatch(r"s\d+ % 16 == 0 on the mLSTM sequence length \(first value 48\): "
                            r".*recompiles", g) for g in guards), guards
    assert any(re.fullmatch(r"s\d+ == 32 on the mLSTM head dim DV: .*", g) for g in guards), guards
    (line,) = lines(records, "mlstm")
    assert line.endswith("SEQ_ALIGNED=True"), line


# ---------------------------------------------------------------------------------------
# The GPU-only paths of the grouped-linear log lines (max-autotune, TMA, heuristics), fed
# directly: a crash in a log line must not wait for a GPU run to show.


class _Node:
    def __init__(self, size, dtype=torch.bfloat16):
        self._size, self._dtype = size, dtype

    def get_size(self):
        return self._size

    def get_dtype(self):
        return self._dtype


def test_grouped_linear_autotune_line_lists_its_candidates(records):
    cfg = grouped_kernels.Config(128, 256, 64, num_warps=8, num_stages=4, flatten=True)
    configs = [(cfg, False), (cfg, True), (grouped_kernels.BATCH_INVARIANT_CONFIG, True)]
    errors = [(grouped_kernels.BATCH_INVARIANT_CONFIG, True, "out of shared memory")]
    grouped_lowering._log_decision(
        "grouped_linear", _Node([4096, 2048]), _Node([8, 1024, 2048]), grouped_kernels.H100_SXM,
        configs, errors, built=True, autotune=True, externs=" + the eager op + torch._grouped_mm",
        no_tma=None, flags="ALIGNED_ROWS=False ALIGNED_OUT=False", why_config="unused")
    assert lines(records, "grouped_linear") == [
        "grouped_linear: max-autotune over 2 template configs (1 with TMA) + the eager op + "
        "torch._grouped_mm for x [4096, 2048] bfloat16, weight [8, 1024, 2048] on NVIDIA H100 "
        "80GB HBM3; TMA and pointer loads; ALIGNED_ROWS=False ALIGNED_OUT=False"]
    debug = lines(records, "grouped_linear", logging.DEBUG)
    assert len(debug) == 4 and debug[0].endswith("TMA=True): out of shared memory"), debug


def test_grouped_linear_reasons_off_the_cpu():
    h100, h200 = grouped_kernels.H100_SXM, grouped_kernels.H200
    bf16 = torch.bfloat16
    assert grouped_lowering._why_config(h100, 4096, 8, 1024, bf16, False) == (
        "heuristic for 512 rows per group on NVIDIA H100 80GB HBM3 (measured row), "
        "no benchmarking")
    assert grouped_lowering._why_config(h200, 4096, 8, 1024, bf16, True) == (
        "heuristic for 512 rows per group on NVIDIA H200 (measured row), no benchmarking")
    # A part without a row in TUNED (an H100 PCIe: 114 SMs) gets the generic rule.
    h100_pcie = grouped_kernels.DeviceSpec("NVIDIA H100 PCIe", 114, 232448, (9, 0))
    assert grouped_lowering._why_config(h100_pcie, 4096, 8, 1024, bf16, True) == (
        "heuristic for 512 rows per group on NVIDIA H100 PCIe (generic rule), no benchmarking")
    with compileops.batch_invariant():
        assert grouped_lowering._why_config(h100, 4096, 8, 1024, bf16,
                                            False).startswith("batch-invariant")
        assert grouped_lowering._why_pointer_loads(None).startswith("no TMA in batch-invariant")
    assert grouped_lowering._why_no_template_tma(torch.device("cpu"), grouped_kernels.INTERPRETER,
                                                 True) == "no TMA on cpu"


# ---------------------------------------------------------------------------------------
# (e): silent by default; COMPILEOPS_LOG switches it on


_SCRIPT = """
import torch, compileops
x, w = torch.randn(12, 16), torch.randn(2, 24, 16)
offsets = torch.tensor([5, 12], dtype=torch.int32)
torch.compile(compileops.grouped_linear, fullgraph=True)(x, w, offsets)
"""


def test_silent_by_default_and_on_with_compileops_log():
    def start(value):
        env = {k: v for k, v in os.environ.items()
               if k not in ("COMPILEOPS_LOG", "TRITON_INTERPRET")}
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a cache hit does not lower again
        if value is not None:
            env["COMPILEOPS_LOG"] = value
        return subprocess.Popen([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    silent, loud = start(None), start("1")  # in parallel: each pays the imports
    outputs = [proc.communicate(timeout=300) for proc in (silent, loud)]
    for proc, (_, err) in zip((silent, loud), outputs):
        assert proc.returncode == 0, err
    silent_err, loud_err = outputs[0][1], outputs[1][1]
    ours = re.compile(r"compileops\.\w+:")
    assert not ours.search(silent_err) and "extern call" not in silent_err, silent_err
    assert re.search(r"^compileops\.grouped_linear: grouped_linear: extern call of the eager op",
                     loud_err, re.M), loud_err
    assert re.search(r"^compileops\.backends: grouped_linear: reference backend on cpu",
                     loud_err, re.M), loud_err


@pytest.mark.parametrize("value, level", [(None, None), ("", None), ("0", None),
                                          ("1", logging.INFO), (" INFO ", logging.INFO),
                                          ("debug", logging.DEBUG)])
def test_compileops_log_values(value, level):
    assert _log.level_from_env(value) == level


def test_unknown_compileops_log_value_warns_and_stays_off():
    with pytest.warns(UserWarning, match="COMPILEOPS_LOG='loud'"):
        assert _log.level_from_env("loud") is None


def test_compileops_log_installs_one_handler_and_stops_propagation(monkeypatch):
    logger = logging.getLogger("compileops")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    level = logger.level
    try:
        monkeypatch.setenv("COMPILEOPS_LOG", "debug")
        _log.configure_from_env()
        _log.configure_from_env()
        assert len(logger.handlers) == 1 and not logger.propagate
        assert logger.level == logging.DEBUG
        monkeypatch.delenv("COMPILEOPS_LOG")
        monkeypatch.setattr(logger, "handlers", [])
        _log.configure_from_env()
        assert logger.handlers == []  # unset: nothing configured
    finally:
        logger.setLevel(level)  # through setLevel: it also clears the loggers' level cache


# ---------------------------------------------------------------------------------------
# The README's "Logging" block runs as written


def test_readme_logging_block_runs(records, monkeypatch):
    # The block calls logging.basicConfig: keep the root logger as it was.
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache():
        exec(compile(_section_code("Logging"), "README.md", "exec"), {})
    (line,) = lines(records, "grouped_linear")
    assert line.startswith("grouped_linear: extern call of the eager op for x [12, 16]"), line
