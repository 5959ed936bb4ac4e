"""Causality of the mLSTM forward under NaN and Inf: a non-finite value at position t never
reaches an output before t.

For every form (parallel and chunkwise, raw and normed, with an initial state, packed
documents, the recurrent step) on both backends, a NaN or an Inf is put at one entry of
q, k, v or a gate pre-activation at position ``T``, inside a tile and a chunk but not at
its first row (``T`` = 21: rows 16..20 share its 16-row tile and chunk, whose diagonal
tiles multiply masked columns' k and v in the same MMAs as the live ones). Then:

* the outputs of the rows before ``T`` (h or the normed h, the normaliser n, the stabiliser
  m, the states entering each chunk) are finite and equal to those of the same call on the
  finite inputs: the same shapes and tiles, so bitwise;
* every output row from ``T`` on (``T``'s document) holds a non-finite value, except for
  the two limits that are numbers (an open forget gate, ``fgate = +Inf``; a closed input
  gate, ``igate = -Inf``), where it is finite; a bad q reaches row ``T`` alone.

Small shapes, on the CPU always (the Triton kernels under the interpreter): ``T`` and the
cases pinned below are placed against the 16-row tiles and chunks of the CPU kernels'
configuration. On a GPU the tiles are 64 or 128 rows, so the same cases meet other tiles
and other kernel forms; the CUDA behaviour is the docstring's (``compileops.mlstm``).
"""
import pytest
import torch

import compileops
from compileops.mlstm.chunkwise import mlstm_chunkwise_op
from compileops.mlstm.gates import log_forget_op
from tests.mlstm._helpers import BACKENDS, make_inputs

S, DQK, DV, CHUNK, T = 32, 16, 16, 16, 21
#: The step form's token loop: shorter (one launch per token).
STEP_S, STEP_T = 8, 5
NAN, INF = float("nan"), float("inf")
#: (input, value): one entry of q, k or v (channel 3), or the gate pre-activation, at T.
BAD = [("q", NAN), ("k", NAN), ("k", INF), ("v", NAN), ("v", INF), ("igate", NAN),
       ("igate", INF), ("igate", -INF), ("fgate", NAN), ("fgate", INF), ("fgate", -INF)]
#: The limits whose outputs are numbers: h from T on stays finite.
FINITE_LIMITS = {("igate", -INF), ("fgate", INF)}
#: The CPU even where CUDA is present (the module docstring): with a GPU these tests would
#: meet the GPU's tiles, which their cases are not placed against.
DEVICE = "cpu"


def _inputs(dtype=torch.float32, seq=S):
    return make_inputs(1, 1, seq, DQK, DV, dtype=dtype, device=DEVICE)


def _with_bad(x, name, value, t):
    """``x`` with ``value`` at position t of input ``name`` (a copy: x is not modified)."""
    x = x.map(torch.clone)
    t_in = getattr(x, name)
    if t_in.dim() == 4:
        t_in[0, 0, t, 3] = value
    else:
        t_in[0, 0, t] = value
    return x


def _state():
    gen = torch.Generator().manual_seed(5)
    c0 = torch.randn(1, 1, DQK, DV, generator=gen)
    n0 = torch.randn(1, 1, DQK, generator=gen)
    m0 = torch.randn(1, 1, generator=gen)
    return tuple(t.to(DEVICE) for t in (c0, n0, m0))


def _stats(x, normed, **kwargs):
    """``mlstm_with_stats``: ``{name: (tensor, its sequence axis)}``, plus the last state's
    C (no sequence axis: the rows it sums all come before its end)."""
    norm = dict(norm_weight=x.norm_weight, norm_bias=x.norm_bias) if normed else {}
    result = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate, **norm, **kwargs)
    out = {"out": (result[0], 1 if normed else 2), "n": (result[1], 2), "m": (result[2], 2)}
    if kwargs.get("return_last_state"):
        out["last C"] = (result[3][0], None)
    return out


