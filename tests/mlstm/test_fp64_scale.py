"""fp64 kernels take ``1 / sqrt(DQK)`` in fp64. Triton passes a Python float argument as
fp32, so the launchers' ``scale`` arrives rounded (``1 / sqrt(6)`` is 3e-8 off in fp32, and
fp64 outputs on CUDA were off by as much); the kernels derive it again in fp64
(:func:`compileops.mlstm.kernels.common.head_scale`). The interpreter keeps Python floats
in fp64, so this is checked in the code compiled for sm90 (compiling needs no GPU)."""
import json
import re

import pytest

from tests.compiled_main import run_main

triton = pytest.importorskip("triton")
try:
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
except Exception:  # pragma: no cover
    pytest.skip("triton's NVIDIA backend is not installed", allow_module_level=True)


def _compile_ttir(fn, dtype: str, constexprs: dict) -> str:
    """``fn`` compiled for sm90 with ``dtype`` inputs, every float argument as fp32 (as
    Triton passes Python floats): its TTIR."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    inputs = ("q_ptr", "k_ptr", "v_ptr", "h_ptr", "out_ptr", "weight_ptr", "bias_ptr",
              "dh_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "cstate_ptr", "dcstate_ptr", "dc_ptr",
              "dc_last_ptr")
    acc = tl.float64 if dtype == "fp64" else tl.float32
    acc_name = "fp64" if dtype == "fp64" else "fp32"
    signature, consts = {}, {}
    for name in fn.arg_names:
        if name in constexprs or name == "ACC":
            signature[name] = "constexpr"
            consts[name] = acc if name == "ACC" else constexprs[name]
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}" if name in inputs else f"*{acc_name}"
        elif name in ("scale", "eps", "norm_eps"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4}).asm["ttir"]


def _main():  # runs in a subprocess without TRITON_INTERPRET (the compiler needs JITFunctions)
    from compileops.mlstm.kernels import backward, chunkwise, forward

    shared = dict(DQK=6, DV=32, BLOCK_DQK=16, BLOCK_DV=32, HAS_STATE=False, UPCAST=False,
                  INPUT_PRECISION="ieee")
    tiles = dict(BLOCK_M=32, BLOCK_N=32)
    kernels = {
        "forward": (forward.mlstm_forward_kernel, dict(
            shared, **tiles, HAS_NORM=True, HAS_WEIGHT=True, HAS_BIAS=True,
            RESIDUAL_WEIGHT=False, SAVE_H=True)),
        "dq": (backward.mlstm_dq_kernel, dict(shared, **tiles, PAIRED=False)),
        "dkv": (backward.mlstm_dkv_kernel, dict(shared, **tiles, PAIRED=False)),
        "state_grads": (chunkwise.chunk_state_grads_kernel, dict(
            {k: v for k, v in shared.items() if k not in ("BLOCK_DV", "HAS_STATE")},
            BLOCK_V=32, CHUNK=32, SUB=32, HAS_LAST_GRAD=False, HAS_RESETS=False,
            EXACT_INITIAL=False)),
    }
    out = {}
    for name, (fn, constexprs) in kernels.items():
        ttir = _compile_ttir(fn, "fp64", constexprs)
        out[name] = bool(re.search(r"arith\.extf %scale\b", ttir))
    print(json.dumps(out))


@pytest.fixture(scope="module")
def widened():
    return run_main(__file__)


@pytest.mark.parametrize("kernel", ["forward", "dq", "dkv", "state_grads"])
def test_fp64_kernels_do_not_widen_an_fp32_scale(widened, kernel):
    assert widened[kernel] is False, f"{kernel}: 1/sqrt(DQK) reaches the fp64 kernel in fp32"


if __name__ == "__main__":
    _main()
