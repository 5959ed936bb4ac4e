"""The recurrent mLSTM step, ``compileops.mlstm_step`` / ``compileops::mlstm_step``:

* both backends against the fp64 step reference (``recurrent.step_reference``, then the
  reference norm) on the same rounded inputs, fp64 / fp32 / bf16 / fp16, with and without the
  norm, DQK != DV (16/32, 24/40); the Triton kernel with several DQK and DV tiles;
* a loop of steps equals ``compileops.mlstm`` on the whole sequence (fp64: 1e-10; bf16:
  ``LOOP_TOL``), also after a prompt run in parallel that hands over its last state;
* inputs are never modified; deterministic and batch-invariant (bitwise);
* gradients (plain PyTorch on every backend) against autograd through the reference;
* bad input named eagerly and under ``torch.compile(fullgraph=True)``; fullgraph compile
  of a generation loop; ``torch.library.opcheck``.

Measured (CPU): the output against the fp64 truth, fp32 ~1.4e-7, fp16 ~2e-4, bf16 ~1.9e-3
(reference) and ~3.4e-3 (the kernel under Triton's interpreter, whose fp32 -> bf16 cast
appears to truncate rather than round): the output's own rounding, the state stays fp32.
The loop of steps against ``compileops.mlstm`` (Triton, 24 tokens, DQK 16, DV 24): fp64
~4e-16; bf16 ~4.1e-3 raw and ~1.6e-3 normed (both round to bf16, in different places).
"""
import pytest
import torch
from torch._dynamo.utils import counters

import compileops
from compileops import use_backend
from compileops.mlstm import recurrent, reference
from compileops.mlstm.kernels import step as step_kernels
from compileops.testing import assert_close_to_reference
from tests.mlstm._helpers import BACKENDS, make_inputs

step_op = torch.ops.compileops.mlstm_step.default
backward_op = torch.ops.compileops.mlstm_step_backward.default

#: Relative L2 error of the step's output against the fp64 reference on the same rounded
#: inputs; the state (fp32 for bf16 inputs) is held to ``STATE_TOL``.
OUT_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3,
           torch.float16: 1e-3}
STATE_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6,
             torch.float16: 2e-6}
#: A loop of steps against compileops.mlstm on the whole sequence, in the same dtype.
LOOP_TOL = {torch.float64: 1e-10, torch.bfloat16: 1e-2}


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _state(b, nh, dqk, dv, dtype=torch.float64, seed=3):
    """A random state in the accumulation dtype of ``dtype`` inputs."""
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(b, nh, dqk, dv, generator=gen, dtype=torch.float64) * 0.3
    n = torch.randn(b, nh, dqk, generator=gen, dtype=torch.float64) * 0.3
    m = torch.randn(b, nh, generator=gen, dtype=torch.float64)
    return tuple(t.to(_acc(dtype)) for t in (c, n, m))


def _token(b, nh, dqk, dv, dtype=torch.float64, normed=True, seed=0):
    """One token's ``dict(q, k, v, igate, fgate, norm_weight, norm_bias)`` (fp64 drawn)."""
    x = make_inputs(b, nh, 1, dqk, dv, dtype=dtype, weight=normed, bias=normed, seed=seed)
    return dict(q=x.q[:, :, 0], k=x.k[:, :, 0], v=x.v[:, :, 0], igate=x.igate[..., 0],
                fgate=x.fgate[..., 0], norm_weight=x.norm_weight, norm_bias=x.norm_bias)


def _step(t, state=None, **kwargs):
    return compileops.mlstm_step(t["q"], t["k"], t["v"], t["igate"], t["fgate"], state,
                                 norm_weight=t["norm_weight"], norm_bias=t["norm_bias"],
                                 **kwargs)


def _truth(t, state, norm_eps=1e-6, eps=1e-6, residual_weight=False):
    """fp64: ``recurrent.step_reference``, then the reference multi-head layernorm."""
    t = {k: (None if v is None else v.double()) for k, v in t.items()}
    state = None if state is None else tuple(s.double() for s in state)
    h, new = recurrent.step_reference(t["q"], t["k"], t["v"], t["igate"], t["fgate"], state,
                                      eps)
    if t["norm_weight"] is None and t["norm_bias"] is None:
        return h, new
    out = reference.multihead_layernorm(h[:, :, None], t["norm_weight"], t["norm_bias"],
                                        norm_eps, residual_weight)
    return out[:, 0], new