def _steps(x, normed):
    """The token loop of ``compileops.mlstm_step``: h (or the normed h) per token, and the
    state after each token (C, n and m, sequence axis 2)."""
    norm = dict(norm_weight=x.norm_weight, norm_bias=x.norm_bias) if normed else {}
    outs, cs, ns, ms = [], [], [], []
    state = None
    for t in range(x.q.shape[2]):
        out, state = compileops.mlstm_step(x.q[:, :, t], x.k[:, :, t], x.v[:, :, t],
                                           x.igate[:, :, t], x.fgate[:, :, t], state, **norm)
        outs.append(out)
        cs.append(state[0])
        ns.append(state[1])
        ms.append(state[2])
    return {"out": (torch.stack(outs, 1 if normed else 2), 1 if normed else 2),
            "state C": (torch.stack(cs, 2), 2), "state n": (torch.stack(ns, 2), 2),
            "state m": (torch.stack(ms, 2), 2)}


FORMS = {
    "parallel": lambda x: _stats(x, False, kernel="parallel"),
    "parallel-normed": lambda x: _stats(x, True, kernel="parallel"),
    "chunkwise": lambda x: _stats(x, False, kernel="chunkwise", chunk_size=CHUNK),
    "chunkwise-normed": lambda x: _stats(x, True, kernel="chunkwise", chunk_size=CHUNK),
    "chunkwise-state": lambda x: _stats(x, False, kernel="chunkwise", chunk_size=CHUNK,
                                        initial_state=_state(), return_last_state=True),
    # Two documents, T in the second (its 9th row), each laid out on its own chunks.
    "packed-normed": lambda x: _stats(x, True, kernel="chunkwise", chunk_size=CHUNK,
                                      cu_seqlens=torch.tensor([0, 13, S], device=DEVICE)),
}


def _prefix(tensor, axis, t):
    return tensor.narrow(axis, 0, t)


def _suffix(tensor, axis, t):
    return tensor.narrow(axis, t, tensor.shape[axis] - t)


def check_causal(run, x, name, value, what, t=T, finite_limits=FINITE_LIMITS):
    """``run(x)`` with ``value`` at t of input ``name`` against ``run(x)``: the rows before t
    bitwise, the rows from t on non-finite (finite for ``finite_limits``)."""
    got = run(_with_bad(x, name, value, t))
    want = run(x)
    for key, (tensor, axis) in got.items():
        clean = want[key][0]
        assert torch.isfinite(clean).all(), f"{what}: {key} of the finite inputs"
        if axis is None:  # the last state: after every row
            if name == "q":  # read by no state
                assert torch.equal(tensor, clean), f"{what}: {key}"
            elif (name, value) in finite_limits:
                assert torch.isfinite(tensor).all(), f"{what}: {key}"
            else:
                assert not torch.isfinite(tensor).all(), f"{what}: {key} stayed finite"
            continue
        before = _prefix(tensor, axis, t)
        assert torch.isfinite(before).all(), (
            f"{what}: {key} non-finite before t at rows "
            f"{sorted(set((~torch.isfinite(before)).nonzero()[:, axis].tolist()))}")
        assert torch.equal(before, _prefix(clean, axis, t)), f"{what}: {key} changed before t"
    out, axis = got["out"]
    after = _suffix(out, axis, t).movedim(axis, 0).flatten(1)  # [rows from t, the rest]
    if name == "q":  # read by row t alone: every other row is untouched
        assert not torch.isfinite(after[0]).all(), f"{what}: row t is finite"
        for key, (tensor, ax) in got.items():
            if ax is not None:
                later = tensor.narrow(ax, t + 1, tensor.shape[ax] - t - 1)
                clean = want[key][0].narrow(ax, t + 1, tensor.shape[ax] - t - 1)
                assert torch.equal(later, clean), f"{what}: {key} changed after t"
    elif (name, value) in finite_limits:
        assert torch.isfinite(after).all(), f"{what}: a finite limit gave a non-finite h"
    else:
        rows = (~torch.isfinite(after)).any(dim=1)
        assert rows.all(), (f"{what}: rows {(~rows).nonzero().flatten().add(t).tolist()} "
                            "from t on are finite")


