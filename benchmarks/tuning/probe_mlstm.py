"""Probe the mLSTM kernels on a GPU: correctness at a real shape against the fp64 reference
(one head-batch slice), then forward / backward kernel times for a few tile configs.

    python3 benchmarks/tuning/probe_mlstm.py [--seq 1024] [--quick]

``--breakdown`` times the backward's parts; the dQ and dK/dV kernels of every
``_backward_<name>.py`` beside this file (a copy of the module, edited; e.g. ``git show
REV:compileops/mlstm/kernels/backward.py > benchmarks/tuning/_backward_before.py``) are
timed too, in the same process.
"""
import argparse
import dataclasses
import itertools
import math
import time

import torch
import triton
import triton.language as tl

import compileops
from compileops.mlstm import kernels, reference
from compileops.mlstm.op import _kernel_backward


def make(b, nh, s, dqk, dv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, nh, s, dqk, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, nh, s, dqk, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, nh, s, dv, device="cuda", dtype=dtype, generator=g)
    i = torch.randn(b, nh, s, device="cuda", dtype=dtype, generator=g)
    f = torch.randn(b, nh, s, device="cuda", dtype=dtype, generator=g) + 3
    w = torch.randn(nh * dv, device="cuda", dtype=dtype, generator=g)
    return q, k, v, i, f, w


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(seq, dtype):
    args = make(2, 2, seq, 128, 256, dtype)
    ins = [t.detach().clone().requires_grad_() for t in args]
    out = compileops.mlstm(*ins[:5], norm_weight=ins[5])
    go = torch.randn_like(out)
    out.backward(go)
    ref_in = [t.detach().double().requires_grad_() for t in args]
    ref = reference.mlstm(*ref_in[:5], norm_weight=ref_in[5])[0]
    ref.backward(go.double())
    errs = [rel(out, ref)] + [rel(a.grad, b.grad) for a, b in zip(ins, ref_in)]
    print(f"check S={seq} {dtype}: rel L2 out/dq/dk/dv/di/df/dw", " ".join(f"{e:.2e}" for e in errs),
          flush=True)


