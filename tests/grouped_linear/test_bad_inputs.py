"""Issue 24's bad-input matrix for the grouped linear family: every documented precondition of
``compileops.grouped_linear`` / ``grouped_linear_swiglu`` / ``grouped_linear_splits``,
``splits_to_offsets``, ``compileops.nn.GroupedLinear``, the routing helpers
(``permute_by_expert``, ``unpermute_and_combine``) and the ``grouped_linear_dx`` /
``grouped_linear_wgrad`` ops, broken one at a time, must raise a clear error naming the
argument, eagerly (on both backends) and under ``torch.compile(fullgraph=True)`` (Inductor).
Plus NaN/Inf: they propagate as IEEE says into exactly the outputs that read them.

Where each check runs (``compileops/grouped_linear/checks.py``):

* shape, dtype and device: ``torch._check*`` in the ops and their fake functions. Under
  ``torch.compile`` a failing fake function surfaces as Dynamo's ``TorchRuntimeError`` quoting
  the original error; a check in a traced public function (``m_splits``, the routing helpers)
  is a plain ``raise``, which ``fullgraph=True`` reports as ``Unsupported`` quoting it.
  :func:`raises` accepts exactly those and checks the quoted type and message.
* offset values (non-decreasing, ``>= 0``, ``<= M``), ``m_splits`` values and expert ids: read
  on the host, so by default only for CPU tensors (always, the mode tested here), on CUDA only
  under ``strict_offset_checks()``, never while tracing. Compiled on CPU the grouped-linear ops
  stay extern calls of the op, so the op's eager offset check still runs (``compiled`` cases);
  the ``m_splits`` and expert-id checks live in traced Python and are skipped while compiling:
  there a bad ``m_splits`` is still caught by the op, under the name ``offsets``, and bad
  expert ids are documented as unchecked (no compiled case).
* ``unpermute_and_combine``'s order (a permutation of ``0..T*k-1``): on the host like the
  offsets, else on the device (``torch._assert_async``: a device-side assert on CUDA, Inductor's
  assert compiled, a ``RuntimeError`` on CPU tensors), so every mode refuses a bad one.
"""
from __future__ import annotations

from functools import partial
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileops
from compileops.grouped_linear import checks as routing_checks
from compileops.grouped_linear import permute_by_expert, routing, splits_to_offsets
from compileops.grouped_linear import unpermute_and_combine
from compileops.grouped_linear.backward_ops import grouped_linear_dx_op, grouped_linear_wgrad_op
from tests import fuzzing
from tests.bad_inputs import _dynamo_once_per_module, _fresh_dynamo, raises  # noqa: F401

MODES = ("eager-reference", "eager-triton", "compiled")
SIZES = (3, 2, 4)  # groups of x's rows; one tail row past offsets[-1]
M, K, N, G = sum(SIZES) + 1, 8, 6, len(SIZES)


def _offsets(*values):
    return torch.tensor(values, dtype=torch.int32)


