"""Layout mistakes get messages that name them, at every public mLSTM entry point that takes
the ``[B, NH, S, D]`` layout (``compileops.mlstm`` in each form, ``mlstm_with_stats``, with
states and packed documents, compiled too) and at the decode step:

* q, k, v passed as ``[B, S, NH, D]`` (the attention layout) with the gates ``[B, NH, S]``:
  the gate's message says that axes 1 and 2 are swapped and how to transpose;
* only one of q, k, v swapped; the gates swapped along with q, k, v (only the norm's length
  tells then); a packed row (its ``cu_seqlens`` check comes first and names q's axis 2);
* ``mlstm_step`` given a sequence of one token (``[B, 1, NH, D]``, ``[B, NH, 1, D]``, gates
  ``[B, NH, 1]`` or ``[B, 1, NH]``): the message says to drop the S axis;
* a wrong shape that fits no such mistake keeps the plain message (no hint).
"""
import pytest
import torch

import compileops
from compileops import use_backend
from tests.mlstm._helpers import BACKENDS

B, S, NH, DQK, DV = 2, 12, 3, 8, 4
SWAPPED = r"axes 1 and 2 are swapped between q and igate.*pass q\.transpose\(1, 2\)"


def _attention_layout(normed: bool = False):
    """q, k, v as ``[B, S, NH, D]``; the gates right, ``[B, NH, S]``."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, NH, DQK, generator=g) for _ in range(2))
    v = torch.randn(B, S, NH, DV, generator=g)
    igate, fgate = torch.randn(B, NH, S, generator=g), torch.randn(B, NH, S, generator=g) + 3
    norm = dict(norm_weight=torch.ones(NH * DV)) if normed else {}
    return (q, k, v, igate, fgate), norm


ENTRY_POINTS = {
    "auto": lambda *a, **kw: compileops.mlstm(*a, **kw),
    "parallel": lambda *a, **kw: compileops.mlstm(*a, kernel="parallel", **kw),
    "chunkwise": lambda *a, **kw: compileops.mlstm(*a, kernel="chunkwise", chunk_size=16, **kw),
    "with_stats": lambda *a, **kw: compileops.mlstm_with_stats(*a, **kw),
    "last_state": lambda *a, **kw: compileops.mlstm(*a, return_last_state=True, **kw),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_attention_layout_is_named(entry, normed, backend):
    args, norm = _attention_layout(normed)
    with use_backend(backend), pytest.raises(RuntimeError, match=SWAPPED) as info:
        ENTRY_POINTS[entry](*args, **norm)
    message = str(info.value)
    assert f"(S = {S}, NH = {NH})" in message, message
    assert "The mLSTM takes q, k [B, NH, S, DQK]" in message, message


@pytest.mark.parametrize("entry", ["auto", "chunkwise"])
def test_attention_layout_is_named_while_compiling(entry):
    args, _ = _attention_layout()
    compiled = torch.compile(ENTRY_POINTS[entry], backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=SWAPPED):
        compiled(*args)


def test_one_swapped_tensor_is_named():
    (q, k, v, igate, fgate), _ = _attention_layout()
    right = [t.transpose(1, 2) for t in (q, k, v)]
    for name, index in (("k", 1), ("v", 2)):
        tensors = list(right)
        tensors[index] = (q, k, v)[index]  # this one left in [B, S, NH, D]
        with pytest.raises(RuntimeError, match=rf"axes 1 and 2 are swapped between q and "
                           rf"{name}, so one of them is \[B, S, NH, D\]"):
            compileops.mlstm(*tensors, igate, fgate)


def test_gates_swapped_along_with_qkv_is_named_by_the_norm():
    """All five in the wrong layout agree with each other: only the norm's length tells."""
    (q, k, v, igate, fgate), norm = _attention_layout(normed=True)
    with pytest.raises(RuntimeError, match=rf"norm_weight must be \[NH \* DV\] = "
                       rf"\[{S * DV}\], got \({NH * DV},\): it fits NH = {NH}, q's axis 2\. "
                       r"Are q, k and v \[B, S, NH, D\]"):
        compileops.mlstm(q, k, v, igate.transpose(1, 2), fgate.transpose(1, 2), **norm)


def test_packed_documents_name_q_axis_2():
    (q, k, v, igate, fgate), _ = _attention_layout()
    one_row = [t[:1] for t in (q, k, v, igate, fgate)]
    cu_seqlens = torch.tensor([0, 5, S])
    with pytest.raises(ValueError, match=rf"cu_seqlens must end at S = {NH} \(the packed "
                       r"row's length: axis 2 of q \[B, NH, S, D\]\)"):
        compileops.mlstm(*one_row, cu_seqlens=cu_seqlens)


def _token():
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(B, NH, DQK, generator=g) for _ in range(2))
    v = torch.randn(B, NH, DV, generator=g)
    return q, k, v, torch.randn(B, NH, generator=g), torch.randn(B, NH, generator=g) + 3