def bench(seq, tokens, cfgs_fw, cfgs_bw):
    b, nh, dqk, dv = tokens // seq, 16, 128, 256
    q, k, v, i, f, w = make(b, nh, seq, dqk, dv, torch.bfloat16)
    acc = torch.float32
    logf = reference.log_forget_cumsum(f.float()).contiguous()
    ig = i.float().contiguous()
    flops = b * nh * seq * seq * (dqk + dv)
    for cfg in cfgs_fw:
        try:
            fn = lambda: kernels.mlstm_forward(q, k, v, ig, logf, w, None, True, 1e-6, 1e-6,
                                               False, True, config=cfg)
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            print(f"fw S={seq} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"fw S={seq} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    out, h, m, rs = kernels.mlstm_forward(q, k, v, ig, logf, w, None, True, 1e-6, 1e-6, False,
                                          True)
    go = torch.randn_like(out)
    for cfg in cfgs_bw:
        try:
            def fn():
                dh, r, beta, dm, pw, pb = kernels.norm_backward(go, h, w, m, rs, True, 1e-6,
                                                                1e-6, False, cfg)
                return kernels.cell_backward(q, k, v, dh, ig, logf, m, r, beta, cfg)
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            print(f"bw S={seq} {cfg}: {ms:.3f} ms {2.5 * flops / ms / 1e9:.0f} TFLOP/s (2.5x count)",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"bw S={seq} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def breakdown(seq, tokens, configs=()):
    """The backward's parts timed apart: the norm preprocess, the dQ programs and the dK/dV
    programs, at the default config and at each of ``configs`` (BackwardConfig)."""
    from compileops.mlstm.kernels import backward as bwk

    b, nh, dqk, dv = tokens // seq, 16, 128, 256
    q, k, v, i, f, w = make(b, nh, seq, dqk, dv, torch.bfloat16)
    logf = reference.log_forget_cumsum(f.float()).contiguous()
    ig = i.float().contiguous()
    out, h, m, rs = kernels.mlstm_forward(q, k, v, ig, logf, w, None, True, 1e-6, 1e-6, False,
                                          True)
    go = torch.randn_like(out)
    default = kernels.choose_backward_config(q, dqk, dv)
    dh, r, beta, dm, _, _ = kernels.norm_backward(go, h, w, m, rs, True, 1e-6, 1e-6, False,
                                                  default)
    t_norm = triton.testing.do_bench(
        lambda: kernels.norm_backward(go, h, w, m, rs, True, 1e-6, 1e-6, False, default),
        rep=50)
    # The norm preprocess streams grad, h and dh (3 x 2 bytes per element): its bandwidth.
    stream = 3 * out.numel() * out.element_size()
    for rows, warps, programs in itertools.product((8, 16, 32), (1, 2, 4), (4096, 8192, 32768)):
        cfg = dataclasses.replace(default, block_rows=rows, norm_warps=warps,
                                  norm_programs=programs)
        t = triton.testing.do_bench(
            lambda: kernels.norm_backward(go, h, w, m, rs, True, 1e-6, 1e-6, False, cfg),
            rep=50)
        print(f"norm S={seq} rows={rows} warps={warps} programs={programs}: {t:.3f} ms "
              f"({stream / t / 1e6:.0f} GB/s)", flush=True)
    dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rg, cg = torch.empty_like(logf), torch.empty_like(logf)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dh.stride())
    scale = 1 / math.sqrt(dqk)
    import importlib
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    versions = [("tree", bwk)] + [
        (name[len("_backward_"):-3], importlib.import_module(name[:-3]))
        for name in sorted(os.listdir(here))
        if name.startswith("_backward_") and name.endswith(".py")]
    for (name, mod), cfg in itertools.product(versions, [default, *configs]):
        common = dict(DQK=dqk, DV=dv, BLOCK_DQK=dqk, BLOCK_DV=dv, BLOCK_M=cfg.block_m,
                      ACC=tl.float32, INPUT_PRECISION="tf32", UPCAST=False, HAS_STATE=False)
        dq_tiles = dict(BLOCK_N=cfg.dq_tile, num_warps=cfg.dq_warps, num_stages=cfg.dq_stages)
        dkv_tiles = dict(BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages)
        # Kernels with head_major_tile take a flat grid; older copies (bh, tile).
        flat = "head_major_tile" in vars(mod)

        def grid(block):
            tiles = triton.cdiv(seq, block)
            return (b * nh * tiles,) if flat else (b * nh, tiles)

        try:
            t_dq = triton.testing.do_bench(lambda: mod.mlstm_dq_kernel[grid(cfg.block_m)](
                q, k, v, dh, ig, logf, m, r, beta, r, r, r, dq, rg, seq, seq, nh, *strides,
                scale, **common, **dq_tiles), rep=50)
            t_dkv = triton.testing.do_bench(lambda: mod.mlstm_dkv_kernel[grid(cfg.block_n)](
                q, k, v, dh, ig, logf, m, r, beta, r, r, r, dk, dvv, cg, seq, seq, nh, *strides,
                scale, **common, **dkv_tiles), rep=50)
        except Exception as e:  # noqa: BLE001  (a config past the shared memory, say)
            print(f"breakdown [{name}] S={seq} {cfg}: FAILED {type(e).__name__}: "
                  f"{str(e)[:120]}", flush=True)
            continue
        # Causal FLOPs per pass: dQ 2*(DQK + DV + DQK), dK/dV 2*(DQK + DV + DV + DQK) per entry.
        entries = b * nh * seq * seq / 2
        print(f"breakdown [{name}] S={seq} {cfg}: norm {t_norm:.3f} ms, dQ {t_dq:.3f} ms "
              f"({entries * 2 * (2 * dqk + dv) / t_dq / 1e9:.0f} TFLOP/s), dK/dV {t_dkv:.3f} ms "
              f"({entries * 2 * (2 * dqk + 2 * dv) / t_dkv / 1e9:.0f} TFLOP/s)", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="only the backward's parts")
    p.add_argument("--bw-configs", nargs="*", default=[],
                   help="BM,BN,WARPS,STAGES: more backward configs for --breakdown")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    t0 = time.time()
    if a.breakdown:
        extra = [kernels.BackwardConfig(*map(int, c.split(","))) for c in a.bw_configs]
        for s in a.seqs:
            breakdown(s, 65536, extra)
        return
    check(300, torch.float32)
    check(300, torch.bfloat16)
    F, Bw = kernels.ForwardConfig, kernels.BackwardConfig
    cfgs_fw = [F(64, 64, 8, 3), F(128, 64, 8, 2), F(128, 32, 8, 3), F(64, 32, 4, 3),
               F(128, 128, 8, 2), F(64, 64, 4, 3), F(128, 64, 8, 4)]
    cfgs_bw = [Bw(64, 32, 4, 2), Bw(64, 32, 8, 2), Bw(64, 64, 8, 2), Bw(32, 32, 4, 2),
               Bw(64, 32, 4, 3), Bw(128, 32, 8, 2)]
    if a.quick:
        cfgs_fw, cfgs_bw = cfgs_fw[:2], cfgs_bw[:2]
    for s in a.seqs:
        bench(s, 65536, cfgs_fw, cfgs_bw)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
