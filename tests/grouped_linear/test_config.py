"""The config heuristics take the device as an explicit description (``DeviceSpec``): what
would run on an H100, an H200 or a part with less shared memory, asked on a CPU machine.
Host-only: no kernel runs."""
import dataclasses

import pytest
import torch

from compileops.grouped_linear import kernels
from compileops.grouped_linear.kernels import Config, DeviceSpec
from compileops.grouped_linear.kernels import config as config_mod

BF16 = torch.bfloat16
# (M, G, N, K, swiglu): the MoE layers' products (bench_moe_layer.py) and small-group cases.
CASES = [(16384, 8, 14336, 4096, True), (16384, 8, 4096, 14336, False),
         (65536, 128, 768, 2048, True), (65536, 128, 2048, 768, False),
         (4096, 256, 1024, 512, False), (512, 64, 1024, 512, False), (65536, 64, 128, 512, False)]
A100 = DeviceSpec("NVIDIA A100-SXM4-80GB", 108, 166912, (8, 0))
SMALL_SMEM = DeviceSpec("a part with 99 KB per block", 84, 101376, (8, 9))


def test_device_spec_of_cpu_is_the_interpreter():
    assert kernels.device_spec(torch.device("cpu")) is kernels.INTERPRETER
    assert kernels.device_spec(kernels.H200) is kernels.H200
    for m, g, n, k, swiglu in CASES:
        assert kernels.choose_config(m, g, n, k, BF16, torch.device("cpu"),
                                     swiglu=swiglu) == kernels.INTERPRETER_CONFIG


def test_the_h100_row_is_what_it_runs():
    """The measured H100 picks (TUNED's row): 128 x 256 four-stage flattened forward and dX,
    128 x 128 SwiGLU, the three dW configs; small groups and fp32 stay generic."""
    h100 = kernels.H100_SXM
    assert kernels.choose_config(16384, 8, 4096, 14336, BF16, h100) == Config(
        128, 256, 64, 8, 4, flatten=True)
    assert kernels.choose_config(16384, 8, 14336, 4096, BF16, h100, swiglu=True) == Config(
        128, 128, 64, 8, 3)
    for m, g, want in ((65536, 64, kernels.WGRAD_LONG_CONFIG),
                       (65536, 128, kernels.WGRAD_MID_CONFIG),
                       (65536, 256, kernels.WGRAD_SHORT_CONFIG)):
        assert kernels.choose_wgrad_config(m, g, 2048, 768, BF16, h100) == want
    assert kernels.choose_config(512, 64, 1024, 512, BF16, h100) == Config(16, 128, 64, 4, 4)


def test_a_part_takes_only_its_own_row(monkeypatch):
    """A row measured on one part never reaches another: an H200 row changes the H200's
    pick and nothing else; a case the row does not list keeps the generic rule."""
    h200_swiglu = Config(128, 128, 64, 8, 4, flatten=True)
    monkeypatch.setitem(kernels.TUNED, kernels.H200.name, {"swiglu": h200_swiglu})
    for m, g, n, k, swiglu in CASES:
        h100 = kernels.choose_config(m, g, n, k, BF16, kernels.H100_SXM, swiglu=swiglu)
        h200 = kernels.choose_config(m, g, n, k, BF16, kernels.H200, swiglu=swiglu)
        tuned = swiglu and m / g > 64
        assert (h200 == h200_swiglu) == tuned, (m, g, n, k, swiglu, h200)
        if not tuned:
            assert h200 == h100, (m, g, n, k, swiglu)


