"""Ahead-of-time compile of the eager Triton kernels for an H100 (sm90) on this CPU machine
(triton ships ptxas): catches what the interpreter tolerates but the compiler rejects, and
checks the GEMM loops get Hopper wgmma and software pipelining (cp.async, or TMA copies in
the TMA variants) when strides are specialised as in real launches (unit inner strides,
16-divisible pointers and sizes). Compiling is not running: GPU runs are in the gpu tests."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except Exception:  # pragma: no cover
    pytest.skip("triton's NVIDIA backend is not installed", allow_module_level=True)

from tests.compiled_main import run_main  # noqa: E402
from tests.grouped_linear._helpers import MJAGGED_STORE_VARIANTS, mjagged_store_config  # noqa: E402

TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# fp8 cases: e4m3 operands (A and B), 16-bit everything else.
OPERANDS = {"fp8": "*fp8e4nv", "fp8-blockwise": "*fp8e4nv"}
UNIT = ("stride_ak", "stride_bk", "stride_biasn", "stride_on", "stride_xk", "stride_wk")
UNIT_DX = ("stride_ak", "stride_bn", "stride_biasn", "stride_on")
NOT_DIVISIBLE = ("M", "G")


def compile_sm90(fn, args, constexprs, unit=UNIT, **options):
    """Compile ``fn`` for sm90 with real-launch specialisations (the ``unit`` strides,
    divisibility)."""
    sig, consts = {}, dict(constexprs)
    for name, ty in args:
        if name in unit:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = ty
    for name in constexprs:
        sig[name] = "constexpr"
    # Attributes are keyed by the argument's position in the kernel's own parameter list
    # (a parameter listed in another order here would get another's divisibility).
    divisible = [fn.arg_names.index(n) for n, t in sig.items()
                 if t != "constexpr" and n not in NOT_DIVISIBLE]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def mjagged_args(ptr, operand_ptr=None):
    operand_ptr = operand_ptr or ptr
    return ([(n, operand_ptr) for n in ("a_ptr", "b_ptr")] + [("bias_ptr", ptr)]
            + [("offs_ptr", "*i32"), ("out_ptr", ptr)]
            + [(n, "i32") for n in ("M", "N_OUT", "K", "G")]
            + [(n, "i64") for n in ("stride_am", "stride_ak", "stride_bg", "stride_bk", "stride_bn",
                                    "stride_biasg", "stride_biasn", "stride_om", "stride_on")]
            + [("pre_ptr", ptr), ("stride_pm", "i64"), ("stride_pn", "i64"), ("scale_ptr", ptr),
               ("a_scale_ptr", "*fp32"), ("b_scale_ptr", "*fp32")]
            + [(n, "i64") for n in ("stride_bsg", "stride_asm", "stride_bsn", "stride_bsk")]
            + [("b2_ptr", operand_ptr), ("K2", "i32")])


def mjagged_compile(dtype, swiglu, tma=False, b_kn=False, flatten=False, cfg=None,
                    has_bias=True, save_preact=False, row_scale=False, fast_accum=False,
                    second_weight=False, out=None):
    """``cfg=None``: choose_config's pick for a 16-bit / fp32 MoE shape. ``TMA_STORE`` is
    always passed (``cfg.tma_store`` on the TMA path, as the launcher does; see
    :func:`kjagged_compile` on unnamed defaulted constexprs). ``out``: the output's (and
    the other 16/32-bit pointers') type for fp8 operands, bf16 by default."""
    from compileops.grouped_linear import kernels

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
                   "fp8-blockwise": torch.float8_e4m3fn}[dtype]
    if cfg is None:
        cfg = kernels.choose_config(65536, 128, 1536, 2048, torch_dtype, kernels.H100_SXM,
                                    swiglu=swiglu)
    fp8 = dtype.startswith("fp8")
    return compile_sm90(
        kernels.mjagged_gemm_kernel,
        mjagged_args(TYPES[(out or "bf16") if fp8 else dtype], OPERANDS.get(dtype)),
        dict(HAS_BIAS=has_bias and not fp8, SWIGLU=swiglu, NUM_PROGS=132 * cfg.programs_per_sm,
             GROUP_M=cfg.group_m, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
             BLOCK_K=cfg.block_k, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32",
             INTERPRETER_DOT=False, USE_TMA=tma, B_KN=b_kn, G_BLOCK=kernels.group_block(128),
             FLATTEN=flatten, TMA_STORE=tma and cfg.tma_store, SAVE_PREACT=save_preact,
             ROW_SCALE=row_scale, FP8_ROWWISE=dtype == "fp8",
             FP8_BLOCKWISE=dtype == "fp8-blockwise", FP8_FAST_ACCUM=fast_accum,
             SECOND_WEIGHT=second_weight, WARP_SPECIALIZE=cfg.warp_specialize),
        # dX reads W_g [N, K] as B [K, N]: its unit stride is along N, as in a real launch
        # (TMA descriptors need 16-byte aligned strides but the innermost).
        unit=UNIT_DX if b_kn else UNIT,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def mjagged_ttgir(dtype, swiglu, tma=False, b_kn=False, flatten=False, save_preact=False):
    return mjagged_compile(dtype, swiglu, tma, b_kn, flatten,
                           save_preact=save_preact).asm["ttgir"]


def kjagged_compile(ptr="*fp16", tma=False, block_k=128, num_warps=8, num_stages=3,
                    stride_type="i64", variant=None, fp8=None):
    """``variant``: the dW variant flags set (``wgrad_variant_flags``' constexprs). All of them
    are always passed, as the launcher does: an AOT compile leaves an unnamed defaulted
    constexpr None, and ``ASTSource.hash`` keeps the constexprs' values but not their names,
    so compiles naming different single flags would share a cache entry.

    ``fp8`` (``"promoted"`` or ``"fast"``): fp8 dW as :func:`grouped_linear_wgrad_fp8`
    launches it: e4m3 ``dY^T`` and ``X^T`` (unit strides along the reduction), bf16 dW, the
    scales in the epilogue, no db, pointer loads."""
    from compileops.grouped_linear import kernels

    operand = "*fp8e4nv" if fp8 else ptr
    args = ([("dy_ptr", operand), ("x_ptr", operand), ("offs_ptr", "*i32"), ("dw_ptr", ptr),
             ("db_ptr", ptr), ("ticket_ptr", "*i32")] + [(n, "i32") for n in ("M", "N", "K", "G")]
            + [(n, stride_type) for n in ("stride_dym", "stride_dyn", "stride_xm", "stride_xk")]
            + [("dy_scale_ptr", "*fp32"), ("x_scale_ptr", "*fp32")])
    constexprs = dict(WITH_DB=not fp8, DB_MMA=not fp8, NUM_PROGS=132, BLOCK_M=64, BLOCK_N=128,
                      BLOCK_K=block_k, INPUT_PRECISION="tf32", INTERPRETER_DOT=False, USE_TMA=tma,
                      FP8_SCALES=bool(fp8), FP8_FAST_ACCUM=fp8 == "fast")
    # GROUP_N (the tile order) too: an AOT compile does not apply the kernel's default.
    constexprs.update({name: False for name in VARIANT_FLAGS}, GROUP_N=1, DYNAMIC_TILES=False,
                      ASM_TICKET=True, LANES=32 * num_warps, G_BLOCK=kernels.group_block(64))
    constexprs.update(variant or {})
    # fp8 dW reads dY^T and X^T along the reduction (unit strides there), as launched.
    unit = ("stride_dym", "stride_xm") if fp8 else UNIT
    return compile_sm90(kernels.kjagged_gemm_kernel, args, constexprs, unit=unit,
                        num_warps=num_warps, num_stages=num_stages)


def kjagged_ttgir(ptr="*fp16", tma=False):
    return kjagged_compile(ptr, tma).asm["ttgir"]


VARIANT_FLAGS = ("RAGGED_TMA", "TMA_STORE", "EPILOGUE_SUBTILE", "FLATTEN")
# The sweep's dW variants (benchmarks/tuning/sweep_grouped_linear.py WGRAD_CONFIGS), as the
# launcher passes them: (block_k, num_warps, num_stages, constexprs). All with TMA loads. The
# "wgrad-default-*" entries are choose_wgrad_config's sm90 defaults (checked to match below).
WGRAD_VARIANTS = {
    "wgrad-ragged": (256, 8, 3, dict(RAGGED_TMA=True)),
    "wgrad-tma-store": (256, 8, 3, dict(TMA_STORE=True)),
    "wgrad-tma-store-subtile": (256, 8, 3, dict(TMA_STORE=True, EPILOGUE_SUBTILE=True)),
    "wgrad-default-long": (256, 8, 3, dict(RAGGED_TMA=True, TMA_STORE=True, GROUP_N=8)),
    "wgrad-ragged-tma-store-subtile": (256, 8, 3, dict(RAGGED_TMA=True, TMA_STORE=True,
                                                       EPILOGUE_SUBTILE=True)),
    "wgrad-default-mid": (256, 8, 4, dict(RAGGED_TMA=True, TMA_STORE=True, EPILOGUE_SUBTILE=True,
                                           GROUP_N=8)),
    "wgrad-default-short": (128, 4, 3, dict(RAGGED_TMA=True)),
    # The long and mid defaults without db: one loop over the program's chunks (FLATTEN).
    "wgrad-default-long-flat": (256, 8, 3, dict(RAGGED_TMA=True, TMA_STORE=True, GROUP_N=8,
                                                FLATTEN=True, WITH_DB=False)),
    "wgrad-default-mid-flat": (256, 8, 4, dict(RAGGED_TMA=True, TMA_STORE=True,
                                               EPILOGUE_SUBTILE=True, GROUP_N=8, FLATTEN=True,
                                               WITH_DB=False)),
    # The dynamic tile schedule (Config.dynamic_tiles) on the long default.
    "wgrad-dynamic-long": (256, 8, 3, dict(RAGGED_TMA=True, TMA_STORE=True, GROUP_N=8,
                                           DYNAMIC_TILES=True)),
}
SMEM_LIMIT = 232448  # bytes of shared memory one H100 block may use
SMEM_PER_SM = 233472  # bytes of shared memory per H100 SM (1 KB of it reserved per block)


def summarize_variant(kernel):
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    return dict(summarize(ttgir), shared=kernel.metadata.shared, warps=kernel.metadata.num_warps,
                # dY / X boxes through the 4-D ragged descriptors
                # (triton 3.6 spells the destination shared::cluster, 3.7+ shared::cta)
                ragged_loads=any(f"cp.async.bulk.tensor.4d.{space}.global" in ptx
                                 for space in ("shared::cluster", "shared::cta")),
                tma_stores=ptx.count("cp.async.bulk.tensor.2d.global.shared"),
                masked_tail="ld.global" in ptx and "cp.async.cg.shared.global" in ptx,
                # dynamic schedule: ticket claims (inline PTX), in the for loop and the while
                tickets=ptx.count("atom.relaxed.gpu.global.add.u32"))


CASES = {"bf16": ("bf16", False), "bf16-swiglu": ("bf16", True), "fp32-ieee": ("fp32", False),
         "bf16-tma": ("bf16", False, True), "bf16-swiglu-tma": ("bf16", True, True),
         "bf16-dx-tma": ("bf16", False, True, True),
         "bf16-flatten-tma": ("bf16", False, True, False, True),
         # the training SwiGLU: pre-activations stored beside the output
         "bf16-swiglu-preact-tma": ("bf16", True, True, False, False, True),
         # rowwise fp8 (e4m3 operands, the scales in the epilogue), choose_config's tiles
         "fp8-rowwise": ("fp8", False), "fp8-rowwise-tma": ("fp8", False, True),
         "fp8-rowwise-swiglu-tma": ("fp8", True, True),
         # blockwise fp8: the block scales applied per K step
         "fp8-blockwise-tma": ("fp8-blockwise", False, True),
         "fp8-blockwise-swiglu-tma": ("fp8-blockwise", True, True),
         "fp8-blockwise-dx-tma": ("fp8-blockwise", False, True, True),
         # the router probability in the fp8 product's epilogue (row_scale)
         "fp8-rowwise-row-scale-tma": ("fp8", False, True, False, False, False, True),
         "fp8-blockwise-row-scale-tma": ("fp8-blockwise", False, True, False, False, False,
                                         True)}


# A gate/up pair kept as two weights (SECOND_WEIGHT), no bias: (SWIGLU, B_KN, USE_TMA). The
# forward with its pre-activations (the training form); dX runs its second K loop on the up
# weight, never flattened (the launcher and the lowering turn FLATTEN off for it).
PAIR_CASES = {"bf16-swiglu-pair": (True, False, False), "bf16-swiglu-pair-tma": (True, False, True),
              "bf16-dx-pair": (False, True, False), "bf16-dx-pair-tma": (False, True, True)}


def _main():  # runs in a subprocess without TRITON_INTERPRET (the compiler needs JITFunctions)
    out = {}
    for name, (swiglu, b_kn, tma) in PAIR_CASES.items():
        for pair in (True, False):  # the pair, and the same product on one weight
            kernel = mjagged_compile("bf16", swiglu, tma, b_kn, False, has_bias=False,
                                     save_preact=swiglu, second_weight=pair)
            ttgir = kernel.asm["ttgir"]
            out[name if pair else name.replace("-pair", "-one-weight")] = dict(
                summarize(ttgir), shared=kernel.metadata.shared,
                mma=ttgir.count("ttng.warp_group_dot "),
                tma_loads=ttgir.count("ttng.async_tma_copy_global_to_local"))
    for name, args in CASES.items():
        kernel = mjagged_compile(*args[:5], save_preact=args[5] if len(args) > 5 else False,
                                 row_scale=args[6] if len(args) > 6 else False)
        out[name] = dict(summarize(kernel.asm["ttgir"]),
                         # Hopper's fp8 MMA on e4m3 operands, not an upcast to 16 bits
                         e4m3_mma="f32.e4m3.e4m3" in kernel.asm["ptx"])
    for name, fast in (("fp8-accumulate-promoted", False), ("fp8-accumulate-fast", True)):
        kernel = mjagged_compile("fp8", False, True, row_scale=True, fast_accum=fast)
        out[name] = dict(
            # the MMA's limit on reduced-precision sums, and the fp32 adds of partial sums
            max_imprecise=sorted(set(re.findall(r"maxNumImpreciseAcc = (\d+)",
                                                kernel.asm["ttgir"]))),
            partial_adds=len(re.findall(r"\badd\.f32", kernel.asm["ptx"])))
    out["wgrad-fp16"] = summarize(kjagged_ttgir())
    out["wgrad-bf16-tma"] = summarize(kjagged_ttgir("*bf16", tma=True))
    for name, (block_k, warps, stages, flags) in WGRAD_VARIANTS.items():
        out[name] = summarize_variant(kjagged_compile("*bf16", True, block_k, warps, stages,
                                                      variant=flags))
    # Real launches pass small strides as i32 (the ragged descriptor's 2**34 needs i64).
    out["wgrad-default-long-i32-strides"] = summarize_variant(
        kjagged_compile("*bf16", True, 256, 8, 3, stride_type="i32",
                        variant=WGRAD_VARIANTS["wgrad-default-long"][3]))
    for name in MJAGGED_STORE_VARIANTS:
        product, cfg = mjagged_store_config(name)
        kernel = mjagged_compile("bf16", product == "swiglu", True, product == "dx",
                                 cfg.flatten, cfg, has_bias=product != "dx")
        ptx = kernel.asm["ptx"]
        out[name] = dict(summarize(kernel.asm["ttgir"]), shared=kernel.metadata.shared,
                         # the output tile through the 4-D ragged descriptor, no pointer store
                         ragged_stores=ptx.count("cp.async.bulk.tensor.4d.global.shared"),
                         pointer_stores="st.global" in ptx)
    out.update(fp8_wgrad_builds())
    out.update(fp8_fast_accum_builds())
    out.update(quantiser_builds())
    print(json.dumps(out))


# Rowwise fp8 products with fast accumulation (M routed rows, G, N out, K, SwiGLU, dX), built
# with the tiles choose_config gives them (128 x 256 flattened; SwiGLU 128 x 128).
FP8_FAST_BUILDS = {"fp8-fast-down": (65536, 128, 2048, 768, False, False),
                   "fp8-fast-down-dx": (65536, 128, 768, 2048, False, True),
                   "fp8-fast-swiglu": (65536, 128, 768, 2048, True, False),
                   "fp8-fast-long-k": (16384, 8, 4096, 14336, False, False)}
# fp32 outputs (fp32 activations): the tile the rule picks for them, with its epilogue.
FP8_FAST_FP32_OUT_BUILDS = {"fp8-fast-down-fp32-out": (65536, 128, 2048, 768, False),
                            "fp8-fast-swiglu-fp32-out": (65536, 128, 768, 2048, True)}


def fp8_fast_accum_builds():
    from compileops.grouped_linear import kernels

    built = {}
    for name, (m, g, n, k, swiglu, b_kn) in FP8_FAST_BUILDS.items():
        cfg = kernels.choose_config(m, g, n, k, torch.float8_e4m3fn, kernels.H100_SXM,
                                    swiglu=swiglu, fp8_fast_accum=True)
        kernel = mjagged_compile("fp8", swiglu, True, b_kn, cfg.flatten, cfg,
                                 row_scale=not swiglu, fast_accum=True)
        ttgir = kernel.asm["ttgir"]
        built[name] = dict(summarize(ttgir), shared=kernel.metadata.shared,
                           e4m3_mma="f32.e4m3.e4m3" in kernel.asm["ptx"],
                           tile=[cfg.block_m, cfg.block_n], flatten=cfg.flatten,
                           mma=ttgir.count("ttng.warp_group_dot "))
    for name, (m, g, n, k, swiglu) in FP8_FAST_FP32_OUT_BUILDS.items():
        cfg = kernels.choose_config(m, g, n, k, torch.float8_e4m3fn, kernels.H200,
                                    swiglu=swiglu, fp8_fast_accum=True, out_dtype=torch.float32)
        kernel = mjagged_compile("fp8", swiglu, True, False, cfg.flatten, cfg, fast_accum=True,
                                 save_preact=swiglu, out="fp32")
        built[name] = dict(shared=kernel.metadata.shared, tile=[cfg.block_m, cfg.block_n],
                           e4m3_mma="f32.e4m3.e4m3" in kernel.asm["ptx"])
    return built


def fp8_wgrad_builds():
    """fp8 dW with the tiles the launcher takes from choose_fp8_wgrad_config: Qwen3-30B-A3B's
    down projection (128 experts, 512 rows each), default and fast accumulation, and
    Mixtral-8x7B's (8 experts, 2048 rows each) with fast accumulation (the long tile)."""
    from compileops.grouped_linear import kernels

    builds = {"promoted": (65536, 128, 2048, 768, False), "fast": (65536, 128, 2048, 768, True),
              "fast-long": (16384, 8, 4096, 14336, True)}
    built = {}
    for accumulate, (m, g, n, k, fast) in builds.items():
        cfg = kernels.choose_fp8_wgrad_config(m, g, n, k, kernels.H100_SXM, fast_accum=fast)
        kernel = kjagged_compile("*bf16", False, cfg.block_k, cfg.num_warps, cfg.num_stages,
                                 variant=dict(GROUP_N=cfg.group_n, BLOCK_M=cfg.block_m,
                                              BLOCK_N=cfg.block_n),
                                 fp8="fast" if fast else "promoted")
        ptx = kernel.asm["ptx"]
        built[f"wgrad-fp8-{accumulate}"] = dict(
            summarize(kernel.asm["ttgir"]), shared=kernel.metadata.shared,
            e4m3_mma="f32.e4m3.e4m3" in ptx,
            # 16-byte asynchronous copies: the padded spans' loads as whole vectors
            async_16=ptx.count("cp.async.cg.shared.global") > 0,
            partial_adds=len(re.findall(r"\badd\.f32", ptx)))
    return built


def quantiser_builds():
    """The fp8 quantisers built for sm90 (bf16 in, e4m3 out): rowwise, and blockwise with 1 x
    128 and 128 x 128 blocks; the ``cvt`` to e4m3 in each."""
    from compileops.grouped_linear.kernels import fp8 as fp8_kernels

    common = [("x_ptr", "*bf16"), ("q_ptr", "*fp8e4nv"), ("scale_ptr", "*fp32")]
    built = {}
    for name, k in (("quantise-rowwise", 2048), ("quantise-rowwise-two-pass", 65536)):
        block_m, block_k, warps = fp8_kernels._rowwise_blocks(k, cpu=False)
        rowwise = compile_sm90(
            fp8_kernels.rowwise_quantize_kernel,
            common + [("M", "i32"), ("K", "i32"), ("stride_xm", "i64"), ("stride_xk", "i64")],
            dict(BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=k <= block_k), num_warps=warps)
        built[name] = "e4m3x2" in rowwise.asm["ptx"]
    for name, block_r, per_row in (("quantise-1x128", 32, True), ("quantise-128x128", 128, False)):
        kernel = compile_sm90(
            fp8_kernels.blockwise_quantize_kernel,
            common + [("R", "i32"), ("K", "i32")]
            + [(n, "i64") for n in ("stride_xb", "stride_xr", "stride_xk")]
            + [("r_blocks", "i32"), ("k_blocks", "i32")],
            dict(BLOCK_R=block_r, BLOCK_K=128, PER_ROW=per_row), num_warps=4 if per_row else 8)
        built[name] = "e4m3x2" in kernel.asm["ptx"]
    # fp8 dW's operands: per group and column, the codes written transposed
    from compileops.grouped_linear.kernels import fp8_wgrad

    tables = [("offs_ptr", "*i32"), ("dst_offs_ptr", "*i32")]
    def blocks(tile):  # as quantize_group_columns launches them
        return dict(BLOCK_M=tile[0], BLOCK_C=tile[1], G_BLOCK=256), tile[2]

    amax_blocks, amax_warps = blocks(fp8_wgrad.AMAX_TILE)
    codes_blocks, codes_warps = blocks(fp8_wgrad.CODES_TILE)
    amax = compile_sm90(
        fp8_wgrad.group_columns_amax_kernel,
        [("x_ptr", "*bf16"), ("amax_ptr", "*i32")] + tables
        + [(n, "i32") for n in ("M", "C", "G")] + [(n, "i64") for n in ("stride_xm", "stride_xc")],
        amax_blocks, unit=("stride_xc",), num_warps=amax_warps)
    codes = compile_sm90(
        fp8_wgrad.group_columns_codes_kernel,
        common + [("amax_ptr", "*i32")] + tables
        + [(n, "i32") for n in ("M", "C", "G", "W")]
        + [(n, "i64") for n in ("stride_xm", "stride_xc", "stride_qc")],
        codes_blocks, unit=("stride_xc",), num_warps=codes_warps)
    # the amax merge is an integer max reduction in memory; the codes are e4m3 conversions
    built["quantise-group-columns"] = ("max.s32" in amax.asm["ptx"]
                                       and "e4m3x2" in codes.asm["ptx"])
    # the transposed codes leave through shared memory as 16-byte stores along the rows
    built["group-columns-16-byte"] = ("ld.global.v4" in amax.asm["ptx"]
                                      and "ld.global.v4" in codes.asm["ptx"]
                                      and "st.global.v4" in codes.asm["ptx"])
    return built


@pytest.mark.parametrize("case", list(PAIR_CASES))
def test_gate_up_pair_compiles_for_sm90(compiled, case):
    """The pair's products are Hopper wgmma in pipelined K loops, with the shared memory of
    the same product on one weight (the concatenated SwiGLU; dX on one weight): the forward's
    two MMAs (gate and up, one A tile) and TMA copies as there; dX's two K loops, one MMA
    and the one-weight loop's copies each (A's two column ranges, the two weights)."""
    got, one = compiled[case], compiled[case.replace("-pair", "-one-weight")]
    assert got["wgmma"] and got["pipelined"], got
    assert got["shared"] == one["shared"] <= SMEM_LIMIT, (got, one)
    assert got["tma"] == case.endswith("-tma"), got
    if "swiglu" in case:
        assert got["mma"] == one["mma"] == 2 and got["tma_loads"] == one["tma_loads"], (got, one)
    else:
        assert got["mma"] == 2 * one["mma"] == 2, (got, one)
        assert got["tma_loads"] == 2 * one["tma_loads"], (got, one)


def test_fp8_accumulation_choice_reaches_the_mma(compiled):
    """Rowwise fp8 products by default hand each 128-wide K step's MMA sum to the fp32
    accumulator (Triton's partial accumulator: a limit of 128 reduced-precision sums and
    fp32 adds after the MMAs); ``FP8_FAST_ACCUM`` leaves the whole K loop to the MMA (no
    limit, no adds)."""
    promoted, fast = compiled["fp8-accumulate-promoted"], compiled["fp8-accumulate-fast"]
    assert promoted["max_imprecise"] == ["128"] and promoted["partial_adds"] > 0, promoted
    assert fast["max_imprecise"] == [str(2**30)] and fast["partial_adds"] == 0, fast


@pytest.mark.parametrize("case", list(FP8_FAST_BUILDS))
def test_fp8_fast_accumulation_tiles_compile_for_sm90(compiled, case):
    """The wide tiles of fast accumulation build within one block's shared memory, as
    pipelined TMA loads into e4m3 wgmma: 128 x 256 tiles flattened for the plain products
    (the long-K Mixtral down projection too), and SwiGLU's two 128 x 128 MMAs."""
    got = compiled[case]
    assert got["shared"] <= SMEM_LIMIT, got
    assert got["wgmma"] and got["e4m3_mma"] and got["pipelined"] and got["tma"], got
    if case == "fp8-fast-swiglu":
        assert got["tile"] == [128, 128] and not got["flatten"] and got["mma"] == 2, got
    else:
        assert got["tile"] == [128, 256] and got["flatten"] and got["mma"] == 1, got


@pytest.mark.parametrize("case", list(FP8_FAST_FP32_OUT_BUILDS))
def test_fp8_fast_accumulation_with_fp32_outputs_fits_shared_memory(compiled, case):
    """With fp32 outputs the flattened 128 x 256 tile would need its three operand stages
    and the fp32 output tile at once (272 KB on an H200, which refused to launch it): the
    rule gives those products the 128 x 128 tile, which builds within one block's shared
    memory, as SwiGLU's does with its fp32 pre-activations."""
    got = compiled[case]
    assert got["shared"] <= SMEM_LIMIT and got["e4m3_mma"], got
    assert got["tile"] == [128, 128], got


def test_fp8_weight_grad_compiles_for_sm90(compiled):
    """fp8 dW: Hopper's e4m3 wgmma on the transposed codes, its loads pipelined as 16-byte
    asynchronous copies (each group's span starts and ends on 16 codes), within one block's
    shared memory; by default the partial sums of each 64-row step are added in fp32, with
    fast accumulation not (also with the long tile of 128-row steps)."""
    promoted, fast = compiled["wgrad-fp8-promoted"], compiled["wgrad-fp8-fast"]
    long = compiled["wgrad-fp8-fast-long"]
    assert long["partial_adds"] == 0, long
    for got in (promoted, fast, long):
        assert got["wgmma"] and got["e4m3_mma"] and got["pipelined"], got
        assert got["async_16"] and got["shared"] <= SMEM_LIMIT, got
    assert promoted["partial_adds"] > 0 and fast["partial_adds"] == 0, (promoted, fast)


def test_fp8_quantisers_compile_for_sm90(compiled):
    for name in ("quantise-rowwise", "quantise-rowwise-two-pass", "quantise-1x128",
                 "quantise-128x128", "quantise-group-columns"):
        assert compiled[name], f"{name}: expected an e4m3 conversion in the sm90 build"


def test_group_column_quantiser_moves_16_byte_vectors(compiled):
    """fp8 dW's operand quantiser is bound by memory: its bf16 tiles load as 16-byte vectors
    and its transposed e4m3 codes store as 16-byte vectors (a byte per column would write
    each 32-byte sector 16 times)."""
    assert compiled["group-columns-16-byte"]


def summarize(ttgir):
    return {"wgmma": "warp_group_dot" in ttgir,
            "pipelined": ("async_copy_global_to_local" in ttgir
                          or "async_tma_copy_global_to_local" in ttgir),
            "tma": "async_tma_copy_global_to_local" in ttgir,
            # dW's db: column sums as a [BLOCK_N, 16] wgmma against a ones tile
            "db_mma": "x16xf32, #mma" in ttgir and "warp_group_dot" in ttgir}


@pytest.fixture(scope="module")
def compiled():
    return run_main(__file__)


@pytest.mark.parametrize("case", list(CASES) + ["wgrad-fp16", "wgrad-bf16-tma"])
def test_kernel_compiles_for_sm90_pipelined(compiled, case):
    assert compiled[case]["pipelined"], f"{case}: expected a software-pipelined (cp.async) K loop"
    if case != "fp32-ieee":  # IEEE fp32 dots use FMA, not tensor cores
        assert compiled[case]["wgmma"], f"{case}: expected Hopper wgmma"
    assert compiled[case]["tma"] == case.endswith("-tma"), f"{case}: TMA loads iff requested"
    assert compiled[case].get("e4m3_mma", False) == case.startswith("fp8"), (
        f"{case}: e4m3 wgmma iff the operands are fp8")
    if case.startswith("wgrad"):
        assert compiled[case]["db_mma"], f"{case}: expected db summed by a 16-wide wgmma"


@pytest.mark.parametrize("case", list(WGRAD_VARIANTS) + ["wgrad-default-long-i32-strides"])
def test_wgrad_variants_compile_for_sm90(compiled, case):
    """The dW variants build for sm90 within the shared-memory limit (the short-group default
    runs two programs per SM: twice its bytes must fit too) and do what they say: ragged 4-D
    TMA loads without the masked tail, TMA (bulk tensor) stores of dW (two with halves)."""
    got = compiled[case]
    _, warps, _, flags = WGRAD_VARIANTS[case.replace("-i32-strides", "")]
    assert got["shared"] <= SMEM_LIMIT, got
    if case == "wgrad-default-short":
        assert 2 * (got["shared"] + 1024) <= SMEM_PER_SM, got
    assert got["wgmma"] and got["tma"] and got["pipelined"], got
    assert got["db_mma"] == flags.get("WITH_DB", True), got
    assert got["warps"] == warps, got
    assert got["ragged_loads"] == flags.get("RAGGED_TMA", False), got
    if flags.get("RAGGED_TMA"):
        assert not got["masked_tail"], got
    stores = 0 if not flags.get("TMA_STORE") else 2 if flags.get("EPILOGUE_SUBTILE") else 1
    if flags.get("DYNAMIC_TILES"):  # the tile body twice: the for loop's rounds and the remainder
        assert got["tickets"] == 2 and got["tma_stores"] == 2 * stores, got
        # The for loop keeps the dW staging tile across tiles (its stores overlap the next
        # tile): the static kernel's shared memory, not less (a while loop reuses it).
        assert got["shared"] == compiled["wgrad-default-long"]["shared"], got
    else:
        assert got["tickets"] == 0 and got["tma_stores"] == stores, got


@pytest.mark.parametrize("case", list(MJAGGED_STORE_VARIANTS))
def test_mjagged_tma_store_compiles_for_sm90(compiled, case):
    """The sweep's M-jagged TMA-store configs (``_helpers.MJAGGED_STORE_VARIANTS``) build for
    sm90 within the shared-memory limit (operand stages plus the output staging tile; two
    programs per SM must both fit for the x2/SM one) and store every output tile by TMA
    through the ragged 4-D descriptor."""
    got = compiled[case]
    _, cfg = mjagged_store_config(case)
    assert got["shared"] <= SMEM_LIMIT, got
    assert cfg.programs_per_sm * (got["shared"] + 1024) <= SMEM_PER_SM, got
    assert got["wgmma"] and got["tma"], got
    assert got["ragged_stores"] >= 1 and not got["pointer_stores"], got


@pytest.mark.parametrize("groups,kind", [(64, "long"), (128, "mid"), (256, "short")])
def test_codegen_defaults_are_choose_wgrad_config(groups, kind):
    """The "wgrad-default-*" compiles above are the configs choose_wgrad_config returns."""
    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels.kjagged import wgrad_variant_flags

    cfg = kernels.choose_wgrad_config(65536, groups, 2048, 768, torch.bfloat16,
                                      kernels.H100_SXM)
    block_k, warps, stages, flags = WGRAD_VARIANTS[f"wgrad-default-{kind}"]
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (
        64, 128, block_k, warps, stages), cfg
    flags = dict(flags)
    assert cfg.group_n == flags.pop("GROUP_N", 1), cfg
    dw = torch.empty(64, 1, 1, dtype=torch.bfloat16)  # the flags read dW's groups, dtype, address
    assert wgrad_variant_flags(cfg, True, 65536, 2048, 768, dw) == dict(
        dict.fromkeys(VARIANT_FLAGS, False), **flags)
    # Without db the long and mid defaults take the flattened chunk loop, the short one not.
    flat = WGRAD_VARIANTS.get(f"wgrad-default-{kind}-flat", (0, 0, 0, dict(flags)))[3]
    flat = {k: v for k, v in flat.items() if k not in ("GROUP_N", "WITH_DB")}
    assert wgrad_variant_flags(cfg, True, 65536, 2048, 768, dw, False) == dict(
        dict.fromkeys(VARIANT_FLAGS, False), **flat)


def _dynamic_template_source(tmp_path):
    """The grouped-linear template as Inductor writes it under ``dynamic=True`` (Triton
    codegen on this CPU), saved as a module: ``(path, kernel name, signature)``."""
    import re

    import compileops
    from tests.grouped_linear._helpers import template_source

    x, w = torch.randn(64, 128), torch.randn(4, 256, 128)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)

    def f(a, b, o):
        return compileops.grouped_linear(a, b, o) * 2

    body = template_source(f, x, w, offs, dynamic=True, with_imports=True)
    signature = re.search(r"'signature': (\{[^}]*\})", body).group(1)
    # The module without Inductor's launcher decorator: the bare @triton.jit kernel.
    body = body[:body.index("@triton_heuristics.template(")] + body[body.index("@triton.jit"):]
    path = tmp_path / "dynamic_template.py"
    path.write_text(body)
    return path, re.search(r"def (triton_tem_\w+)\(", body).group(1), signature


def _compile_saved_template(path, name, signature):  # subprocess: no TRITON_INTERPRET
    import ast
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("dynamic_template", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    signature = ast.literal_eval(signature)
    pointers = [i for i, t in enumerate(signature.values()) if t.startswith("*")]
    src = ASTSource(fn=getattr(module, name), signature=signature, constexprs={},
                    attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=2)).asm["ptx"]
    print(json.dumps(re.findall(r"st\.global(?:\.\w+)*", ptx)))


def test_dynamic_template_stores_vectorise_on_sm90(tmp_path):
    """Under dynamic=True the output's row stride is a kernel argument the lowering guarded to
    a multiple of 16; the template shows Triton the factor ((N // 16) * 16), so the fused
    epilogue's stores compile to 16-byte vector stores for an H100. (tl.multiple_of on the
    scalar argument, the earlier form, left them 4-byte scalar stores.)"""
    path, name, signature = _dynamic_template_source(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile-template",
                           str(path), name, signature], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stores = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stores and all(".v4" in s for s in stores), stores


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile-template"]:
        _compile_saved_template(*sys.argv[2:5])
    else:
        _main()
