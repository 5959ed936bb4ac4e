"""The chunkwise mLSTM's states in and out, on every backend.

* S = 0: empty outputs, the last state equal to the initial one (or the empty state), eager
  and compiled, forward and backward, with and without states and packed documents;
* gradients through the states (the initial state's, the last state's) on every backend,
  against fp64 autograd through the plain reference (``recurrent.
  parallel_reference_with_state``), including a detached initial state (truncated
  backpropagation through time) and a gradient of q alone; and ``gradcheck`` of the
  reference backend at a tiny shape;
* a malformed ``initial_state`` is named, with what it must be.

GPU variants: ``-m gpu`` (CUDA tensors, bf16 and fp32).
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compileops
from compileops.mlstm import recurrent, reference
from tests.fuzzing import sizes

CUDA = torch.cuda.is_available()
BACKENDS = ["reference", "triton"]


def _inputs(seq, *, b=1, nh=2, dqk=8, dv=8, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, shift=0.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) + shift).to(device,
                                                                                  dtype)

    tensors = [randn(b, nh, seq, dqk), randn(b, nh, seq, dqk), randn(b, nh, seq, dv),
               randn(b, nh, seq), randn(b, nh, seq, shift=3.0)]
    acc = reference.gate_dtype(dtype)
    state = [(torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3).to(device, acc)
             for shape in ((b, nh, dqk, dv), (b, nh, dqk), (b, nh))]
    weight = randn(nh * dv)
    return tensors, tuple(state), weight


# ------------------------------------------------------------------------------ S = 0


def _empty_case(backend, compiled, with_state, return_last, packed, device="cpu",
                dtype=torch.float64):
    tensors, state, weight = _inputs(0, device=device, dtype=dtype)
    leaves = [t.requires_grad_() for t in (*tensors, weight, *state)]
    cu = torch.tensor([0, 0, 0], dtype=torch.int32, device=device) if packed else None

    def fn(q, k, v, igate, fgate, w, c, n, m):
        return compileops.mlstm(q, k, v, igate, fgate, norm_weight=w, kernel="chunkwise",
                                chunk_size=16, initial_state=(c, n, m) if with_state else None,
                                return_last_state=return_last, cu_seqlens=cu)

    run = torch.compile(fn, fullgraph=True) if compiled else fn
    with compileops.use_backend(backend):
        result = run(*leaves)
        out, last = result if return_last else (result, None)
        assert out.shape == (1, 0, 16) and out.dtype == dtype
        loss = out.sum()
        if return_last:
            want = state if with_state else recurrent.empty_state(1, 2, 8, 8, dtype, device)
            for got, w in zip(last, want):
                assert torch.equal(got, w), "the last state of S = 0 is the initial one"
            cotangents = [torch.full_like(t, 2.0) for t in last]
            loss = loss + sum((t * g).sum() for t, g in zip(last, cotangents))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    for g in grads[:6]:
        assert g is None or not bool(g.any())
    if with_state and return_last:  # the identity: each state's gradient is its cotangent
        for g in grads[6:]:
            assert torch.equal(g, torch.full_like(g, 2.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", ["plain", "state", "last", "state+last", "packed"])
def test_empty_sequence(backend, compiled, case):
    _empty_case(backend, compiled, with_state="state" in case, return_last="last" in case,
                packed=case == "packed")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("batch,heads", [(0, 2), (2, 0)], ids=["B=0", "NH=0"])
@pytest.mark.parametrize("with_state", [False, True], ids=["", "state"])
def test_empty_batch_or_heads_chunkwise(backend, compiled, batch, heads, with_state):
    """No rows (B = 0 or NH = 0): empty outputs and gradients, the states passed through."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(batch, heads, 20, 8, generator=gen) for _ in range(3)] + \
        [torch.randn(batch, heads, 20, generator=gen) for _ in range(2)]
    state = (torch.zeros(batch, heads, 8, 8), torch.zeros(batch, heads, 8),
             torch.zeros(batch, heads)) if with_state else ()
    leaves = [t.requires_grad_() for t in (*tensors, *state)]

    def fn(*leaves):
        out, last = compileops.mlstm(*leaves[:5], kernel="chunkwise", chunk_size=16,
                                     initial_state=tuple(leaves[5:]) or None,
                                     return_last_state=True)
        return out, last

    run = torch.compile(fn, fullgraph=True) if compiled else fn
    with compileops.use_backend(backend):
        out, last = run(*leaves)
        assert out.shape == (batch, heads, 20, 8)
        assert [tuple(t.shape) for t in last] == [(batch, heads, 8, 8), (batch, heads, 8),
                                                  (batch, heads)]
        grads = torch.autograd.grad(out.sum() + sum(t.sum() for t in last), leaves,
                                    allow_unused=True)
    assert all(g is None or g.shape == t.shape for g, t in zip(grads, leaves))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", ["plain", "state", "last", "state+last", "packed"])