def test_generic_rule_fits_the_parts_shared_memory():
    """Parts without a row: as many operand stages as the part's shared memory holds (the
    four-stage 128 x 256 tile on sm90's 227 KB; fewer stages, or the narrower tile, on
    parts with less), and never a dW config that needs more than the part has."""
    for spec in (kernels.H200, A100, SMALL_SMEM):
        for m, g, n, k, swiglu in CASES:
            cfg = kernels.choose_config(m, g, n, k, BF16, spec, swiglu=swiglu)
            stage = config_mod.operand_stage_bytes(cfg, 2, swiglu=swiglu)
            assert stage * cfg.num_stages <= spec.smem_per_block - config_mod.EPILOGUE_SMEM_RESERVE \
                or cfg.num_stages == 2, (spec.name, cfg)
    assert kernels.choose_config(16384, 8, 4096, 14336, BF16, kernels.H200).num_stages == 4
    a100 = kernels.choose_config(16384, 8, 4096, 14336, BF16, A100)
    assert (a100.block_n, a100.num_stages) == (128, 3), a100
    for m, g in ((65536, 64), (65536, 128)):
        assert kernels.choose_wgrad_config(m, g, 2048, 768, BF16, A100) \
            == kernels.WGRAD_SHORT_CONFIG


def test_grid_is_one_program_per_sm_of_the_part():
    cfg = dataclasses.replace(kernels.WGRAD_SHORT_CONFIG)
    assert kernels.grid_size(kernels.H100_SXM, cfg) == 132 * cfg.programs_per_sm
    assert kernels.grid_size(A100, cfg) == 108 * cfg.programs_per_sm
    assert kernels.grid_size(torch.device("cpu"), cfg) == 4 * cfg.programs_per_sm


@pytest.mark.parametrize("spec", [kernels.H100_SXM, kernels.H200], ids=lambda s: s.name)
def test_tuned_rows_hold_configs_of_their_cases(spec):
    """Every TUNED row names known cases and valid dW variants (a typo in a row added after
    a sweep would otherwise be ignored silently)."""
    from compileops.grouped_linear.kernels.kjagged import check_wgrad_variant

    cases = {"swiglu", "fwd", "fwd_narrow", "wgrad_long", "wgrad_mid", "wgrad_short"}
    for name, row in kernels.TUNED.items():
        assert set(row) <= cases, (name, set(row) - cases)
        for case, cfg in row.items():
            assert isinstance(cfg, Config), (name, case)
            if case.startswith("wgrad"):
                check_wgrad_variant(cfg)