def _forms_cases():
    for backend in BACKENDS:
        for form in FORMS:
            for name, value in BAD:
                yield pytest.param(backend, form, name, value,
                                   id=f"{backend}-{form}-{name}={value}")


@pytest.mark.parametrize("backend,form,name,value", list(_forms_cases()))
def test_forms_are_causal(backend, form, name, value):
    with compileops.use_backend(backend):
        check_causal(FORMS[form], _inputs(), name, value, f"{backend} {form} {name}={value}")


STEP_CASES = ([(False, n, v) for n, v in BAD]
              + [(True, n, v) for n, v in [("k", NAN), ("v", INF), ("fgate", NAN)]])


@pytest.mark.parametrize("normed,name,value", STEP_CASES,
                         ids=[f"{'normed' if m else 'raw'}-{n}={v}" for m, n, v in STEP_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_step_loop_is_causal(backend, normed, name, value):
    """The recurrent form: each step reads the state and its own token only. A closed
    forget gate (``fgate = -Inf``) is one more limit that is a number here: the recursion
    drops the state (``exp(-inf) C = 0``), where the parallel and chunkwise forms' ``F_i -
    F_j`` is ``-inf - -inf``, NaN from t on."""
    with compileops.use_backend(backend):
        check_causal(lambda x: _steps(x, normed), _inputs(seq=STEP_S), name, value,
                     f"{backend} step {name}={value}", STEP_T,
                     FINITE_LIMITS | {("fgate", -INF)})


@pytest.mark.parametrize("name,value", [
    pytest.param("k", NAN, id="k=nan"),
    pytest.param("v", NAN, id="v=nan"),
    pytest.param("v", INF, id="v=inf")])
@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
def test_one_loop_tiles_are_causal(normed, name, value):
    """bf16: the parallel kernel's one-loop form (every key tile in one pipeline, the gates'
    spread inside a tile within ``ONE_LOOP_SPREAD``), whose diagonal tiles reach v through
    the MMA."""
    from compileops.mlstm.kernels.forward import ONE_LOOP_SPREAD
    from compileops.mlstm.reference import LOG2E

    x = _inputs(torch.bfloat16)
    logf = log_forget_op(x.fgate.float())
    terms = (x.igate.float() - logf) * LOG2E
    tile = terms[..., T - T % 16:T - T % 16 + 16]
    assert tile.max() - tile.min() <= ONE_LOOP_SPREAD  # the one-loop form runs
    with compileops.use_backend("triton"):
        check_causal(lambda y: _stats(y, normed, kernel="parallel"), x, name, value,
                     f"bf16 one-loop {name}={value}")


@pytest.mark.parametrize("name,value", [("k", NAN), ("k", INF), ("v", NAN), ("v", INF)])
@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
def test_16bit_two_loop_tiles_are_causal(normed, name, value):
    """bf16 with an input-gate spike at row 17, inside T's tile: the tile's column terms
    spread past ``ONE_LOOP_SPREAD``, so the parallel kernel takes its two-loop form, whose
    diagonal tiles (the exact exponential) reach v through the MMA."""
    from compileops.mlstm.kernels.forward import ONE_LOOP_SPREAD
    from compileops.mlstm.reference import LOG2E

    x = _inputs(torch.bfloat16)
    x.igate[0, 0, 17] = 60.0
    logf = log_forget_op(x.fgate.float())
    terms = (x.igate.float() - logf) * LOG2E
    tile = terms[..., T - T % 16:T - T % 16 + 16]
    assert tile.max() - tile.min() > ONE_LOOP_SPREAD  # the two-loop form runs
    with compileops.use_backend("triton"):
        check_causal(lambda y: _stats(y, normed, kernel="parallel"), x, name, value,
                     f"bf16 two-loop {name}={value}")


@pytest.mark.parametrize("name,value", [("k", NAN), ("v", INF), ("igate", NAN),
                                        ("fgate", NAN)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_states_are_causal(backend, name, value):
    """The states entering each chunk that starts at or before T (C, n and m, as the
    chunkwise op keeps them for its backward) do not see T; the last state does."""
    x = _inputs()
    c0, n0, m0 = _state()

    def states(y):
        logf = log_forget_op(y.fgate, CHUNK)
        parts = mlstm_chunkwise_op(y.q, y.k, y.v, y.igate, logf, None, None, c0, n0, m0,
                                   CHUNK, False, 1e-6, 1e-6, False, False)
        cst, nst, mst, c_last = parts[4], parts[5], parts[6], parts[7]
        # Slot c: the state entering chunk c (n and m have one more slot: the last state).
        return {"C": (cst, 1), "n": (nst[:, :-1], 1), "m": (mst[:, :-1], 1),
                "last C": (c_last, None)}

    first_after = T // CHUNK + 1  # the first chunk whose entering state has seen T
    with compileops.use_backend(backend):
        got, want = states(_with_bad(x, name, value, T)), states(x)
    for key in ("C", "n", "m"):
        g, w = got[key][0], want[key][0]
        assert torch.equal(g[:, :first_after], w[:, :first_after]), f"{backend}: {key}"
    assert not torch.isfinite(got["last C"][0]).all()


@pytest.mark.parametrize("name,value", [("k", NAN), ("k", INF), ("v", NAN), ("v", INF)])
def test_parallel_reference_with_state_is_causal(name, value):
    """The states' ground truth (``recurrent.parallel_reference_with_state``), packed: a bad
    value at T (the second document's 9th row) reaches neither the rows before it nor the
    first document's last state; the second document's last state holds it."""
    from compileops.mlstm import recurrent

    x = _inputs(torch.float64)
    cu = torch.tensor([0, 13, S], device=DEVICE)

    def last_states(y):
        return recurrent.parallel_reference_with_state(y.q, y.k, y.v, y.igate, y.fgate,
                                                       cu_seqlens=cu)[3]

    def run(y):
        h, b, m, (c_last, _, _) = recurrent.parallel_reference_with_state(
            y.q, y.k, y.v, y.igate, y.fgate, cu_seqlens=cu)
        return {"out": (h, 2), "b": (b, 2), "m": (m, 2), "second C": (c_last[1], None)}

    check_causal(run, x, name, value, f"parallel_reference_with_state {name}={value}")
    for got, want in zip(last_states(_with_bad(x, name, value, T)), last_states(x)):
        assert torch.equal(got[0], want[0])  # the first document's


#: A known limit, pinned by strict xfails: in 16-bit, the Triton forward rounds a
#: tile's rows against references shared by the tile (its gates' spread and stabiliser), so
#: a later gate of the same tile can move an earlier row's output by a last bit (about one
#: bf16 ulp: 0.0078-0.0156 for outputs of size 1-2), and a sequence cut short can round its
#: last tile's rows differently. fp32 and the reference backend are exactly causal here.
TRITON_TILE_ROUNDING = pytest.mark.xfail(
    strict=True, reason="known limit: 16-bit Triton tiles round rows against tile-wide gate "
    "references, so a later gate in the tile can move an earlier row by a last bit")


@pytest.mark.parametrize("name,delta", [("igate", 8.0), ("fgate", -8.0), ("igate", INF)],
                         ids=["igate+8", "fgate-8", "igate=inf"])
@pytest.mark.parametrize("backend", [
    "reference", pytest.param("triton", marks=TRITON_TILE_ROUNDING)])
def test_bf16_rows_do_not_see_later_gates_of_their_tile(backend, name, delta):
    """bf16, the parallel form: a gate changed at t = 33 (row 32 shares its 16-row tile)
    leaves every row before t bitwise as it was, and so does cutting the sequence after t."""
    seq, t = 40, 33
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, seq, DQK, generator=gen, dtype=torch.float64)
               for _ in range(3))
    igate = torch.randn(1, 1, seq, generator=gen, dtype=torch.float64)
    fgate = torch.randn(1, 1, seq, generator=gen, dtype=torch.float64) + 3
    inputs = {n: x.to(torch.bfloat16) for n, x in
              zip(("q", "k", "v", "igate", "fgate"), (q, k, v, igate, fgate))}
    changed = dict(inputs)
    changed[name] = inputs[name].clone()
    changed[name][..., t] = (changed[name][..., t].float() + delta).to(torch.bfloat16)
    with compileops.use_backend(backend):
        clean = compileops.mlstm(*inputs.values(), kernel="parallel")
        moved = compileops.mlstm(*changed.values(), kernel="parallel")
        cut = compileops.mlstm(*(x[..., :t + 1, :] if x.dim() == 4 else x[..., :t + 1]
                                 for x in inputs.values()), kernel="parallel")
    assert torch.equal(moved[..., :t, :], clean[..., :t, :]), name
    assert torch.equal(cut[..., :t, :], clean[..., :t, :]), "cut after t"


def _closed_first_rows(x, rows, value=-INF):
    """``x`` with the input gate at ``rows`` (a list of positions) set to ``value``."""
    x = x.map(torch.clone)
    for t in rows:
        x.igate[0, 0, t] = value
    return x


def _run_with_grads(run, x):
    """``run(x)``'s output and the gradients of a fixed weighted sum of it w.r.t. q, k, v and
    the two gates."""
    leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v, x.igate, x.fgate)]
    y = x.map(lambda t: t)
    y.q, y.k, y.v, y.igate, y.fgate = leaves
    out = run(y)
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype,
                            device=out.device).reshape(out.shape)
    grads = torch.autograd.grad((out * weight).sum(), leaves)
    return out.detach(), grads


