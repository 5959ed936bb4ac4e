"""chunk_sums / chunk_average / valid_chunk_mask."""
from __future__ import annotations

import pytest
import torch

import compileops
from compileops.testing import (
    assert_batch_invariant,
    assert_close_to_reference,
    assert_deterministic,
)
from compileops.xtoken import chunk_average, chunk_sums, valid_chunk_mask
from compileops.xtoken.op import chunk_sums_backward_op, chunk_sums_op
from compileops.xtoken.reference import chunk_average_one_hot_bmm

from tests.xtoken._helpers import BACKENDS


def _runs(B, T, C, seed=0, gaps=True):
    """Non-decreasing contiguous runs with -1 gaps (the aligner's output)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, C, (B, T), generator=gen), dim=1).values
    if gaps:
        ids[torch.rand(B, T, generator=gen) < 0.2] = -1
    return ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_means(backend):
    lp = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0], [5.0, 7.0], [8.0, 9.0]]])
    ids = torch.tensor([[0, 0, -1, 2, 2]])  # chunk 1 empty, chunk 3 empty, -1 ignored
    with compileops.use_backend(backend):
        mean, sizes = chunk_average(lp, ids, 4)
        sums, sizes2 = chunk_sums(lp, ids, 4)
    want = torch.tensor([[[2.0, 3.0], [0.0, 0.0], [6.5, 8.0], [0.0, 0.0]]])
    assert torch.equal(mean, want)
    assert torch.equal(sizes, torch.tensor([[2.0, 0.0, 2.0, 0.0]]))
    assert torch.equal(sums[0, 2], torch.tensor([13.0, 16.0]))
    assert torch.equal(sizes, sizes2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contiguous", [True, False], ids=["runs", "scattered"])
def test_matches_one_hot_bmm(backend, contiguous):
    B, T, C, V = 3, 40, 12, 33
    ids = _runs(B, T, C)
    if not contiguous:
        ids = ids[:, torch.randperm(T, generator=torch.Generator().manual_seed(1))]
    ids[0, :3] = C + 2  # out of range: ignored like -1
    lp = torch.randn(B, T, V, dtype=torch.float64).float().requires_grad_()
    with compileops.use_backend(backend):
        mean, sizes = chunk_average(lp, ids, C)
    want_mean, want_sizes = chunk_average_one_hot_bmm(lp.detach().double(), ids, C)
    assert_close_to_reference(mean, want_mean, max_relative_error=1e-6)
    assert torch.equal(sizes, want_sizes.float())
    # Backward: grad / size gathered back to each token; -1 tokens get 0.
    g = torch.randn(B, C, V)
    with compileops.use_backend(backend):
        (grad,) = torch.autograd.grad(mean, lp, g)
    lp64 = lp.detach().double().requires_grad_()
    (want_grad,) = torch.autograd.grad(chunk_average_one_hot_bmm(lp64, ids, C)[0], lp64,
                                       g.double())
    assert_close_to_reference(grad, want_grad, max_relative_error=1e-6, what="grad")
    assert torch.equal(grad[ids < 0], torch.zeros_like(grad[ids < 0]))


def test_triton_equals_reference_bitwise_on_cpu():
    """Same fp32 token-order sums, so the interpreter and the reference agree exactly."""
    lp = torch.randn(2, 50, 70)
    ids = _runs(2, 50, 9)
    out = {}
    for backend in BACKENDS:
        with compileops.use_backend(backend):
            out[backend] = chunk_sums(lp, ids, 9) + (
                chunk_sums_backward_op(torch.randn(2, 9, 70, generator=torch.Generator()
                                                   .manual_seed(0)), ids, torch.float32),)
    for a, b in zip(out["triton"], out["reference"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_log_probs(backend):
    lp = torch.randn(2, 16, 8).bfloat16().requires_grad_()
    ids = _runs(2, 16, 5)
    with compileops.use_backend(backend):
        sums, sizes = chunk_sums(lp, ids, 5)
    assert sums.dtype == torch.float32 and sizes.dtype == torch.float32
    want, _ = chunk_average_one_hot_bmm(lp.detach().double(), ids, 5)
    assert_close_to_reference(sums / sizes.clamp(min=1)[..., None], want,
                              max_relative_error=1e-6)
    (grad,) = torch.autograd.grad(sums.sum(), lp)
    assert grad.dtype == torch.bfloat16
    assert torch.equal(grad.float(), (ids >= 0).float()[..., None].expand(-1, -1, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_and_deterministic(backend):
    lp = torch.randn(4, 24, 10, requires_grad=True)
    ids = _runs(4, 24, 7)
    with compileops.use_backend(backend):
        assert_batch_invariant(lambda x, i: chunk_sums(x, i, 7), [lp.detach(), ids])
        assert_batch_invariant(lambda g, i: chunk_sums_backward_op(g, i, torch.float32),
                               [torch.randn(4, 7, 10), ids])
        assert_deterministic(lambda x: chunk_average(x, ids, 7)[0], [lp], runs=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_fullgraph_no_recompiles(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(lp, ids):
        mean, sizes = chunk_average(lp.log_softmax(-1), ids, 6)
        return mean * (sizes > 0)[..., None]

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    with compileops.use_backend(backend):
        for T in (5, 9, 16):
            lp = torch.randn(2, T, 7, requires_grad=True)
            ids = _runs(2, T, 6, seed=T)
            got = compiled(lp, ids)
            (g_got,) = torch.autograd.grad(got.sum(), lp)
            want = fn(lp, ids)
            (g_want,) = torch.autograd.grad(want.sum(), lp)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


def test_opcheck():
    lp = torch.randn(2, 9, 5, requires_grad=True)
    ids = _runs(2, 9, 4).int()
    torch.library.opcheck(chunk_sums_op, (lp, ids, 4))
    torch.library.opcheck(chunk_sums_backward_op, (torch.randn(2, 4, 5), ids, torch.float32))


def test_edge_shapes_and_errors():
    sums, sizes = chunk_sums(torch.randn(2, 3, 4), torch.full((2, 3), -1), 0)
    assert sums.shape == (2, 0, 4) and sizes.shape == (2, 0)
    sums, sizes = chunk_sums(torch.randn(2, 0, 4), torch.zeros(2, 0, dtype=torch.long), 3)
    assert torch.equal(sums, torch.zeros(2, 3, 4)) and torch.equal(sizes, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"chunk_id must be \[B, T\]"):
        chunk_sums(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), 3)
    with pytest.raises(RuntimeError, match="chunk_id must be int32 or int64"):
        chunk_sums(torch.randn(2, 3, 4), torch.zeros(2, 3), 3)
    with pytest.raises(RuntimeError, match="log_probs must be 3-D"):
        chunk_sums(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_chunks must be >= 0"):
        chunk_sums(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), -1)


def test_inputs_not_modified():
    lp = torch.randn(2, 10, 6)
    ids = _runs(2, 10, 4)
    lp0, ids0 = lp.clone(), ids.clone()
    chunk_average(lp, ids, 4)
    assert torch.equal(lp, lp0) and torch.equal(ids, ids0)


def test_valid_chunk_mask():
    student = torch.tensor([[2.0, 0.0, 1.0, 3.0]])
    teacher = torch.tensor([[1.0, 4.0, 0.0, 2.0]])
    pair = torch.tensor([[True, True, True, False]])
    assert torch.equal(valid_chunk_mask(student, teacher, pair),
                       torch.tensor([[True, False, False, False]]))
