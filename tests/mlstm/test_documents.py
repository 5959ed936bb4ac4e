"""Packed documents (``cu_seqlens``) are isolated: a document's output, stabiliser,
normaliser and input gradients are the document's alone, whatever the other documents hold.

Property tests (tests/fuzzing.py, ``packed_documents``): random packings with empty
documents, a target document, and other documents holding NaN, +-Inf, or gates at +-1e4;
the target is compared with the same document run alone, bitwise on the Triton kernels
(Triton's interpreter here; ``-m gpu`` on CUDA) and to fp64 rounding on the reference backend
(whose elementwise CPU ops round an element by where it sits in the row; so does the
normaliser statistic's exp on CPU tensors).
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileops
from tests.fuzzing import cumulative_ends, packed_documents

CUDA = torch.cuda.is_available()
NAMES = ("q", "k", "v", "igate", "fgate")


def _inputs(lengths, poisons, *, nh=2, dqk=8, dv=16, dtype=torch.float64, device="cpu",
            seed=0):
    seq = sum(lengths)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, shift=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) + shift

    x = {"q": randn(1, nh, seq, dqk), "k": randn(1, nh, seq, dqk), "v": randn(1, nh, seq, dv),
         "igate": randn(1, nh, seq), "fgate": randn(1, nh, seq, shift=3.0)}
    starts = cumulative_ends(lengths)
    for doc, name, row, value in poisons:
        x[name][:, :, starts[doc] + row] = value
    weight, bias = randn(nh * dv), randn(nh * dv)
    x = {n: t.to(device, dtype) for n, t in x.items()}
    return x, weight.to(device, dtype), bias.to(device, dtype), starts


def _run(x, weight, bias, chunk, cu, grad_out):
    leaves = [x[n].clone().requires_grad_() for n in NAMES]
    out, n, m = compileops.mlstm_with_stats(*leaves, norm_weight=weight, norm_bias=bias,
                                            kernel="chunkwise", chunk_size=chunk,
                                            cu_seqlens=cu)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out, n, m, grads


def _rows(t, start, end):
    return t[..., start:end, :] if t.dim() == 4 else t[..., start:end]


def _check_isolated(example, backend, chunk, *, dtype=torch.float64, device="cpu"):
    lengths, target, poisons = example
    x, weight, bias, starts = _inputs(lengths, poisons, dtype=dtype, device=device)
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn((1, sum(lengths), weight.numel()), generator=gen,
                           dtype=torch.float64).to(device, dtype)
    start, end = starts[target], starts[target + 1]
    alone_x = {n: _rows(t, start, end) for n, t in x.items()}
    with compileops.use_backend(backend):
        packed = _run(x, weight, bias, chunk, cu, grad_out)
        alone = _run(alone_x, weight, bias, chunk, None, grad_out[:, start:end])
    got = [packed[0][:, start:end], _rows(packed[1], start, end), _rows(packed[2], start, end),
           *(_rows(g, start, end) for g in packed[3])]
    want = [alone[0], alone[1], alone[2], *alone[3]]
    for what, g, w in zip(("out", "n", "m", *(f"d{n}" for n in NAMES)), got, want):
        message = f"document {target} of {lengths}, poisons {poisons}: {what}"
        # n = max(|b|, exp(-m)) is a torch op on the gathered rows: on CPU its exp rounds by
        # the row's place in the tensor, as the reference backend's ops do.
        exact = backend == "triton" and (what != "n" or device != "cpu")
        if exact:
            assert torch.equal(g, w), message
        else:  # a few ulps of the dtype
            ulp = torch.finfo(dtype).eps
            torch.testing.assert_close(g, w, atol=ulp * 1e-3, rtol=ulp * 8, msg=message)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@settings(max_examples=8)
@given(example=packed_documents(max_docs=4, max_length=32), chunk=st.sampled_from([16, 32]))
def test_a_document_is_its_own_alone(backend, example, chunk):
    _check_isolated(example, backend, chunk)


@given(example=packed_documents(max_docs=3, max_length=24))
@settings(max_examples=4)
def test_fp32_documents_are_bitwise_their_own(example):
    _check_isolated(example, "triton", 16, dtype=torch.float32)


def test_an_inf_before_a_document_stays_there():
    """The audit's cases: an Inf in the first document, and its input gates 230 above the
    second's, leave the second as it is alone."""
    for poisons in ([(0, "v", 3, float("inf"))], [(0, "k", 0, float("inf"))],
                    [(0, "igate", i, 230.0) for i in range(3)]):
        for backend in ("triton", "reference"):
            _check_isolated(([20, 20], 1, poisons), backend, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@given(example=packed_documents(max_docs=6, max_length=300),
       chunk=st.sampled_from([64, 128]))
def test_gpu_a_document_is_its_own_alone(dtype, example, chunk):
    _check_isolated(example, "triton", chunk, dtype=dtype, device="cuda")
