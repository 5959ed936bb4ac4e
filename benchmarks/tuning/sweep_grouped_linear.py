"""Tile-config sweep for the grouped linear kernels (GPU): what the heuristics in
``compileops.grouped_linear.kernels.choose_config`` / ``choose_wgrad_config`` are based on.

For each benchmark shape and split, times the M-jagged kernel (forward and dX) and the
K-jagged kernel (dW + db) over a bounded list of configs, next to ``torch._grouped_mm`` in
the same process, after checking each config's result against ``torch._grouped_mm``.
Prints one line per (case, config) with ms, TFLOP/s and the ratio to ``_grouped_mm``, then
the best config per case.

    python benchmarks/tuning/sweep_grouped_linear.py [--shapes qwen3_up ...] [--splits skewed ...]
    python benchmarks/tuning/sweep_grouped_linear.py --list-configs   # JSON, no GPU needed

``--layer-shapes`` sweeps the expert GEMMs of ``bench_moe_layer.py``'s layers instead: per
layer its gate/up product (the SwiGLU pass) and its down product (forward and dX).
``--table-row`` ends with the ``TUNED`` row (``compileops/grouped_linear/kernels/config.py``)
these results support for this GPU: per case, the config with the best geometric-mean
speed-up over ``torch._grouped_mm`` across the swept shapes and splits (a config that failed
or was wrong on any of them is out). Filling a device's row:

    python benchmarks/tuning/sweep_grouped_linear.py --layer-shapes --passes swiglu fwd dX \
        --table-row

Uses the documented tuning API only: :class:`~compileops.grouped_linear.kernels.Config`,
``choose_config`` / ``choose_wgrad_config`` and the launchers ``mjagged_gemm`` /
``grouped_linear_wgrad`` (``config=``: a config that fails to launch raises).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import harness  # noqa: E402
from benchmarks.bench_grouped_linear import SHAPES, make_offsets  # noqa: E402
from benchmarks.bench_moe_layer import SHAPES as LAYERS  # noqa: E402
from compileops.grouped_linear import kernels  # noqa: E402
from compileops.grouped_linear.kernels import Config  # noqa: E402

# bench_moe_layer.py's expert GEMMs, (G, M, K, N) as SHAPES, M = tokens * top-k routed rows:
# "<layer>_gate_up" (x [M, D] by the gate/up weight [G, 2H, D]; the SwiGLU pass) and
# "<layer>_down" (h [M, H] by the down weight [G, D, H]; forward and dX).
LAYER_SHAPES = {}
for _key, _layer in LAYERS.items():
    _rows = _layer.tokens * _layer.top_k
    LAYER_SHAPES[f"{_key}_gate_up"] = (_layer.experts, _rows, _layer.dim, 2 * _layer.hidden)
    LAYER_SHAPES[f"{_key}_down"] = (_layer.experts, _rows, _layer.hidden, _layer.dim)
# The passes a layer shape is swept for (a gate/up product is only ever the SwiGLU one).
LAYER_PASSES = {"_gate_up": ("swiglu",), "_down": ("fwd", "dX", "dW")}
# Descriptions for --list-configs without a GPU (the labels mark each shape's default).
DEVICES = {"h100": kernels.H100_SXM, "h200": kernels.H200}

FWD_CONFIGS = [
    Config(128, 256, 64, 8, 3, flatten=True),
    Config(128, 256, 64, 8, 3, flatten=True, group_m=4),
    Config(128, 256, 64, 8, 3, flatten=True, group_m=16),
    Config(256, 128, 64, 8, 3, flatten=True),
    Config(128, 128, 64, 4, 3, programs_per_sm=2),
    Config(128, 128, 64, 4, 3, flatten=True, programs_per_sm=2),
    Config(128, 128, 64, 4, 4, programs_per_sm=2),
    # Output tiles stored by TMA (Config.tma_store; ragged descriptor, see store_rows_below).
    # sm_90 shared memory: 128x256 s3 213528 B (48 KB operand stages + a 64 KB staging tile);
    # the x2/SM one is s2 (98576 B each): with s3 (131352 B) two programs no longer fit on an
    # SM (233472 B), so half the grid would wait for the other half.
    Config(128, 256, 64, 8, 3, flatten=True, tma_store=True),
    Config(128, 128, 64, 4, 2, flatten=True, programs_per_sm=2, tma_store=True),
    # A fourth operand stage for the 128 x 256 tile (4 x 48 KB of shared memory).
    Config(128, 256, 64, 8, 4, flatten=True),
    Config(128, 256, 64, 8, 4, flatten=True, group_m=4),
]
# SwiGLU tiles hold two accumulators (gate and up): half the N width of the plain ones.
SWIGLU_CONFIGS = [
    Config(128, 128, 64, 8, 3, flatten=True),
    Config(128, 128, 64, 8, 3),
    Config(128, 64, 64, 4, 3, programs_per_sm=2),
    Config(128, 64, 64, 4, 4, flatten=True, programs_per_sm=2),
    # TMA stores of the SwiGLU output (about 180 KB of shared memory on sm_90, both).
    Config(128, 128, 64, 8, 3, flatten=True, tma_store=True),
    Config(128, 128, 64, 8, 3, tma_store=True),
]
WGRAD_CONFIGS = [
    Config(64, 128, 256, 8, 3),
    Config(64, 128, 256, 8, 4),
    Config(64, 128, 128, 4, 3, programs_per_sm=2),
    # dW variants aimed at the per-tile overhead (see Config): the masked tail chunk through
    # ragged TMA, the dW tile stored by TMA (whole or in halves), and both together.
    # choose_wgrad_config's defaults are ragged + tma-store (long groups) and x2/SM ragged
    # (short groups). s4 with ragged + whole-tile store needs 265216 B of shared memory,
    # over sm_90's 232448, so it is not listed.
    Config(64, 128, 256, 8, 3, ragged_tma=True),
    Config(64, 128, 256, 8, 3, tma_store=True),
    Config(64, 128, 256, 8, 3, tma_store=True, epilogue_subtile=True),
    Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True),
    Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True, epilogue_subtile=True),
    Config(64, 128, 128, 4, 3, programs_per_sm=2, ragged_tma=True),
    # dW tile order inside a group (Config.group_n): super-blocks of group_n N-tiles swept
    # N-tile fastest, instead of K-tile fastest. For a large skewed group (DeepSeek: up to
    # 3832 rows, X_g 55 MB > the 50 MB L2), K-fastest streams all of X_g once per wave of
    # N-tiles; N-fastest re-reads the smaller dY_g instead. Same dW bits in any order.
    Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True, group_n=4),
    Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True, group_n=8),
    Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True, group_n=16),
    Config(64, 128, 128, 4, 3, programs_per_sm=2, ragged_tma=True, group_n=8),
    # A fourth operand stage for the long-group tile (it helped the M-jagged 128 x 256 tile):
    # without the TMA store (192 KB), and with it in halves (224 KB + a 32 KB staging tile).
    Config(64, 128, 256, 8, 4, ragged_tma=True, group_n=8),
    Config(64, 128, 256, 8, 4, ragged_tma=True, tma_store=True, epilogue_subtile=True,
           group_n=8),
    # Tiles claimed from an atomic ticket counter (Config.dynamic_tiles) instead of the fixed
    # stride: with skewed groups the programs' fixed shares of the work differ.
    Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True, group_n=8, dynamic_tiles=True),
    Config(64, 128, 256, 8, 4, ragged_tma=True, tma_store=True, epilogue_subtile=True,
           group_n=8, dynamic_tiles=True),
    Config(64, 128, 128, 4, 3, programs_per_sm=2, ragged_tma=True, dynamic_tiles=True),
    # One loop over each program's row chunks (Config.flatten; kjagged_flat_loop), as in
    # the long and mid defaults. It applies without db only, so with db these time the
    # tile loop; WGRAD_NO_DB below times the loop itself.
    Config(64, 128, 256, 8, 3, flatten=True, ragged_tma=True, tma_store=True, group_n=8),
    Config(64, 128, 256, 8, 4, flatten=True, ragged_tma=True, tma_store=True,
           epilogue_subtile=True, group_n=8),
]
# Timed once more without db (with_db=False): what the column sums cost.
WGRAD_NO_DB = [Config(64, 128, 256, 8, 3),
               Config(64, 128, 256, 8, 3, ragged_tma=True, tma_store=True, group_n=8),
               Config(64, 128, 256, 8, 3, flatten=True, ragged_tma=True, tma_store=True,
                      group_n=8),
               Config(64, 128, 256, 8, 4, ragged_tma=True, tma_store=True,
                      epilogue_subtile=True, group_n=8),
               Config(64, 128, 256, 8, 4, flatten=True, ragged_tma=True, tma_store=True,
                      epilogue_subtile=True, group_n=8),
               Config(64, 128, 128, 4, 3, programs_per_sm=2, ragged_tma=True, group_n=8)]


class _NoDbConfig(Config):
    """A dW config timed with ``with_db=False`` (labelled 'no db')."""
    _no_db = True


def _no_db(cfg: Config) -> Config:
    return _NoDbConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


def config_label(cfg: Config, default: Optional[Config] = None) -> str:
    """Short config name for the sweep's lines, e.g. ``64x128x256 w8 s3 ragged tma-store``;
    `` (default)`` when ``cfg`` is ``default`` (what the heuristic picks for the case)."""
    is_default = (default is not None and not getattr(cfg, "_no_db", False)
                  and dataclasses.astuple(cfg) == dataclasses.astuple(default))
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
            f"s{cfg.num_stages}{' flat' if cfg.flatten else ''}"
            f"{f' x{cfg.programs_per_sm}/SM' if cfg.programs_per_sm > 1 else ''}"
            f"{f' gm{cfg.group_m}' if cfg.group_m != 8 else ''}"
            f"{f' gn{cfg.group_n}' if cfg.group_n != 1 else ''}"
            f"{' ragged' if cfg.ragged_tma else ''}"
            f"{' tma-store' if cfg.tma_store else ''}"
            f"{'/2' if cfg.tma_store and cfg.epilogue_subtile else ''}"
            f"{' dyn' if cfg.dynamic_tiles else ''}"
            f"{' no db' if getattr(cfg, '_no_db', False) else ''}"
            f"{' (default)' if is_default else ''}")


def list_configs(device=kernels.H100_SXM) -> dict:
    """The configs each pass times, with their labels, and per benchmark shape the labels
    against that shape's heuristic pick on ``device`` (``--list-configs``: what the tests
    check)."""
    def entry(cfg: Config, default: Optional[Config] = None) -> dict:
        return {"config": dataclasses.asdict(cfg), "label": config_label(cfg, default)}

    cuda, bf16 = device, torch.bfloat16
    out = {
        "fwd": [entry(c) for c in FWD_CONFIGS],
        "swiglu": [entry(c) for c in SWIGLU_CONFIGS],
        "dW": [entry(c) for c in WGRAD_CONFIGS],
        "dW no db": [entry(_no_db(c)) for c in WGRAD_NO_DB],
        "dW defaults": {},
    }
    for name, (groups, m, k, n) in SHAPES.items():
        default = kernels.choose_wgrad_config(m, groups, n, k, bf16, cuda)
        out["dW defaults"][name] = {
            "config": dataclasses.asdict(default),
            "labels": [config_label(c, default) for c in WGRAD_CONFIGS],
        }
    return out


def table_case(stage: str, groups: int, m: int, n_out: int) -> Optional[str]:
    """The ``TUNED`` case a timed (pass, shape) informs (``kernels.config``'s cases), or
    None where the heuristic has no table entry (64 rows per group or fewer)."""
    if stage == "dW":
        return kernels.config.wgrad_case(m, groups)
    return kernels.config.mjagged_case(m, groups, n_out, torch.bfloat16,
                                       swiglu=stage == "swiglu")


def table_row(timings: dict, device_name: str, command: str) -> str:
    """The ``TUNED`` row for this GPU, as Python source: per case, the config whose
    geometric-mean speed-up over ``torch._grouped_mm`` across the swept (shape, split) pairs
    is best, among the configs timed (correct) on all of them. ``timings``: case ->
    {(shape, split, pass): {config label: (Config, speed-up)}} (forward and dX both inform
    the "fwd" case)."""
    lines = [f"    # {device_name}: {harness.environment_line().split(' | command')[0]};",
             f"    #   {command}",
             f"    {device_name!r}: {{"]
    for case, per_shape in sorted(timings.items()):
        common = set.intersection(*(set(results) for results in per_shape.values()))
        if not common:
            continue
        label = max(common, key=lambda lb: sum(math.log(r[lb][1]) for r in per_shape.values()))
        cfg = next(iter(per_shape.values()))[label][0]
        gmean = math.exp(sum(math.log(r[label][1]) for r in per_shape.values()) / len(per_shape))
        fields = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(Config)
                           if getattr(cfg, f.name) != f.default or f.name.startswith("block"))
        lines.append(f"        {case!r}: Config({fields}),  # {label}: {gmean:.3f}x over "
                     f"{len(per_shape)} shape/split/pass runs")
    lines.append("    },")
    return "\n".join(lines)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--splits", nargs="*", default=["balanced", "skewed"])
    parser.add_argument("--passes", nargs="*", default=["fwd", "dX", "dW", "swiglu"])
    parser.add_argument("--configs", default="",
                        help="time only the configs whose label matches this regex")
    parser.add_argument("--list-configs", action="store_true",
                        help="print the configs and their labels as JSON and exit (no GPU)")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h100",
                        help="--list-configs: the device description the defaults are for")
    parser.add_argument("--layer-shapes", action="store_true",
                        help="sweep bench_moe_layer.py's expert GEMMs (gate/up: swiglu; "
                             "down: fwd, dX, dW) instead of --shapes")
    parser.add_argument("--table-row", action="store_true",
                        help="end with the TUNED row these results support for this GPU")
    args = parser.parse_args()
    if args.list_configs:
        print(json.dumps(list_configs(DEVICES[args.device])))
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    best: list[str] = []
    timings: dict = {}  # --table-row: case -> {(shape, split, pass): {label: (Config, speed-up)}}
    t0 = time.perf_counter()
    table = {**SHAPES, **LAYER_SHAPES}
    names = list(LAYER_SHAPES) if args.layer_shapes else args.shapes
    for name in names:
        groups, m, k, n = table[name]
        passes = [p for p in args.passes
                  if p in next((v for end, v in LAYER_PASSES.items() if name.endswith(end)),
                               args.passes)]
        for split in args.splits:
            offs = make_offsets(groups, m, split, dev)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
            dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            flops = 2.0 * m * n * k
            w_t = w.transpose(-2, -1)

            def swiglu_anchor():
                gate, up = torch._grouped_mm(x, w_t, offs=offs).chunk(2, dim=-1)
                return torch.nn.functional.silu(gate) * up

            bf16 = torch.bfloat16
            defaults = {  # what the heuristics pick for this case: labelled "(default)"
                "swiglu": kernels.choose_config(m, groups, n // 2, k, bf16, dev, swiglu=True),
                "fwd": kernels.choose_config(m, groups, n, k, bf16, dev),
                "dX": kernels.choose_config(m, groups, k, n, bf16, dev),
                "dW": kernels.choose_wgrad_config(m, groups, n, k, bf16, dev),
            }
            cases = {
                "swiglu": (lambda cfg: kernels.mjagged_gemm(
                               x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, n // 2,
                               out_dtype=x.dtype, config=cfg, swiglu=True),
                           swiglu_anchor, SWIGLU_CONFIGS),
                "fwd": (lambda cfg: kernels.mjagged_gemm(
                            x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, n,
                            out_dtype=x.dtype, config=cfg),
                        lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), FWD_CONFIGS),
                "dX": (lambda cfg: kernels.mjagged_gemm(
                           dy, w, (w.stride(0), w.stride(1), w.stride(2)), offs, k,
                           out_dtype=dy.dtype, config=cfg, b_kn=True),
                       lambda: torch._grouped_mm(dy, w, offs=offs), FWD_CONFIGS),
                "dW": (lambda cfg: kernels.grouped_linear_wgrad(
                           dy, x, offs, torch.bfloat16, torch.bfloat16, config=cfg,
                           with_db=not getattr(cfg, "_no_db", False))[0],
                       lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                       WGRAD_CONFIGS + [_no_db(c) for c in WGRAD_NO_DB]),
            }
            for stage in passes:
                ours, anchor, configs = cases[stage]
                case = f"{name} {split} {stage}"
                want = anchor()
                anchor_ms = harness.bench_ms(anchor, warmup=5, rep=30)
                print(f"{case:28s} torch._grouped_mm{' + eager SwiGLU' if stage == 'swiglu' else ''} {anchor_ms:8.4f} ms "
                      f"{flops / anchor_ms / 1e9:6.1f} TFLOP/s", flush=True)
                results = []
                for cfg in configs:
                    label = config_label(cfg, defaults[stage])
                    if args.configs and not re.search(args.configs, label):
                        continue
                    try:
                        got = ours(cfg)
                        err = rel_err(got[: int(offs[-1])], want[: int(offs[-1])]) if stage != "dW" \
                            else rel_err(got, want)
                        ms = harness.bench_ms(lambda: ours(cfg), warmup=5, rep=30)
                    except Exception as exc:  # a config may not fit (smem, registers)
                        print(f"{case:28s} {label:44s} FAILED {type(exc).__name__}: "
                              f"{str(exc)[:160]}", flush=True)
                        continue
                    ok = "ok" if err < 2e-2 else f"WRONG rel err {err:.2e}"
                    results.append((ms, label))
                    n_out = {"swiglu": n // 2, "fwd": n, "dX": k, "dW": n}[stage]
                    case_key = table_case(stage, groups, m, n_out)
                    # dW: the bias-free layers' form (no db) is what the table's dW runs.
                    no_db = getattr(cfg, "_no_db", False)
                    if case_key and err < 2e-2 and no_db == (stage == "dW"):
                        timings.setdefault(case_key, {}).setdefault((name, split, stage), {})[
                            config_label(cfg)] = (cfg, anchor_ms / ms)
                    print(f"{case:28s} {label:44s} {ms:8.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s "
                          f"{anchor_ms / ms:5.2f}x  {ok}", flush=True)
                if results:
                    ms, label = min(results)
                    best.append(f"{case:28s} best {label:44s} {ms:8.4f} ms  {anchor_ms / ms:5.2f}x")
                del want
            del x, w, dy
            torch.cuda.empty_cache()
    print("\nBest per case:")
    print("\n".join(best))
    if args.table_row:
        print("\nTUNED row for compileops/grouped_linear/kernels/config.py:")
        print(table_row(timings, torch.cuda.get_device_name(dev),
                        "python " + " ".join(sys.argv)))
    print(f"-- sweep wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
