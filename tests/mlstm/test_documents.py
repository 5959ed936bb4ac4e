"""Packed documents (``cu_seqlens``) in the chunkwise mLSTM.

* isolation (a property): each document's output and its inputs' gradients are bitwise those
  of the document run alone (same kernel form, same chunk size), on both backends, whatever
  the other documents hold: Inf, NaN, input or forget gates at +-1e4;
* the document tables the kernels read (``kernels.documents``) against a plain oracle, for
  valid and invalid ``cu_seqlens``;
* ``cu_seqlens`` checks (a property): values that are not a packing of S rows, and a bad
  shape, dtype or device, raise an error naming ``cu_seqlens``, eagerly and compiled; on
  CUDA, strict offset checks raise, and without them the call never syncs and gives NaN.

GPU variants: ``-m gpu`` (CUDA tensors, bf16 and fp32).
"""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import compileops
from tests.fuzzing import (
    Example,
    cumulative_ends,
    document_lengths,
    gpu_variant,
    hostile_fills,
    invalid_cu_seqlens,
    use,
)

CUDA = torch.cuda.is_available()
GATE_AND_INPUT_NAMES = ("q", "k", "v", "igate", "fgate")


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` along S of ``[B, NH, S, D]``, ``[B, NH, S]`` or (the normed
    output) ``[B, S, NH * DV]``-shaped tensors, as a fresh contiguous tensor."""
    return t[:, :, start:end].contiguous() if t.dim() >= 3 else t


def _out_rows(out: torch.Tensor, normed: bool, start: int, end: int) -> torch.Tensor:
    return (out[:, start:end] if normed else out[:, :, start:end]).contiguous()


def _run(backend, tensors, weight, grad_out, chunk, cu_seqlens=None):
    """``compileops.mlstm`` forward and backward: ``(out, [dq, dk, dv, digate, dfgate])``."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    with use(backend):
        out = compileops.mlstm(*leaves, norm_weight=weight, kernel="chunkwise",
                               chunk_size=chunk, cu_seqlens=cu_seqlens)
        grads = torch.autograd.grad(out, leaves, grad_out) if out.numel() else \
            [torch.zeros_like(t) for t in leaves]
    return out, grads


def check_packed_isolation(data, device) -> None:
    ex = Example(data, device)
    lengths = ex.draw(document_lengths(4, 40 if ex.on_cpu else 300), "lengths")
    target = ex.draw(st.integers(0, len(lengths) - 1), "target document")
    if lengths[target] == 0:  # an empty document alone has no rows to compare: make it one
        lengths[target] = ex.draw(st.integers(1, 20), "target length")
    ends = cumulative_ends(lengths)
    seq = ends[-1]
    heads = ex.draw(st.integers(1, 2), "NH")
    dqk, dv = ex.draw(st.sampled_from([4, 16]), "DQK"), ex.draw(st.sampled_from([8, 24]), "DV")
    dtypes = [torch.float32, torch.float64, torch.bfloat16] if ex.on_cpu else \
        [torch.float32, torch.bfloat16]
    dtype = ex.draw(st.sampled_from(dtypes), "dtype")
    chunk = ex.draw(st.sampled_from([16, 32] if ex.on_cpu else [16, 64, 128]), "chunk")
    normed = ex.draw(st.booleans(), "normed")
    gen = ex.gen

    def values(*shape, scale=1.0, shift=0.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift

    tensors = {"q": values(1, heads, seq, dqk), "k": values(1, heads, seq, dqk),
               "v": values(1, heads, seq, dv), "igate": values(1, heads, seq),
               "fgate": values(1, heads, seq, shift=3.0)}
    # Every other document holds something hostile in one of its inputs, in all its rows.
    for doc, (start, end) in enumerate(zip(ends, ends[1:])):
        if doc != target and end > start:
            name = ex.draw(st.sampled_from(GATE_AND_INPUT_NAMES), f"doc {doc} hostile input")
            tensors[name][:, :, start:end] = ex.draw(hostile_fills(), f"doc {doc} value")
    tensors = [ex.exact(n, tensors[n].to(dtype).to(ex.device)) for n in GATE_AND_INPUT_NAMES]
    weight = (values(heads * dv, scale=0.5).to(dtype).to(ex.device) if normed else None)
    out_shape = (1, seq, heads * dv) if normed else (1, heads, seq, dv)
    grad_out = values(*out_shape).to(dtype).to(ex.device)
    cu = torch.tensor(ends, dtype=ex.draw(st.sampled_from([torch.int32, torch.int64]),
                                          "cu_seqlens dtype"), device=ex.device)
    start, end = ends[target], ends[target + 1]

    for backend in ex.backends():
        if backend == "triton" and dtype == torch.float64 and not ex.on_cpu:
            continue
        out, grads = _run(backend, tensors, weight, grad_out, chunk, cu)
        alone, alone_grads = _run(backend, [_rows(t, start, end) for t in tensors], weight,
                                  _out_rows(grad_out, normed, start, end), chunk)
        got = _out_rows(out, normed, start, end)
        assert torch.equal(got, alone), (
            f"{backend}: document {target} [{start}, {end}) of {ends} differs from the "
            f"document alone; max diff {(got.double() - alone.double()).abs().max()}")
        assert bool(alone.isfinite().all()), f"{backend}: the document alone is not finite"
        for name, g, w in zip(GATE_AND_INPUT_NAMES, grads, alone_grads):
            assert torch.equal(_rows(g, start, end), w), (
                f"{backend}: d{name} of document {target} [{start}, {end}) of {ends} "
                f"differs from the document alone")


@settings(max_examples=10)
@given(data=st.data())
def test_packed_documents_are_isolated(data):
    check_packed_isolation(data, "cpu")


@gpu_variant
@given(data=st.data())
def test_packed_documents_are_isolated_gpu(data, device):
    check_packed_isolation(data, device)


def test_packed_compiled_equals_eager_bitwise():
    """torch.compile(fullgraph=True) runs the same kernels: forward and backward bitwise."""
    tensors = _small(45)
    cu = torch.tensor([0, 3, 3, 30, 45], dtype=torch.int32)
    grad = torch.randn(1, 2, 45, 8, generator=torch.Generator().manual_seed(1))

    def fw_bw(fn):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = fn(*leaves, cu)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    with use("triton"):
        eager = fw_bw(_packed_call)
        compiled = fw_bw(torch.compile(_packed_call, fullgraph=True))
    for name, a, b in zip(("out", *GATE_AND_INPUT_NAMES), compiled, eager):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------ the document tables


def _tables_oracle(cu, seq, chunk):
    """The tables of ``compileops.mlstm.documents``, in plain PyTorch."""
    cu = torch.tensor([0, seq]) if cu is None else cu.long().cpu()
    ends = torch.cummax(cu.clamp(0, seq), 0).values
    ends = torch.cat([ends.new_zeros(1), ends[1:-1], ends.new_full((1,), seq)])
    valid = bool((cu[0] == 0) & (cu[-1] == seq) & (cu[1:] >= cu[:-1]).all())
    owned = ((ends[1:] - ends[:-1] + chunk - 1) // chunk).clamp_min(1)
    first = torch.cat([owned.new_zeros(1), owned.cumsum(0)])
    slots = max(1, -(-seq // chunk)) + len(cu) - 2
    doc = torch.searchsorted(first[1:], torch.arange(slots), right=True)
    return ends.tolist() + [int(valid)], first.tolist(), doc.tolist()


@settings(max_examples=40)
@given(seq=st.integers(0, 300), chunk=st.sampled_from([16, 32, 64]),
       kind=st.sampled_from(["none", "valid", "any"]), data=st.data())
def test_document_tables_match_the_oracle(seq, chunk, kind, data):
    """Up to 300 documents: more than one block of the table kernel's lanes."""
    from compileops.mlstm.kernels.documents import document_tables

    if kind == "none":
        cu = None
    elif kind == "valid":
        lengths = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=300))
        seq = sum(lengths)
        cu = torch.tensor(cumulative_ends(lengths), dtype=torch.int32)
    else:
        cu = torch.tensor(data.draw(st.lists(st.integers(-5, seq + 5), min_size=2,
                                             max_size=300)), dtype=torch.int64)
    with compileops.use_backend("triton"):
        tables = document_tables(cu, seq, chunk, torch.device("cpu"))
    got = (tables.bounds.tolist(), tables.slot_first.tolist(), tables.slot_doc.tolist())
    assert got == _tables_oracle(cu, seq, chunk)


# ------------------------------------------------------------------ cu_seqlens checks


def _small(seq, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seq)
    shapes = [(1, 2, seq, 8), (1, 2, seq, 8), (1, 2, seq, 8), (1, 2, seq), (1, 2, seq)]
    return [torch.randn(s, generator=gen).to(device, dtype) for s in shapes]


def _packed_call(q, k, v, igate, fgate, cu):
    return compileops.mlstm(q, k, v, igate, fgate, kernel="chunkwise", chunk_size=16,
                            cu_seqlens=cu)


@settings(max_examples=20)
@given(seq=st.integers(0, 40).flatmap(lambda s: st.tuples(st.just(s), invalid_cu_seqlens(s))),
       dtype=st.sampled_from([torch.int32, torch.int64]), backend=st.sampled_from(
           ["reference", "triton"]))
def test_invalid_cu_seqlens_values_are_named(seq, dtype, backend):
    seq, ends = seq
    cu = torch.tensor(ends, dtype=dtype)
    with use(backend), pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to S"):
        _packed_call(*_small(seq), cu)


def test_invalid_cu_seqlens_values_are_named_compiled():
    """The compiled graph calls the op, which checks CPU values when it runs: one compile
    (dynamic) for every value and count, each bad one named."""
    compiled = torch.compile(_packed_call, fullgraph=True, dynamic=True)
    with use("triton"):
        good = compiled(*_small(20), torch.tensor([0, 7, 20], dtype=torch.int32))
        assert good.shape == (1, 2, 20, 8)
        for ends in ([1, 20], [0, 19], [0, 21], [0, 9, 5, 20], [0, -1, 20], [0, 3, 4, 21]):
            with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to S = 20"):
                compiled(*_small(20), torch.tensor(ends, dtype=torch.int32))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("bad,error,match", [
    (torch.tensor([0], dtype=torch.int32), ValueError, r"cu_seqlens must be 1-D \[N \+ 1\]"),
    (torch.tensor([[0, 20]], dtype=torch.int32), ValueError, r"cu_seqlens must be 1-D"),
    (torch.tensor([0.0, 20.0]), TypeError, r"cu_seqlens must be an int32 or int64 tensor"),
    ([0, 20], TypeError, r"cu_seqlens must be a tensor"),
], ids=["one entry", "2-D", "float", "list"])
def test_cu_seqlens_shape_and_dtype_are_named(bad, error, match, compiled):
    fn = torch.compile(_packed_call, fullgraph=True) if compiled else _packed_call
    # Dynamo reports an error raised while tracing as its own exception, the message kept.
    with pytest.raises(Exception, match=match) as raised:
        fn(*_small(20), bad)
    if not compiled:
        assert raised.type is error


def test_parallel_form_refuses_cu_seqlens():
    with pytest.raises(ValueError, match="kernel='parallel' takes no cu_seqlens"):
        compileops.mlstm(*_small(20), kernel="parallel",
                         cu_seqlens=torch.tensor([0, 20], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_cu_seqlens_without_host_sync(dtype):
    """Forward and backward with cu_seqlens on CUDA never sync with the host (the documents
    are found on the device), and a compiled call agrees with the eager one."""
    tensors = [t.requires_grad_() for t in _small(300, "cuda", dtype)]
    cu = torch.tensor([0, 17, 17, 130, 300], dtype=torch.int32, device="cuda")
    _packed_call(*tensors, cu).sum().backward()  # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _packed_call(*tensors, cu)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    compiled = torch.compile(_packed_call, fullgraph=True)(*tensors, cu)
    assert torch.equal(compiled, out)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_invalid_cu_seqlens_strict_raises_else_nan():
    tensors = _small(40, "cuda")
    for ends in ([1, 40], [0, 39], [0, 50], [0, 30, 20, 40], [0, -3, 40]):
        cu = torch.tensor(ends, dtype=torch.int32, device="cuda")
        with compileops.strict_offset_checks(), pytest.raises(ValueError, match="cu_seqlens"):
            _packed_call(*tensors, cu)
        out = _packed_call(*tensors, cu)  # unchecked: never out of bounds, NaN
        torch.cuda.synchronize()
        assert bool(out.isnan().all()), f"{ends}: the output should be NaN"
