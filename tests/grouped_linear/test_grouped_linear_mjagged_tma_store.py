"""M-jagged kernel (forward, dX, SwiGLU) with ``Config.tma_store``: output tiles stored through
a ragged descriptor (``store_rows_below``) instead of masked pointer stores. Under the
interpreter with emulated TMA descriptors: the same bits as the pointer store, no row of a
neighbouring group or of the zero tail overwritten, where the flag reaches the kernel, the
sweep's configs. Their sm90 builds are checked in test_grouped_linear_sm90_codegen.py,
GPU runs in test_grouped_linear_gpu.py."""
import dataclasses

import pytest
import torch

from compileops.grouped_linear import kernels, reference
from compileops.grouped_linear.kernels import Config
from compileops.testing import assert_close_to_reference
from tests.grouped_linear._helpers import import_sweep

BASE = Config(16, 32, 32, num_warps=4, num_stages=1)
STORE = dataclasses.replace(BASE, tma_store=True)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
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


def make(layout, dtype):
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
                                    bias=b, swiglu_out=True, out_dtype=x.dtype, config=cfg,
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
    x, w, b, grad, offs = make(layout, dtype)
    got = run(product, STORE, x, w, b, grad, offs)
    assert kernels._mjagged_tma_store(got, STORE, True), "the TMA store must be exercised"
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
    flag = kernels._mjagged_tma_store
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
    x, w, b, grad, offs = make("interior", torch.bfloat16)
    w, b = w[:, :36], b[:, :36]
    args = (x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, 18)
    got = kernels.mjagged_gemm(*args, bias=b, swiglu_out=True, out_dtype=x.dtype,
                               config=STORE, use_tma=True)
    assert not kernels._mjagged_tma_store(got, STORE, True)
    plain = kernels.mjagged_gemm(*args, bias=b, swiglu_out=True, out_dtype=x.dtype,
                                 config=BASE, use_tma=True)
    assert torch.equal(bits(got), bits(plain))


def test_sweep_lists_tma_store_configs_with_distinct_labels():
    sweep = import_sweep()
    for configs in (sweep.FWD_CONFIGS, sweep.SWIGLU_CONFIGS):
        labels = [sweep.config_label(c) for c in configs]
        assert len(set(labels)) == len(labels), labels
        assert any(c.tma_store for c in configs)
        assert all((" tma-store" in sweep.config_label(c)) == c.tma_store for c in configs)
        for cfg in configs:  # the M-jagged kernel has no other variant
            assert not (cfg.ragged_tma or cfg.epilogue_subtile), cfg


def test_tma_compatible_tensors():
    """``_tma_compatible`` (shared by the forward, dX, dW and TMA-store checks): unit last
    stride, 16-byte aligned base and outer strides, for 2-D and 3-D tensors."""
    t = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert kernels._tma_compatible(t) and kernels._tma_compatible(torch.zeros(4, 8, 16))
    assert not kernels._tma_compatible(t.T)  # last stride 64
    assert not kernels._tma_compatible(t.view(-1)[1:4033].view(63, 64))  # base off by 2 bytes
    assert not kernels._tma_compatible(t[:, :60].contiguous().as_strided((8, 60), (60, 1)))
    assert not kernels._tma_compatible(torch.zeros(4, 3, 12, dtype=torch.bfloat16)[:, :, :4])  # 24-byte stride
