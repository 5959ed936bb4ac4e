"""Tile sweep for fp8 dW (GPU): what ``AMAX_TILE`` / ``CODES_TILE``
(``compileops/grouped_linear/kernels/fp8_wgrad.py``) and ``choose_fp8_wgrad_config``
(``kernels/config.py``) should be.

For each ``bench_moe_layer.py`` layer (uniform groups, bf16 operands):

* ``quantiser``: each dW operand (``[tokens * top_k, width]``: x, h, and the two products'
  output gradients) through the amax pass and the codes pass, alone, with each candidate
  ``(rows, columns, warps)`` tile;
* ``product``: each of the two expert products' whole fp8 dW (both quantisations and the
  product, fast accumulation) with the default pick and each candidate product config,
  against the bf16 dW kernel on the same operands.

    python benchmarks/tuning/sweep_fp8_wgrad.py [--shapes mixtral ...] [--parts quantiser product]
        [--align 64 128]
    python benchmarks/tuning/sweep_fp8_wgrad.py --list   # the candidates, no GPU

Prints one line per case; writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_moe_layer import SHAPES  # noqa: E402
from compileops.grouped_linear import kernels  # noqa: E402
from compileops.grouped_linear.fp8 import E4M3  # noqa: E402
from compileops.grouped_linear.kernels import fp8_wgrad  # noqa: E402

QUANTISER_TILES = [(64, 128, 4), (128, 64, 4), (128, 32, 4), (64, 64, 4), (64, 32, 4),
                   (32, 64, 2), (32, 128, 2), (128, 128, 8)]
PRODUCT_CONFIGS = {
    "64x128x256-w8s4": kernels.Config(64, 128, 256, num_warps=8, num_stages=4),
    "128x128x128-w8s4": kernels.Config(128, 128, 128, num_warps=8, num_stages=4),
    "128x128x256-w8s3": kernels.Config(128, 128, 256, num_warps=8, num_stages=3),
    "128x256x128-w8s3": kernels.Config(128, 256, 128, num_warps=8, num_stages=3),
}
ALIGN = 128  # every candidate's rows divide it


def uniform_offsets(rows: int, groups: int, device) -> torch.Tensor:
    return torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn)


def sweep_quantiser(x: torch.Tensor, offsets: torch.Tensor, label: str,
                    align: int = ALIGN) -> None:
    """Both passes of ``quantize_group_columns`` launched alone, per tile; GB/s counts the
    bytes each pass must move (amax: read x; codes: read x, write one byte a code)."""
    m, c = x.shape
    g = offsets.shape[0]
    width = fp8_wgrad.padded_width(m, g, align)
    padded = fp8_wgrad.padded_group_offsets(offsets, m, align)
    q_t = torch.empty((c, width), dtype=E4M3, device=x.device)
    scale = torch.empty((g, c), dtype=torch.float32, device=x.device)
    bits = torch.zeros((g, c), dtype=torch.int32, device=x.device)
    # As quantize_group_columns launches them: rows cut to the alignment.
    tiles = dict.fromkeys(fp8_wgrad.tile_within_spans(tile, align) for tile in QUANTISER_TILES)
    for tile in tiles:
        rows, cols, warps = tile
        amax_ms = time_ms(lambda: fp8_wgrad.launch_group_columns_amax(
            x, bits, offsets, padded, width, tile))
        codes_ms = time_ms(lambda: fp8_wgrad.launch_group_columns_codes(
            x, q_t, scale, bits, offsets, padded, tile))
        print(f"{label} [{m}, {c}] G={g} align {align} tile {rows}x{cols} w{warps}: "
              f"amax {amax_ms:.3f} ms "
              f"({x.numel() * 2 / amax_ms / 1e6:.0f} GB/s), codes {codes_ms:.3f} ms "
              f"({x.numel() * 3 / codes_ms / 1e6:.0f} GB/s)", flush=True)


def sweep_product(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                  label: str) -> None:
    m, n = dy.shape
    k = x.shape[1]
    bf16 = time_ms(lambda: kernels.grouped_linear_wgrad(dy, x, offsets, torch.bfloat16, None,
                                                        with_db=False))
    cells = [f"bf16 dW {bf16:.3f} ms ({2 * m * n * k / bf16 / 1e9:.0f} TF/s)"]
    for name, cfg in [("default", None)] + list(PRODUCT_CONFIGS.items()):
        ms = time_ms(lambda: kernels.grouped_linear_wgrad_fp8(
            dy, x, offsets, torch.bfloat16, fast_accum=True, config=cfg))
        cells.append(f"fp8 {name} {ms:.3f}")
    print(f"{label} dW M={m} N={n} K={k}: " + "; ".join(cells), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--parts", nargs="*", default=["quantiser", "product"],
                        choices=["quantiser", "product"])
    parser.add_argument("--align", type=int, nargs="*", default=[ALIGN],
                        help="span alignments to sweep the quantiser at (powers of two, "
                             "16-128; the product's row step sets it: 64 or 128)")
    parser.add_argument("--list", action="store_true", help="print the candidates and exit")
    args = parser.parse_args()
    for align in args.align:
        if align < fp8_wgrad.GROUP_ALIGN or align > ALIGN or align & (align - 1):
            parser.error(f"--align takes powers of two from {fp8_wgrad.GROUP_ALIGN} to {ALIGN}, "
                         f"got {align}")
    if args.list:
        print("quantiser tiles (rows, columns, warps):", QUANTISER_TILES)
        print("product configs:", list(PRODUCT_CONFIGS))
        return 0
    if not torch.cuda.is_available():
        print("sweep_fp8_wgrad.py times GPU kernels and needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    for key in args.shapes:
        shape = SHAPES[key]
        rows = shape.tokens * shape.top_k
        offsets = uniform_offsets(rows, shape.experts, device)
        # (product, output gradient's width, input's width)
        for product, n, k in (("gate/up", 2 * shape.hidden, shape.dim),
                              ("down", shape.dim, shape.hidden)):
            dy = torch.randn(rows, n, device=device, generator=gen).bfloat16()
            x = torch.randn(rows, k, device=device, generator=gen).bfloat16()
            label = f"{shape.name} {product}"
            if "quantiser" in args.parts:
                for align in args.align:
                    sweep_quantiser(dy, offsets, label + " dY", align)
                    sweep_quantiser(x, offsets, label + " x", align)
            if "product" in args.parts:
                sweep_product(dy, x, offsets, label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
