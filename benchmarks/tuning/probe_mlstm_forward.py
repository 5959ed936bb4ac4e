"""Probe the parallel mLSTM forward on a GPU: the tree's kernel against other versions of
``forward.py``, over tile configs, with registers, spills and shared memory per config.

    git show REV:compileops/mlstm/kernels/forward.py > benchmarks/tuning/_forward_before.py
    python3 benchmarks/tuning/probe_mlstm_forward.py [--seqs 1024 2048 4096] [--save-h 0]
        [--configs 128,64,8,3 ...]

Every ``_forward_<name>.py`` beside this file (a whole copy of the module, edited) is timed
in the same process as the tree's; without any, only the tree's kernel is.
"""
import argparse
import importlib
import os
import sys

import torch
import triton

from compileops.mlstm import reference
from compileops.mlstm.kernels import forward as fw_new
from compileops.mlstm.kernels.config import ForwardConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_mlstm import make  # noqa: E402  (same data: unit normal q, k, v, gates; f + 3)

_HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS = [("tree", fw_new)] + [
    (name[len("_forward_"):-3], importlib.import_module(name[:-3]))
    for name in sorted(os.listdir(_HERE)) if name.startswith("_forward_") and name.endswith(".py")]


def spills(kernel):
    out = []
    try:
        for cache in kernel.device_caches.values():
            for ck in cache[0].values():
                out.append(f"regs={ck.n_regs} spills={ck.n_spills} smem={ck.metadata.shared}")
    except Exception as e:  # noqa: BLE001
        out.append(f"(no cache info: {e})")
    return out[-1] if out else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--save-h", type=int, default=1)
    ap.add_argument("--configs", nargs="*", default=None, help="BM,BN,WARPS,STAGES ...")
    args = ap.parse_args()
    cfgs = [ForwardConfig(*map(int, c.split(","))) for c in args.configs or []] or [
        ForwardConfig(*c) for c in [
        (128, 32, 8, 3), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 4),
        (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2), (128, 64, 4, 2)]]
    for seq in args.seqs:
        b, nh, dqk, dv = args.tokens // seq, 16, 128, 256
        q, k, v, i, f, w = make(b, nh, seq, dqk, dv, torch.bfloat16)
        logf = reference.log_forget_cumsum(f.float()).contiguous()
        ig = i.float().contiguous()
        flops = b * nh * seq * seq * (dqk + dv)
        ref_out = None
        for name, mod in VERSIONS:
            for cfg in cfgs:
                try:
                    fn = lambda: mod.mlstm_forward(q, k, v, ig, logf, w, None, True, 1e-6, 1e-6,
                                                   False, bool(args.save_h), config=cfg)
                    out = fn()[0]
                    if ref_out is None:
                        ref_out = out.float()
                    diff = (out.float() - ref_out).abs().max().item()
                    torch.cuda.synchronize()
                    for c in mod.mlstm_forward_kernel.device_caches.values():
                        c[0].clear()
                    fn()
                    info = spills(mod.mlstm_forward_kernel)
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                    print(f"{name} S={seq} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} "
                          f"s{cfg.num_stages}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                          f"{info} maxdiff={diff:.3g}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} S={seq} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}",
                          flush=True)


if __name__ == "__main__":
    main()