def test_gpu_empty_sequence(dtype, compiled, case):
    _empty_case("triton", compiled, with_state="state" in case, return_last="last" in case,
                packed=case == "packed", device="cuda", dtype=dtype)
    torch.cuda.synchronize()  # an illegal memory access would surface here


# ------------------------------------------------------------ gradients through states


def _truth(tensors, state, weight):
    """fp64: the parallel form with the initial state, then the norm; the last state."""
    h, _, _, last = recurrent.parallel_reference_with_state(*tensors, initial_state=state)
    return reference.multihead_layernorm(h, weight, None, 1e-6), last


def _ours(backend, chunk):
    def run(tensors, state, weight):
        with compileops.use_backend(backend):
            return compileops.mlstm(*tensors, norm_weight=weight, kernel="chunkwise",
                                    chunk_size=chunk, initial_state=state,
                                    return_last_state=True)
    return run


WHICH = ["all", "detached state", "q alone", "last state only"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seq,chunk", [(1, 16), (37, 16), (64, 32)])
@pytest.mark.parametrize("which", WHICH)
def test_state_gradients_match_fp64_autograd(backend, seq, chunk, which):
    _check_state_gradients(backend, seq, chunk, which)


@given(seq=sizes(40), chunk=st.sampled_from([16, 32]), which=st.sampled_from(WHICH),
       backend=st.sampled_from(BACKENDS))
def test_state_gradients_property(seq, chunk, which, backend):
    """Any S (0 included), chunk, state and gradient pattern, on both backends."""
    _check_state_gradients(backend, seq, chunk, which)


def _check_state_gradients(backend, seq, chunk, which):
    tensors, state, weight = _inputs(seq, seed=seq)
    gen = torch.Generator().manual_seed(5)
    g_out = torch.randn(1, seq, 16, generator=gen, dtype=torch.float64)
    g_last = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in state]

    def run(fn):
        inputs = [t.clone().requires_grad_(which != "q alone" or i == 0)
                  for i, t in enumerate(tensors)]
        st = tuple(t.clone().requires_grad_(which in ("all", "last state only")) for t in state)
        w = weight.clone().requires_grad_(which != "q alone")
        out, last = fn(inputs, st, w)
        loss = sum((a * b).sum() for a, b in zip(last, g_last))
        if which != "last state only":
            loss = loss + (out * g_out).sum()
        leaves = [t for t in (*inputs, w, *st) if t.requires_grad]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [out, *last], [torch.zeros_like(t) if g is None else g
                              for t, g in zip(leaves, grads)]

    got, got_grads = run(_ours(backend, chunk))
    want, want_grads = run(_truth)
    assert len(got_grads) == len(want_grads)
    for i, (g, w) in enumerate(zip(got + list(got_grads), want + list(want_grads))):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m: f"#{i}: {m}")


def test_reference_backend_gradcheck_through_states():
    """Finite differences of the reference backend, states in and out (S = 20, chunk 16:
    two chunks), fp64 (gradcheck's fast mode: random projections of the Jacobian)."""
    tensors, state, weight = _inputs(20, nh=1, dqk=4, dv=4, seed=1)

    def fn(q, k, v, igate, fgate, w, c, n, m):
        with compileops.use_backend("reference"):
            out, last = compileops.mlstm(q, k, v, igate, fgate, norm_weight=w,
                                         kernel="chunkwise", chunk_size=16,
                                         initial_state=(c, n, m), return_last_state=True)
        return (out, *last)

    leaves = [t.clone().requires_grad_() for t in (*tensors, weight, *state)]
    assert torch.autograd.gradcheck(fn, leaves, atol=1e-6, rtol=1e-5, fast_mode=True)


