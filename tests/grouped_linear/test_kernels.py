"""The M-jagged kernel (forward, dX, SwiGLU; kernels/mjagged.py) and the shared kernel
plumbing, under the interpreter (TMA descriptors emulated): the TMA path against the fp64
reference, zero tail rows, ``Config.tma_store`` (output tiles stored through a ragged
descriptor: the same bits as the pointer store, no row of a neighbouring group or of the
zero tail overwritten, where the flag reaches the kernel), the config heuristics, and the
per-device TMA fallback. sm90 builds: test_codegen_sm90.py; GPU runs: test_gpu.py; the dW
kernel: test_kernels_wgrad.py."""
import dataclasses
import logging

import pytest
import torch

from compileops.grouped_linear import kernels, reference
from compileops.grouped_linear.kernels import Config
from compileops.grouped_linear.kernels.tma import (
    Fallback,
    clear_fallbacks,
    fell_back,
    launch_or_fall_back,
    mjagged_tma_store,
    tma_compatible,
)
from compileops.testing import assert_close_to_reference
from tests.grouped_linear._helpers import TOL, make_grouped

BASE = Config(16, 32, 32, num_warps=4, num_stages=1)
STORE = dataclasses.replace(BASE, tma_store=True)
K, N = 40, 48  # forward: 2 N-tiles (the second partial); dX: 40 columns; SwiGLU: 24 columns
# 16-row tiles, 4 programs taking tiles round-robin, run one after another by the interpreter.
# Each layout has a group's partial last tile (3 mod 4 in the flat tile order) spilling over
# rows that a lower-numbered program has already written: without the ragged row bound the
# TMA box would overwrite group 4's first rows ("interior") or the zero tail ("tail").
LAYOUTS = {
    "interior": ([20, 0, 9, 7, 30], 13),  # empty group, partial tiles, 13 tail rows
    "tail": ([3, 16, 0, 25], 8),  # a full tile; group 3's partial tile overlaps the tail
}


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def make_layout(layout, dtype):
    sizes, extra = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    m = sum(sizes) + extra
    x = torch.randn(m, K, generator=gen).to(dtype)
    w = (torch.randn(len(sizes), N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(len(sizes), N, generator=gen).to(dtype)
    grad = torch.randn(m, N, generator=gen).to(dtype)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return x, w, b, grad, offs


def run(product, cfg, x, w, b, grad, offs):
    """One M-jagged launch through the TMA path with ``cfg``, as the op's launchers call it."""
    if product == "fwd":
        return kernels.mjagged_gemm(x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, N,
                                    bias=b, out_dtype=x.dtype, config=cfg, use_tma=True)
    if product == "swiglu":
        return kernels.mjagged_gemm(x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, N // 2,
                                    bias=b, swiglu=True, out_dtype=x.dtype, config=cfg,
                                    use_tma=True)
    return kernels.mjagged_gemm(grad, w, (w.stride(0), w.stride(1), w.stride(2)), offs, K,
                                out_dtype=grad.dtype, config=cfg, b_kn=True, use_tma=True)


def want(product, x, w, b, grad, offs):
    xd, wd, bd = x.double(), w.double(), b.double()
    if product == "fwd":
        return reference.grouped_linear_forward(xd, wd, offs, bd)
    if product == "swiglu":
        return reference.grouped_linear_swiglu_forward(xd, wd, offs, bd)
    return reference.grouped_linear_dx(grad.double(), wd, offs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("product", ["fwd", "dx", "swiglu"])
def test_tma_store_is_bitwise_the_pointer_store(product, layout, dtype):
    """Same tiles, only the store differs: the same bits in every row (every row of ``out``
    is written by exactly one tile: its group's or the tail's), each group's rows close to
    the fp64 reference (a clobbered group is named), the tail rows exact zeros."""
    x, w, b, grad, offs = make_layout(layout, dtype)
    got = run(product, STORE, x, w, b, grad, offs)
    assert mjagged_tma_store(got, STORE, True), "the TMA store must be exercised"
    ref = want(product, x, w, b, grad, offs)
    ends = [0] + offs.tolist()
    for g in range(len(ends) - 1):
        if ends[g + 1] > ends[g]:
            assert_close_to_reference(got[ends[g]:ends[g + 1]].float(), ref[ends[g]:ends[g + 1]],
                                      max_relative_error=TOL[dtype], what=f"group {g}")
    tail = got[ends[-1]:]
    assert torch.equal(tail, torch.zeros_like(tail)), "rows past offsets[-1] must be 0"
    plain = run(product, BASE, x, w, b, grad, offs)
    assert torch.equal(bits(got), bits(plain))


def test_flag_reaches_the_kernel_only_where_it_applies():
    flag = mjagged_tma_store
    out = torch.empty(64, 40, dtype=torch.bfloat16)
    assert flag(out, STORE, True)
    assert not flag(out, BASE, True)  # not asked for
    assert not flag(out, STORE, False)  # pointer loads: no descriptors at all
    assert not flag(torch.empty(64, 36, dtype=torch.bfloat16), STORE, True)  # 72-byte rows
    assert flag(torch.empty(64, 36, dtype=torch.float32), STORE, True)  # 144-byte rows
    assert not flag(torch.empty(40, 64, dtype=torch.bfloat16).t(), STORE, True)  # column stride
    misaligned = torch.empty(64 * 40 + 1, dtype=torch.bfloat16)[1:].view(64, 40)
    assert not flag(misaligned, STORE, True)
    narrow = dataclasses.replace(STORE, block_n=4)  # an 8-byte box row: below TMA's 16
    assert not flag(out, narrow, True)
    huge = torch.empty(kernels.RAGGED_ROWS.value, 8, dtype=torch.bfloat16, device="meta")
    assert not flag(huge, STORE, True)  # rows past the ragged descriptor's bound
    assert flag(huge[:-1], STORE, True)


def test_unaligned_output_falls_back_to_the_pointer_store():
    """SwiGLU with 18 bf16 output columns (36-byte rows): no TMA store, same result."""
    x, w, b, grad, offs = make_layout("interior", torch.bfloat16)
    w, b = w[:, :36], b[:, :36]
    args = (x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, 18)
    got = kernels.mjagged_gemm(*args, bias=b, swiglu=True, out_dtype=x.dtype,
                               config=STORE, use_tma=True)
    assert not mjagged_tma_store(got, STORE, True)
    plain = kernels.mjagged_gemm(*args, bias=b, swiglu=True, out_dtype=x.dtype,
                                 config=BASE, use_tma=True)
    assert torch.equal(bits(got), bits(plain))


def test_tma_compatible_tensors():
    """``tma_compatible`` (shared by the forward, dX, dW and TMA-store checks): unit last
    stride, 16-byte aligned base and outer strides, for 2-D and 3-D tensors."""
    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert tma_compatible(t) and tma_compatible(torch.zeros(4, 8, 16))
    assert not tma_compatible(t.T)  # last stride 64
    assert not tma_compatible(t.view(-1)[1:4033].view(63, 64))  # base off by 2 bytes
    assert not tma_compatible(t[:, :60].contiguous().as_strided((8, 60), (60, 1)))
    assert not tma_compatible(torch.zeros(4, 3, 12, dtype=torch.bfloat16)[:, :, :4])  # 24-byte stride
    # An empty tensor (zero groups' weight) has a null, "aligned" base, but no descriptor may
    # be built over it: on an H100 that was an illegal instruction (the GPU fuzzing).
    assert not tma_compatible(torch.zeros(0, 76, 76))
    assert not tma_compatible(torch.zeros(0, 64, dtype=torch.bfloat16))


# ------------------------------------------------------------------ TMA path, tail rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tma_descriptor_path_matches_pointer_path(dtype):
    """The TMA variant (device-side tensor descriptors; the interpreter emulates them) against
    the fp64 reference: partial N/K tiles, a SwiGLU half narrower than a tile, an empty group,
    tail rows."""
    x, w, offs, b = make_grouped([5, 0, 15, 25], k=40, n=48, dtype=dtype, extra_rows=8)
    grad = torch.randn(53, 48).to(dtype)
    tol = TOL[dtype]
    got = {
        "fwd": kernels.grouped_linear_forward(x, w, offs, b, use_tma=True),
        "swiglu": kernels.grouped_linear_swiglu_forward(x, w, offs, b, use_tma=True),
        "dx": kernels.grouped_linear_dx(grad, w, offs, use_tma=True),
    }
    xd, wd, bd = x.double(), w.double(), b.double()
    want = {
        "fwd": reference.grouped_linear_forward(xd, wd, offs, bd),
        "swiglu": reference.grouped_linear_swiglu_forward(xd, wd, offs, bd),
        "dx": reference.grouped_linear_dx(grad.double(), wd, offs),
    }
    for name in got:
        assert_close_to_reference(got[name].float(), want[name], max_relative_error=tol, what=name)
        assert torch.equal(got[name][45:], torch.zeros_like(got[name][45:])), name


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointers", "tma"])
def test_tail_rows_are_zero_even_when_x_tail_holds_inf(use_tma):
    """The tail tiles (rows past offsets[-1]) run the same K loop as real tiles (so the
    persistent loop can be flattened) and are zeroed afterwards: inf/NaN rows there must
    not leak into the output."""
    x, w, offs, b = make_grouped([6, 0, 19], k=24, n=40, extra_rows=21)
    x[25:] = float("inf")
    x[30] = float("nan")
    grad = torch.randn(x.shape[0], 40)
    grad[25:] = float("inf")
    outs = {
        "fwd": kernels.grouped_linear_forward(x, w, offs, b, use_tma=use_tma),
        "swiglu": kernels.grouped_linear_swiglu_forward(x, w, offs, b, use_tma=use_tma),
        "dx": kernels.grouped_linear_dx(grad, w, offs, use_tma=use_tma),
    }
    want = reference.grouped_linear_forward(x[:25].double(), w.double(), offs, b.double())
    assert_close_to_reference(outs["fwd"][:25], want, max_relative_error=1e-5)
    for name, out in outs.items():
        assert torch.equal(out[25:], torch.zeros_like(out[25:])), name
        assert torch.isfinite(out[:25]).all(), name


# ------------------------------------------------------------------ configs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_invariant_config_is_fixed_on_cuda(dtype):
    """Host-only (no GPU needed): on CUDA the eager config must not depend on group sizes in
    batch-invariant mode. On CPU the interpreter config hides this, so check it directly."""
    cuda = kernels.H100_SXM  # a GPU description: no GPU needed
    shapes = [(1, 8), (16, 8), (100, 4), (4096, 16), (65536, 8), (300, 1)]
    normal = {kernels.choose_config(m, g, 256, 512, dtype, cuda) for m, g in shapes}
    assert len(normal) > 1  # the heuristic does vary with M / G: the check below can fail
    for m, g in shapes:
        cfg = kernels.choose_config(m, g, 256, 512, dtype, cuda, batch_invariant=True)
        assert cfg == kernels.BATCH_INVARIANT_CONFIG, (m, g, cfg)


def test_fp32_honours_allow_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert kernels.input_precision(torch.float32) == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert kernels.input_precision(torch.float32) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_interpreter_gets_the_small_configs():
    cpu = torch.device("cpu")
    for bi in (False, True):
        assert kernels.choose_config(4096, 8, 256, 512, torch.bfloat16, cpu,
                                     batch_invariant=bi) == kernels.INTERPRETER_CONFIG
    assert kernels.choose_wgrad_config(4096, 8, 256, 512, torch.bfloat16,
                                       cpu) == kernels.INTERPRETER_CONFIG


# ------------------------------------------------------------------ per-device TMA fallback


@pytest.fixture
def no_fallbacks():
    clear_fallbacks()
    yield
    clear_fallbacks()


def broken(exc):
    def launch():
        raise exc
    return launch


def test_variant_launch_fallback_contract(no_fallbacks, caplog):
    """``launch_or_fall_back`` (both launchers' TMA steps): True when the launch runs; a
    failing launch re-raises for an explicit config, and for a default one records the
    fallback for its device, logs it once and returns False (the launcher then launches
    without the variant)."""
    cuda0 = torch.device("cuda", 0)
    kind = Fallback.WGRAD_VARIANTS
    call = dict(explicit=False, what="dW kernel", instead="the plain TMA kernel")
    assert launch_or_fall_back(lambda: None, kind, cuda0, **call) is True
    with pytest.raises(RuntimeError, match="no TMA here"):
        launch_or_fall_back(broken(RuntimeError("no TMA here")), kind, cuda0,
                            **dict(call, explicit=True))
    assert not fell_back(kind, cuda0)
    with caplog.at_level(logging.WARNING, logger="compileops"):
        assert launch_or_fall_back(broken(RuntimeError("no TMA here")), kind, cuda0,
                                   **call) is False
        assert launch_or_fall_back(broken(RuntimeError("again")), kind, cuda0, **call) is False
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages  # once per device
    assert "dW kernel failed on cuda:0" in messages[0] and "no TMA here" in messages[0]
    assert "the plain TMA kernel" in messages[0]
    assert fell_back(kind, cuda0)


def test_fallback_is_per_device_and_per_kind(no_fallbacks):
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert not launch_or_fall_back(broken(RuntimeError("driver")), Fallback.TMA, cuda1,
                                   explicit=False, what="TMA kernel", instead="pointers")
    assert fell_back(Fallback.TMA, cuda1)
    assert not fell_back(Fallback.TMA, cuda0)
    assert not fell_back(Fallback.MJAGGED_TMA_STORE, cuda1)
    assert not fell_back(Fallback.TMA, torch.device("cpu"))


@pytest.mark.parametrize("exc", [ValueError("a bug"), TypeError("a bug"), KeyError("a bug"),
                                 torch.OutOfMemoryError("CUDA out of memory")],
                         ids=["ValueError", "TypeError", "KeyError", "OutOfMemoryError"])
def test_only_expected_errors_fall_back(exc, no_fallbacks):
    """A bug in a launcher, or running out of memory, is no reason to give up TMA: it
    propagates and records nothing."""
    cuda0 = torch.device("cuda", 0)
    with pytest.raises(type(exc)):
        launch_or_fall_back(broken(exc), Fallback.TMA, cuda0, explicit=False, what="TMA kernel",
                            instead="pointers")
    assert not fell_back(Fallback.TMA, cuda0)


def test_triton_compile_errors_fall_back(no_fallbacks):
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError

    for index, exc in enumerate([PTXASError("ptxas fatal"),
                                 CompilationError("", None, "unsupported")]):
        device = torch.device("cuda", index)
        assert not launch_or_fall_back(broken(exc), Fallback.TMA, device, explicit=False,
                                       what="TMA kernel", instead="pointers")
        assert fell_back(Fallback.TMA, device), exc


def test_shared_memory_overflow_does_not_turn_tma_off(no_fallbacks):
    """A tile whose stages do not fit in shared memory needs as much without TMA: the error
    propagates (to the stage retry) and TMA stays on for the device."""
    from triton.runtime.errors import OutOfResources

    cuda0 = torch.device("cuda", 0)
    with pytest.raises(OutOfResources):
        launch_or_fall_back(broken(OutOfResources(278528, 232448, "shared memory")),
                            Fallback.TMA, cuda0, explicit=False, what="TMA kernel",
                            instead="pointers")
    assert not fell_back(Fallback.TMA, cuda0)