# The fp8 products of bench_moe_layer.py's layers (M routed rows, G, N out, K, swiglu), and
# the e4m3 config each gets on the sm90 parts: the rule of the H200 tile sweep
# (benchmarks/tuning/sweep_grouped_linear_fp8.py), pinned so that a change to it is seen.
FP8_LAYER_PRODUCTS = {
    "Mixtral gate/up": (16384, 8, 14336, 4096, True),
    "Mixtral down": (16384, 8, 4096, 14336, False),
    "Mixtral down dX": (16384, 8, 14336, 4096, False),
    "Qwen3-30B-A3B gate/up": (65536, 128, 768, 2048, True),
    "Qwen3-30B-A3B down": (65536, 128, 2048, 768, False),
    "Qwen3-30B-A3B down dX": (65536, 128, 768, 2048, False),
    "DeepSeek-V3 gate/up": (32768, 32, 2048, 7168, True),
    "DeepSeek-V3 down": (32768, 32, 7168, 2048, False),
    "Qwen3-235B-A22B down": (65536, 128, 4096, 1536, False),
}
FP8_WANT = {
    "Mixtral gate/up": Config(128, 128, 128, num_warps=8, num_stages=3),
    "Mixtral down": Config(128, 128, 128, num_warps=8, num_stages=4),
    "Mixtral down dX": Config(128, 128, 128, num_warps=8, num_stages=4),
    "Qwen3-30B-A3B gate/up": Config(128, 128, 128, num_warps=8, num_stages=3, flatten=True),
    "Qwen3-30B-A3B down": Config(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
    "Qwen3-30B-A3B down dX": Config(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
    "DeepSeek-V3 gate/up": Config(128, 128, 128, num_warps=8, num_stages=3),
    "DeepSeek-V3 down": Config(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
    "Qwen3-235B-A22B down": Config(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
}


@pytest.mark.parametrize("spec", [kernels.H100_SXM, kernels.H200], ids=lambda s: s.name)
@pytest.mark.parametrize("name", list(FP8_LAYER_PRODUCTS))
def test_fp8_configs_of_the_layer_products_are_pinned(name, spec):
    m, g, n, k, swiglu = FP8_LAYER_PRODUCTS[name]
    got = kernels.choose_config(m, g, n, k, torch.float8_e4m3fn, spec, swiglu=swiglu)
    assert got == FP8_WANT[name], (name, got)


# With fast accumulation (one in-place MMA accumulator per tile): 128 x 256 tiles, three
# stages, flattened at every K; SwiGLU 128 x 128, three stages, not flattened (the
# fast-accumulation sweep: benchmarks/tuning/sweep_grouped_linear_fp8.py --fast-accum).
FAST_PRODUCT = Config(128, 256, 128, num_warps=8, num_stages=3, flatten=True)
FAST_SWIGLU = Config(128, 128, 128, num_warps=8, num_stages=3)


@pytest.mark.parametrize("spec", [kernels.H100_SXM, kernels.H200], ids=lambda s: s.name)
@pytest.mark.parametrize("name", list(FP8_LAYER_PRODUCTS))
def test_fp8_fast_accumulation_configs_of_the_layer_products_are_pinned(name, spec):
    m, g, n, k, swiglu = FP8_LAYER_PRODUCTS[name]
    got = kernels.choose_config(m, g, n, k, torch.float8_e4m3fn, spec, swiglu=swiglu,
                                fp8_fast_accum=True)
    assert got == (FAST_SWIGLU if swiglu else FAST_PRODUCT), (name, got)


@pytest.mark.parametrize("spec", [kernels.H100_SXM, kernels.H200], ids=lambda s: s.name)
@pytest.mark.parametrize("name", list(FP8_LAYER_PRODUCTS))
def test_fp8_fast_accumulation_with_fp32_outputs_keeps_the_default_tiles(name, spec):
    """fp32 activations give fp32 outputs: the flattened 128 x 256 tile's three stages and
    its fp32 output tile do not fit one block's shared memory together, so the plain
    products take the default accumulation's tile; bf16 outputs keep the wide one."""
    m, g, n, k, swiglu = FP8_LAYER_PRODUCTS[name]
    got = kernels.choose_config(m, g, n, k, torch.float8_e4m3fn, spec, swiglu=swiglu,
                                fp8_fast_accum=True, out_dtype=torch.float32)
    assert got == (FAST_SWIGLU if swiglu else FP8_WANT[name]), (name, got)
    assert kernels.choose_config(m, g, n, k, torch.float8_e4m3fn, spec, swiglu=swiglu,
                                 fp8_fast_accum=True, out_dtype=BF16) == (
        FAST_SWIGLU if swiglu else FAST_PRODUCT)


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_flattened_fp8_tiles_fit_with_their_output_tile(out_dtype, fast_accum):
    """Every flattened fp8 tile the rule gives, at group means from 65 to 4096 rows and K
    from 256 to 16384, holds its operand stages and its output tile in one block."""
    from compileops.grouped_linear.kernels.config import _flattened_epilogue_fits

    for spec in (kernels.H100_SXM, kernels.H200):
        for mean in (65, 512, 4096):
            for k in (256, 2048, 16384):
                cfg = kernels.choose_config(mean * 8, 8, 4096, k, torch.float8_e4m3fn, spec,
                                            fp8_fast_accum=fast_accum, out_dtype=out_dtype)
                assert not cfg.flatten or _flattened_epilogue_fits(
                    cfg, spec, out_dtype.itemsize), (spec.name, mean, k, cfg)


def test_fast_accumulation_changes_only_fp8_configs():
    """16-bit products ignore ``fp8_fast_accum``; small fp8 groups keep their short tiles."""
    for dtype in (BF16, torch.float32):
        for args in FP8_LAYER_PRODUCTS.values():
            m, g, n, k, swiglu = args
            assert (kernels.choose_config(m, g, n, k, dtype, kernels.H100_SXM, swiglu=swiglu,
                                          fp8_fast_accum=True)
                    == kernels.choose_config(m, g, n, k, dtype, kernels.H100_SXM,
                                             swiglu=swiglu)), (dtype, args)
    small = kernels.choose_config(4096, 128, 2048, 768, torch.float8_e4m3fn, kernels.H100_SXM,
                                  fp8_fast_accum=True)
    assert (small.block_m, small.block_n) == (64, 128), small

