"""Issue 24's bad-input matrix for the embedding family: every documented precondition of
``compileops.embedding``, ``compileops.nn.Embedding`` and the ``compileops::embedding`` /
``compileops::embedding_backward`` ops, broken one at a time, must raise a clear error naming
the argument, eagerly (on both backends) and under ``torch.compile(fullgraph=True)``
(Inductor, what users run). Plus NaN/Inf: they propagate as IEEE says, never zeroed.

Where each check runs (``compileops/embedding/checks.py``):

* shape, dtype, device, ``out_dtype`` and ``padding_idx``: ``torch._check*`` in the ops and
  their fake functions. Under ``torch.compile`` a failing fake function surfaces as Dynamo's
  ``TorchRuntimeError`` quoting the original error (``got ValueError('padding_idx ...')``);
  :func:`raises` accepts exactly that and checks the quoted type and message.
* id range: read on the host. On CPU tensors always (both backends, forward and, since this
  issue, the backward op too), so the default mode is the documented one here;
  ``strict_index_checks()`` additionally checks in the public function before the op (it only
  changes anything on GPUs, where the default is a device assert). Compiled on CPU, the
  Inductor lowering asserts one "all ids valid" scalar (``lowerings/embedding.py``): a
  ``RuntimeError`` whose message names the op and the bound but not ``ids``
  (see ``ID_RANGE_COMPILED``).
"""
from __future__ import annotations


import pytest
import torch

import compileops
from compileops.embedding.op import embedding_backward_op
from tests.bad_inputs import _dynamo_once_per_module, _fresh_dynamo, raises  # noqa: F401

V, D = 6, 4
MODES = ("eager-reference", "eager-triton", "compiled")


def _embed(ids, weight, out_dtype, padding_idx):
    return compileops.embedding(ids, weight, out_dtype=out_dtype, padding_idx=padding_idx)


def _embed_backward(grad, ids, num_embeddings, padding_idx, weight_dtype):
    return embedding_backward_op(grad, ids, num_embeddings, padding_idx, weight_dtype)


# One compiled wrapper per entry point, shared across cases (dynamic=False: messages keep
# concrete sizes instead of symbols).
COMPILED_EMBED = torch.compile(_embed, fullgraph=True, dynamic=False)
COMPILED_EMBED_BACKWARD = torch.compile(_embed_backward, fullgraph=True, dynamic=False)


def _run(mode, eager_fn, compiled_fn, *args):
    if mode == "compiled":
        return compiled_fn(*args)
    with compileops.use_backend(mode.removeprefix("eager-")):
        return eager_fn(*args)


def _weight(dtype=torch.float32):
    return torch.randn(V, D, generator=torch.Generator().manual_seed(0)).to(dtype)


def _ids():
    return torch.tensor([[0, 5, 2], [3, 3, 1]])


# ---------------------------------------------------------------------------------------
# compileops.embedding: shapes, dtypes, devices, out_dtype, padding_idx

