"""Tile-config sweep for the chunkwise mLSTM's state walks (GPU): what
``compileops.mlstm.kernels.config.choose_state_config`` is based on.

The chunkwise form's two sequential kernels, ``chunk_states`` (the state entering each chunk,
forward) and ``chunk_state_grads`` (their gradients, backward), each carry a ``[DQK,
block_v]`` state tile per program through the chunks of a row. This times both, eagerly,
per :class:`StateConfig` over ``block_v`` x ``sub`` x ``num_warps`` x ``num_stages``, at the
bench's data (65,536 tokens, bf16; NH 16, DQK 128, DV 256 by default), and compares each
result with the heuristic config's (relative L2 error of the states; a different ``sub``
sums a chunk's rows in another order, so small differences are expected, large ones are
flagged).

    python benchmarks/tuning/sweep_mlstm_states.py                       # GPU
    python benchmarks/tuning/sweep_mlstm_states.py --seqs 8192 --heads 8 --dqk 256 --dv 512
    python benchmarks/tuning/sweep_mlstm_states.py --device cpu --tiny   # CPU dry run

Uses the tuning API: :class:`StateConfig` and the launchers' ``config=`` argument.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MISMATCH = 2e-2


def _inputs(torch, b, nh, s, dqk, dv, chunk, device):
    from compileops.mlstm.gates import log_forget_op

    gen = torch.Generator(device="cpu").manual_seed(s)

    def randn(*shape, dtype=torch.bfloat16, shift=0.0):
        return (torch.randn(*shape, generator=gen) + shift).to(device=device, dtype=dtype)

    q, k = randn(b, nh, s, dqk), randn(b, nh, s, dqk)
    v, dh = randn(b, nh, s, dv), randn(b, nh, s, dv)
    igate = randn(b, nh, s, dtype=torch.float32)
    logf = log_forget_op(randn(b, nh, s, dtype=torch.float32, shift=3.0), chunk).contiguous()
    r = randn(b, nh, s, dtype=torch.float32).abs()
    beta = randn(b, nh, s, dtype=torch.float32)
    return q, k, v, dh, igate, logf, r, beta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="*", default=[1024, 2048])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dqk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--block-v", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--sub", type=int, nargs="*", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--kernels", nargs="*", default=["states", "grads"],
                        choices=["states", "grads"])
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, ROOT)
    import torch
    import triton.testing

    from compileops.mlstm.kernels import chunkwise
    from compileops.mlstm.kernels.config import StateConfig, choose_state_config

    if args.tiny:
        args.tokens, args.heads, args.dqk, args.dv, args.chunk = 64, 2, 16, 32, 16
        args.seqs, args.block_v, args.sub, args.warps, args.stages = [32], [16, 32], [16], [1], [1]
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {name} | torch {torch.__version__} | triton {triton.__version__} | "
          f"NH {args.heads}, DQK {args.dqk}, DV {args.dv}, chunk {args.chunk}, "
          f"{args.tokens} tokens", flush=True)
    grid = [StateConfig(block_v=bv, sub=sub, num_warps=w, num_stages=st)
            for bv, sub, w, st in itertools.product(args.block_v, args.sub, args.warps,
                                                    args.stages)
            if sub <= args.chunk and bv <= max(16, triton.next_power_of_2(args.dv))]
    start = time.monotonic()
    for s in args.seqs:
        b = max(1, args.tokens // s)
        q, k, v, dh, igate, logf, r, beta = _inputs(torch, b, args.heads, s, args.dqk,
                                                    args.dv, args.chunk, device)
        defaults = {kernel: choose_state_config(q, args.chunk, args.dqk, args.dv,
                                                backward=kernel == "grads")
                    for kernel in ("states", "grads")}
        _, _, m_states, _ = chunkwise.chunk_states(k, v, igate, logf, args.chunk)
        nc = m_states.shape[1] - 1
        # Each row's stabiliser (log2 units) near its chunk's state m, so the weights stay O(1).
        m_rows = m_states[:, :nc].repeat_interleave(args.chunk, dim=1)[:, :s]
        m_log2 = ((logf.view(-1, s) + m_rows) * math.log2(math.e)).view_as(logf).contiguous()
        calls = {
            "states": lambda cfg: chunkwise.chunk_states(k, v, igate, logf, args.chunk,
                                                         config=cfg)[0],
            "grads": lambda cfg: chunkwise.chunk_state_grads(q, dh, logf, m_log2, r, beta,
                                                             m_states, args.chunk,
                                                             config=cfg)[0],
        }
        for kernel in args.kernels:
            call, default = calls[kernel], defaults[kernel]
            ref = call(default).float()
            rows = []
            for cfg in [default] + [c for c in grid if c != default]:
                if time.monotonic() - start > args.budget_s:
                    rows.append((cfg, None, None, "skipped (budget)"))
                    continue
                try:
                    out = call(cfg).float()
                    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                    ms = (triton.testing.do_bench(lambda: call(cfg), warmup=10, rep=40)
                          if device.type == "cuda" else float("nan"))
                    rows.append((cfg, ms, err, "MISMATCH" if err > MISMATCH else ""))
                except Exception as exc:  # a config the compiler or the device refuses
                    rows.append((cfg, None, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
            print(f"\n## {kernel}, S = {s} (B = {b}); default {default}", flush=True)
            print("| block_v | sub | warps | stages | ms | rel. err vs default | note |")
            print("|---|---|---|---|---|---|---|")
            timed = sorted((r for r in rows if r[1] is not None), key=lambda r: r[1])
            for cfg, ms, err, note in timed + [r for r in rows if r[1] is None]:
                mark = " (default)" if cfg == default else ""
                ms_text = "" if ms is None else f"{ms:.4f}"
                err_text = "" if err is None else f"{err:.1e}"
                print(f"| {cfg.block_v} | {cfg.sub} | {cfg.num_warps} | {cfg.num_stages} | "
                      f"{ms_text}{mark} | {err_text} | {note} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
