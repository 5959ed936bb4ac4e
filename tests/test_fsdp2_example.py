"""``examples/fsdp2_moe.py`` under ``torchrun --nproc-per-node 2`` on CPU (gloo), tiny sizes,
with an mLSTM layer in each block, and with ``--model hf-xlstm`` (transformers' xLSTM on
compileops' mLSTM ops): it trains, each rank's first step equals one process on the same
shard bitwise (loss and the gradients entering, between and leaving the blocks), the sharded
loss curve equals the unsharded one, and ``--trace-ops`` finds no op that differs (and sees
the compileops ops run). The two-GPU NCCL run of the MoE model is in benchmarks/RESULTS.md.

Also: run without torchrun, the example exits with one line saying how to launch it (not
``init_process_group``'s "RANK expected" traceback); on CPU its sizes default to the small
shapes (the GPU shapes ran past 4 minutes there), on CUDA to the GPU shapes, explicit flags
win, and ``--help`` says so.
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.gloo import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(*flags: str, model: str = "moe") -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    model_flags = ["--xlstm"] if model == "moe" else ["--model", model]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         os.path.join(ROOT, "examples", "fsdp2_moe.py"), "--device", "cpu", "--tiny",
         *model_flags, "--check-grads", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


@pytest.mark.parametrize("model", ["moe", "hf-xlstm"])
def test_fsdp2_example_on_two_cpu_processes(model):
    if model == "hf-xlstm":
        pytest.importorskip("transformers", minversion="5.7")
    out = _run_example("--steps", "3", "--compare-single", model=model)
    assert "0 graph breaks" in out, out
    checks = [line for line in out.splitlines() if "against one GPU on its shard" in line]
    repeats = [line for line in out.splitlines() if "the one-GPU step again" in line]
    assert len(checks) == 2 and len(repeats) == 2, out
    for line in checks + repeats:
        # The loss, the gradients entering the blocks (d_head_in), entering the second block
        # (d_block1_in) and leaving the first (d_embedding_out).
        if model == "moe":
            assert line.count("bitwise equal: True") == 4, line
            assert "bitwise equal: False" not in line, line
        else:
            # transformers' model has more CPU GEMMs (nn.Linear) whose kernels may choose by
            # alignment, which sharding changes: close, not bitwise, on a user's CPU.
            diffs = [float(d) for d in re.findall(r"max \|diff\| (\S+)\)", line)]
            assert len(diffs) == 3 and max(diffs) <= 1e-6, line
    alignment = [line for line in out.splitlines() if "at another address mod 256" in line]
    assert len(alignment) == 2, out
    gap = float(re.search(r"max \|sharded - single\| loss difference: (\S+)", out).group(1))
    assert gap < 1e-5, out


def test_fsdp2_example_op_trace_finds_no_divergence_on_cpu():
    out = _run_example("--steps", "1", "--compile", "none", "--trace-ops")
    traces = [line for line in out.splitlines() if "op trace, sharded against single" in line]
    assert len(traces) == 2, out
    for line in traces:
        assert "no op differs on equal inputs" in line, line
        assert "compileops::grouped_linear_dx" in line and "compileops::mlstm" in line, line


def test_fsdp2_example_runs_transformers_xlstm_on_compileops_ops():
    pytest.importorskip("transformers", minversion="5.7")
    out = _run_example("--steps", "1", "--compile", "none", "--trace-ops", model="hf-xlstm")
    traces = [line for line in out.splitlines() if "op trace, sharded against single" in line]
    assert len(traces) == 2, out
    for line in traces:
        assert "no op differs on equal inputs" in line, line
        assert "compileops::mlstm" in line, line


def test_fsdp2_example_refuses_an_anchor_of_the_other_model(capsys):
    example = _example_module()
    for argv in (["--model", "hf-xlstm", "--anchor", "grouped_mm"], ["--anchor", "native"]):
        with pytest.raises(SystemExit):
            example.parse_args(["--device", "cpu", *argv])
        assert "applies to another --model" in capsys.readouterr().err


def _example_module():
    path = os.path.join(ROOT, "examples", "fsdp2_moe.py")
    spec = importlib.util.spec_from_file_location("fsdp2_moe_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fsdp2_example_without_torchrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fsdp2_moe.py"),
                          "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0, run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    message = run.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "launch it with torchrun" in message and "--nproc-per-node" in message, message


def test_fsdp2_example_sizes_default_small_on_cpu_and_gpu_sized_on_cuda(monkeypatch):
    example = _example_module()
    cpu = example.parse_args(["--device", "cpu"])
    assert {name: getattr(cpu, name) for name in example.SMALL_SHAPES} == example.SMALL_SHAPES
    assert (cpu.dim, cpu.experts, cpu.seq) == (32, 4, 8)
    explicit = example.parse_args(["--device", "cpu", "--dim", "64", "--seq", "16"])
    assert (explicit.dim, explicit.seq, explicit.experts) == (64, 16, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = example.parse_args(["--device", "cuda"])
    assert {name: getattr(gpu, name) for name in example.GPU_SHAPES} == example.GPU_SHAPES
    assert (gpu.dim, gpu.experts, gpu.seq) == (2048, 64, 2048)
    tiny_gpu = example.parse_args(["--device", "cuda", "--tiny"])
    assert {name: getattr(tiny_gpu, name) for name in example.SMALL_SHAPES} == \
        example.SMALL_SHAPES


def test_fsdp2_example_help_states_the_cpu_defaults():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "fsdp2_moe.py"),
                          "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "default 2048 on CUDA, 32 on CPU" in text, text
    assert "small shapes of --tiny on CPU" in text, text
    assert "torchrun --nproc-per-node 2 examples/fsdp2_moe.py --device cpu" in text, text
