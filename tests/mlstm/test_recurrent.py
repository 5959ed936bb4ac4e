"""The mLSTM references with states (compileops/mlstm/recurrent.py), in fp64:

* the token loop from the empty state equals the parallel cell (``reference.cell``);
* the parallel form with an initial state equals the token loop started from it, h, the
  per-row stabiliser and row sum, and the last state;
* a sequence cut in two calls, the state carried, equals one call (both forms);
* packed documents (``cu_seqlens``) equal each document run alone;
* autograd through the parallel form (the states' gradients included) equals autograd
  through the token loop, and passes ``gradcheck``.
"""
import math

import pytest
import torch

from compileops.mlstm import recurrent, reference
from tests.mlstm._helpers import make_inputs

ATOL = 1e-12


def _state(b, nh, dqk, dv, seed=3, dtype=torch.float64):
    """A random state: C and n of moderate size, m around 0 (a state some tokens old)."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(b, nh, dqk, dv, generator=gen, dtype=torch.float64) * 0.3
    n = torch.randn(b, nh, dqk, generator=gen, dtype=torch.float64) * 0.3
    m = torch.randn(b, nh, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (c, n, m))


def _close(got, want, atol=ATOL, what=""):
    torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=lambda m: f"{what}: {m}")


def _loop_stats(x, state=None, eps=1e-6):
    """h, the row sum ``q . n / sqrt(DQK)`` and m of each token, from the step function."""
    seq, dqk = x.q.shape[-2:]
    bs, ms = [], []
    for t in range(seq):
        _, state = recurrent.step_reference(x.q[:, :, t], x.k[:, :, t], x.v[:, :, t],
                                            x.igate[..., t], x.fgate[..., t], state, eps)
        bs.append((x.q[:, :, t] * state[1]).sum(-1) / math.sqrt(dqk))
        ms.append(state[2])
    return torch.stack(bs, -1), torch.stack(ms, -1)


def test_empty_state():
    c, n, m = recurrent.empty_state(2, 3, 4, 5, torch.bfloat16)
    assert c.shape == (2, 3, 4, 5) and n.shape == (2, 3, 4) and m.shape == (2, 3)
    assert c.dtype == n.dtype == m.dtype == torch.float32
    assert not c.any() and not n.any() and torch.isneginf(m).all()
    assert recurrent.empty_state(1, 1, 2, 2, torch.float64)[0].dtype == torch.float64


def test_first_step_stabiliser_is_the_input_gate():
    """From the empty state (m = -inf, not 0) the first stabiliser is igate itself."""
    x = make_inputs(2, 2, 1, 8, 4, seed=4)
    _, (c, n, m) = recurrent.step_reference(x.q[:, :, 0], x.k[:, :, 0], x.v[:, :, 0],
                                            x.igate[..., 0], x.fgate[..., 0])
    assert torch.equal(m, x.igate[..., 0])
    _close(c, x.k[:, :, 0, :, None] * x.v[:, :, 0, None, :])
    _close(n, x.k[:, :, 0])


@pytest.mark.parametrize("dqk,dv", [(8, 12), (16, 8)])
def test_recurrent_loop_equals_parallel_cell(dqk, dv):
    x = make_inputs(2, 3, 23, dqk, dv, seed=1, fgate_bias=1.0)
    h, b, m = reference.cell(x.q, x.k, x.v, x.igate, x.fgate)
    h_rec, last = recurrent.recurrent_reference(x.q, x.k, x.v, x.igate, x.fgate)
    _close(h_rec, h, what="h")
    b_rec, m_rec = _loop_stats(x)
    _close(b_rec, b, what="b")
    _close(m_rec, m, what="m")
    # The parallel form with states, from the empty state: the same, and the same last state.
    h_par, b_par, m_par, last_par = recurrent.parallel_reference_with_state(
        x.q, x.k, x.v, x.igate, x.fgate)
    for name, got, want in [("h", h_par, h), ("b", b_par, b), ("m", m_par, m),
                            ("C", last_par[0], last[0]), ("n", last_par[1], last[1]),
                            ("m last", last_par[2], last[2])]:
        _close(got, want, what=name)


@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_parallel_with_initial_state_equals_the_loop(eps):
    x = make_inputs(2, 2, 19, 8, 12, seed=2)
    state = _state(2, 2, 8, 12)
    h_rec, last_rec = recurrent.recurrent_reference(x.q, x.k, x.v, x.igate, x.fgate, state,
                                                    eps)
    h, b, m, last = recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate, x.fgate,
                                                            state, eps=eps)
    b_rec, m_rec = _loop_stats(x, state, eps)
    _close(h, h_rec, what="h")
    _close(b, b_rec, what="b")
    _close(m, m_rec, what="m")
    for got, want, name in zip(last, last_rec, "Cnm"):
        _close(got, want, what=name)


def test_a_large_initial_stabiliser_dominates():
    """m0 far above the gates: every row's stabiliser comes from the state's column."""
    x = make_inputs(1, 2, 9, 4, 4, seed=6)
    c0, n0, m0 = _state(1, 2, 4, 4)
    m0 = m0 + 30.0
    _, _, m, last = recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate, x.fgate,
                                                            (c0, n0, m0))
    log_f = reference.log_forget_cumsum(x.fgate)
    _close(m, log_f + m0[..., None])
    _, last_rec = recurrent.recurrent_reference(x.q, x.k, x.v, x.igate, x.fgate, (c0, n0, m0))
    for got, want in zip(last, last_rec):
        _close(got, want)


@pytest.mark.parametrize("form", ["recurrent", "parallel"])
@pytest.mark.parametrize("initial", [False, True], ids=["empty", "state"])
def test_two_calls_with_the_carried_state_equal_one_call(form, initial):
    x = make_inputs(2, 2, 21, 8, 12, seed=3)
    state = _state(2, 2, 8, 12) if initial else None

    def run(sl, st):
        part = x.map(lambda t: t[..., sl, :] if t.dim() == 4 else t[..., sl])
        if form == "recurrent":
            return recurrent.recurrent_reference(part.q, part.k, part.v, part.igate,
                                                 part.fgate, st)
        h, _, _, last = recurrent.parallel_reference_with_state(
            part.q, part.k, part.v, part.igate, part.fgate, st)
        return h, last

    whole, last = run(slice(None), state)
    first, mid = run(slice(0, 8), state)
    second, last2 = run(slice(8, None), mid)
    _close(torch.cat([first, second], dim=2), whole, what="h")
    for got, want, name in zip(last2, last, "Cnm"):
        _close(got, want, what=name)


def _slice_docs(x, cu):
    bounds = cu.tolist()
    return [x.map(lambda t, a=a, b=b: t[..., a:b, :] if t.dim() == 4 else t[..., a:b])
            for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("initial", [False, True], ids=["empty", "per-document"])
def test_packed_documents_equal_each_document_alone(initial):
    cu = torch.tensor([0, 5, 5, 12, 13, 20], dtype=torch.int32)  # an empty one, a single token
    docs = cu.shape[0] - 1
    x = make_inputs(1, 2, 20, 8, 12, seed=5)
    state = _state(docs, 2, 8, 12) if initial else None
    h, b, m, last = recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate, x.fgate,
                                                            state, cu_seqlens=cu)
    assert h.shape == (1, 2, 20, 12) and b.shape == m.shape == (1, 2, 20)
    assert last[0].shape == (docs, 2, 8, 12) and last[2].shape == (docs, 2)
    bounds = cu.tolist()
    for d, part in enumerate(_slice_docs(x, cu)):
        st = None if state is None else tuple(t[d:d + 1] for t in state)
        want_h, want_b, want_m, want_last = recurrent.parallel_reference_with_state(
            part.q, part.k, part.v, part.igate, part.fgate, st)
        sl = slice(bounds[d], bounds[d + 1])
        _close(h[..., sl, :], want_h, what=f"h of document {d}")
        _close(b[..., sl], want_b, what=f"b of document {d}")
        _close(m[..., sl], want_m, what=f"m of document {d}")
        if bounds[d] == bounds[d + 1]:
            want_last = st if st is not None else recurrent.empty_state(1, 2, 8, 12,
                                                                        torch.float64)
        for got, want, name in zip(last, want_last, "Cnm"):
            _close(got[d:d + 1], want, what=f"last {name} of document {d}")


def test_packed_documents_see_nothing_of_each_other():
    """Changing one document's tokens changes no other document's output."""
    cu = torch.tensor([0, 6, 14], dtype=torch.int64)
    x = make_inputs(1, 1, 14, 4, 4, seed=8)
    h, _, _, last = recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate, x.fgate,
                                                            cu_seqlens=cu)
    y = x.map(lambda t: t.clone())
    y.k[..., :6, :] += 1.0
    y.fgate[..., :6] -= 2.0
    h2, _, _, last2 = recurrent.parallel_reference_with_state(y.q, y.k, y.v, y.igate, y.fgate,
                                                              cu_seqlens=cu)
    assert torch.equal(h2[..., 6:, :], h[..., 6:, :])
    assert all(torch.equal(a[1], b[1]) for a, b in zip(last, last2))


def test_empty_sequence_returns_the_initial_state():
    x = make_inputs(1, 2, 0, 4, 6)
    state = _state(1, 2, 4, 6)
    h, last = recurrent.recurrent_reference(x.q, x.k, x.v, x.igate, x.fgate, state)
    assert h.shape == (1, 2, 0, 6) and all(torch.equal(a, b) for a, b in zip(last, state))
    h, b, m, last = recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate, x.fgate,
                                                            state)
    assert h.shape == (1, 2, 0, 6) and b.shape == m.shape == (1, 2, 0)
    assert all(torch.equal(a, b) for a, b in zip(last, state))


def test_fp32_inputs_give_fp32_states_close_to_fp64():
    x = make_inputs(1, 2, 11, 8, 8, seed=9)
    x32 = x.map(lambda t: t.float())
    h, b, m, last = recurrent.parallel_reference_with_state(x32.q, x32.k, x32.v, x32.igate,
                                                            x32.fgate)
    assert h.dtype == b.dtype == m.dtype == last[0].dtype == torch.float32
    h64, last64 = recurrent.recurrent_reference(x.q, x.k, x.v, x.igate, x.fgate)
    _close(h.double(), h64, atol=1e-5)
    h_bf, last_bf = recurrent.recurrent_reference(*[t.bfloat16() for t in x.tensors()[:5]])
    assert h_bf.dtype == last_bf[0].dtype == torch.float32


# --------------------------------------------------------------------------- gradients


def _loss_grads(fn, x, state, seed=5):
    """Gradients of a random linear loss of ``fn``'s h and last state, w.r.t. the inputs
    and the initial state."""
    leaves = x.leaves()
    st = [t.clone().requires_grad_(True) for t in state]
    h, last = fn(leaves, tuple(st))
    gen = torch.Generator().manual_seed(seed)
    loss = (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
    loss = loss + sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
                      for t in last)
    return torch.autograd.grad(loss, leaves.tensors() + st)


def test_parallel_gradients_equal_the_loops_states_included():
    x = make_inputs(2, 2, 13, 8, 12, weight=False, bias=False, seed=10)
    state = _state(2, 2, 8, 12, seed=11)

    def loop(leaves, st):
        return recurrent.recurrent_reference(leaves.q, leaves.k, leaves.v, leaves.igate,
                                             leaves.fgate, st)

    def parallel(leaves, st):
        h, _, _, last = recurrent.parallel_reference_with_state(
            leaves.q, leaves.k, leaves.v, leaves.igate, leaves.fgate, st)
        return h, last

    names = ["q", "k", "v", "igate", "fgate", "C0", "n0", "m0"]
    for name, got, want in zip(names, _loss_grads(parallel, x, state),
                               _loss_grads(loop, x, state)):
        _close(got, want, atol=1e-10, what=f"d{name}")


def test_gradcheck_packed_with_initial_states():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    x = make_inputs(1, 1, 7, 3, 2, weight=False, bias=False, seed=12)
    state = _state(2, 1, 3, 2, seed=13)

    def fn(q, k, v, igate, fgate, c0, n0, m0):
        h, b, m, last = recurrent.parallel_reference_with_state(q, k, v, igate, fgate,
                                                                (c0, n0, m0), cu_seqlens=cu)
        return h, b, *last

    args = [t.clone().requires_grad_(True) for t in (*x.tensors(), *state)]
    assert torch.autograd.gradcheck(fn, args)


# --------------------------------------------------------------------------- bad input


def test_cu_seqlens_preconditions():
    x = make_inputs(2, 1, 6, 4, 4)
    one = make_inputs(1, 1, 6, 4, 4)
    args = (one.q, one.k, one.v, one.igate, one.fgate)
    with pytest.raises(ValueError, match="B must be 1, got 2"):
        recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate, x.fgate,
                                                cu_seqlens=torch.tensor([0, 6]))
    for bad, match in (([0, 4], r"must end at S = 6 .*cu_seqlens\[-1\] = 4"),
                       ([1, 6], r"must start at 0, got cu_seqlens\[0\] = 1"),
                       ([0, 4, 3, 6], r"must not decrease, got cu_seqlens\[1\] = 4 and "
                                      r"cu_seqlens\[2\] = 3")):
        with pytest.raises(ValueError, match=match):
            recurrent.parallel_reference_with_state(*args, cu_seqlens=torch.tensor(bad))
    with pytest.raises(ValueError, match="int32 or int64"):
        recurrent.parallel_reference_with_state(*args, cu_seqlens=torch.tensor([0., 6.]))
    with pytest.raises(ValueError, match=r"leading dimension of 2 \(N, one per document\)"):
        recurrent.parallel_reference_with_state(*args, _state(1, 1, 4, 4),
                                                cu_seqlens=torch.tensor([0, 2, 6]))