# --------------------------------------------------------------------------- precision


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
@pytest.mark.parametrize("dqk,dv", [(16, 32), (24, 40)])
def test_step_against_the_fp64_reference(backend, dtype, normed, dqk, dv):
    t = _token(2, 3, dqk, dv, dtype, normed, seed=dqk)
    state = _state(2, 3, dqk, dv, dtype)
    want, want_state = _truth(t, state)
    with use_backend(backend):
        out, new_state = _step(t, state)
    assert out.dtype == dtype and out.shape == ((2, 3 * dv) if normed else (2, 3, dv))
    assert_close_to_reference(out, want, max_relative_error=OUT_TOL[dtype], what="out")
    for got, w, name in zip(new_state, want_state, "Cnm"):
        assert got.dtype == _acc(dtype) and got.shape == w.shape, name
        assert_close_to_reference(got, w, max_relative_error=STATE_TOL[dtype], what=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_step_from_no_state_and_norm_options(backend):
    """state=None is the empty state; the norm's options (bias only, ``1 + weight``,
    norm_eps, eps = 0) as compileops.mlstm has them."""
    t = _token(2, 2, 16, 24, torch.float32, seed=7)
    t["norm_weight"] = None
    want, want_state = _truth(t, None, norm_eps=1e-5, eps=0.0)
    with use_backend(backend):
        out, state = _step(t, norm_eps=1e-5, eps=0.0)
    assert_close_to_reference(out, want, max_relative_error=2e-6)
    assert torch.equal(state[2], t["igate"])  # m_1 = igate from the empty state
    t = _token(2, 2, 16, 24, torch.float32, seed=8)
    want, _ = _truth(t, None, residual_weight=True)
    with use_backend(backend):
        out, _ = _step(t, residual_weight=True)
    assert_close_to_reference(out, want, max_relative_error=2e-6)


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_kernel_with_several_tiles_matches_one_tile(normed):
    """Small tiles: three DQK tiles, and without the norm three DV tiles; the n and m every
    program computes are the ones the first stores."""
    t = _token(2, 2, 40, 40, torch.float64, normed, seed=4)
    state = _state(2, 2, 40, 40)
    acc = torch.float64
    args = (t["q"], t["k"], t["v"], t["igate"].to(acc),
            torch.nn.functional.logsigmoid(t["fgate"]), state, t["norm_weight"],
            t["norm_bias"], normed, 1e-6, 1e-6, False)
    one = step_kernels.mlstm_step(*args)
    several = step_kernels.mlstm_step(*args, blocks=(16, 64 if normed else 16))
    want_out, want_state = _truth(t, state)
    for got, want in zip((several[0], *several[1:]), (want_out, *want_state)):
        assert_close_to_reference(got, want, max_relative_error=1e-12)
    for a, b in zip(one, several):
        torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-13)
    with pytest.raises(ValueError, match="one DV tile"):
        step_kernels.mlstm_step(*args[:8], True, *args[9:], blocks=(16, 16))


# --------------------------------------------------------------------------- sequences


def _steps(x, state=None, start=0, **kwargs):
    """Run ``compileops.mlstm_step`` over tokens ``start..S-1`` of ``x`` (slices of the
    sequence tensors: strided inputs), stacking the outputs as compileops.mlstm lays them."""
    outs = []
    for t in range(start, x.q.shape[2]):
        out, state = compileops.mlstm_step(
            x.q[:, :, t], x.k[:, :, t], x.v[:, :, t], x.igate[..., t], x.fgate[..., t], state,
            norm_weight=x.norm_weight, norm_bias=x.norm_bias, **kwargs)
        outs.append(out)
    return torch.stack(outs, dim=1 if x.normed else 2), state


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_a_loop_of_steps_equals_the_parallel_op(dtype, normed):
    seq = 12 if dtype == torch.float64 else 24
    x = make_inputs(2, 2, seq, 16, 24, dtype=dtype, weight=normed, bias=normed, seed=5)
    with use_backend("triton"):
        got, _ = _steps(x)
        want = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight,
                                norm_bias=x.norm_bias)
    assert_close_to_reference(got, want, max_relative_error=LOOP_TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_generation_goes_on_from_the_prompts_last_state(backend):
    """A prompt through compileops.mlstm (``return_last_state``), then steps: the whole
    sequence's output, and the last state of the parallel reference with states."""
    x = make_inputs(2, 2, 14, 16, 24, seed=6)
    prompt = x.map(lambda t: t[:, :, :9] if t.dim() > 1 else t)
    with use_backend(backend):
        first, state = compileops.mlstm(prompt.q, prompt.k, prompt.v, prompt.igate,
                                        prompt.fgate, norm_weight=x.norm_weight,
                                        norm_bias=x.norm_bias, return_last_state=True)
        rest, last = _steps(x, state, start=9)
        whole = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight,
                                 norm_bias=x.norm_bias)
    assert_close_to_reference(torch.cat([first, rest], dim=1), whole, max_relative_error=1e-10)
    _, _, _, want_last = recurrent.parallel_reference_with_state(x.q, x.k, x.v, x.igate,
                                                                 x.fgate)
    for got, want, name in zip(last, want_last, "Cnm"):
        assert_close_to_reference(got, want, max_relative_error=1e-10, what=name)


