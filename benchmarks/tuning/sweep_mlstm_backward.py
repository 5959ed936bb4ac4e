"""Backward tile configs of the mLSTM kernels at one head shape (GPU), through the public op.

For each sequence length (B * S = ``--tokens``; ``--kernel``, by default ``"auto"``: S above
1024 runs the chunkwise form) and each candidate :class:`BackwardConfig`, it runs ``compileops.mlstm`` with
the norm (bf16, eager, forward and backward) and reports:

* the whole step's time (``triton.testing.do_bench``);
* the CUDA time per step of the dQ kernels, the dK/dV kernels, the forward and the chunk-state
  kernels (``torch.profiler``), which is what a backward config changes;
* the largest relative L2 difference of the gradients from the heuristic's config (a config
  that computes something else shows up here, not as a fast row).

Candidates are written ``BM,BN,W,S[,DQN,DQW,DQS]`` (dK/dV tile, warps, stages; the dQ key
tile, warps, stages), e.g. ``64,64,8,1,64,8,2``. A config that does not fit (shared memory)
is reported as failed. The heuristic's own choice runs first.

    python benchmarks/tuning/sweep_mlstm_backward.py --heads 8 --dqk 256 --dv 512 \\
        --seqs 1024 8192 --configs 64,32,4,2,16,4,3 64,64,8,1,64,8,2
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import compileops
from compileops.mlstm import kernels
from compileops.mlstm.kernels import backward as backward_module
from compileops.mlstm.kernels import config as config_module
from compileops.mlstm.kernels.config import BackwardConfig

_HEURISTIC = config_module.choose_backward_config


def _use(cfg):
    """Every caller of ``choose_backward_config`` gets ``cfg`` (None: the heuristic's)."""
    chosen = _HEURISTIC if cfg is None else (lambda *args, **kwargs: cfg)
    for module in (config_module, backward_module, kernels):
        module.choose_backward_config = chosen


def parse_config(text: str) -> BackwardConfig:
    fields = [int(x) for x in text.split(",")]
    if len(fields) not in (4, 7):
        raise argparse.ArgumentTypeError(f"want BM,BN,W,S[,DQN,DQW,DQS], got {text!r}")
    bm, bn, warps, stages = fields[:4]
    dq = dict(zip(("dq_block_n", "dq_num_warps", "dq_num_stages"), fields[4:]))
    return BackwardConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                          block_rows=8, norm_warps=1, **dq)


def inputs(batch, heads, seq, dqk, dv):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, shift=0.0):
        x = torch.randn(*shape, device="cuda", generator=g) + shift
        return x.to(torch.bfloat16).requires_grad_()

    return (rand(batch, heads, seq, dqk), rand(batch, heads, seq, dqk),
            rand(batch, heads, seq, dv), rand(batch, heads, seq),
            rand(batch, heads, seq, shift=3.0),
            torch.ones(heads * dv, device="cuda", dtype=torch.bfloat16, requires_grad=True))


KERNEL = "auto"


def step(args):
    q, k, v, igate, fgate, weight = args
    out = compileops.mlstm(q, k, v, igate, fgate, norm_weight=weight, kernel=KERNEL)
    out.backward(torch.ones_like(out))


def kernel_times(args, steps=3) -> dict:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(args)
        torch.cuda.synchronize()
    parts = {}
    for event in prof.key_averages():
        name = event.key
        part = ("dkv" if "mlstm_dkv" in name else "dq" if "mlstm_dq" in name
                else "state" if "state" in name else "forward" if "forward" in name else "rest")
        parts[part] = parts.get(part, 0.0) + event.device_time_total / steps / 1000
    return parts


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dqk", type=int, default=128)
    p.add_argument("--dv", type=int, default=256)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--configs", type=parse_config, nargs="*", default=[])
    p.add_argument("--kernel", default="auto", choices=["auto", "parallel", "chunkwise"])
    p.add_argument("--budget-s", type=float, default=float("inf"))
    a = p.parse_args()
    global KERNEL
    KERNEL = a.kernel
    start = time.time()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; NH {a.heads}, DQK {a.dqk}, DV {a.dv}, {a.tokens} tokens, "
          f"kernel={a.kernel}")
    for seq in a.seqs:
        args = inputs(a.tokens // seq, a.heads, seq, a.dqk, a.dv)
        reference = None
        for cfg in [None, *a.configs]:
            label = "heuristic" if cfg is None else (
                f"dkv {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}, dq "
                f"{cfg.dq_tile} w{cfg.dq_warps} s{cfg.dq_stages}")
            if time.time() - start > a.budget_s:
                print(f"S={seq} {label}: not run (budget)", flush=True)
                continue
            _use(cfg)
            try:
                step(args)
                grads = [t.grad.clone() for t in args]
                for t in args:
                    t.grad = None
                diff = "" if reference is None else (
                    f" | max rel diff {max(rel(x, y) for x, y in zip(grads, reference)):.1e}")
                reference = reference or grads
                ms = triton.testing.do_bench(lambda: step(args), warmup=5, rep=30,
                                             grad_to_none=list(args))
                parts = " ".join(f"{k} {v:.2f}" for k, v in sorted(kernel_times(args).items()))
                print(f"S={seq} {label}: step {ms:.3f} ms | {parts}{diff}", flush=True)
            except Exception as e:  # a config that does not fit is a result, not a crash
                print(f"S={seq} {label}: failed, {type(e).__name__}: {str(e)[:160]}",
                      flush=True)
            for t in args:
                t.grad = None
    _use(None)


if __name__ == "__main__":
    main()