FORWARD_CASES = {
    # case: (make (ids, weight, out_dtype, padding_idx), error, message naming the argument)
    "ids as a list": (lambda i, w: (i.tolist(), w, None, None), TypeError,
                      r"ids must be a torch\.Tensor, got list"),
    "float ids": (lambda i, w: (i.float(), w, None, None), RuntimeError,
                  r"ids must be int32 or int64, got torch\.float32"),
    "bool ids": (lambda i, w: (i.bool(), w, None, None), RuntimeError,
                 r"ids must be int32 or int64, got torch\.bool"),
    "int16 ids": (lambda i, w: (i.short(), w, None, None), RuntimeError,
                  r"ids must be int32 or int64, got torch\.int16"),
    "1-D weight": (lambda i, w: (i, w[0], None, None), RuntimeError,
                   r"weight must be 2-D \[num_embeddings, embedding_dim\], got shape \(4,\)"),
    "3-D weight": (lambda i, w: (i, w[None], None, None), RuntimeError,
                   r"weight must be 2-D .*got shape \(1, 6, 4\)"),
    "int weight": (lambda i, w: (i, w.long(), None, None), RuntimeError,
                   r"weight must be a floating-point tensor, got torch\.int64"),
    "ids on another device": (lambda i, w: (i.to("meta"), w, None, None), RuntimeError,
                              r"ids is on meta but weight is on cpu"),
    "weight on another device": (lambda i, w: (i, w.to("meta"), None, None), RuntimeError,
                                 r"ids is on cpu but weight is on meta"),
    "int out_dtype": (lambda i, w: (i, w, torch.int32, None), TypeError,
                      r"out_dtype must be a floating-point dtype, got torch\.int32"),
    "padding_idx = V": (lambda i, w: (i, w, None, V), ValueError,
                        r"padding_idx must be in \[0, 6\) once normalised, got 6"),
    "padding_idx < -V": (lambda i, w: (i, w, None, -V - 1), ValueError,
                         r"padding_idx must be in \[0, 6\) once normalised, got -1"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_embedding_rejects_bad_arguments(case, mode):
    make, error, pattern = FORWARD_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _embed, COMPILED_EMBED, *make(_ids(), _weight()))


# ---------------------------------------------------------------------------------------
# compileops.embedding: id values (checked on CPU tensors in every mode, see the docstring)

BAD_IDS = {
    "id = V": (torch.int64, V),
    "id = -1": (torch.int64, -1),
    "id = 2**40": (torch.int64, 2**40),
    "int32 id = -2**31": (torch.int32, -(2**31)),
}
# The compiled (Inductor, CPU) message comes from lowerings/embedding.py's single assert; it
# names the op and the bound, not `ids` (outside this family's checks).
ID_RANGE_COMPILED = r"compileops\.embedding: an id in ids is out of range \[0, num_embeddings\)"


def _ids_with(dtype, bad):
    ids = _ids().to(dtype)
    ids[1, 1] = bad
    return ids


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict_index_checks"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(BAD_IDS))
def test_out_of_range_ids_raise_index_error_naming_the_id(case, mode, strict):
    dtype, bad = BAD_IDS[case]
    ids = _ids_with(dtype, bad)
    with compileops.strict_index_checks(strict):
        if mode == "compiled":  # strict checks are skipped while compiling (documented)
            with raises(RuntimeError, ID_RANGE_COMPILED):
                COMPILED_EMBED(ids, _weight(), None, None)
        else:
            with raises(IndexError, rf"id {bad} is out of range for a table of 6 rows "
                                    r"\(valid ids are 0\.\.5\)"):
                _run(mode, _embed, None, ids, _weight(), None, None)


# ---------------------------------------------------------------------------------------
# compileops.nn.Embedding


@pytest.mark.parametrize("option", [dict(max_norm=1.0), dict(scale_grad_by_freq=True),
                                    dict(sparse=True)], ids=lambda o: next(iter(o)))
def test_module_refuses_options_it_would_ignore(option):
    name = next(iter(option))
    with raises(NotImplementedError, rf"does not support {name}; use torch\.nn\.Embedding"):
        compileops.nn.Embedding(V, D, **option)


MODULE = compileops.nn.Embedding(V, D, padding_idx=0)
COMPILED_MODULE = torch.compile(MODULE, fullgraph=True, dynamic=False)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", ["float ids", "id = V", "id = -1"])
def test_module_rejects_bad_ids(case, mode):
    compiled = mode == "compiled"
    fn = COMPILED_MODULE if compiled else MODULE
    if case == "float ids":
        with raises(RuntimeError, r"ids must be int32 or int64", compiled=compiled):
            fn(_ids().float())
        return
    bad = V if case == "id = V" else -1
    error, pattern = ((RuntimeError, ID_RANGE_COMPILED) if compiled else
                      (IndexError, rf"id {bad} is out of range .*valid ids are 0\.\.5"))
    with raises(error, pattern):
        fn(_ids_with(torch.int64, bad))


# ---------------------------------------------------------------------------------------
# compileops::embedding_backward, called directly (autograd always passes valid arguments)

def _grad():
    return torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1))


