"""Probe (GPU): where the dW kernel loses to torch._grouped_mm on skewed group sizes.

Same FLOPs, different group sizes: a linear cost model (a fixed cost per tile plus one step
per 64-row chunk) says balanced and skewed splits cost the same apart from the schedule's
imbalance, yet our dW can lose more than the anchor on the Dirichlet(1) splits of Mixtral
and DeepSeek (benchmarks/RESULTS.md). This script separates the suspects:

* ``order``: the skewed sizes in their drawn order, sorted large-first and small-first
  (the schedule's imbalance changes with the order, the per-size costs do not);
* ``round64``: the skewed sizes rounded to multiples of 64 rows (no partial last chunk),
  same total;
* ``single``: one group alone at several sizes (Mixtral / DeepSeek dims, the group's rows
  only): the per-size throughput of both kernels.

Ours and the anchor are timed in ``--rounds`` alternating rounds, medians reported
(``bench_grouped_linear.time_alternating``).

    python3 benchmarks/tuning/probe_grouped_linear_dw.py [--shapes deepseek_v3 ...] [--profile]

``--profile``: skip the timings; run each case's kernels once between
``cudaProfilerStart/Stop`` for ``ncu --profile-from-start off``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_grouped_linear import SHAPES, make_offsets, time_alternating  # noqa: E402
from compileops.grouped_linear import kernels  # noqa: E402


def offsets_from_sizes(sizes: torch.Tensor, device) -> torch.Tensor:
    return torch.cumsum(sizes.to(torch.int64), 0).to(torch.int32).to(device)


def round_to_64(sizes: torch.Tensor) -> torch.Tensor:
    rounded = (sizes + 32) // 64 * 64
    rounded[torch.argmax(rounded)] += int(sizes.sum() - rounded.sum())  # keep the total
    return rounded


def parse_variant(field: str) -> dict:
    """``"a+b=2"`` -> ``{"a": True, "b": 2}`` (Config fields)."""
    out = {}
    for part in field.split("+"):
        name, _, value = part.partition("=")
        out[name] = int(value) if value else True
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["mixtral", "deepseek_v3", "qwen3_down"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--single", nargs="*", type=int, default=[256, 1024, 2048, 4096])
    parser.add_argument("--cases", nargs="*", default=None,
                        help="only these case labels (e.g. balanced skewed)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="Config changes, one timed variant each: a field name switches "
                             "it on, field=INT sets it; '+' joins them (e.g. dynamic_tiles "
                             "block_m=128+num_stages=2+epilogue_subtile)")
    parser.add_argument("--variants-no-db", action="store_true",
                        help="time the variants without db (compare with 'ours no db')")
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    for name in args.shapes:
        groups, m, k, n = SHAPES[name]
        x = torch.randn(m, k, device=dev, dtype=bf16)
        dy = torch.randn(m, n, device=dev, dtype=bf16)
        skew = make_offsets(groups, m, "skewed", dev).cpu()
        sizes = torch.diff(skew, prepend=skew.new_zeros(1)).to(torch.int64)
        cases = {
            "balanced": make_offsets(groups, m, "balanced", dev),
            "skewed": skew.to(dev),
            "skewed large-first": offsets_from_sizes(torch.sort(sizes, descending=True)[0], dev),
            "skewed small-first": offsets_from_sizes(torch.sort(sizes)[0], dev),
            "skewed round64": offsets_from_sizes(round_to_64(sizes), dev),
        }
        if name in ("mixtral", "deepseek_v3"):
            for rows in args.single:
                cases[f"single {rows}"] = torch.tensor([rows], dtype=torch.int32, device=dev)
        for label, offs in cases.items():
            if args.cases and label not in args.cases:
                continue
            rows = int(offs[-1])
            flops = 2.0 * rows * n * k

            def ours(offs=offs):
                return kernels.grouped_linear_wgrad(dy, x, offs, bf16, bf16)

            def ours_no_db(offs=offs):
                return kernels.grouped_linear_wgrad(dy, x, offs, bf16, bf16, with_db=False)

            def anchor(offs=offs):
                return torch._grouped_mm(dy.t(), x, offs=offs)

            fns = {"ours": ours, "ours no db": ours_no_db, "anchor": anchor}
            default = kernels.choose_wgrad_config(rows, offs.numel(), n, k, bf16, dev)
            want_dw, want_db = ours()
            for field in args.variants:
                cfg = dataclasses.replace(default, **parse_variant(field))

                def variant(offs=offs, cfg=cfg):
                    return kernels.grouped_linear_wgrad(dy, x, offs, bf16, bf16, config=cfg,
                                                        with_db=not args.variants_no_db)

                got_dw, got_db = variant()
                # A different block_m changes the fp32 summation order: then only close.
                dw_err = float((got_dw.float() - want_dw.float()).norm()
                               / want_dw.float().norm().clamp_min(1e-30))
                line = (f"{name:12s} {label:20s} {field}: dW bitwise {torch.equal(got_dw, want_dw)}"
                        f" (rel diff {dw_err:.1e})")
                if got_db is not None:
                    db_err = float((got_db.float() - want_db.float()).norm()
                                   / want_db.float().norm().clamp_min(1e-30))
                    line += f", db bitwise {torch.equal(got_db, want_db)} (rel diff {db_err:.1e})"
                print(line, flush=True)
                fns[field] = variant
            if args.profile:
                for fn in fns.values():
                    fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                for fn in fns.values():
                    fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                print(f"{name} {label}: profiled", flush=True)
                continue
            ms = time_alternating(fns, args.rounds, smoke=False)
            line = "  ".join(f"{impl} {t:7.4f} ms {flops / t / 1e9:6.1f} TF/s"
                             for impl, t in ms.items())
            ratios = "  ".join(f"{impl} {ms['anchor'] / t:.3f}" for impl, t in ms.items()
                               if impl != "anchor")
            print(f"{name:12s} {label:20s} {line}\n{'':33s} vs anchor: {ratios}", flush=True)
        del x, dy
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
