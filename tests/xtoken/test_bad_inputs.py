"""Issue 24's bad-input matrix for the cross-tokenizer family: every documented precondition of
``compileops.xtoken.project`` / ``SparseProjection``, ``chunk_sums`` / ``chunk_average`` /
``valid_chunk_mask``, the projection files (``parse_projection_file``, ``get_projection``,
``SparseProjection.from_file``) and the four ``xtoken_*`` ops, broken one at a time, must raise
a clear error naming the argument, eagerly (on both backends) and under
``torch.compile(fullgraph=True)`` (Inductor). Plus NaN/Inf: they propagate as IEEE says into
exactly the outputs that read them.

Where each check runs (``compileops/xtoken/checks.py``):

* shape, dtype and device: ``torch._check*`` in the ops and their fake functions. Under
  ``torch.compile`` a failing fake function surfaces as Dynamo's ``TorchRuntimeError`` quoting
  the original error; ``valid_chunk_mask``'s check is a plain ``raise`` in traced code, which
  ``fullgraph=True`` reports as ``Unsupported`` quoting it. :func:`raises` accepts exactly
  those and checks the quoted type and message.
* values (``columns`` in ``[0, V_t)``, and since this issue the CSR buffers: ``indptr`` a CSR
  pointer, ids in range): read on the host for CPU tensors, in every mode here. Compiled on
  CPU the ops stay extern calls, so the op's eager check runs (``compiled`` cases). On CUDA
  nothing is read (the kernels mask bad columns; the CSR buffers are trusted).
* files: read eagerly (never compiled).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import compileops
from compileops.xtoken import (
    SparseProjection,
    chunk_average,
    chunk_sums,
    clear_caches,
    get_projection,
    parse_projection_file,
    project,
    valid_chunk_mask,
)
from compileops.xtoken.op import chunk_sums_backward_op, project_backward_op

from tests.xtoken._helpers import random_projection
from tests.bad_inputs import _dynamo_once_per_module, _fresh_dynamo, raises  # noqa: F401

MODES = ("eager-reference", "eager-triton", "compiled")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROJ = random_projection()  # V_s = 37 students, V_t = 29 teachers
V_S, V_T, NNZ = PROJ.num_student, PROJ.num_teacher, PROJ.row_weights.numel()


def _project(p, csr, columns):
    return project(p, csr, columns)


def _project_backward(grad, row_indptr, row_teacher_ids, row_weights, num_teacher, columns):
    return project_backward_op(grad, row_indptr, row_teacher_ids, row_weights, num_teacher,
                               columns)


def _chunk_sums(log_probs, chunk_id, max_chunks):
    return chunk_sums(log_probs, chunk_id, max_chunks)


def _chunk_average(log_probs, chunk_id, max_chunks):
    return chunk_average(log_probs, chunk_id, max_chunks)


def _chunk_backward(grad_sums, chunk_id, dtype):
    return chunk_sums_backward_op(grad_sums, chunk_id, dtype)


# One compiled wrapper per entry point, shared across cases (dynamic=False: messages keep
# concrete sizes instead of symbols).
COMPILED = {fn: torch.compile(fn, fullgraph=True, dynamic=False)
            for fn in (_project, _project_backward, _chunk_sums, _chunk_average,
                       _chunk_backward, valid_chunk_mask)}


def _run(mode, fn, *args):
    if mode == "compiled":
        return COMPILED[fn](*args)
    with compileops.use_backend(mode.removeprefix("eager-")):
        return fn(*args)


def _backward_backend(mode):
    """The eager modes' backend for an autograd backward (the compiled backward graph calls
    the ops with the default backend)."""
    if mode == "compiled":
        return contextlib.nullcontext()
    return compileops.use_backend(mode.removeprefix("eager-"))


def _p():
    return torch.rand(2, 3, V_S, generator=torch.Generator().manual_seed(1))


def _columns():
    return torch.randint(0, V_T, (2, 3, 4), generator=torch.Generator().manual_seed(2))


def _csr(**replace):
    return dataclasses.replace(PROJ.csr(), **replace)


def _csr_mismatched_nnz():
    """Each layout valid on its own shapes, but the column CSR holds one entry fewer."""
    c = PROJ.csr()
    return _csr(col_indptr=c.col_indptr.clamp(max=NNZ - 1), col_student_ids=c.col_student_ids[:-1],
                col_weights=c.col_weights[:-1])


def _shifted(t, position, value):
    t = t.clone()
    t[position] = value
    return t


# ---------------------------------------------------------------------------------------
# project / xtoken_project

PROJECT_CASES = {
    # case: (make (p, csr, columns), error, message naming the argument)
    "int p": (lambda p, c: (p.long(), c, None), RuntimeError,
              r"p must be a floating-point tensor, got torch\.int64"),
    "0-d p": (lambda p, c: (torch.tensor(1.0), c, None), ValueError,
              r"p must be \[\*, V_s\], got a 0-d tensor"),
    "p vocab": (lambda p, c: (p[..., :-1], c, None), ValueError,
                r"p's last dim \(36\) must equal the projection's student vocab \(37\)"),
    "p device": (lambda p, c: (p.to("meta"), c, None), RuntimeError,
                 r"col_indptr is on cpu but p is on meta"),
    "float columns": (lambda p, c: (p, c, _columns().float()), RuntimeError,
                      r"columns must be int32 or int64, got torch\.float32"),
    "columns shape": (lambda p, c: (p, c, _columns()[0]), ValueError,
                      r"columns must be \[\*p\.shape\[:-1\], K\] = \[2, 3, K\], got \(3, 4\)"),
    "columns device": (lambda p, c: (p, c, _columns().to("meta")), RuntimeError,
                       r"columns is on meta but p is on cpu"),
    # The CSR buffers: the messages named the layout ("column CSR weights") but not the
    # argument once.
    "col_weights fp64": (lambda p, c: (p, _csr(col_weights=c.col_weights.double()), None),
                         TypeError, r"col_weights: column CSR weights must be float32, "
                                    r"got torch\.float64"),
    "float row_teacher_ids": (
        lambda p, c: (p, _csr(row_teacher_ids=c.row_teacher_ids.float()), None), RuntimeError,
        r"row_teacher_ids: row CSR ids must be int32 or int64, got torch\.float32"),
    "2-D col_indptr": (lambda p, c: (p, _csr(col_indptr=c.col_indptr[None]), None),
                       RuntimeError, r"col_indptr: column CSR indptr must be 1-D"),
    "col_weights length": (lambda p, c: (p, _csr(col_weights=c.col_weights[:-1]), None),
                           ValueError, r"col_student_ids and col_weights: column CSR ids and "
                                       r"weights must have the same length"),
    "nnz mismatch": (lambda p, c: (p, _csr_mismatched_nnz(), None), ValueError,
                     rf"col_student_ids has {NNZ - 1} entries but row_teacher_ids has {NNZ}"),
    # Values, read on the host for CPU tensors.
    "column = V_t": (lambda p, c: (p, c, _shifted(_columns(), (1, 2, 3), V_T)), IndexError,
                     r"columns holds teacher id 29, out of range for a projection with 29 "
                     r"teacher columns \(valid ids are 0\.\.28\)"),
    "column = -1": (lambda p, c: (p, c, _shifted(_columns(), (0, 0, 0), -1)), IndexError,
                    r"columns holds teacher id -1, out of range"),
    # Once unchecked: the kernels read out of bounds (a segfault under Triton's
    # interpreter, see test_corrupt_csr_buffers_do_not_abort_the_process), the reference
    # raised torch's "index ... out of bounds" without naming a buffer.
    "decreasing col_indptr": (
        lambda p, c: (p, _csr(col_indptr=_shifted(c.col_indptr, 3, -5)), None), ValueError,
        rf"col_indptr: column CSR indptr must start at 0, never decrease and end at "
        rf"nnz = {NNZ} \(the length of col_student_ids\)"),
    "col_indptr past nnz": (
        lambda p, c: (p, _csr(col_indptr=_shifted(c.col_indptr, -1, NNZ + 7)), None),
        ValueError, r"col_indptr: column CSR indptr must start at 0, never decrease"),
    "col_student_ids out of range": (
        lambda p, c: (p, _csr(col_student_ids=_shifted(c.col_student_ids, 5, V_S)), None),
        IndexError, r"col_student_ids: column CSR ids holds id 37, out of range for p's last "
                    r"dim \(the student vocab\) 37"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(PROJECT_CASES))
def test_project_rejects_bad_arguments(case, mode):
    make, error, pattern = PROJECT_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _project, *make(_p(), PROJ.csr()))


MODULE = random_projection()
COMPILED_MODULE = torch.compile(MODULE, fullgraph=True, dynamic=False)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", ["p vocab", "float columns", "column = V_t"])
def test_sparse_projection_module_rejects_bad_arguments(case, mode):
    make, error, pattern = PROJECT_CASES[case]
    p, _, columns = make(_p(), PROJ.csr())
    compiled = mode == "compiled"
    with raises(error, pattern, compiled=compiled):
        (COMPILED_MODULE if compiled else MODULE)(p, columns)


# ---------------------------------------------------------------------------------------
# xtoken_project_backward, called directly (autograd passes the projection's own buffers)


def _grad(k=V_T):
    return torch.randn(2, 3, k, generator=torch.Generator().manual_seed(3))


def _backward_args(grad=None, columns=None, num_teacher=V_T, **replace):
    c = _csr(**replace)
    return (_grad() if grad is None else grad, c.row_indptr, c.row_teacher_ids, c.row_weights,
            num_teacher, columns)


BACKWARD_CASES = {
    # case: (make args, error, message)
    "int grad": (lambda: _backward_args(_grad().long()), RuntimeError,
                 r"grad must be a floating-point tensor, got torch\.int64"),
    "0-d grad": (lambda: _backward_args(torch.tensor(1.0)), ValueError,
                 r"grad must be \[\*, V_t\] or \[\*, K\]"),
    "num_teacher < 0": (lambda: _backward_args(num_teacher=-1), ValueError,
                        r"num_teacher must be >= 0"),
    "grad vocab": (lambda: _backward_args(num_teacher=V_T + 1), ValueError,
                   r"grad's last dim \(29\) must equal num_teacher \(30\)"),
    "columns K": (lambda: _backward_args(_grad(5), _columns()), ValueError,
                  r"columns \[\*, K\] and grad \[\*, K\] disagree on K: 4 vs 5"),
    "columns shape": (lambda: _backward_args(_grad(4), _columns()[0]), ValueError,
                      r"columns must be \[\*grad\.shape\[:-1\], K\]"),
    "bf16 row_weights": (lambda: _backward_args(row_weights=PROJ.row_weights.bfloat16()),
                         TypeError, r"row_weights: row CSR weights must be float32"),
    "row_indptr device": (lambda: _backward_args(row_indptr=PROJ.row_indptr.to("meta")),
                          RuntimeError, r"row_indptr is on meta but grad is on cpu"),
    "column = V_t": (lambda: _backward_args(_grad(4), _shifted(_columns(), (0, 1, 2), V_T)),
                     IndexError, r"columns holds teacher id 29, out of range"),
    # Once unchecked (a segfault on the Triton path, see below).
    "row_indptr past nnz": (
        lambda: _backward_args(row_indptr=_shifted(PROJ.row_indptr, -1, NNZ + 7)), ValueError,
        rf"row_indptr: row CSR indptr must start at 0, never decrease and end at nnz = {NNZ} "
        r"\(the length of row_teacher_ids\)"),
    "decreasing row_indptr": (
        lambda: _backward_args(row_indptr=_shifted(PROJ.row_indptr, 4, -(10**6))), ValueError,
        r"row_indptr: row CSR indptr must start at 0, never decrease"),
    "row_teacher_ids out of range": (
        lambda: _backward_args(row_teacher_ids=_shifted(PROJ.row_teacher_ids, 0, 10**6)),
        IndexError, r"row_teacher_ids: row CSR ids holds id 1000000, out of range for "
                    r"num_teacher 29 \(valid ids are 0\.\.28\)"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_project_backward_rejects_bad_arguments(case, mode):
    make, error, pattern = BACKWARD_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _project_backward, *make())


def test_corrupt_csr_buffers_do_not_abort_the_process():
    """Once each of these segfaulted the interpreter-run Triton kernels (an
    illegal memory access on a GPU), or read out of bounds silently: run them in a child
    process, which must exit normally with the named error for each."""
    script = textwrap.dedent("""
        import dataclasses, os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, compileops
        from compileops.xtoken import project
        from tests.xtoken._helpers import random_projection
        proj = random_projection()
        csr = proj.csr()
        def bump(t, i, v):
            t = t.clone(); t[i] = v; return t
        cases = {
            "col_indptr": dict(col_indptr=bump(csr.col_indptr, -1, 10**6)),
            "col_indptr_decreasing": dict(col_indptr=bump(csr.col_indptr, 3, -10**6)),
            "col_student_ids": dict(col_student_ids=csr.col_student_ids + 10**6),
            "row_indptr": dict(row_indptr=bump(csr.row_indptr, -1, 10**6)),
            "row_teacher_ids": dict(row_teacher_ids=csr.row_teacher_ids + 10**6),
        }
        with compileops.use_backend("triton"):
            for name, replace in cases.items():
                p = torch.rand(2, proj.num_student, requires_grad=True)
                try:
                    project(p, dataclasses.replace(csr, **replace)).sum().backward()
                    print(name, "no error")
                except (ValueError, IndexError) as e:
                    print(name, type(e).__name__, str(e).split(":")[0])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.split("\n")[:5] == [
        "col_indptr ValueError col_indptr",
        "col_indptr_decreasing ValueError col_indptr",
        "col_student_ids IndexError col_student_ids",
        "row_indptr ValueError row_indptr",
        "row_teacher_ids IndexError row_teacher_ids",
    ], proc.stdout