# --------------------------------------------------------------------------- contract


def test_inputs_unmodified_and_outputs_fresh():
    for backend in BACKENDS:
        for normed in (True, False):
            t = _token(2, 2, 16, 24, torch.float32, normed, seed=9)
            state = _state(2, 2, 16, 24, torch.float32)
            before = ({k: v.clone() for k, v in t.items() if v is not None},
                      [s.clone() for s in state])
            with use_backend(backend):
                out, new = _step(t, state)
            for k, v in before[0].items():
                assert torch.equal(t[k], v), f"{backend}: {k} was modified"
            for s, b in zip(state, before[1]):
                assert torch.equal(s, b), f"{backend}: the state was modified"
            inputs = [v for v in t.values() if v is not None] + list(state)
            for o in (out, *new):
                assert all(o.untyped_storage().data_ptr() != i.untyped_storage().data_ptr()
                           for i in inputs)


def test_triton_step_is_deterministic_and_batch_invariant():
    t = _token(3, 2, 24, 40, torch.bfloat16, seed=10)
    state = _state(3, 2, 24, 40, torch.bfloat16)
    with use_backend("triton"):
        out, new = _step(t, state)
        again, new_again = _step(t, state)
        row = {k: (v if v is None or k.startswith("norm") else v[1:2]) for k, v in t.items()}
        one, one_state = _step(row, tuple(s[1:2] for s in state))
    assert torch.equal(out, again) and all(map(torch.equal, new, new_again))
    assert torch.equal(one, out[1:2])
    assert all(torch.equal(a, b[1:2]) for a, b in zip(one_state, new))


def test_empty_batch():
    t = _token(0, 2, 16, 8, torch.float32)
    for backend in BACKENDS:
        with use_backend(backend):
            out, (c, n, m) = _step(t, _state(0, 2, 16, 8, torch.float32))
        assert out.shape == (0, 16) and c.shape == (0, 2, 16, 8) and m.shape == (0, 2)


# --------------------------------------------------------------------------- gradients


GRAD_CASES = ["normed-state", "raw-state", "normed-empty", "raw-explicit-empty", "raw-tie"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", GRAD_CASES)
def test_gradients_equal_autograd_through_the_reference(backend, case):
    """fp64, a random loss of the output and the new state: every gradient (the state's and
    the norm's included) against autograd through ``recurrent.step_reference`` and the
    reference norm. ``tie``: ``log sigmoid(fgate) + m == igate`` exactly for one head, where
    the stabiliser's gradient splits in half (as ``torch.maximum``'s)."""
    normed = case.startswith("normed")
    t = _token(2, 2, 8, 12, torch.float64, normed, seed=11)
    state = None if case == "normed-empty" else _state(2, 2, 8, 12)
    if case == "raw-explicit-empty":
        state = recurrent.empty_state(2, 2, 8, 12, torch.float64)
    if case == "raw-tie":
        t["igate"][0, 1] = (torch.nn.functional.logsigmoid(t["fgate"]) + state[2])[0, 1]
    names = [n for n in ("q", "k", "v", "igate", "fgate", "norm_weight", "norm_bias")
             if t[n] is not None]
    gen = torch.Generator().manual_seed(1)
    out_shape = (2, 24) if normed else (2, 2, 12)
    g_out = torch.randn(out_shape, generator=gen, dtype=torch.float64)
    g_state = [torch.randn(s.shape, generator=gen, dtype=torch.float64)
               for s in recurrent.empty_state(2, 2, 8, 12, torch.float64)]

    def grads(fn):
        leaves = {n: t[n].clone().requires_grad_(True) for n in names}
        st = None if state is None else [s.clone().requires_grad_(True) for s in state]
        out, new = fn({**t, **leaves}, st)
        loss = (out * g_out).sum() + sum((a * b).sum() for a, b in zip(new, g_state))
        wrt = list(leaves.values()) + (st or [])
        return torch.autograd.grad(loss, wrt, allow_unused=True)

    def ours(x, st):
        with use_backend(backend):
            return _step(x, None if st is None else tuple(st))

    def truth(x, st):
        return _truth(x, None if st is None else tuple(st))

    got, want = grads(ours), grads(truth)
    assert all(g is not None for g in got)
    for name, g, w in zip(names + ["C", "n", "m"], got, want):
        w = torch.zeros_like(g) if w is None else w
        assert g.dtype == w.dtype and not g.isnan().any(), name
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=name)


