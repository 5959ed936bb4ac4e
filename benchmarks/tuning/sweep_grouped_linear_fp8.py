"""Tile-config sweep for the fp8 grouped products (GPU): what the fp8 rule in
``compileops.grouped_linear.kernels.config`` (``_generic_fp8_config``) should be.

For each of ``bench_moe_layer.py``'s expert GEMMs (gate/up: the SwiGLU pass; down: forward
and dX), each scaling (rowwise, blockwise) and each candidate config, it times the fp8
product alone (operands quantised beforehand, as a cached weight and a fused producer would
give them), checks it against the bf16 product (relative L2 within 6e-2), and prints the
ratio to bf16 ``torch._grouped_mm`` and, for rowwise forward products, to torchao's
``_to_fp8_rowwise_then_scaled_grouped_mm`` (which also quantises both operands: the ratio
says what a fused layer could gain over it), all in the same process. The quantisers are
timed once per operand.

    python benchmarks/tuning/sweep_grouped_linear_fp8.py [--layers qwen3-30b ...]
        [--scalings rowwise] [--passes fwd swiglu dX]
    python benchmarks/tuning/sweep_grouped_linear_fp8.py --scalings rowwise --fast-accum
    python benchmarks/tuning/sweep_grouped_linear_fp8.py --list-configs   # JSON, no GPU
    python benchmarks/tuning/sweep_grouped_linear_fp8.py --smoke          # CPU, tiny, seconds

Uniform routing, group sizes a multiple of 16 (torchao's requirement). Uses the tuning API
(``Config``, ``mjagged_gemm``'s ``config=``) and the launchers of
``compileops.grouped_linear.kernels.fp8``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import harness  # noqa: E402
from benchmarks.bench_moe_layer import SHAPES as LAYERS  # noqa: E402
from benchmarks.bench_moe_layer import SMOKE_SHAPES  # noqa: E402
from compileops.grouped_linear import fp8 as fp8_rule  # noqa: E402
from compileops.grouped_linear.kernels import Config, mjagged_gemm  # noqa: E402

# Candidates: the rule's picks and their neighbours (8-bit operands: K steps of 128 bytes).
CONFIGS = [
    Config(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
    Config(128, 128, 128, num_warps=8, num_stages=4),
    Config(128, 128, 128, num_warps=8, num_stages=3),
    Config(128, 64, 128, num_warps=8, num_stages=4),
    Config(64, 128, 128, num_warps=4, num_stages=4),
    Config(128, 128, 128, num_warps=8, num_stages=3, flatten=True),
    Config(128, 128, 128, num_warps=8, num_stages=4, programs_per_sm=2),
]
# With fast accumulation (--fast-accum) the MMA accumulates in place: no second fp32
# accumulator, so 128 x 256 tiles hold as many registers as 128 x 128 ones with the default
# accumulation. Also Triton's warp specialisation of the persistent loop (not flattened).
FAST_ACCUM_CONFIGS = [
    Config(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
    Config(128, 128, 128, num_warps=8, num_stages=3),
    Config(128, 256, 128, num_warps=8, num_stages=3, flatten=True),
    Config(128, 256, 128, num_warps=8, num_stages=3),
    Config(256, 128, 128, num_warps=8, num_stages=3, flatten=True),
    Config(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    Config(128, 128, 128, num_warps=8, num_stages=4, warp_specialize=True),
    Config(128, 256, 128, num_warps=8, num_stages=3, warp_specialize=True),
    Config(128, 128, 128, num_warps=4, num_stages=4, warp_specialize=True),
    Config(128, 256, 128, num_warps=8, num_stages=3, flatten=True, tma_store=True),
]


def label(cfg: Config) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            + (" flat" if cfg.flatten else "") + (f" pps{cfg.programs_per_sm}"
                                                   if cfg.programs_per_sm > 1 else "")
            + (" ws" if cfg.warp_specialize else "") + (" tma_store" if cfg.tma_store else ""))


def timed_ms(fn, device) -> float:
    """do_bench's ms on a GPU; one call's wall time on CPU (--smoke: meaningless numbers)."""
    if device.type == "cuda":
        return harness.bench_ms(fn, warmup=5, rep=30)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def gemms(layers):
    """(name, pass, G, M, K, N): the layers' expert products."""
    out = []
    for key in layers:
        layer = {**LAYERS, **SMOKE_SHAPES}[key]
        rows = layer.tokens * layer.top_k
        out.append((f"{key} gate/up", "swiglu", layer.experts, rows, layer.dim, 2 * layer.hidden))
        for stage in ("fwd", "dX"):
            out.append((f"{key} down", stage, layer.experts, rows, layer.hidden, layer.dim))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--scalings", nargs="*", default=["rowwise", "blockwise"],
                   choices=["rowwise", "blockwise"])
    p.add_argument("--passes", nargs="*", default=["swiglu", "fwd", "dX"],
                   choices=["swiglu", "fwd", "dX"])
    p.add_argument("--fast-accum", action="store_true",
                   help="rowwise products with fast accumulation, and its candidate tiles")
    p.add_argument("--list-configs", action="store_true", help="print the candidates, exit")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny layer on CPU (Triton's interpreter), two configs: checks the script")
    a = p.parse_args()
    candidates = FAST_ACCUM_CONFIGS if a.fast_accum else CONFIGS
    if a.fast_accum and a.scalings != ["rowwise"]:
        p.error("--fast-accum applies to the rowwise products: pass --scalings rowwise")
    if a.list_configs:
        print(json.dumps([label(c) for c in candidates]))
        return 0
    from compileops.grouped_linear.kernels import fp8 as k8

    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import (
            _to_fp8_rowwise_then_scaled_grouped_mm as torchao_fp8,
        )
    except Exception as exc:  # the anchor is optional: say so and go on
        torchao_fp8 = None
        print(f"torchao not available ({type(exc).__name__}): no torchao column", flush=True)
    dev = torch.device("cpu" if a.smoke else "cuda")
    configs = [Config(16, 32, 32, num_warps=1, num_stages=1)] if a.smoke else candidates
    if a.smoke:
        torchao_fp8 = None
    print(harness.environment_line(), flush=True)
    for name, stage, groups, m, k, n in gemms(list(SMOKE_SHAPES) if a.smoke else a.layers):
        if stage not in a.passes:
            continue
        gen = torch.Generator(device=dev).manual_seed(0)
        per = max(16, m // groups // 16 * 16)
        m = max(m, per * groups)
        offs = (torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * per)
        w = (torch.randn(groups, n, k, device=dev, generator=gen) / k ** 0.5).bfloat16()
        transposed = stage == "dX"
        a_in = torch.randn(m, n if transposed else k, device=dev, generator=gen).bfloat16()
        flops = 2.0 * per * groups * n * k
        if transposed:
            want = torch._grouped_mm(a_in, w, offs=offs)
            anchor = lambda: torch._grouped_mm(a_in, w, offs=offs)  # noqa: E731
        else:
            want = torch._grouped_mm(a_in, w.transpose(-2, -1), offs=offs)
            anchor = lambda: torch._grouped_mm(a_in, w.transpose(-2, -1), offs=offs)  # noqa: E731
        if stage == "swiglu":
            gate, up = want.chunk(2, dim=-1)
            want = torch.nn.functional.silu(gate) * up
        bf16_ms = timed_ms(anchor, dev)
        tao_ms = None
        if torchao_fp8 is not None and stage == "fwd":
            tao_ms = timed_ms(lambda: torchao_fp8(
                a_in, w.transpose(-2, -1), offs, pad_token_groups_for_grouped_mm=False), dev)
        print(f"== {name} {stage}: G {groups} M {m} K {k} N {n}; bf16 _grouped_mm "
              f"{bf16_ms:.4f} ms" + (f", torchao fp8 {tao_ms:.4f} ms" if tao_ms else ""),
              flush=True)
        rows = int(offs[-1])
        for scaling in a.scalings:
            if scaling == "rowwise":
                wq, ws = k8.quantize_weight_rowwise(w, transpose=transposed)
                # dX: dY times the forward copy's scales, quantised per row; unit weight
                # scales (compileops.grouped_linear.fp8, "dX from the forward's weight copy").
                a_q_in = (fp8_rule.scale_gradient_rows(a_in, ws, offs) if transposed
                          else a_in)
                aq = k8.quantize_rowwise(a_q_in)
                strides = (wq.stride(0), wq.stride(2), wq.stride(1))
                n_out = wq.shape[1] // (2 if stage == "swiglu" else 1)
                w_scales = torch.ones(wq.shape[:2], device=dev) if transposed else ws
                launch = dict(b_strides=strides, n_out=n_out, fp8_scales=(aq[1], w_scales),
                              b_kn=False)
                quant_ms = timed_ms(lambda: k8.quantize_rowwise(a_q_in), dev)
            else:
                wq, ws = k8.quantize_blockwise(w, fp8_rule.WEIGHT_BLOCK)
                aq = k8.quantize_blockwise(a_in, fp8_rule.ACTIVATION_BLOCK)
                sg, sn, sk = ws.stride()
                if transposed:
                    launch = dict(b_strides=wq.stride(), n_out=k, b_kn=True,
                                  fp8_block_scales=(aq[1], ws, (sg, sk, sn)))
                else:
                    launch = dict(b_strides=(wq.stride(0), wq.stride(2), wq.stride(1)),
                                  n_out=n // (2 if stage == "swiglu" else 1), b_kn=False,
                                  fp8_block_scales=(aq[1], ws, (sg, sn, sk)))
                quant_ms = timed_ms(
                    lambda: k8.quantize_blockwise(a_in, fp8_rule.ACTIVATION_BLOCK), dev)
            print(f"   {scaling}: quantising the activation {quant_ms:.4f} ms", flush=True)
            for cfg in [None, *configs]:
                tag = "(default)" if cfg is None else label(cfg)

                def run(cfg=cfg):
                    return mjagged_gemm(aq[0], wq, launch["b_strides"], offs, launch["n_out"],
                                        out_dtype=torch.bfloat16, swiglu=stage == "swiglu",
                                        b_kn=launch["b_kn"], config=cfg,
                                        fp8_scales=launch.get("fp8_scales"),
                                        fp8_block_scales=launch.get("fp8_block_scales"),
                                        fp8_fast_accum=a.fast_accum)
                try:
                    got = run()
                    err = float((got[:rows].float() - want[:rows].float()).norm()
                                / want[:rows].float().norm())
                    ms = timed_ms(run, dev)
                except Exception as exc:  # a config may not fit (shared memory, registers)
                    print(f"   {scaling} {tag:36s} FAILED {type(exc).__name__}: "
                          f"{str(exc)[:160]}", flush=True)
                    continue
                check = "ok" if err <= 6e-2 else f"WRONG rel err {err:.2e}"
                print(f"   {scaling} {tag:36s} {ms:8.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s "
                      f"{bf16_ms / ms:5.2f}x bf16" + (f" {tao_ms / ms:5.2f}x torchao" if tao_ms
                                                      else "") + f"  {check}", flush=True)
        del w, a_in, want
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