def _check_rounded_state_gradients(dtype, device, seq, b, nh, dqk, dv):
    """The states' gradients on the Triton kernels, against fp64 autograd on the same
    rounded inputs (relative L2: the chunkwise form's bf16 bound, 8e-2; fp32 1e-4), or twice
    the error of plain fp32 autograd through the same formula where that is larger: the
    initial n's gradient reaches it through ``seq`` steps of decay (about 5e-7 of its
    cotangent at 300), and fp32 autograd already misses it by 10-15%."""
    from compileops.testing import assert_close_to_reference, error_report

    tensors, state, weight = _inputs(seq, b=b, nh=nh, dqk=dqk, dv=dv, dtype=dtype,
                                     device=device, seed=3)
    gen = torch.Generator().manual_seed(4)
    g_out = torch.randn(b, seq, nh * dv, generator=gen, dtype=torch.float64).to(device)
    g_last = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device)
              for t in state]

    def run(fn, cast=None):
        def leaf(t):
            return (t if cast is None else t.to(cast)).clone().requires_grad_()

        inputs, st, w = [leaf(t) for t in tensors], tuple(leaf(t) for t in state), leaf(weight)
        out, last = fn(inputs, st, w)
        loss = (out.double() * g_out).sum() + sum((a.double() * b).sum()
                                                  for a, b in zip(last, g_last))
        return torch.autograd.grad(loss, [*inputs, w, *st])

    got = run(_ours("triton", 64))
    want = run(_truth, cast=torch.float64)
    plain = run(_truth, cast=torch.float32)
    tol = 8e-2 if dtype == torch.bfloat16 else 1e-4
    for i, (g, w, p) in enumerate(zip(got, want, plain)):
        floor = 2 * error_report(p, w).relative_error
        assert_close_to_reference(g, w, max_relative_error=max(tol, floor),
                                  what=f"gradient #{i}")


def test_bf16_initial_normaliser_gradient():
    """A norm after the cell makes the normaliser's term vanish in exact arithmetic, so in
    bf16 it is rounding noise of dh. The initial n's gradient is that term alone: taken from
    the dh rounded for the cell it was 1000x its (tiny) true value; it takes the unrounded
    dh's now. The Triton kernels under the interpreter (the CPU's bf16 rounding)."""
    _check_rounded_state_gradients(torch.bfloat16, "cpu", 200, b=1, nh=2, dqk=32, dv=32)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="known limit (compileops.mlstm docstring): above 256 value columns "
                          "the norm runs after the cell, which sees only the bf16-rounded "
                          "gradient of h; the initial n's gradient is rounding noise there")
def test_bf16_initial_normaliser_gradient_wide_value_heads():
    """The same check where the value head is cut in slices of 256 (DV 512): the initial n's
    gradient is about 900x off its true value. Strict: a fix makes this test fail until the
    mark is removed."""
    _check_rounded_state_gradients(torch.bfloat16, "cpu", 200, b=1, nh=1, dqk=16, dv=512)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_state_gradients(dtype):
    _check_rounded_state_gradients(dtype, "cuda", 300, b=2, nh=4, dqk=64, dv=64)


# ------------------------------------------------------------- malformed initial_state


@pytest.mark.parametrize("bad,error,match", [
    ("two", TypeError, "got str"),
    ("pair", ValueError, "got 2 items"),
    ("four", ValueError, "got 4 items"),
    ("partial", ValueError, r"partial state \(n is None\)"),
    ("not a tensor", TypeError, "got float for m"),
    ("tensor", TypeError, "got Tensor"),
])
def test_malformed_initial_state_is_named(bad, error, match):
    tensors, (c, n, m), _ = _inputs(20)
    initial = {"two": "cn", "pair": (c, n), "four": (c, n, m, m), "partial": (c, None, m),
               "not a tensor": (c, n, 0.0), "tensor": c}[bad]
    with pytest.raises(error, match=r"initial_state must be a tuple \(C \[B, NH, DQK, DV\], "
                                    r"n \[B, NH, DQK\], m \[B, NH\]\) of three tensors.*"
                                    + match):
        compileops.mlstm(*tensors, kernel="chunkwise", initial_state=initial)