# ---------------------------------------------------------------------------------------
# chunk_sums / chunk_average / xtoken_chunk_sums_backward / valid_chunk_mask

B, T, VOCAB, C = 2, 9, 5, 4


def _log_probs():
    return torch.randn(B, T, VOCAB, generator=torch.Generator().manual_seed(4))


def _chunk_id():
    # Not contiguous runs, unsorted, with -1 and ids past C: documented as valid input.
    return torch.tensor([[0, 1, 0, 2, 1, -1, 3, 3, 0], [2, 2, -1, 0, 7, 1, 1, 3, -3]])


CHUNK_CASES = {
    # case: (make (log_probs, chunk_id, max_chunks), error, message)
    "2-D log_probs": (lambda lp, ids: (lp[0], ids, C), RuntimeError,
                      r"log_probs must be 3-D \[B, T, V\], got shape \(9, 5\)"),
    "int log_probs": (lambda lp, ids: (lp.long(), ids, C), RuntimeError,
                      r"log_probs must be a floating-point tensor, got torch\.int64"),
    "float chunk_id": (lambda lp, ids: (lp, ids.float(), C), RuntimeError,
                       r"chunk_id must be int32 or int64, got torch\.float32"),
    "3-D chunk_id": (lambda lp, ids: (lp, ids[..., None], C), RuntimeError,
                     r"chunk_id must be 2-D \[B, T\]"),
    "chunk_id shape": (lambda lp, ids: (lp, ids[:, :5], C), ValueError,
                       r"chunk_id must be \[B, T\] = \(2, 9\), got \(2, 5\)"),
    "max_chunks < 0": (lambda lp, ids: (lp, ids, -1), ValueError,
                       r"max_chunks must be >= 0, got -1"),
    "chunk_id device": (lambda lp, ids: (lp, ids.to("meta"), C), RuntimeError,
                        r"chunk_id is on meta but log_probs is on cpu"),
}