BACKWARD_CASES = {
    # case: (make (grad, ids, num_embeddings, padding_idx, weight_dtype), error, message)
    "int grad": (lambda g, i: (g.long(), i, V, None, torch.float32), RuntimeError,
                 r"grad must be a floating-point tensor, got torch\.int64"),
    "grad shape": (lambda g, i: (g[:, :2], i, V, None, torch.float32), ValueError,
                   r"grad must be \[\*ids\.shape, D\] = \[2, 3, D\], got \(2, 2, 4\)"),
    "float ids": (lambda g, i: (g, i.float(), V, None, torch.float32), RuntimeError,
                  r"ids must be int32 or int64, got torch\.float32"),
    "num_embeddings < 0": (lambda g, i: (g, i, -1, None, torch.float32), ValueError,
                           r"num_embeddings must be >= 0"),
    "int weight_dtype": (lambda g, i: (g, i, V, None, torch.int64), TypeError,
                         r"weight_dtype must be a floating-point dtype, got torch\.int64"),
    "padding_idx = V": (lambda g, i: (g, i, V, V, torch.float32), ValueError,
                        r"padding_idx must be in \[0, 6\)"),
    "ids on another device": (lambda g, i: (g, i.to("meta"), V, None, torch.float32),
                              RuntimeError, r"ids is on meta but grad is on cpu"),
    # Once unchecked: the reference wrapped -1 to row V-1 and raised a bare
    # "index 6 is out of bounds" for V; the kernels dropped both silently.
    "id = V": (lambda g, i: (g, _ids_with(torch.int64, V), V, None, torch.float32), IndexError,
               r"id 6 is out of range for a table of 6 rows \(valid ids are 0\.\.5\)"),
    "id = -1": (lambda g, i: (g, _ids_with(torch.int64, -1), V, None, torch.float32),
                IndexError, r"id -1 is out of range for a table of 6 rows"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_embedding_backward_rejects_bad_arguments(case, mode):
    make, error, pattern = BACKWARD_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _embed_backward, COMPILED_EMBED_BACKWARD, *make(_grad(), _ids()))


# ---------------------------------------------------------------------------------------
# NaN and Inf propagate (IEEE): into exactly the outputs that read them


NAN_ROW, INF_ROW, PAD = 2, 3, 5


def _nonfinite_weight(dtype):
    w = _weight(torch.float32)
    w[NAN_ROW, 1] = float("nan")
    w[INF_ROW, 2] = float("inf")
    w[INF_ROW, 3] = float("-inf")
    w[PAD] = float("nan")  # padding_idx only affects the backward: the forward still reads it
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_weights_reach_exactly_the_outputs_that_read_them(mode, dtype):
    weight = _nonfinite_weight(dtype)
    ids = torch.tensor([[2, 0, 3], [5, 2, 1]])
    out = _run(mode, _embed, COMPILED_EMBED, ids, weight, torch.float32, PAD)
    want = weight.double()[ids]  # the gather itself is the oracle: lossless
    assert out.dtype == torch.float32
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.isinf(), want.isinf())
    assert torch.equal(torch.signbit(out[out.isinf()]), torch.signbit(want[want.isinf()]))
    assert out.isnan().any() and out.isinf().any()
    assert torch.equal(out[want.isfinite()].double(), want[want.isfinite()])


def _embed_sum_grad(mode, ids, grad):
    """grad_weight of the lookup for the upstream ``grad``, forward and backward in ``mode``."""
    weight = _weight().requires_grad_(True)
    if mode == "compiled":  # the compiled backward calls compileops::embedding_backward
        return torch.autograd.grad(COMPILED_EMBED(ids, weight, None, PAD), weight, grad)[0]
    with compileops.use_backend(mode.removeprefix("eager-")):
        return torch.autograd.grad(_embed(ids, weight, None, PAD), weight, grad)[0]


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_grads_reach_exactly_the_rows_they_feed(mode):
    ids = torch.tensor([[1, 2, 2], [4, 4, 5], [3, 2, 5]])
    grad = torch.ones(3, 3, D)
    grad[0, 0, 1] = float("nan")  # row 1: NaN in column 1
    grad[0, 1, 2] = float("inf")  # row 2: +inf and -inf in column 2 -> NaN
    grad[2, 1, 2] = float("-inf")
    grad[1, 0, 3] = float("inf")  # row 4: +inf in column 3
    grad[1, 2, :] = float("nan")  # padding_idx (5): documented to receive no gradient
    got = _embed_sum_grad(mode, ids, grad)
    want = torch.zeros(V, D, dtype=torch.float64)
    for t, row in enumerate(ids.reshape(-1).tolist()):  # the definition, IEEE in fp64
        if row != PAD:
            want[row] += grad.reshape(-1, D)[t].double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    assert got[1, 1].isnan() and got[2, 2].isnan() and got[4, 3] == float("inf")
    assert torch.equal(got[PAD], torch.zeros(D))
    torch.testing.assert_close(got.double()[want.isfinite()], want[want.isfinite()])
