"""The embedding ops eagerly: opcheck, both backends against plain indexing and the reference,
bad input, strict index checks, determinism and batch invariance of the backward. The kernels'
own options are in test_kernels.py."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileops
from compileops import testing, use_backend
from compileops.embedding import reference, set_strict_index_checks, strict_index_checks

embedding_op = torch.ops.compileops.embedding.default
embedding_backward_op = torch.ops.compileops.embedding_backward.default


def _inputs(V=37, D=20, shape=(3, 11), id_dtype=torch.int64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=gen).to(dtype)
    ids = torch.randint(0, V, shape, generator=gen).to(id_dtype)
    return ids, weight


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_opcheck_forward(backend, out_dtype):
    ids, weight = _inputs(dtype=torch.bfloat16)
    weight.requires_grad_(True)
    with use_backend(backend):
        torch.library.opcheck(embedding_op, (ids, weight, out_dtype, None))
        torch.library.opcheck(embedding_op, (ids.int(), weight, out_dtype, 4))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck_backward(backend):
    ids, _ = _inputs()
    grad = torch.randn(*ids.shape, 20)
    with use_backend(backend):
        torch.library.opcheck(embedding_backward_op, (grad, ids, 37, None, torch.bfloat16))
        torch.library.opcheck(embedding_backward_op, (grad, ids.int(), 37, 3, torch.float32))


# --------------------------------------------------------------------------- kernels vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_triton_forward_equals_indexing(dtype, id_dtype, out_dtype):
    ids, weight = _inputs(V=53, D=70, shape=(5, 9), id_dtype=id_dtype, dtype=dtype)
    ids[0, 0], ids[0, 1] = 0, 52  # boundary ids
    with use_backend("triton"):
        out = compileops.embedding(ids, weight, out_dtype=out_dtype)
    expected = weight[ids.long()].to(out_dtype or dtype)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


def test_triton_forward_non_contiguous_table_and_ids():
    base = torch.randn(40, 64)
    weight = base[:, ::2]  # column stride 2
    ids = torch.randint(0, 40, (12, 6)).t()  # non-contiguous ids
    with use_backend("triton"):
        out = compileops.embedding(ids, weight)
    assert torch.equal(out, weight[ids])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 7])
def test_triton_backward_matches_reference(weight_dtype, padding_idx):
    gen = torch.Generator().manual_seed(1)
    V, D = 31, 45
    ids = torch.randint(0, V, (4, 30), generator=gen)
    ids[1, :20] = 7  # a run longer than the kernel's unroll
    ids[2, :9] = 30
    grad = torch.randn(4, 30, D, generator=gen)
    with use_backend("triton"):
        got = embedding_backward_op(grad, ids, V, padding_idx, weight_dtype)
    want = reference.embedding_backward(grad, ids, V, padding_idx, weight_dtype)
    if weight_dtype == torch.float32:
        # Same additions in the same order: bitwise.
        assert torch.equal(got, want)
    else:
        # The fp32 sums are bitwise equal (checked above); Triton's CPU interpreter truncates the
        # final fp32->bf16 cast instead of rounding to nearest, so allow one bf16 ulp here. GPU
        # tests assert bitwise equality.
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)


def test_triton_backward_stride_zero_and_non_contiguous_grad():
    ids = torch.randint(0, 9, (5, 6))
    expanded = torch.randn(1, 1, 8).expand(5, 6, 8)
    transposed = torch.randn(6, 5, 8).transpose(0, 1)
    for grad in (expanded, transposed):
        with use_backend("triton"):
            got = embedding_backward_op(grad, ids, 9, None, torch.float32)
        assert torch.equal(got, reference.embedding_backward(grad, ids, 9, None, torch.float32))
        assert grad.stride() == (expanded.stride() if grad is expanded else transposed.stride())


def test_empty_ids():
    weight = torch.randn(5, 4, requires_grad=True)
    ids = torch.empty(0, 3, dtype=torch.long)
    for backend in ("reference", "triton"):
        with use_backend(backend):
            out = compileops.embedding(ids, weight)
            assert out.shape == (0, 3, 4)
            out.sum().backward()
            assert torch.equal(weight.grad, torch.zeros(5, 4))
            weight.grad = None


def test_autograd_fp32_path_gives_weight_dtype_grad():
    ids, weight = _inputs(dtype=torch.bfloat16)
    weight.requires_grad_(True)
    for backend in ("reference", "triton"):
        with use_backend(backend):
            out = compileops.embedding(ids, weight, out_dtype=torch.float32)
            out.backward(torch.ones_like(out))
        assert weight.grad.dtype == torch.bfloat16
        counts = torch.bincount(ids.reshape(-1), minlength=37).to(torch.bfloat16)
        assert torch.equal(weight.grad, counts[:, None].expand(37, 20))
        weight.grad = None


def test_inputs_not_modified():
    ids, weight = _inputs()
    ids_copy, weight_copy = ids.clone(), weight.clone()
    grad = torch.randn(*ids.shape, 20)
    grad_copy = grad.clone()
    for backend in ("reference", "triton"):
        with use_backend(backend):
            compileops.embedding(ids, weight, out_dtype=torch.float64)
            embedding_backward_op(grad, ids, 37, 2, torch.float32)
    assert torch.equal(ids, ids_copy) and torch.equal(weight, weight_copy)
    assert torch.equal(grad, grad_copy)


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_bitwise_deterministic_over_10_runs(backend):
    ids, weight = _inputs(V=23, D=16, shape=(4, 40))
    weight = weight.to(torch.bfloat16).requires_grad_(True)
    with use_backend(backend):
        testing.assert_deterministic(
            lambda i, w: compileops.embedding(i, w, out_dtype=torch.float32), [ids, weight], runs=10
        )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_batch_invariant(backend):
    ids, weight = _inputs(V=29, D=16, shape=(6, 7))
    with use_backend(backend):
        testing.assert_batch_invariant(lambda i: compileops.embedding(i, weight), [ids])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_batch_invariant(backend):
    """Rows touched only by batch A get bitwise the same gradient whether or not other
    sequences (with other ids, or the padding id) sit before, after or between them."""
    V, D = 60, 24
    gen = torch.Generator().manual_seed(3)
    ids_a = torch.randint(0, 30, (3, 20), generator=gen)
    ids_a[0, :15] = 4
    grad_a = torch.randn(3, 20, D, generator=gen)
    ids_b = torch.randint(30, 60, (5, 20), generator=gen)  # disjoint ids
    ids_b[1, :5] = 59  # the padding id, used below
    grad_b = torch.randn(5, 20, D, generator=gen)
    touched_a = torch.unique(ids_a)
    with use_backend(backend):
        alone = embedding_backward_op(grad_a, ids_a, V, None, torch.float32)
        for ids, grad in (
            (torch.cat([ids_a, ids_b]), torch.cat([grad_a, grad_b])),
            (torch.cat([ids_b, ids_a]), torch.cat([grad_b, grad_a])),
            (torch.cat([ids_b[:2], ids_a, ids_b[2:]]), torch.cat([grad_b[:2], grad_a, grad_b[2:]])),
        ):
            mixed = embedding_backward_op(grad, ids, V, 59, torch.float32)
            assert torch.equal(mixed[touched_a], alone[touched_a])
            assert torch.all(mixed[59] == 0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bad", [-1, -5, 37, 1000])
def test_out_of_range_ids_raise_index_error(backend, bad):
    ids, weight = _inputs()
    ids[1, 2] = bad
    with use_backend(backend), pytest.raises(IndexError, match=f"id {bad} is out of range"):
        compileops.embedding(ids, weight)


def test_strict_mode_checks_on_host():
    ids, weight = _inputs()
    ids[0, 0] = 99
    compileops.set_strict_index_checks(True)
    try:
        with pytest.raises(IndexError, match="id 99 is out of range"):
            compileops.embedding(ids, weight)
    finally:
        compileops.set_strict_index_checks(False)


def test_strict_index_checks_context_and_default_toggle_the_host_check(monkeypatch):
    """Strict checks add one host check of the ids in ``embedding()`` (the op's own CPU
    check is always there): on under the context manager or the process default, off
    again after the context, and a nested ``strict_index_checks(False)`` wins."""
    from compileops.embedding import checks

    calls = []
    real = checks.check_ids_in_range
    monkeypatch.setattr(checks, "check_ids_in_range", lambda *a: calls.append(1) or real(*a))
    ids, weight = _inputs()

    def host_checks():
        calls.clear()
        compileops.embedding(ids, weight)
        return len(calls)

    plain = host_checks()
    with strict_index_checks():
        assert host_checks() == plain + 1
    assert host_checks() == plain
    set_strict_index_checks(True)
    try:
        assert host_checks() == plain + 1
        with strict_index_checks(False):
            assert host_checks() == plain
    finally:
        set_strict_index_checks(False)
    assert host_checks() == plain


BAD_FORWARD = [
    ("float ids", lambda ids, w: (ids.float(), w), "ids must be int32 or int64"),
    ("1-D weight", lambda ids, w: (ids, w[0]), "weight must be 2-D"),
    ("3-D weight", lambda ids, w: (ids, w[None]), "weight must be 2-D"),
    ("int weight", lambda ids, w: (ids, w.long()), "weight must be a floating-point tensor"),
    ("device mismatch", lambda ids, w: (ids.to("meta"), w), "ids is on meta but weight is on cpu"),
]


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_bad_forward_input_eager(case):
    _, make, message = case
    ids, weight = make(*_inputs())
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        compileops.embedding(ids, weight)


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_bad_forward_input_at_trace_time(case):
    _, make, message = case
    ids, weight = make(*_inputs())
    compiled = torch.compile(lambda i, w: compileops.embedding(i, w), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(ids, weight)


def test_bad_out_dtype_and_padding_idx():
    ids, weight = _inputs()
    with pytest.raises(TypeError, match="out_dtype must be a floating-point dtype"):
        compileops.embedding(ids, weight, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 37\)"):
        compileops.embedding(ids, weight, padding_idx=37)
    with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 37\)"):
        compileops.embedding(ids, weight, padding_idx=-38)


def test_bad_backward_input():
    ids, _ = _inputs()
    with pytest.raises(ValueError, match=r"grad must be \[\*ids.shape, D\]"):
        embedding_backward_op(torch.randn(3, 10, 4), ids, 37, None, torch.float32)
    with pytest.raises(TypeError, match="weight_dtype must be a floating-point dtype"):
        embedding_backward_op(torch.randn(3, 11, 4), ids, 37, None, torch.int64)


def test_unknown_and_unavailable_backends():
    with pytest.raises(ValueError, match="unknown backend 'cutlass'"):
        use_backend("cutlass")


# --------------------------------------------------------------------------- in-place on the output


@settings(max_examples=20)
@given(data=st.data())
def test_output_takes_in_place_ops_as_torch_embedding_does(data):
    # The output is a fresh tensor, not a view of one (autograd refuses in-place ops on a
    # view returned by a custom op): `out.mul_(2)` then backward works, as with
    # torch.nn.functional.embedding, on both backends and for any ids shape.
    backend = data.draw(st.sampled_from(["reference", "triton"]), label="backend")
    shape = tuple(data.draw(st.lists(st.integers(0, 3), max_size=3), label="ids shape"))
    V = data.draw(st.integers(1, 6), label="V")
    D = data.draw(st.integers(0, 5), label="D")
    out_dtype = data.draw(st.sampled_from([None, torch.float64]), label="out_dtype")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, shape, generator=gen)
    table = torch.randn(V, D, generator=gen)
    ours, theirs = (table.clone().requires_grad_() for _ in range(2))
    with use_backend(backend):
        out = compileops.embedding(ids, ours, out_dtype=out_dtype)
        assert out._base is None, "the output is a view"
        out.mul_(2)
        out.sum().backward()
    want = torch.nn.functional.embedding(ids, theirs).to(out_dtype or table.dtype)
    want.mul_(2)
    want.sum().backward()
    assert torch.equal(out, want)
    assert torch.equal(ours.grad, theirs.grad)