@pytest.mark.parametrize("fn", [_chunk_sums, _chunk_average], ids=["sums", "average"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunk_sums_rejects_bad_arguments(case, mode, fn):
    make, error, pattern = CHUNK_CASES[case]
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, fn, *make(_log_probs(), _chunk_id()))


@pytest.mark.parametrize("mode", MODES)
def test_chunk_ids_need_not_be_contiguous_runs(mode):
    """Scattered, unsorted ids (and ids outside [0, C), which count nowhere) are valid input:
    each chunk is the sum of its tokens, whatever their positions."""
    lp, ids = _log_probs(), _chunk_id()
    sums, sizes = _run(mode, _chunk_sums, lp, ids, C)
    for b in range(B):
        for c in range(C):
            members = (ids[b] == c).nonzero().reshape(-1).tolist()
            assert sizes[b, c] == len(members)
            torch.testing.assert_close(sums[b, c], lp[b, members].sum(0), rtol=1e-6, atol=1e-6)


CHUNK_BACKWARD_CASES = {
    # case: (make (grad_sums, chunk_id, dtype), error, message)
    "2-D grad_sums": (lambda g, ids: (g[0], ids, torch.float32), RuntimeError,
                      r"grad_sums must be 3-D \[B, C, V\]"),
    "int grad_sums": (lambda g, ids: (g.long(), ids, torch.float32), RuntimeError,
                      r"grad_sums must be a floating-point tensor"),
    "float chunk_id": (lambda g, ids: (g, ids.float(), torch.float32), RuntimeError,
                       r"chunk_id must be int32 or int64"),
    "B mismatch": (lambda g, ids: (g, ids[:1], torch.float32), ValueError,
                   r"chunk_id \[B, T\] and grad_sums \[B, C, V\] disagree on B: 1 vs 2"),
    "int dtype": (lambda g, ids: (g, ids, torch.int64), TypeError,
                  r"dtype must be a floating-point dtype, got torch\.int64"),
    "chunk_id device": (lambda g, ids: (g, ids.to("meta"), torch.float32), RuntimeError,
                        r"chunk_id is on meta but grad_sums is on cpu"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CHUNK_BACKWARD_CASES))
def test_chunk_sums_backward_rejects_bad_arguments(case, mode):
    make, error, pattern = CHUNK_BACKWARD_CASES[case]
    grad_sums = torch.randn(B, C, VOCAB, generator=torch.Generator().manual_seed(5))
    with raises(error, pattern, compiled=mode == "compiled"):
        _run(mode, _chunk_backward, *make(grad_sums, _chunk_id()))


MASK_CASES = {
    # Once unchecked: [B, 1] against [B, C] broadcast silently, and other
    # mismatches raised torch's broadcasting error without an argument name.
    "teacher_sizes shape": (lambda s, t, v: (s, t[:, :3], v), ValueError,
                            r"teacher_sizes must be \[B, C\] = \(2, 4\) like student_sizes, "
                            r"got \(2, 3\)"),
    "pair_valid broadcast": (lambda s, t, v: (s, t, v[:, :1]), ValueError,
                             r"pair_valid must be \[B, C\] = \(2, 4\) .*got \(2, 1\)"),
    "1-D student_sizes": (lambda s, t, v: (s[0], t, v), RuntimeError,
                          r"student_sizes must be 2-D \[B, C\], got shape \(4,\)"),
    "pair_valid device": (lambda s, t, v: (s, t, v.to("meta")), RuntimeError,
                          r"pair_valid is on meta but student_sizes is on cpu"),
}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_valid_chunk_mask_rejects_bad_arguments(case, mode):
    make, error, pattern = MASK_CASES[case]
    sizes = torch.tensor([[1.0, 0.0, 2.0, 3.0], [0.0, 1.0, 1.0, 0.0]])
    args = make(sizes, sizes.flip(0), torch.ones(B, C, dtype=torch.bool))
    compiled = mode == "compiled"
    with raises(error, pattern, compiled=compiled):
        (COMPILED[valid_chunk_mask] if compiled else valid_chunk_mask)(*args)


# ---------------------------------------------------------------------------------------
# Projection files (eager: files are read on the host, never compiled)


def _load_via(loader, path):
    clear_caches()
    try:
        if loader == "parse_projection_file":
            return parse_projection_file(path)
        if loader == "get_projection":
            return get_projection(path)
        return SparseProjection.from_file(path)
    finally:
        clear_caches()


IND = torch.tensor([[0, 1], [1, 2], [2, -1]])
LIK = torch.tensor([[0.5, 0.5], [0.3, 0.7], [1.0, 0.0]])
DENSE = r"dense top-k "
SPARSE_NEEDS = (r"sparse projection entries must be \(student_id, teacher_id\) -> count with int "
                r"ids and a number count; found ")
FILE_CASES = {
    # case: (what is written (bytes, or an object for torch.save), error, message after path)
    "empty file": (b"", ValueError, r" with torch\.load\(weights_only=True\)"),
    "not a pickle": (b"not a projection", ValueError, r" with torch\.load\(weights_only=True\)"),
    "unsafe pickle": ({"indices": IND, "likelihoods": datetime.date(2024, 1, 1)}, ValueError,
                      r" with torch\.load\(weights_only=True\)"),
    "empty dict": ({}, ValueError, r": unknown projection format: found a dict with keys \[\]"),
    "wrong keys": ({"indices": IND, "weights": LIK}, ValueError,
                   r": unknown projection format: found a dict with keys \['indices', 'weights'\]"),
    "only indices": ({"indices": IND}, ValueError, r": unknown projection format"),
    "a list": ([1, 2, 3], ValueError, r": unknown projection format: found an object of type list"),
    "a tensor": (IND, ValueError, r": unknown projection format: found an object of type Tensor"),
    "float indices": ({"indices": IND.float(), "likelihoods": LIK}, ValueError,
                      ": " + DENSE + r"'indices' must be an integer tensor .*got torch\.float32"),
    "bool indices": ({"indices": IND > 0, "likelihoods": LIK}, ValueError,
                     ": " + DENSE + r"'indices' must be an integer tensor \(not bool"),
    "bool likelihoods": ({"indices": IND, "likelihoods": LIK > 0}, ValueError,
                         ": " + DENSE + r"'likelihoods' must be real numbers, got torch\.bool"),
    "shape mismatch": ({"indices": IND, "likelihoods": LIK[:2]}, ValueError,
                       ": " + DENSE + r"'indices' \(3, 2\) and 'likelihoods' \(2, 2\) must "
                       r"have the same shape"),
    "1-D indices": ({"indices": IND[:, 0], "likelihoods": LIK[:, 0]}, ValueError,
                    ": " + DENSE + r"'indices' must be a 2-D \[V_s, k\] tensor, got shape \(3,\)"),
    "list indices": ({"indices": [[0, 1]], "likelihoods": LIK[:1]}, ValueError,
                     ": " + DENSE + r"'indices' must be a 2-D .*got list"),
    "teacher id -5": ({"indices": torch.tensor([[0, 1], [1, -5], [2, -1]]), "likelihoods": LIK},
                      ValueError, r": indices\[1, 1\] = -5: teacher id -5 is negative; only -1"),
    "teacher id 2**40": ({"indices": torch.tensor([[0, 1], [1, 2**40], [2, -1]]),
                          "likelihoods": LIK}, ValueError,
                         r": indices\[1, 1\] = 1099511627776: teacher id 1099511627776 is too "
                         r"large: vocabulary sizes are limited to 2147483647"),
    "string key": ({("a", 1): 1.0}, ValueError, ": " + SPARSE_NEEDS + r"\('a', 1\) -> 1\.0"),
    "float key": ({(0.5, 1): 1.0}, ValueError, ": " + SPARSE_NEEDS + r"\(0\.5, 1\)"),
    "bool key": ({(0, 1): 1.0, (True, 3): 1.0}, ValueError,
                 ": " + SPARSE_NEEDS + r"\(True, 3\) -> 1\.0"),
    "3-tuple key": ({(0, 1, 2): 1.0}, ValueError, ": " + SPARSE_NEEDS + r"\(0, 1, 2\)"),
    "string count": ({(0, 1): "x"}, ValueError, ": " + SPARSE_NEEDS + r"\(0, 1\) -> 'x'"),
    "bool count": ({(0, 1): True}, ValueError, ": " + SPARSE_NEEDS + r"\(0, 1\) -> True"),
    "tensor count": ({(0, 1): torch.tensor(1.0)}, ValueError,
                     ": " + SPARSE_NEEDS + r"\(0, 1\) -> tensor"),
    # Audit findings: a student id of 2**40 failed with an 8 TB allocation, 2**70 with
    # "Overflow when unpacking long long"; a teacher id of -5 and a student -1 were dropped.
    "student id 2**40": ({(0, 1): 1.0, (2**40, 3): 2.0}, ValueError,
                         r": entry \(1099511627776, 3\) -> 2\.0: student id 1099511627776 is "
                         r"too large"),
    "student id 2**70": ({(2**70, 3): 2.0}, ValueError,
                         r": entry \(1180591620717411303424, 3\) -> 2\.0: id "
                         r"1180591620717411303424 does not fit in int64"),
    "teacher id -5 (sparse)": ({(0, 1): 1.0, (4, -5): 1.0}, ValueError,
                               r": entry \(4, -5\) -> 1\.0: teacher id -5 is negative"),
    "student id -1": ({(-1, 3): 9.0}, ValueError,
                      r": entry \(-1, 3\) -> 9\.0: student id -1 is negative; only -1 is "
                      r"allowed, and only as a teacher id"),
}


@pytest.mark.parametrize("loader", ["parse_projection_file", "get_projection",
                                    "SparseProjection.from_file"])
@pytest.mark.parametrize("case", list(FILE_CASES))
def test_bad_projection_files_raise_naming_the_file(case, loader, tmp_path):
    content, error, pattern = FILE_CASES[case]
    path = tmp_path / "projection.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with raises(error, re.escape(str(path)) + pattern):
        _load_via(loader, path)


@pytest.mark.parametrize("loader", ["parse_projection_file", "get_projection",
                                    "SparseProjection.from_file"])
def test_missing_projection_file(loader, tmp_path):
    path = tmp_path / "missing.pt"
    with raises(FileNotFoundError, r"projection file not found: " + re.escape(str(path))):
        _load_via(loader, path)


@pytest.mark.parametrize("loader", ["parse_projection_file", "get_projection",
                                    "SparseProjection.from_file"])
def test_files_that_nemo_rl_accepts_load(loader, tmp_path):
    """The same rules as the NeMo-RL loaders: other keys beside 'indices' and 'likelihoods'
    are ignored, integer likelihoods are weights, a (-1, -1) entry is a sentinel."""
    for i, obj in enumerate([{"indices": IND, "likelihoods": LIK, "vocab": 3},
                             {"indices": IND, "likelihoods": (LIK * 10).long()},
                             {(0, 1): 2, (-1, -1): 5.0}]):
        path = tmp_path / f"ok{i}.pt"
        torch.save(obj, path)
        _load_via(loader, path)


def test_vocabulary_sizes_are_checked(tmp_path):
    path = tmp_path / "projection.pt"
    torch.save({"indices": IND, "likelihoods": LIK}, path)
    for bad in (-1, True, 2.0, 2**31):
        with raises(ValueError, r"num_teacher must be an int in \[0, 2147483647\], got "):
            get_projection(path, num_teacher=bad)


def test_vocabulary_sizes_are_keyword_only(tmp_path):
    path = tmp_path / "projection.pt"
    torch.save({"indices": IND, "likelihoods": LIK}, path)
    with raises(TypeError, r"get_projection\(\) takes from 1 to 2 positional arguments"):
        get_projection(path, "cpu", 5, 4)


@pytest.mark.parametrize("normalize_rows", [False, True])
def test_nan_and_inf_in_a_projection_file_propagate(normalize_rows, tmp_path):
    """Never silently zeroed: with ``normalize_rows`` a NaN made its whole row's total NaN,
    and the row was dropped as if it were all zeros; now the row is NaN."""
    path = tmp_path / "projection.pt"
    likelihoods = LIK.clone()
    likelihoods[0, 1] = float("nan")  # student 0 -> teacher 1
    likelihoods[1, 0] = float("inf")  # student 1 -> teacher 1
    torch.save({"indices": IND, "likelihoods": likelihoods}, path)
    clear_caches()
    dense = get_projection(path, normalize_rows=normalize_rows).to_dense()
    clear_caches()
    if normalize_rows:  # NaN total: the whole row NaN; inf total: inf/inf NaN, finite/inf 0
        want_nan = torch.tensor([[True, True, False], [False, True, False], [False] * 3])
        assert torch.equal(dense[1, 2], torch.tensor(0.0)) and torch.equal(dense[2, 2],
                                                                            torch.tensor(1.0))
    else:
        want_nan = torch.tensor([[False, True, False], [False] * 3, [False] * 3])
        assert dense[1, 1] == float("inf")
    assert torch.equal(dense.isnan(), want_nan)


# ---------------------------------------------------------------------------------------
# NaN and Inf propagate (IEEE) into exactly the outputs that read them


def _nonfinite(t, nan, posinf=None, neginf=None):
    t = t.clone()
    t[nan] = float("nan")
    if posinf is not None:
        t[posinf] = float("inf")
    if neginf is not None:
        t[neginf] = float("-inf")
    return t


def _expected_masks(x, reads):
    """Which outputs are NaN / +-inf when output j sums ``x[..., i] * w`` over the entries
    ``reads[i, j]`` (all weights positive): IEEE, computed from the sparsity alone."""
    reads = reads.double()
    r_nan = (x.isnan().double() @ reads) > 0
    r_pos = ((x == float("inf")).double() @ reads) > 0
    r_neg = ((x == float("-inf")).double() @ reads) > 0
    return r_nan | (r_pos & r_neg), (r_pos ^ r_neg) & ~r_nan


def _assert_propagated(got, want_nan, want_inf, want_finite):
    assert want_nan.any() and want_inf.any()
    assert torch.equal(got.isnan(), want_nan)
    assert torch.equal(got.isinf(), want_inf)
    finite = ~(want_nan | want_inf)
    torch.testing.assert_close(got[finite].double(), want_finite[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_columns", [False, True], ids=["full", "columns"])
@pytest.mark.parametrize("mode", MODES)
def test_projection_nan_and_inf_reach_exactly_the_columns_that_read_them(mode, with_columns):
    dense = PROJ.csr().to_dense()  # all weights > 0
    assert (dense >= 0).all()
    p = _nonfinite(_p(), nan=(0, 1, 4), posinf=(1, 2, 6), neginf=(1, 2, 11))
    p.requires_grad_(True)
    reads = dense != 0
    columns = None
    if with_columns:  # make sure the selected columns read the non-finite students
        columns = _columns()
        columns[0, 1, 0] = reads[4].nonzero()[0, 0]  # NaN student
        columns[1, 2, 0] = (reads[6] & ~reads[11]).nonzero()[0, 0]  # +inf student only
        nonempty = reads.any(0).nonzero().reshape(-1)
        columns[0, 0, 1], columns[1, 1, 2] = nonempty[0], nonempty[1]  # grads below
    out = _run(mode, _project, p, PROJ.csr(), columns)
    want_nan, want_inf = _expected_masks(p.detach(), reads)
    finite = p.detach().double().nan_to_num(0.0, 0.0, 0.0) @ dense.double()
    if with_columns:
        want_nan, want_inf, finite = (t.gather(-1, columns) for t in (want_nan, want_inf, finite))
    _assert_propagated(out, want_nan, want_inf, finite)

    # Backward: a NaN / inf in the upstream grad reaches exactly the students that feed it.
    grad = _nonfinite(torch.ones_like(out), nan=(0, 0, 1), posinf=(1, 1, 2))
    with _backward_backend(mode):
        (grad_p,) = torch.autograd.grad(out, p, grad)
    if columns is not None:  # position j of token n feeds teacher column columns[n, j]
        full = torch.zeros(*grad.shape[:-1], V_T, dtype=torch.float64)
        grad = full.scatter_add_(-1, columns, grad.double())
    want_nan, want_inf = _expected_masks(grad, reads.t())
    finite = grad.double().nan_to_num(0.0, 0.0, 0.0) @ dense.double().t()
    _assert_propagated(grad_p, want_nan, want_inf, finite)


@pytest.mark.parametrize("mode", MODES)
def test_chunk_nan_and_inf_reach_exactly_their_chunk(mode):
    lp, ids = _log_probs(), _chunk_id()
    lp = _nonfinite(lp, nan=(0, 1, 2), posinf=(0, 0, 3), neginf=(0, 2, 3))  # chunk 1; chunk 0
    lp[0, 5] = float("nan")  # id -1: documented to contribute nowhere
    lp[1, 4] = float("inf")  # id 7 >= C: likewise
    lp[1, 3, 0] = float("-inf")  # chunk 0 of row 1
    lp.requires_grad_(True)
    mean, sizes = _run(mode, _chunk_average, lp, ids, C)
    onehot = torch.stack([torch.nn.functional.one_hot(ids[b].clamp(min=0), 8)[:, :C]
                          * (ids[b] >= 0)[:, None] for b in range(B)])  # [B, T, C]
    want_nan, want_inf = _expected_masks(lp.detach().transpose(1, 2), onehot)
    want_nan, want_inf = want_nan.transpose(1, 2), want_inf.transpose(1, 2)
    finite = (onehot.transpose(1, 2).double() @ lp.detach().double().nan_to_num(0.0, 0.0, 0.0))
    finite = finite / sizes.clamp(min=1)[..., None].double()
    assert want_nan[0, 0, 3] and want_nan[0, 1, 2] and want_inf[1, 0, 0]
    _assert_propagated(mean, want_nan, want_inf, finite)

    grad = _nonfinite(torch.ones_like(mean), nan=(0, 2, 1), posinf=(1, 1, 4))
    with _backward_backend(mode):
        (grad_lp,) = torch.autograd.grad(mean, lp, grad)
    scaled = grad.double() / sizes.clamp(min=1)[..., None].double()  # [B, C, V]
    want_nan, want_inf = _expected_masks(scaled.transpose(1, 2), onehot.transpose(1, 2))
    want_nan, want_inf = want_nan.transpose(1, 2), want_inf.transpose(1, 2)
    finite = onehot.double() @ scaled.nan_to_num(0.0, 0.0, 0.0)
    _assert_propagated(grad_lp, want_nan, want_inf, finite)
