"""The xtoken ops under ``torch.compile``: fullgraph without recompiles on both backends, and
``torch.library.opcheck`` of every op (fake functions, autograd registration, schemas)."""
from __future__ import annotations

import pytest
import torch

import compileops
from compileops.xtoken import chunk_average
from compileops.xtoken.op import (
    chunk_sums_backward_op,
    chunk_sums_op,
    project_backward_op,
    project_op,
)

from tests.xtoken._helpers import BACKENDS, chunk_runs, random_projection


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_average_compiled_fullgraph_no_recompiles(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(lp, ids):
        mean, sizes = chunk_average(lp.log_softmax(-1), ids, 6)
        return mean * (sizes > 0)[..., None]

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    with compileops.use_backend(backend):
        for T in (5, 9, 16):
            lp = torch.randn(2, T, 7, requires_grad=True)
            ids = chunk_runs(2, T, 6, seed=T)
            got = compiled(lp, ids)
            (g_got,) = torch.autograd.grad(got.sum(), lp)
            want = fn(lp, ids)
            (g_want,) = torch.autograd.grad(want.sum(), lp)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_project_compiled_fullgraph_matches_eager_without_recompiles(backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    proj = random_projection()

    def fn(p, cols):
        return proj(p).logsumexp(-1) + proj(p, cols).sum(-1)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    with compileops.use_backend(backend):
        for n in (3, 5, 8):
            p = torch.rand(2, n, proj.num_student, requires_grad=True)
            cols = torch.randint(0, proj.num_teacher, (2, n, 4))
            got = compiled(p, cols)
            (g_got,) = torch.autograd.grad(got.sum(), p)
            want = fn(p, cols)
            (g_want,) = torch.autograd.grad(want.sum(), p)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


def test_chunk_sums_opcheck():
    lp = torch.randn(2, 9, 5, requires_grad=True)
    ids = chunk_runs(2, 9, 4).int()
    torch.library.opcheck(chunk_sums_op, (lp, ids, 4))
    torch.library.opcheck(chunk_sums_backward_op, (torch.randn(2, 4, 5), ids, torch.float32))


def _op_args(proj, p, cols):
    return (p, proj.col_indptr, proj.col_student_ids, proj.col_weights,
            proj.row_indptr, proj.row_teacher_ids, proj.row_weights, cols)


@pytest.mark.parametrize("with_columns", [False, True])
def test_project_opcheck(with_columns):
    proj = random_projection(num_student=11, num_teacher=9, k=2)
    p = torch.rand(2, 3, 11, requires_grad=True)
    cols = torch.randint(0, 9, (2, 3, 4)) if with_columns else None
    torch.library.opcheck(project_op, _op_args(proj, p, cols))
    grad = torch.randn(2, 3, 4 if with_columns else 9)
    torch.library.opcheck(
        project_backward_op,
        (grad, proj.row_indptr, proj.row_teacher_ids, proj.row_weights, 9, cols),
    )