CLOSED_FORMS = {
    "parallel": lambda x, normed: _stats(x, normed, kernel="parallel")["out"][0],
    "chunkwise": lambda x, normed: _stats(x, normed, kernel="chunkwise",
                                          chunk_size=CHUNK)["out"][0],
    # The second document starts at row 13, inside the first chunk's layout row.
    "packed": lambda x, normed: _stats(
        x, normed, kernel="chunkwise", chunk_size=CHUNK,
        cu_seqlens=torch.tensor([0, 13, S], device=DEVICE))["out"][0],
    "step": lambda x, normed: _steps(x, normed)["out"][0],
}


@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
@pytest.mark.parametrize("form", list(CLOSED_FORMS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_input_gate_before_anything_entered_is_the_limit(backend, form, normed):
    """A closed input gate (``igate = -Inf``) at the first rows of a sequence (and, packed,
    of the second document): nothing has entered the cell, so those rows' h is 0 (the normed
    output: the norm's bias), the limit of ``igate -> -Inf``. The outputs and every gradient
    are finite and bitwise those of a finite, very negative gate there (-1e4: ``exp(1e4)``
    overflows in fp32 and fp64 alike, so that call's h there is 0 too)."""
    seq = STEP_S if form == "step" else S
    rows = [0, 1] + ([13] if form == "packed" else [])
    x = _inputs(seq=seq)
    run = lambda y: CLOSED_FORMS[form](y, normed)  # noqa: E731
    with compileops.use_backend(backend):
        got, got_grads = _run_with_grads(run, _closed_first_rows(x, rows))
        want, want_grads = _run_with_grads(run, _closed_first_rows(x, rows, -1e4))
    assert torch.isfinite(got).all(), "non-finite outputs"
    seq_axis = 1 if normed else 2
    for t in rows:
        row = got.select(seq_axis, t)
        expected = (x.norm_bias.to(row.dtype).expand_as(row) if normed
                    else torch.zeros_like(row))
        assert torch.equal(row, expected), f"row {t}"
    assert torch.equal(got, want)
    for name, g, w in zip(("q", "k", "v", "igate", "fgate"), got_grads, want_grads):
        assert torch.isfinite(g).all(), f"d{name} is not finite"
        assert torch.equal(g, w), f"d{name}"


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "step"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_input_gate_closed_gives_zeros(backend, form):
    """Nothing ever enters the cell: every h is 0."""
    seq = STEP_S if form == "step" else S
    x = _closed_first_rows(_inputs(seq=seq), range(seq))
    with compileops.use_backend(backend):
        h = CLOSED_FORMS[form](x, False)
    assert torch.equal(h, torch.zeros_like(h))


@pytest.mark.parametrize("value", [NAN, INF, 1e4, -1e4],
                         ids=["nan", "inf", "1e4", "-1e4"])
@pytest.mark.parametrize("gate", ["igate", "fgate"])
@pytest.mark.parametrize("form", ["parallel", "chunkwise"])
def test_fp64_rows_before_a_later_gate_keep_their_bits(form, gate, value):
    """fp64 on the Triton kernels, as fp32: a gate at T, however far from the others, leaves
    every row before it bitwise as it was, those of T's own tile included (the kernels'
    one-loop form, whose reference is the tile's last row's, is 16-bit only)."""
    kwargs = {"chunk_size": CHUNK} if form == "chunkwise" else {}
    x = _inputs(torch.float64)
    got = _with_bad(x, gate, value, T)
    with compileops.use_backend("triton"):
        moved = _stats(got, False, kernel=form, **kwargs)
        clean = _stats(x, False, kernel=form, **kwargs)
    for key in ("out", "n", "m"):
        tensor, axis = moved[key]
        assert torch.equal(_prefix(tensor, axis, T), _prefix(clean[key][0], axis, T)), key


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["parallel", "chunkwise", "step"])
def test_gpu_closed_input_gate_before_anything_entered_is_the_limit(form):
    """The CUDA kernels and their tiles (64 or 128 rows): bf16, DQK = DV = 128; a closed input
    gate at the first rows gives zeros there, finite outputs and gradients, bitwise those of
    a gate of -1e4."""
    seq = STEP_S if form == "step" else 256
    x = make_inputs(2, 2, seq, 128, 128, dtype=torch.bfloat16, device="cuda", weight=False,
                    bias=False)
    rows = [0, 1, 2]
    run = lambda y: CLOSED_FORMS[form](y, False) if form == "step" else _stats(  # noqa: E731
        y, False, kernel=form, **({"chunk_size": 64} if form == "chunkwise" else {}))["out"][0]
    got, got_grads = _run_with_grads(run, _closed_first_rows(x, rows))
    want, want_grads = _run_with_grads(run, _closed_first_rows(x, rows, -1e4))
    assert torch.equal(got[:1, :1, rows], torch.zeros_like(got[:1, :1, rows]))
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.isfinite(g).all()
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("value", [NAN, INF, 1e4], ids=["nan", "inf", "1e4"])
@pytest.mark.parametrize("form", ["parallel", "chunkwise"])
def test_gpu_fp64_rows_before_a_later_gate_keep_their_bits(form, value):
    """fp64 on the CUDA kernels: a gate at row 100 (inside the 64- or 128-row tile that
    starts at 64) leaves every row before it bitwise as it was."""
    seq, t = 256, 100
    x = make_inputs(1, 2, seq, 64, 64, dtype=torch.float64, device="cuda", weight=False,
                    bias=False)
    kwargs = {"chunk_size": 128} if form == "chunkwise" else {}
    moved = _stats(_with_bad(x, "igate", value, t), False, kernel=form, **kwargs)
    clean = _stats(x, False, kernel=form, **kwargs)
    for key in ("out", "n", "m"):
        tensor, axis = moved[key]
        assert torch.equal(_prefix(tensor, axis, t), _prefix(clean[key][0], axis, t)), key