STEP_CASES = [
    ("q [B, NH, 1, D]", lambda q, k, v, i, f: (q[:, :, None], k, v, i, f),
     r"q must be 3-D .*a sequence of one token \[B, NH, 1, D\]\? .*pass q\.squeeze\(2\)"),
    ("q [B, 1, NH, D]", lambda q, k, v, i, f: (q[:, None], k, v, i, f),
     r"q must be 3-D .*a sequence of one token \[B, 1, NH, D\]\? .*pass q\.squeeze\(1\)"),
    ("v [B, NH, 1, D]", lambda q, k, v, i, f: (q, k, v[:, :, None], i, f),
     r"v must be 3-D .*pass v\.squeeze\(2\)"),
    ("igate [B, NH, 1]", lambda q, k, v, i, f: (q, k, v, i[..., None], f),
     r"igate must be \[B, NH\] = \(2, 3\), got \(2, 3, 1\): .*pass igate\.squeeze\(-1\)"),
    ("fgate [B, 1, NH]", lambda q, k, v, i, f: (q, k, v, i, f[:, None]),
     r"fgate must be \[B, NH\] = \(2, 3\), got \(2, 1, 3\): .*pass fgate\.squeeze\(1\)"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_step_given_a_sequence_of_one_token_is_named(case, backend):
    _, change, message = case
    with use_backend(backend), pytest.raises(RuntimeError, match=message):
        compileops.mlstm_step(*change(*_token()))


def test_step_hint_while_compiling():
    _, change, message = STEP_CASES[0]
    compiled = torch.compile(compileops.mlstm_step, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(*change(*_token()))


def test_shapes_that_fit_no_layout_mistake_get_no_hint():
    (q, k, v, igate, fgate), _ = _attention_layout()
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # the right layout now
    cases = [
        ((q, k, v, igate[..., :-1], fgate), r"igate must be \[B, NH, S\] = \(2, 3, 12\), "
         r"got \(2, 3, 11\)$"),
        ((q, k[..., :-1], v, igate, fgate), r"k must have q's shape .*got \(2, 3, 12, 7\)$"),
        ((q, k, v[:, :, :-1], igate, fgate), r"v must be \[B, NH, S, DV\] .*got "
         r"\(2, 3, 11, 4\)$"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            compileops.mlstm(*args)
    with pytest.raises(RuntimeError, match=r"norm_weight must be \[NH \* DV\] = \[12\], got "
                       r"\(5,\)$"):
        compileops.mlstm(q, k, v, igate, fgate, norm_weight=torch.ones(5))
    q1, k1, v1, i1, f1 = _token()
    with pytest.raises(RuntimeError, match=r"q must be 3-D .*got shape \(2, 3, 2, 8\)$"):
        compileops.mlstm_step(torch.cat([q1[:, :, None]] * 2, dim=2), k1, v1, i1, f1)


def _right_layout():
    """q, k ``[B, NH, S, DQK]``, v ``[B, NH, S, DV]``, the gates ``[B, NH, S]``."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(B, NH, S, DQK, generator=g) for _ in range(2))
    v = torch.randn(B, NH, S, DV, generator=g)
    return q, k, v, torch.randn(B, NH, S, generator=g), torch.randn(B, NH, S, generator=g) + 3


def _first_token(q, k, v, igate, fgate):
    """The decode step's inputs: token 0 of each, its S axis dropped."""
    return q[:, :, 0], k[:, :, 0], v[:, :, 0], igate[..., 0], fgate[..., 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS) + ["step"])
def test_a_list_for_a_tensor_is_named(entry, backend):
    """A Python list where a tensor goes: a TypeError naming the argument, not an
    AttributeError from inside."""
    q, k, v, igate, fgate = _right_layout()
    if entry == "step":
        q, k, v, igate, fgate = _first_token(q, k, v, igate, fgate)
    call = ENTRY_POINTS.get(entry, compileops.mlstm_step)
    with use_backend(backend), pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
        call(q, k, v.tolist(), igate, fgate)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("empty", ["q", "v"])
@pytest.mark.parametrize("entry", ["parallel", "chunkwise", "step"])
def test_empty_head_dims_are_refused(entry, empty, backend):
    """DQK = 0 or DV = 0: a named error (the reference backend gave NaN, the Triton one a
    ZeroDivisionError)."""
    q, k, v, igate, fgate = _right_layout()
    if empty == "q":
        q, k = q[..., :0], k[..., :0]
    else:
        v = v[..., :0]
    if entry == "step":
        q, k, v, igate, fgate = _first_token(q, k, v, igate, fgate)
    call = ENTRY_POINTS.get(entry, compileops.mlstm_step)
    with use_backend(backend), pytest.raises(RuntimeError, match="DQK and DV must be at least 1"):
        call(q, k, v, igate, fgate)


PACKED_SHAPE_MISTAKES = {
    "gates [B, S, NH]": (lambda q, k, v, i, f: (q, k, v, i.transpose(1, 2), f),
                         r"igate must be \[B, NH, S\].*axes 1 and 2 are swapped"),
    "igate a row short": (lambda q, k, v, i, f: (q, k, v, i[..., :-1], f),
                          r"igate must be \[B, NH, S\]"),
    "v a row short": (lambda q, k, v, i, f: (q, k, v[:, :, :-1], i, f),
                      r"v must be \[B, NH, S, DV\]"),
    "k a row short": (lambda q, k, v, i, f: (q, k[:, :, :-1], v, i, f),
                      r"k must have q's shape"),
    "q without its batch axis": (lambda q, k, v, i, f: (q[0], k[0], v[0], i[0], f[0]),
                                 r"q must be 4-D \[B, NH, S, D\]"),
    "q with a fifth axis": (lambda q, k, v, i, f: (q[None], k, v, i, f),
                            r"q must be 4-D \[B, NH, S, D\]"),
    "q 3-D": (lambda q, k, v, i, f: (q[0], k, v, i, f), r"q must be 4-D \[B, NH, S, D\]"),
    "v too long": (lambda q, k, v, i, f: (q, k, torch.cat([v, v[:, :, :1]], 2), i, f),
                   r"v must be \[B, NH, S, DV\]"),
    "v with another NH": (lambda q, k, v, i, f: (q, k, v[:, :1], i, f),
                          r"v must be \[B, NH, S, DV\]"),
    "v of integers": (lambda q, k, v, i, f: (q, k, v.long(), i, f),
                      r"v must be bf16, fp16, fp32 or fp64"),
}


def _packed_mistake(case):
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, NH, S, DQK, generator=g) for _ in range(2))
    v = torch.randn(1, NH, S, DV, generator=g)
    gates = torch.randn(1, NH, S, generator=g), torch.randn(1, NH, S, generator=g) + 3
    make, message = PACKED_SHAPE_MISTAKES[case]
    return make(q, k, v, *gates), message


def _packed_call(q, k, v, i, f, cu):
    return compileops.mlstm(q, k, v, i, f, cu_seqlens=cu)


@pytest.mark.parametrize("case", list(PACKED_SHAPE_MISTAKES))
def test_packed_documents_check_shapes_before_laying_them_out(case):
    """With ``cu_seqlens`` the inputs are laid out by document before the op checks them:
    eagerly, the shape messages of the unpacked call come first (not an indexing error, nor
    a batch size read off the wrong axis)."""
    args, message = _packed_mistake(case)
    with pytest.raises(RuntimeError, match=message):
        _packed_call(*args, torch.tensor([0, 5, S]))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", list(PACKED_SHAPE_MISTAKES))
def test_packed_documents_check_shapes_while_compiling(case, dynamic):
    """The same messages from a compiled call (the checks run as an op's fake function while
    Dynamo traces, before the layout): not a fake tensor's indexing error."""
    args, message = _packed_mistake(case)
    compiled = torch.compile(_packed_call, backend="aot_eager", fullgraph=True,
                             dynamic=dynamic)
    with pytest.raises(Exception, match=message):
        compiled(*args, torch.tensor([0, 5, S]))


@pytest.mark.parametrize("chunk_size", [15, 8, "16", 3.5, True, "x"])
@pytest.mark.parametrize("kernel", ["auto", "parallel", "chunkwise"])
def test_a_bad_chunk_size_is_refused_whichever_form_runs(kernel, chunk_size):
    """At S = 12 ``auto`` runs the parallel form, which has no chunks: a bad ``chunk_size``
    is refused all the same (it used to pass there and fail only at longer S)."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, NH, S, DQK, generator=g) for _ in range(2))
    v = torch.randn(1, NH, S, DV, generator=g)
    igate, fgate = torch.randn(1, NH, S, generator=g), torch.randn(1, NH, S, generator=g)
    with pytest.raises((TypeError, ValueError), match="chunk_size must be"):
        compileops.mlstm(q, k, v, igate, fgate, kernel=kernel, chunk_size=chunk_size)


def test_a_numpy_chunk_size_is_named_while_compiling():
    """Compiled, a NumPy integer reaches the check as a tensor (Dynamo's NumPy tracing): the
    error says a Python int is wanted (it used to fail building the value's repr)."""
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, NH, S, DQK, generator=g) for _ in range(2))
    v = torch.randn(1, NH, S, DV, generator=g)
    igate, fgate = torch.randn(1, NH, S, generator=g), torch.randn(1, NH, S, generator=g)

    def call(q, k, v, igate, fgate, chunk_size):
        return compileops.mlstm(q, k, v, igate, fgate, kernel="chunkwise",
                                chunk_size=chunk_size)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(q, k, v, igate, fgate, np.int64(32))
    assert "chunk_size must be a Python int" in f"{info.value} {info.value.__cause__}"