def test_gradients_come_in_each_inputs_dtype():
    t = _token(2, 2, 8, 12, torch.bfloat16, seed=15)
    t["norm_weight"] = t["norm_weight"].float()
    leaves = {n: t[n].clone().requires_grad_(True) for n in t}
    state = [s.requires_grad_(True) for s in _state(2, 2, 8, 12, torch.bfloat16)]
    with use_backend("triton"):
        out, new = _step(leaves, tuple(state))
    grads = torch.autograd.grad(out.float().sum() + new[2].sum(),
                                list(leaves.values()) + state)
    for x, g in zip(list(leaves.values()) + state, grads):
        assert g.dtype == x.dtype and g.shape == x.shape


# --------------------------------------------------------------------------- bad input


def _good():
    t = _token(2, 2, 8, 4, torch.float32)
    t["state"] = _state(2, 2, 8, 4, torch.float32)
    return t


def _with(**changes):
    def make():
        args = _good()
        for name, fn in changes.items():
            args[name] = fn(args[name])
        return args

    return make


def _call(a, **kwargs):
    return compileops.mlstm_step(a["q"], a["k"], a["v"], a["igate"], a["fgate"], a["state"],
                                 norm_weight=a["norm_weight"], norm_bias=a["norm_bias"],
                                 **kwargs)