def _inputs(dtype=torch.float32):
    """x [M, K], weight [G, N, K], offsets int32 [G], bias [G, N]."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(G, N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(G, N, generator=gen).to(dtype)
    return x, w, torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32), b


def _linear(x, w, offsets, b):
    return compileops.grouped_linear(x, w, offsets, b)


def _swiglu(x, w, offsets, b, recompute):
    return compileops.grouped_linear_swiglu(x, w, offsets, b, recompute=recompute)


def _splits(x, w, m_splits, b):
    return compileops.grouped_linear_splits(x, w, m_splits, b)


def _dx(grad, w, offsets):
    return grouped_linear_dx_op(grad, w, offsets)


def _wgrad(grad, x, offsets, weight_dtype, bias_dtype):
    return grouped_linear_wgrad_op(grad, x, offsets, weight_dtype, bias_dtype)


def _permute(x, expert_ids, num_experts):
    return permute_by_expert(x, expert_ids, num_experts)


# One compiled wrapper per entry point, shared across cases (dynamic=False: messages keep
# concrete sizes instead of symbols).
COMPILED = {fn: torch.compile(fn, fullgraph=True, dynamic=False)
            for fn in (_linear, _swiglu, _splits, _dx, _wgrad, _permute,
                       unpermute_and_combine, splits_to_offsets)}


def _run(mode, fn, *args):
    if mode == "compiled":
        return COMPILED[fn](*args)
    with compileops.use_backend(mode.removeprefix("eager-")):
        return fn(*args)


# ---------------------------------------------------------------------------------------
# grouped_linear: shapes, dtypes, devices

FORWARD_CASES = {
    # case: (make (x, weight, offsets, bias), error, message naming the argument)
    "3-D x": (lambda x, w, o, b: (x[None], w, o, b), RuntimeError,
              r"x must be 2-D \[M, K\], got shape \(1, 10, 8\)"),
    "2-D weight": (lambda x, w, o, b: (x, w[0], o, b), RuntimeError,
                   r"weight must be 3-D \[G, N, K\], got shape \(6, 8\)"),
    "2-D offsets": (lambda x, w, o, b: (x, w, o[None], b), RuntimeError,
                    r"offsets must be 1-D \[G\]"),
    "int x": (lambda x, w, o, b: (x.int(), w.int(), o, b.int()), TypeError,
              r"x must be bf16, fp16, fp32 or fp64, got torch\.int32"),
    "weight dtype": (lambda x, w, o, b: (x, w.half(), o, b), TypeError,
                     r"weight dtype torch\.float16 must match x dtype torch\.float32"),
    "int64 offsets": (lambda x, w, o, b: (x, w, o.long(), b), TypeError,
                      r"offsets must be int32 \(cumulative end rows\), got torch\.int64"),
    "float offsets": (lambda x, w, o, b: (x, w, o.float(), b), TypeError,
                      r"offsets must be int32 .*got torch\.float32"),
    "offsets length": (lambda x, w, o, b: (x, w, o[:2], b), ValueError,
                       r"offsets must have one entry per group: got 2 offsets for 3 groups"),
    "mismatched K": (lambda x, w, o, b: (x[:, :7], w, o, b), ValueError,
                     r"mismatched K: x is \[M, K\] = \(10, 7\) but weight is \[G, N, K\]"),
    "bias shape": (lambda x, w, o, b: (x, w, o, b[:, :3]), ValueError,
                   r"bias must be \[G, N\] = \[3, 6\], got \(3, 3\)"),
    "1-D bias": (lambda x, w, o, b: (x, w, o, b[0]), ValueError, r"bias must be \[G, N\]"),
    "bias dtype": (lambda x, w, o, b: (x, w, o, b.half()), TypeError,
                   r"bias dtype torch\.float16 must match x dtype"),
    "weight device": (lambda x, w, o, b: (x, w.to("meta"), o, b), RuntimeError,
                      r"weight is on meta but x is on cpu"),
    "offsets device": (lambda x, w, o, b: (x, w, o.to("meta"), b), RuntimeError,
                       r"offsets is on meta but x is on cpu"),
    "bias device": (lambda x, w, o, b: (x, w, o, b.to("meta")), RuntimeError,
                    r"bias is on meta but x is on cpu"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_grouped_linear_rejects_bad_arguments(case, mode):
    make, error, pattern = FORWARD_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _linear, *make(*_inputs()))


@pytest.mark.parametrize("mode", ["eager-triton", "compiled"])
def test_fp64_on_the_triton_backend_names_the_reference_backend(mode):
    # fp64 is valid on the reference backend (the ground truth), refused by the kernels.
    x, w, offs, b = _inputs(torch.float64)
    with raises(TypeError, r"grouped_linear: the triton backend runs bf16, fp16 and fp32, got "
                           r"torch\.float64; fp64 runs on the reference backend"):
        _run(mode, _linear, x, w, offs, b)


# ---------------------------------------------------------------------------------------
# Offset values (CPU tensors: checked in every mode; strict mode adds nothing on CPU)

BAD_OFFSETS = {
    "decreasing": ((5, 3, 9), r"offsets must be non-decreasing \(cumulative end rows\), "
                              r"got \[5, 3, 9\]"),
    "negative": ((-1, 3, 9), r"offsets must be >= 0, got \[-1, 3, 9\]"),
    "past M": ((3, 5, 11), r"offsets\[-1\] = 11 exceeds the number of rows M = 10"),
}


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict_offset_checks"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(BAD_OFFSETS))
def test_bad_offset_values_raise_value_error(case, mode, strict):
    values, pattern = BAD_OFFSETS[case]
    x, w, _, b = _inputs()
    with compileops.strict_offset_checks(strict), raises(ValueError, pattern):
        _run(mode, _linear, x, w, _offsets(*values), b)


# ---------------------------------------------------------------------------------------
# grouped_linear_swiglu (recompute=False with a gradient runs grouped_linear_swiglu_with_preact)


@pytest.mark.parametrize("recompute", [False, True], ids=["preact", "recompute"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["odd N", "int64 offsets", "decreasing offsets"])
def test_grouped_linear_swiglu_rejects_bad_arguments(case, mode, recompute):
    x, w, offs, b = _inputs()
    x.requires_grad_(True)
    if case == "odd N":
        w, b = w[:, :5], b[:, :5]
        error, pattern = ValueError, r"needs an even N in weight \[G, 2H, K\] .*got N = 5"
    elif case == "int64 offsets":
        offs = offs.long()
        error, pattern = TypeError, r"offsets must be int32"
    else:
        offs = _offsets(5, 3, 9)
        error, pattern = ValueError, r"offsets must be non-decreasing"
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _swiglu, x, w, offs, b, recompute)


# ---------------------------------------------------------------------------------------
# m_splits: grouped_linear_splits, splits_to_offsets, nn.GroupedLinear
#
# Once unchecked: float splits were truncated by the int32 cumulative sum (a silent wrong
# answer), and bad counts were only reported as "offsets ..." by the op.

SPLITS_ON_DEVICE = r"m_splits must be >= 0 and add up to at most M"
SPLIT_CASES = {
    # case: (m_splits, error, eager message, compiled message or None if the same)
    "float tensor": (torch.tensor([3.0, 2.5, 4.0]), TypeError,
                     r"m_splits must be an integer tensor \(rows per group\), got torch\.float32",
                     None),
    "float list": ([3, 2.5, 4], TypeError, r"m_splits must be an integer tensor", None),
    "bool tensor": (torch.tensor([True, False, True]), TypeError,
                    r"m_splits must be an integer tensor .*got torch\.bool", None),
    "2-D": (torch.tensor([[3, 2, 4]]), RuntimeError,
            r"m_splits must be 1-D \[G\] \(rows per group\), got shape \(1, 3\)", None),
    "too few": (torch.tensor([3, 2]), ValueError,
                r"m_splits must have one entry per group: got 2 for 3 groups", None),
    # Values: read on the host eagerly; compiled, checked on the device (a RuntimeError).
    "negative": (torch.tensor([3, -2, 4]), ValueError,
                 r"m_splits must be >= 0, got \[3, -2, 4\]", (RuntimeError, SPLITS_ON_DEVICE)),
    "more than M rows": (torch.tensor([3, 2, 6]), ValueError,
                         r"m_splits add up to 11 rows, more than the number of rows M = 10",
                         (RuntimeError, SPLITS_ON_DEVICE)),
}


def _expected(error, pattern, compiled_expectation, compiled):
    """The error type and pattern of a case in this mode (a compiled expectation is a
    pattern of the same type, or a ``(type, pattern)`` pair)."""
    if not compiled or not compiled_expectation:
        return error, pattern
    if isinstance(compiled_expectation, tuple):
        return compiled_expectation
    return error, compiled_expectation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_grouped_linear_splits_rejects_bad_splits(case, mode):
    m_splits, error, pattern, compiled_pattern = SPLIT_CASES[case]
    x, w, _, b = _inputs()
    compiled = mode == "compiled"
    with raises(*_expected(error, pattern, compiled_pattern, compiled), compiled=compiled):
        _run(mode, _splits, x, w, m_splits, b)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", ["float tensor", "float list", "2-D"])
def test_splits_to_offsets_rejects_bad_splits(case, mode):
    m_splits, error, pattern, _ = SPLIT_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        (COMPILED[splits_to_offsets] if mode == "compiled" else splits_to_offsets)(m_splits)


MODULE = compileops.nn.GroupedLinear(G, K, N)
COMPILED_MODULE = torch.compile(MODULE, fullgraph=True, dynamic=False)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", ["float tensor", "too few", "negative", "int64 offsets",
                                  "decreasing offsets"])
def test_module_rejects_bad_groups(case, mode):
    x = _inputs()[0]
    compiled = mode == "compiled"
    module = COMPILED_MODULE if compiled else MODULE
    if case == "int64 offsets":
        with raises(TypeError, r"offsets must be int32", compiled=compiled):
            module(x, _offsets(3, 5, 9).long(), offsets=True)
    elif case == "decreasing offsets":
        with raises(ValueError, r"offsets must be non-decreasing"):
            module(x, _offsets(5, 3, 9), offsets=True)
    else:
        m_splits, error, pattern, compiled_pattern = SPLIT_CASES[case]
        with raises(*_expected(error, pattern, compiled_pattern, compiled), compiled=compiled):
            module(x, m_splits)


# ---------------------------------------------------------------------------------------
# The backward ops, called directly (autograd always passes valid arguments)


def _grad():
    return torch.randn(M, N, generator=torch.Generator().manual_seed(1))


DX_CASES = {
    # case: (make (grad, weight, offsets), error, message)
    "1-D grad": (lambda g, w, o: (g[0], w, o), RuntimeError, r"grad must be 2-D \[M, N\]"),
    "grad N": (lambda g, w, o: (g[:, :5], w, o), ValueError,
               r"grad \[M, N\] = \(10, 5\) does not match weight \[G, N, K\] = \(3, 6, 8\)"),
    # The next three named x (the op's stand-in for grad) once.
    "int grad": (lambda g, w, o: (g.long(), w.long(), o), TypeError,
                 r"grad must be bf16, fp16, fp32 or fp64, got torch\.int64"),
    "weight dtype": (lambda g, w, o: (g, w.half(), o), TypeError,
                     r"weight dtype torch\.float16 must match grad dtype torch\.float32"),
    "weight device": (lambda g, w, o: (g, w.to("meta"), o), RuntimeError,
                      r"weight is on meta but grad is on cpu"),
    "int64 offsets": (lambda g, w, o: (g, w, o.long()), TypeError, r"offsets must be int32"),
    "offsets length": (lambda g, w, o: (g, w, o[:2]), ValueError,
                       r"offsets must have one entry per group"),
    # Once unchecked (a silent wrong answer).
    "decreasing offsets": (lambda g, w, o: (g, w, _offsets(5, 3, 9)), ValueError,
                           r"offsets must be non-decreasing"),
    "offsets past M": (lambda g, w, o: (g, w, _offsets(3, 5, 11)), ValueError,
                       r"offsets\[-1\] = 11 exceeds the number of rows M = 10"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(DX_CASES))
def test_grouped_linear_dx_rejects_bad_arguments(case, mode):
    make, error, pattern = DX_CASES[case]
    _, w, offs, _ = _inputs()
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _dx, *make(_grad(), w, offs))


F32 = torch.float32
WGRAD_CASES = {
    # case: (make (grad, x, offsets, weight_dtype, bias_dtype), error, message)
    "grad rows": (lambda g, x, o: (g[:9], x, o, F32, F32), ValueError,
                  r"grad has 9 rows but x has 10"),
    "1-D x": (lambda g, x, o: (g, x[0], o, F32, F32), RuntimeError, r"x must be 2-D \[M, K\]"),
    "int64 offsets": (lambda g, x, o: (g, x, o.long(), F32, F32), TypeError,
                      r"offsets must be int32 \(cumulative end rows\), got torch\.int64"),
    "offsets device": (lambda g, x, o: (g, x, o.to("meta"), F32, F32), RuntimeError,
                       r"offsets is on meta but grad is on cpu"),
    # Once unchecked: integer grads, mixed dtypes and integer result dtypes ran
    # (a silent wrong answer on the reference backend), and offset values were never read.
    "int grad": (lambda g, x, o: (g.long(), x.long(), o, F32, F32), TypeError,
                 r"grad must be bf16, fp16, fp32 or fp64, got torch\.int64"),
    "x dtype": (lambda g, x, o: (g, x.bfloat16(), o, F32, F32), TypeError,
                r"x dtype torch\.bfloat16 must match grad dtype torch\.float32"),
    "int weight_dtype": (lambda g, x, o: (g, x, o, torch.int32, F32), TypeError,
                         r"weight_dtype must be a floating-point dtype, got torch\.int32"),
    "int bias_dtype": (lambda g, x, o: (g, x, o, F32, torch.int64), TypeError,
                       r"bias_dtype must be a floating-point dtype, got torch\.int64"),
    "decreasing offsets": (lambda g, x, o: (g, x, _offsets(5, 3, 9), F32, F32), ValueError,
                           r"offsets must be non-decreasing"),
    "negative offsets": (lambda g, x, o: (g, x, _offsets(-1, 3, 9), F32, F32), ValueError,
                         r"offsets must be >= 0"),
    "offsets past M": (lambda g, x, o: (g, x, _offsets(3, 5, 11), F32, F32), ValueError,
                       r"offsets\[-1\] = 11 exceeds the number of rows M = 10"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(WGRAD_CASES))
def test_grouped_linear_wgrad_rejects_bad_arguments(case, mode):
    make, error, pattern = WGRAD_CASES[case]
    x, _, offs, _ = _inputs()
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _wgrad, *make(_grad(), x, offs))


# ---------------------------------------------------------------------------------------
# Routing helpers. Once unchecked: an expert id outside [0, E) was silently routed
# past the last group (a zero output) or into expert 0, float ids were sorted as floats, and
# shape mismatches raised torch's index/reshape errors without an argument name.

T, TOP_K, E = 4, 2, 3


def _routing():
    x = torch.randn(T, 5, generator=torch.Generator().manual_seed(2))
    expert_ids = torch.tensor([[0, 2], [1, 0], [2, 2], [1, 0]])
    return x, expert_ids


PERMUTE_CASES = {
    # case: (make (x, expert_ids, num_experts), error, message)
    "float expert_ids": (lambda x, e: (x, e.float(), E), RuntimeError,
                         r"expert_ids must be int32 or int64, got torch\.float32"),
    "1-D expert_ids": (lambda x, e: (x, e[:, 0], E), RuntimeError,
                       r"expert_ids must be 2-D \[T, k\], got shape \(4,\)"),
    "1-D x": (lambda x, e: (x[0], e, E), RuntimeError, r"x must be 2-D \[T, D\]"),
    "rows": (lambda x, e: (x[:3], e, E), ValueError,
             r"expert_ids \[T, k\] = \(4, 2\) must have one row per row of x \[T, D\] = \(3, 5\)"),
    "num_experts < 0": (lambda x, e: (x, e, -1), ValueError, r"num_experts must be >= 0, got -1"),
    "expert_ids device": (lambda x, e: (x, e.to("meta"), E), RuntimeError,
                          r"expert_ids is on meta but x is on cpu"),
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", list(PERMUTE_CASES))
def test_permute_by_expert_rejects_bad_arguments(case, mode):
    make, error, pattern = PERMUTE_CASES[case]
    compiled = mode == "compiled"
    with raises(error, pattern, compiled=compiled):
        (COMPILED[_permute] if compiled else _permute)(*make(*_routing()))


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict_offset_checks"])
@pytest.mark.parametrize("bad", [E, -1, 2**40])
def test_permute_by_expert_rejects_out_of_range_expert_ids(bad, strict):
    # Eager only: the id check reads the host, and is documented to be skipped while compiling.
    x, expert_ids = _routing()
    expert_ids[2, 1] = bad
    with compileops.strict_offset_checks(strict), raises(
            IndexError, rf"expert_ids holds expert {bad}, out of range for num_experts = 3 "
                        r"\(valid ids are 0\.\.2\)"):
        permute_by_expert(x, expert_ids, E)


UNPERMUTE_CASES = {
    # case: (make (y_sorted, order, weights), error, message)
    "weights shape": (lambda y, o, w: (y, o, w[:, :1]), ValueError,
                      r"y_sorted \[T\*k, D\] = \(8, 5\), order \[T\*k\] = \(8,\) and weights "
                      r"\[T, k\] = \(4, 1\) disagree on T\*k"),
    "y_sorted rows": (lambda y, o, w: (y[:7], o, w), ValueError, r"disagree on T\*k"),
    "float order": (lambda y, o, w: (y, o.float(), w), RuntimeError,
                    r"order must be int32 or int64, got torch\.float32"),
    "int weights": (lambda y, o, w: (y, o, w.long()), RuntimeError,
                    r"weights must be a floating-point tensor, got torch\.int64"),
    "1-D y_sorted": (lambda y, o, w: (y[:, 0], o, w), RuntimeError,
                     r"y_sorted must be 2-D \[T\*k, D\]"),
    "order device": (lambda y, o, w: (y, o.to("meta"), w), RuntimeError,
                     r"order is on meta but y_sorted is on cpu"),
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", list(UNPERMUTE_CASES))
def test_unpermute_and_combine_rejects_bad_arguments(case, mode):
    make, error, pattern = UNPERMUTE_CASES[case]
    x, expert_ids = _routing()
    y_sorted, order, _ = permute_by_expert(x, expert_ids, E)
    weights = torch.rand(T, TOP_K, generator=torch.Generator().manual_seed(3))
    compiled = mode == "compiled"
    fn = COMPILED[unpermute_and_combine] if compiled else unpermute_and_combine
    with raises(error, pattern, compiled=compiled):
        fn(*make(y_sorted, order, weights))


# ---------------------------------------------------------------------------------------
# NaN and Inf propagate (IEEE) into exactly the outputs that read them


def _oracle_forward(x, w, offs, b):
    """fp64, group by group with plain matmuls (not the project's reference); tail rows 0."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[g].double().t() + b[g].double()
        start = end
    return out


def _nonfinite_inputs():
    x, w, offs, b = _inputs()
    x[0, 1] = float("nan")  # row 0 (group 0): every column NaN
    x[3, 2] = float("inf")  # row 3 (group 1): every column +-inf
    x[M - 1, :] = float("nan")  # the tail row: documented to give exactly 0
    w[2, 1, 4] = float("nan")  # group 2, output column 1: rows 5..8 of column 1
    b[0, 4] = float("-inf")  # group 0, column 4: rows 1, 2 (row 0 is already NaN)
    return x, w, offs, b


def _assert_same_nonfinite(got, want):
    assert torch.equal(got.isnan(), want.isnan()), (got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf()), (got.isinf(), want.isinf())
    assert torch.equal(torch.signbit(got[got.isinf()]), torch.signbit(want[want.isinf()]))
    torch.testing.assert_close(got.double()[want.isfinite()], want[want.isfinite()],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_reach_exactly_the_outputs_that_read_them(mode):
    x, w, offs, b = _nonfinite_inputs()
    got = _run(mode, _linear, x, w, offs, b)
    want = _oracle_forward(x, w, offs, b)
    assert want[0].isnan().all() and want[3].isinf().all() and want[5:9, 1].isnan().all()
    _assert_same_nonfinite(got, want)
    assert torch.equal(got[M - 1], torch.zeros(N))  # rows past offsets[-1]: exactly zero


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_grads_reach_exactly_the_gradients_that_read_them(mode):
    x, w, offs, b = _inputs()
    x, w, b = (t.requires_grad_(True) for t in (x, w, b))
    grad = torch.ones(M, N)
    grad[1, 2] = float("nan")  # row 1 (group 0): dX row 1, dW[0, 2, :], db[0, 2]
    grad[6, 3] = float("inf")  # row 6 (group 2): dX row 6, dW[2, 3, :], db[2, 3]
    grad[M - 1, :] = float("nan")  # the tail row belongs to no group: no gradient anywhere
    if mode == "compiled":
        out = COMPILED[_linear](x, w, offs, b)
        got = torch.autograd.grad(out, (x, w, b), grad)
    else:
        with compileops.use_backend(mode.removeprefix("eager-")):
            got = torch.autograd.grad(_linear(x, w, offs, b), (x, w, b), grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    out = _oracle_forward(*leaves[:2], offs, leaves[2])
    want = torch.autograd.grad(out, leaves, grad.double())
    assert want[0][1].isnan().all() and want[1][0, 2].isnan().all() and want[2][2, 3].isinf()
    for g, wnt in zip(got, want):
        _assert_same_nonfinite(g, wnt)


# ---------------------------------------------------------------------------------------
# unpermute_and_combine: an order that is not a permutation


def _combine_inputs(tokens, top_k, dim, gen):
    y_sorted = torch.randn(tokens * top_k, dim, generator=gen, dtype=torch.float64)
    return y_sorted, torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)


def _oracle_combine(y_sorted, order, weights):
    """fp64, token by token: ``out[t] = sum_j weights[t, j] * y_sorted[position of t*k + j]``."""
    tokens, top_k = weights.shape
    position = {int(v): i for i, v in enumerate(order)}
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            out[t] += weights[t, j] * y_sorted[position[t * top_k + j]]
    return out


@settings(max_examples=60)
@given(data=st.data())
def test_unpermute_and_combine_refuses_an_order_that_is_not_a_permutation(data):
    # Both inversions (sort, scatter) and both checks: the host's (CPU tensors; CUDA under
    # strict_offset_checks) names the entry, the device's (CUDA by default: no host sync)
    # is a torch._assert_async, which raises at once on CPU tensors.
    tokens, top_k = data.draw(st.integers(0, 5), label="T"), data.draw(st.integers(1, 3), label="k")
    order, fault = data.draw(fuzzing.routing_orders(tokens * top_k), label="order")
    as_permutation = data.draw(st.booleans(), label="order_is_permutation")
    on_host = data.draw(st.booleans(), label="checked on the host")
    y_sorted, weights = _combine_inputs(tokens, top_k, 3, torch.Generator().manual_seed(0))
    order = torch.tensor(order, dtype=torch.int64)
    run = partial(unpermute_and_combine, y_sorted, order, weights,
                  order_is_permutation=as_permutation)
    with mock.patch.object(routing_checks, "check_order_eagerly",
                           routing_checks.check_order_eagerly if on_host else lambda order: False):
        if fault == "none":
            torch.testing.assert_close(run(), _oracle_combine(y_sorted, order, weights),
                                       rtol=1e-12, atol=1e-12)
        elif not on_host:
            with pytest.raises(RuntimeError, match="order is not a permutation of 0..T\\*k-1"):
                run()
        elif fault == "duplicate":
            with pytest.raises(ValueError, match=r"order must be a permutation of 0\.\.\d+ .*"
                               r"holds \d+ twice \(order\[\d+\] and order\[\d+\]\) and lacks"):
                run()
        else:
            bad = int(order[(order < 0) | (order >= order.numel())][0])
            with pytest.raises(IndexError, match=rf"order\[\d+\] = {bad} is outside \[0, "):
                run()


def _unpermute_as_permutation(y_sorted, order, weights):
    return unpermute_and_combine(y_sorted, order, weights, order_is_permutation=True)


COMPILED_COMBINE = {flag: torch.compile(fn, fullgraph=True, dynamic=False)
                    for flag, fn in ((False, unpermute_and_combine),
                                     (True, _unpermute_as_permutation))}


@pytest.mark.parametrize("as_permutation", [False, True], ids=["sorted", "scattered"])
@pytest.mark.parametrize("fault", ["too large", "negative", "duplicate"])
def test_compiled_unpermute_and_combine_refuses_an_order_that_is_not_a_permutation(
        fault, as_permutation):
    y_sorted, weights = _combine_inputs(3, 2, 4, torch.Generator().manual_seed(1))
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    fn = COMPILED_COMBINE[as_permutation]
    torch.testing.assert_close(fn(y_sorted, order, weights),
                               _oracle_combine(y_sorted, order, weights), rtol=1e-12, atol=1e-12)
    order[2] = {"too large": 6, "negative": -2, "duplicate": 0}[fault]
    with pytest.raises(RuntimeError, match="order is not a permutation of 0..T\\*k-1"):
        fn(y_sorted, order, weights)


@given(st.lists(st.integers(-3, 12), max_size=10))
def test_inverse_permutation_never_reads_uninitialised_memory(values):
    # A non-permutation has no inverse, but the result must still be a function of the input
    # (indices in [0, n): slots no entry lands in hold 0, a slot entries land in holds one
    # of their positions), never what was in memory before.
    perm = torch.tensor(values, dtype=torch.int64)
    n = perm.numel()
    inverse = routing.inverse_permutation(perm)
    for slot in range(n):
        landed = [i for i, v in enumerate(values) if v == slot]
        assert int(inverse[slot]) in (landed or [0]), (slot, inverse.tolist())


@pytest.mark.parametrize("fn", [compileops.grouped_linear, compileops.grouped_linear_swiglu])
@pytest.mark.parametrize("fp8", [None, "rowwise"])
def test_offsets_as_a_python_list_is_a_clear_type_error(fn, fp8):
    """torch's schema parser would say 'expected Tensor ... but got list'; ours names what
    offsets are and where per-group counts go."""
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match=r"offsets must be a torch.Tensor \(cumulative end "
                                        r"rows.*grouped_linear_splits"):
        fn(x, w, [2, 6], fp8=fp8)
