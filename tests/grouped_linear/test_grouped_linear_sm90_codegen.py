"""Ahead-of-time compile of the eager Triton kernels for an H100 (sm90) on this CPU machine
(triton ships ptxas): catches what the interpreter tolerates but the compiler rejects, and
checks the GEMM loops get Hopper wgmma and software pipelining (cp.async, or TMA copies in
the TMA variants) when strides are specialised as in real launches (unit inner strides,
16-divisible pointers and sizes). Compiling is not running: GPU runs are in the gpu tests."""
import json
import os
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

TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
UNIT = ("stride_ak", "stride_bk", "stride_biasn", "stride_on", "stride_xk")
NOT_DIVISIBLE = ("M", "G")


def compile_sm90(fn, args, constexprs, **options):
    """Compile ``fn`` for sm90 with real-launch specialisations (unit strides, divisibility)."""
    sig, consts = {}, dict(constexprs)
    for name, ty in args:
        if name in UNIT:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = ty
    for name in constexprs:
        sig[name] = "constexpr"
    divisible = [i for i, (n, t) in enumerate(sig.items())
                 if t != "constexpr" and n not in NOT_DIVISIBLE]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def mjagged_args(ptr):
    return ([(n, ptr) for n in ("a_ptr", "b_ptr", "bias_ptr")] + [("offs_ptr", "*i32"), ("out_ptr", ptr)]
            + [(n, "i32") for n in ("M", "N_OUT", "K", "G")]
            + [(n, "i64") for n in ("stride_am", "stride_ak", "stride_bg", "stride_bk", "stride_bn",
                                    "stride_biasg", "stride_biasn", "stride_om", "stride_on")])


def mjagged_ttgir(dtype, swiglu, tma=False, b_kn=False, flatten=False):
    from compileops.grouped_linear import kernels

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    cfg = kernels.choose_config(65536, 128, 1536, 2048, torch_dtype, torch.device("cuda"))
    k = compile_sm90(
        kernels.mjagged_gemm_kernel, mjagged_args(TYPES[dtype]),
        dict(HAS_BIAS=True, SWIGLU=swiglu, NUM_PROGS=132, GROUP_M=kernels.GROUP_M,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_UPCAST=False,
             USE_TMA=tma, B_KN=b_kn, G_BLOCK=kernels.group_block(128), FLATTEN=flatten),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return k.asm["ttgir"]


def kjagged_ttgir(ptr="*fp16", tma=False):
    from compileops.grouped_linear import kernels

    args = ([("dy_ptr", ptr), ("x_ptr", ptr), ("offs_ptr", "*i32"), ("dw_ptr", ptr),
             ("db_ptr", ptr)] + [(n, "i32") for n in ("M", "N", "K", "G")]
            + [(n, "i64") for n in ("stride_dym", "stride_dyn", "stride_xm", "stride_xk")])
    k = compile_sm90(kernels.kjagged_gemm_kernel, args,
                     dict(HAS_DB=True, DB_MMA=True, NUM_PROGS=132, BLOCK_M=64, BLOCK_N=128,
                          BLOCK_K=128,
                          INPUT_PRECISION="tf32", DOT_UPCAST=False, USE_TMA=tma),
                     num_warps=8, num_stages=3)
    return k.asm["ttgir"]


CASES = {"bf16": ("bf16", False), "bf16-swiglu": ("bf16", True), "fp32-ieee": ("fp32", False),
         "bf16-tma": ("bf16", False, True), "bf16-swiglu-tma": ("bf16", True, True),
         "bf16-dx-tma": ("bf16", False, True, True),
         "bf16-flatten-tma": ("bf16", False, True, False, True)}


def _main():  # runs in a subprocess without TRITON_INTERPRET (the compiler needs JITFunctions)
    out = {name: summarize(mjagged_ttgir(*args)) for name, args in CASES.items()}
    out["wgrad-fp16"] = summarize(kjagged_ttgir())
    out["wgrad-bf16-tma"] = summarize(kjagged_ttgir("*bf16", tma=True))
    print(json.dumps(out))


def summarize(ttgir):
    return {"wgmma": "warp_group_dot" in ttgir,
            "pipelined": ("async_copy_global_to_local" in ttgir
                          or "async_tma_copy_global_to_local" in ttgir),
            "tma": "async_tma_copy_global_to_local" in ttgir,
            # dW's db: column sums as a [BLOCK_N, 16] wgmma against a ones tile
            "db_mma": "x16xf32, #mma" in ttgir and "warp_group_dot" in ttgir}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES) + ["wgrad-fp16", "wgrad-bf16-tma"])
def test_kernel_compiles_for_sm90_pipelined(compiled, case):
    assert compiled[case]["pipelined"], f"{case}: expected a software-pipelined (cp.async) K loop"
    if case != "fp32-ieee":  # IEEE fp32 dots use FMA, not tensor cores
        assert compiled[case]["wgmma"], f"{case}: expected Hopper wgmma"
    assert compiled[case]["tma"] == case.endswith("-tma"), f"{case}: TMA loads iff requested"
    if case.startswith("wgrad"):
        assert compiled[case]["db_mma"], f"{case}: expected db summed by a 16-wide wgmma"


if __name__ == "__main__":
    _main()