BAD = [
    ("q 4-D", _with(q=lambda t: t[:, :, None]), r"q must be 3-D \[B, NH, D\] \(one token\)"),
    ("k shape", _with(k=lambda t: t[..., :5]), r"k must have q's shape"),
    ("v shape", _with(v=lambda t: t[:1]), r"v must be \[B, NH, DV\]"),
    ("igate shape", _with(igate=lambda t: t[..., None]), r"igate must be \[B, NH\]"),
    ("fgate shape", _with(fgate=lambda t: t[:1]), r"fgate must be \[B, NH\]"),
    ("norm_weight length", _with(norm_weight=lambda t: t[:-1]),
     r"norm_weight must be \[NH \* DV\] = \[8\]"),
    ("int q", _with(q=lambda t: t.long()), r"q must be bf16, fp16, fp32 or fp64"),
    ("mixed dtypes", _with(v=lambda t: t.double()), r"q, k and v must share one dtype"),
    ("device mismatch k", _with(k=lambda t: t.to("meta")), r"k is on meta but q is on cpu"),
    ("state C shape", _with(state=lambda s: (s[0][..., :3], s[1], s[2])),
     r"state C must have shape \[2, 2, 8, 4\]"),
    ("state n shape", _with(state=lambda s: (s[0], s[1][:1], s[2])),
     r"state n must have shape \[2, 2, 8\]"),
    ("state m dtype", _with(state=lambda s: (s[0], s[1], s[2].double())),
     r"state m must be torch.float32 for torch.float32 inputs"),
    ("state C bf16", _with(state=lambda s: (s[0].bfloat16(), s[1], s[2])),
     r"state C must be torch.float32"),
    ("state device", _with(state=lambda s: (s[0], s[1].to("meta"), s[2])),
     r"state n is on meta but q is on cpu"),
]
BAD_PYTHON = [  # raised by the public function before the op, eagerly and traced
    ("partial state", _with(state=lambda s: (s[0], None, s[2])), TypeError,
     r"state must be None or a \(C, n, m\) triple"),
    ("state pair", _with(state=lambda s: s[:2]), TypeError, r"state must be None or a"),
    ("int igate", _with(igate=lambda t: t.long()), TypeError, r"igate must be floating point"),
    ("int fgate", _with(fgate=lambda t: t.int()), TypeError, r"fgate must be floating point"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_eager_and_traced(case):
    _, make, message = case
    for backend in BACKENDS:
        with use_backend(backend):
            with pytest.raises(RuntimeError, match=message):
                _call(make())
    compiled = torch.compile(_call, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(make())


@pytest.mark.parametrize("case", BAD_PYTHON, ids=[c[0] for c in BAD_PYTHON])
def test_bad_python_arguments(case):
    _, make, error, message = case
    with pytest.raises(error, match=message):
        _call(make())
    compiled = torch.compile(_call, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(make())


def test_bad_scalars_and_a_partial_state_at_the_op():
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        _call(_good(), eps=-1.0)
    with pytest.raises(RuntimeError, match="norm_eps must be > 0"):
        _call(_good(), norm_eps=0.0)
    a = _good()
    c, n, m = a["state"]
    with pytest.raises(RuntimeError, match="state must be a \\(C, n, m\\) triple"):
        step_op(a["q"], a["k"], a["v"], a["igate"], a["fgate"], c, None, m, None, None,
                False, 1e-6, 1e-6, False)
    with pytest.raises(RuntimeError, match="logf must be torch.float32"):
        step_op(a["q"], a["k"], a["v"], a["igate"], a["fgate"].double(), c, n, m, None, None,
                False, 1e-6, 1e-6, False)


# --------------------------------------------------------------------------- compile


def _generate(q, k, v, igate, fgate, weight, bias):
    """Three tokens from the empty state, as a decoding loop feeds them."""
    state, outs = None, []
    for t in range(q.shape[2]):
        out, state = compileops.mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t],
                                           igate[..., t], fgate[..., t], state,
                                           norm_weight=weight, norm_bias=bias)
        outs.append(torch.sigmoid(out) * 2.0)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_generation_loop_equals_eager(backend):
    x = make_inputs(2, 2, 3, 16, 8, dtype=torch.float32, seed=12)
    counters.clear()
    compiled = torch.compile(_generate, backend=backend, fullgraph=True)
    got, got_state = compiled(*x.tensors())
    want, want_state = _generate(*x.tensors())
    assert not counters["graph_break"]
    tol = 0 if backend == "aot_eager" else 1e-6
    for a, b in [(got, want), *zip(got_state, want_state)]:
        assert_close_to_reference(a, b, max_relative_error=tol)


def test_fullgraph_with_a_state_input_and_gradients():
    """A state passed in and a gradient under fullgraph: same values and gradients as
    eager (the compiled backward calls ``compileops::mlstm_step_backward``)."""
    t = _token(2, 2, 8, 12, torch.float64, seed=13)
    state = _state(2, 2, 8, 12)

    def fn(q, state):
        out, (c, n, m) = compileops.mlstm_step(q, t["k"], t["v"], t["igate"], t["fgate"],
                                               state, norm_weight=t["norm_weight"])
        return out.square().sum() + c.sum() + m.sum()

    q = t["q"].clone().requires_grad_(True)
    counters.clear()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, state)
    (got_grad,) = torch.autograd.grad(got, q)
    want = fn(q, state)
    (want_grad,) = torch.autograd.grad(want, q)
    assert not counters["graph_break"]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- opcheck


def _op_args(normed, with_state, requires_grad=False):
    t = _token(2, 2, 8, 12, torch.float32, normed, seed=14)
    c, n, m = _state(2, 2, 8, 12, torch.float32) if with_state else (None, None, None)
    tensors = [t["q"], t["k"], t["v"], t["igate"].float(),
               torch.nn.functional.logsigmoid(t["fgate"]), c, n, m, t["norm_weight"],
               t["norm_bias"]]
    if requires_grad:
        tensors = [None if x is None else x.detach().requires_grad_(True) for x in tensors]
    return (*tensors, normed, 1e-6, 1e-6, False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normed,with_state,grad", [(True, True, True), (False, False, True),
                                                    (True, False, False)],
                         ids=["normed-state-grad", "raw-empty-grad", "normed-empty"])
def test_opcheck(backend, normed, with_state, grad):
    with use_backend(backend):
        torch.library.opcheck(step_op, _op_args(normed, with_state, grad))


@pytest.mark.parametrize("normed,with_state", [(True, True), (False, False)],
                         ids=["normed-state", "raw-empty"])
def test_opcheck_backward(normed, with_state):
    args = _op_args(normed, with_state)
    q, v = args[0], args[2]
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(shape, generator=gen) for shape in (
        (2, 24) if normed else (2, 2, 12), (2, 2, 8, 12), (2, 2, 8), (2, 2))]
    torch.library.opcheck(backward_op, (*grads, *args[:9], *args[10:]))
