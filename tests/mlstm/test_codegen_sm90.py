"""Ahead-of-time compile of the mLSTM cell kernels for an H100 (sm90) on this CPU machine
(triton ships ptxas), with the configs the launchers pick on a GPU and the model's head dims
(DQK 128, DV 256, chunk 128): each fits the H100's shared memory per block, and the 16-bit
ones get Hopper wgmma. Catches a kernel that the interpreter runs but a GPU cannot launch
(the chunkwise dQ program with its fp32 state tile once took 256 KB). Compiling is not
running: GPU runs are in the gpu tests."""
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

#: The H100's shared memory per block (227 KB, opted in).
H100_SHARED = 232448
DQK, DV, CHUNK = 128, 256, 128
#: Pointers in the inputs' dtype, in fp64 (the forget-gate sums), in int32 (document
#: tables); the rest are fp32 per-row terms.
INPUT_PTRS = {"q_ptr", "k_ptr", "v_ptr", "dh_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "h_ptr",
              "cstate_ptr", "dcstate_ptr", "weight_ptr", "bias_ptr"}
FP64_PTRS = {"logf_ptr"}
INT32_PTRS = {"bounds_ptr", "slot_first_ptr", "slot_doc_ptr"}
FORWARD_KERNELS = {"mlstm_forward_kernel", "chunk_forward_kernel"}  # out_ptr: the inputs'


def compile_sm90(fn, dtype: str, constexprs: dict, num_warps: int, num_stages: int):
    """``fn`` compiled for sm90 as a launch specialises it: unit inner strides, 16-divisible
    pointers and strides."""
    name = fn.fn.__name__
    sig, consts = {}, {}
    for p in fn.params:
        n = p.name
        if p.is_constexpr:
            sig[n], consts[n] = "constexpr", constexprs[n]
        elif n.endswith("_ptr"):
            if n in INT32_PTRS:
                sig[n] = "*i32"
            elif n in FP64_PTRS:
                sig[n] = "*fp64"
            elif n in INPUT_PTRS or (n == "out_ptr" and name in FORWARD_KERNELS):
                sig[n] = "*" + dtype
            else:
                sig[n] = "*fp32"
        elif n in ("scale", "eps", "norm_eps"):
            sig[n] = "fp32"
        elif n.startswith("stride_") and n.endswith("d"):
            sig[n], consts[n] = "constexpr", 1
        else:
            sig[n] = "i32"
    divisible = [i for i, (n, t) in enumerate(sig.items())
                 if t != "constexpr" and (n.endswith("_ptr") or n.startswith("stride_"))]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def cases():
    """``name -> (kernel, dtype, constexprs, num_warps, num_stages)``: the chunkwise form's
    per-document cell kernels and the parallel form's, bf16, and the fp32 chunkwise dQ."""
    import triton.language as tl

    from compileops.mlstm.kernels import backward, chunk_tiles, forward
    from compileops.mlstm.kernels.config import choose_backward_config, choose_forward_config

    out = {}
    for dtype, torch_dtype, acc, precision in (("bf16", torch.bfloat16, tl.float32, "tf32"),
                                               ("fp32", torch.float32, tl.float32, "ieee")):
        q = torch.empty((1, 1, 1, DQK), dtype=torch_dtype, device="meta")  # not CPU: GPU configs
        base = dict(DQK=DQK, DV=DV, BLOCK_DQK=DQK, BLOCK_DV=DV, ACC=acc, UPCAST=False,
                    INPUT_PRECISION=precision, CHUNK=CHUNK, HAS_NORM=True, HAS_WEIGHT=True,
                    HAS_BIAS=False, RESIDUAL_WEIGHT=False, SAVE_H=True)
        fw = choose_forward_config(q, DQK, DV)
        fwc = choose_forward_config(q, DQK, DV, with_state=True, max_block_m=CHUNK)
        bw = choose_backward_config(q, DQK, DV)
        bwc = bw.capped(CHUNK)
        kernels = {
            "chunk_dq": (chunk_tiles.chunk_dq_kernel,
                         dict(BLOCK_M=bwc.block_m, BLOCK_N=bwc.dq_tile, NEAR=bwc.block_n),
                         bwc.dq_warps, bwc.dq_stages),
        }
        if dtype == "bf16":
            kernels.update({
                "chunk_forward": (chunk_tiles.chunk_forward_kernel,
                                  dict(BLOCK_M=fwc.block_m, BLOCK_N=fwc.block_n),
                                  fwc.num_warps, fwc.num_stages),
                "chunk_dkv": (chunk_tiles.chunk_dkv_kernel,
                              dict(BLOCK_M=bwc.block_m, BLOCK_N=bwc.block_n),
                              bwc.num_warps, bwc.num_stages),
                "forward": (forward.mlstm_forward_kernel,
                            dict(BLOCK_M=fw.block_m, BLOCK_N=fw.block_n),
                            fw.num_warps, fw.num_stages),
                "dq": (backward.mlstm_dq_kernel,
                       dict(BLOCK_M=bw.block_m, BLOCK_N=bw.dq_tile, NEAR=bw.block_n),
                       bw.dq_warps, bw.dq_stages),
                "dkv": (backward.mlstm_dkv_kernel, dict(BLOCK_M=bw.block_m, BLOCK_N=bw.block_n),
                        bw.num_warps, bw.num_stages),
            })
        for name, (fn, extra, warps, stages) in kernels.items():
            out[f"{dtype}-{name}"] = (fn, dtype, {**base, **extra}, warps, stages)
    return out


def _main():  # runs in a subprocess without TRITON_INTERPRET (the compiler needs JITFunctions)
    out = {}
    for name, (fn, dtype, constexprs, warps, stages) in cases().items():
        kernel = compile_sm90(fn, dtype, constexprs, warps, stages)
        out[name] = dict(shared=kernel.metadata.shared, wgmma="wgmma" in kernel.asm["ptx"])
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = ["bf16-chunk_forward", "bf16-chunk_dq", "bf16-chunk_dkv", "bf16-forward", "bf16-dq",
         "bf16-dkv", "fp32-chunk_dq"]


@pytest.mark.parametrize("case", CASES)
def test_cell_kernels_fit_the_h100(compiled, case):
    assert compiled[case]["shared"] <= H100_SHARED, (
        f"{case}: {compiled[case]['shared']} bytes of shared memory, past the H100's "
        f"{H100_SHARED}: it compiles but cannot launch")
    if case.startswith("bf16"):
        assert compiled[case]["wgmma"], f"{case}: expected Hopper wgmma"


if __name__ == "__main__":
    _main()
