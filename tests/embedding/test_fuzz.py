"""Property fuzzing of the embedding family: ``compileops.embedding`` and
``compileops.nn.Embedding`` (hence ``compileops::embedding`` and
``compileops::embedding_backward``) on both backends, against an fp64 oracle written here.

Drawn: table sizes (0, 1, primes, ...), ids of 0 to 3 dims, int32/int64 ids, the table and
output dtypes (fp32, bf16, fp16, fp64), ``padding_idx`` (negative too), and the layouts of the
ids, the table and grad_output (``tests/fuzzing.py``). Contracts (the docstrings):

* forward: bitwise equal to ``weight[ids].to(out_dtype)``;
* backward: each table row the fp32 sum (fp64 for fp64 grads) of its tokens' grads in
  position order, cast once to the table dtype; untouched rows and ``padding_idx`` exactly
  zero. Checked against the fp64 oracle with the classical summation bound, and, since the
  order is fixed, bitwise equal across the two backends;
* no input (ids, table, grad_output) and no memory around one is written.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compileops
from tests.fuzzing import (
    Example,
    FLOAT_DTYPES,
    assert_bitwise,
    assert_ran_on,
    assert_within,
    check_result,
    gpu_variant,
    float_dtypes,
    index_dtypes,
    known_bug,
    oracle_grads,
    recorded_backends,
    rounded,
    summation_bound,
    use,
)


# Known bugs found by this fuzzing (each has a strict xfail test below). While one is open
# the main property steps around it, so the rest of the space keeps being fuzzed; delete
# the entry together with the fix.
KNOWN_BUGS: set[str] = set()  # none open; fixed ones keep their regression test below


def oracle_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx) -> torch.Tensor:
    """fp64 ``out[*ids.shape, D] = weight[ids]``; the ``padding_idx`` row gets no gradient.
    ``weight`` is an fp64 leaf, ``padding_idx`` already in ``[0, V)`` or None."""
    rows = weight[ids.long()]
    if padding_idx is not None:
        pad = (ids.long() == padding_idx)[..., None]
        rows = torch.where(pad, rows.detach(), rows)
    return rows


def interpreter_cannot_cast(ex: Example, backend: str, weight_dtype, out_dtype) -> bool:
    """Triton 3.6's interpreter converts fp64 to bf16 wrongly (NaN or garbage; not a
    compileops bug): the forward's fp64 table -> bf16 output and the backward's fp64
    gradient -> bf16 table. Those combinations run on the reference backend only on CPU."""
    pair = {weight_dtype, out_dtype}
    return ex.interpreted(backend) and pair == {torch.float64, torch.bfloat16}


def check_embedding(data, device, *, dim=None, one_strided_id=False,
                    known_bugs=frozenset(KNOWN_BUGS)) -> None:
    """The property; ``dim`` fixes ``embedding_dim`` instead of drawing it;
    ``one_strided_id``: the ids are one token of stride 3; ``known_bugs``: the
    :data:`KNOWN_BUGS` to step around."""
    ex = Example(data, device)
    weight_dtype = ex.draw(float_dtypes(), "weight dtype")
    out_dtype_arg = ex.draw(st.sampled_from([None, *FLOAT_DTYPES]), "out_dtype")
    out_dtype = out_dtype_arg or weight_dtype
    ids_dtype = ex.draw(index_dtypes(), "ids dtype")
    ndim = 1 if one_strided_id else ex.draw(st.integers(0, 3), "ids ndim")
    # (Few ids on CPU: the interpreted backward kernel costs ~50 ms per id.)
    ids_shape = tuple(ex.size(f"ids dim {i}", (17, 17, 5, 3)[ndim], (300, 300, 64, 16)[ndim])
                      for i in range(ndim)) if not one_strided_id else (1,)
    n_ids = math.prod(ids_shape)
    V = ex.size("num_embeddings", 37, 300, min_value=1 if n_ids else 0)
    D = ex.size("embedding_dim", 37, 300, min_value=int(one_strided_id)) if dim is None else dim
    backward = D > 0 or "backward with embedding_dim 0" not in known_bugs
    padding_idx = ex.draw(st.none() | st.integers(-V, V - 1), "padding_idx") if V else None
    via = ex.draw(st.sampled_from(["function", "module"]), "via")

    weight = ex.floats("weight", (V, D), weight_dtype)
    ids = ex.indices("ids", ex.randint(0, V, ids_shape), ids_dtype, free=True,
                     layout="transposed" if one_strided_id else None)
    if (n_ids == 1 and ids.reshape(-1).stride(0) != 1
            and "backward of one strided id" in known_bugs):
        ids = ex.inputs["ids"] = ids.clone(memory_format=torch.contiguous_format)
    grad_out = ex.floats("grad_out", (*ids_shape, D), out_dtype)
    pad = None if padding_idx is None else padding_idx % V

    # fp64 oracle, forward and backward (and on |grad_out|, for the summation bound).
    w64 = weight.detach().cpu().double().requires_grad_()
    ids_cpu = ids.cpu()
    want = oracle_embedding(ids_cpu, w64, pad)
    (want_grad,) = oracle_grads(want, [w64], grad_out)
    (abs_grad,) = oracle_grads(oracle_embedding(ids_cpu, w64, pad), [w64], grad_out.abs())
    counts = torch.bincount(ids_cpu.reshape(-1).long(), minlength=V)[:, None]
    accumulate = torch.float64 if out_dtype == torch.float64 else torch.float32

    grads = {}
    for backend in ex.backends():
        if interpreter_cannot_cast(ex, backend, weight_dtype, out_dtype):
            continue
        truncating = ex.interpreted(backend)
        if via == "module":
            module = compileops.nn.Embedding(V, D, padding_idx=padding_idx, _weight=weight,
                                             out_dtype=out_dtype_arg)
            leaf = module.weight
            forward = module
        else:
            leaf = weight.detach().requires_grad_()

            def forward(i, leaf=leaf):
                return compileops.embedding(i, leaf, out_dtype=out_dtype_arg,
                                            padding_idx=padding_idx)
        snap = ex.snapshot()
        with recorded_backends() as calls:
            with use(backend):
                out = forward(ids)
            snap.check(f"by the {backend} forward")
            check_result(out, (*ids_shape, D), out_dtype, ex.device, f"{backend} forward")
            assert_bitwise(out, rounded(want, out_dtype, truncating=truncating),
                           f"{backend} forward vs weight[ids].to(out_dtype)")
            if not backward:
                continue
            with use(backend):
                (grad,) = torch.autograd.grad(out, leaf, grad_out)
        snap.check(f"by the {backend} backward")
        assert_ran_on(calls, backend, "forward and backward")
        check_result(grad, (V, D), weight_dtype, ex.device, f"{backend} grad_weight")
        bound = summation_bound(want_grad, abs_grad, counts, accumulate=accumulate,
                                out=weight_dtype, truncating=truncating)
        assert_within(grad, want_grad, bound, f"{backend} grad_weight vs fp64")
        grads[backend] = grad
    if len(grads) == 2 and not (ex.on_cpu and weight_dtype == torch.bfloat16):
        # Same fp32 sum in position order, same single cast: the same bits (on CPU the
        # interpreter truncates to bf16, so bf16 tables are compared to the oracle only).
        assert_bitwise(grads["triton"], grads["reference"], "triton vs reference grad_weight")


@given(data=st.data())
def test_embedding(data):
    check_embedding(data, "cpu")


@gpu_variant
@given(data=st.data())
def test_embedding_gpu(data, device):
    check_embedding(data, device)


@given(data=st.data())
def test_embedding_backward_zero_dim(data):
    check_embedding(data, "cpu", dim=0, known_bugs=())


@given(data=st.data())
def test_embedding_backward_one_strided_id(data):
    check_embedding(data, "cpu", one_strided_id=True, known_bugs=())


@pytest.mark.gpu
def test_use_backend_reaches_cuda_backward():
    # Found by this fuzzing: autograd's CUDA device thread did not see use_backend()'s
    # context variable (fixed by backends.keep_forward_backend; CPU twin with a thread:
    # tests/test_backend_threads.py).
    weight = torch.randn(10, 8, device="cuda", requires_grad=True)
    ids = torch.tensor([1, 2, 3], device="cuda")
    with recorded_backends() as calls:
        with use("reference", pin=False):
            compileops.embedding(ids, weight).sum().backward()
    assert_ran_on(calls, "reference", "forward and backward")
