"""Every xtoken op on the triton backend, with non-contiguous views of each tensor input.

A kernel that indexes a tensor as ``ptr + i`` silently reads the wrong elements of a strided
view (``big[::2]``, a transposed matrix, ...). Each case runs an op once with dense inputs
and once with the same values laid out non-contiguously, forward and backward, and requires
bitwise-equal results (the same kernel adds in the same order either way).

The views' gaps hold valid duplicates for index tensors (a stride-blind kernel reads wrong
but in-bounds ids, so the test fails instead of crashing) and NaN for float tensors.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import compileops
from compileops.xtoken import ProjectionCSR, project
from compileops.xtoken.op import chunk_sums_backward_op, chunk_sums_op, project_backward_op

from tests.xtoken._helpers import random_projection

CSR_FIELDS = tuple(f.name for f in dataclasses.fields(ProjectionCSR))  # all 1-D
LAYOUTS_ND = ("gaps_last", "gaps_all", "colmajor")


def _gapped(t: torch.Tensor, dims) -> torch.Tensor:
    """A view equal to ``t`` with stride 2 (elementwise) along each of ``dims``."""
    big = t
    for d in dims:
        big = big.repeat_interleave(2, dim=d)  # index tensors: the gaps hold valid ids
    if t.is_floating_point():
        big = big.clone()
        for d in dims:
            odd = [slice(None)] * t.dim()
            odd[d] = slice(1, None, 2)
            big[tuple(odd)] = float("nan")
    view = [slice(None)] * t.dim()
    for d in dims:
        view[d] = slice(None, None, 2)
    return big[tuple(view)]


def noncontiguous(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in a non-contiguous layout: ``gaps_last`` (stride 2 in the last dim,
    so ``reshape(-1, t.shape[-1])`` stays a strided view), ``gaps_all`` (stride 2 in every
    dim) or ``colmajor`` (dims stored in reverse order, e.g. a transposed matrix)."""
    if t.dim() == 1 or layout == "gaps_last":
        out = _gapped(t, [t.dim() - 1])
    elif layout == "gaps_all":
        out = _gapped(t, range(t.dim()))
    elif layout == "colmajor":
        rev = tuple(reversed(range(t.dim())))
        out = t.permute(rev).contiguous().permute(rev)
    else:
        raise ValueError(layout)
    assert not out.is_contiguous() and torch.equal(out, t), layout
    return out


def _cases(names_nd, names_1d):
    cases = [(n, lay) for n in names_nd for lay in LAYOUTS_ND]
    cases += [(n, "gaps_last") for n in names_1d]
    cases += [("all", lay) for lay in LAYOUTS_ND]
    return cases


# ---------------------------------------------------------------------------------------
# project (forward + autograd) and project_backward_op (called directly)


def _project_inputs(subset: bool, lead: tuple):
    proj = random_projection(num_student=37, num_teacher=29, k=3)
    gen = torch.Generator().manual_seed(3)
    p = torch.rand(*lead, proj.num_student, generator=gen)
    cols = torch.randint(0, proj.num_teacher, (*lead, 5), generator=gen) if subset else None
    if subset:
        cols.view(-1, 5)[0, 1] = cols.view(-1, 5)[0, 0]  # a duplicate column
    g = torch.randn(*lead, 5 if subset else proj.num_teacher, generator=gen)
    return dict(p=p, columns=cols, grad=g,
                **{f: getattr(proj, f) for f in CSR_FIELDS})


def _run_project(x):
    csr = ProjectionCSR(*(x[f] for f in CSR_FIELDS))
    p = x["p"].detach().requires_grad_()
    with compileops.use_backend("triton"):
        out = project(p, csr, x["columns"])
        (grad_p,) = torch.autograd.grad(out, p, x["grad"])
        direct = project_backward_op(x["grad"], csr.row_indptr, csr.row_teacher_ids,
                                     csr.row_weights, csr.num_teacher, x["columns"])
    return {"out": out, "grad_p": grad_p, "project_backward_op": direct}


def _check_same(got, want):
    for key in want:
        a, b = got[key].detach(), want[key].detach()
        assert torch.equal(a, b), (
            f"{key} differs with non-contiguous inputs: {int((a != b).sum())} of {b.numel()} "
            f"elements, {int(a.isnan().sum())} NaN; first wrong {a[a != b][:3].tolist()} "
            f"vs right {b[a != b][:3].tolist()}")


# ``[B, T, V]`` inputs, and ``[N, V]`` ones (a transposed ``p`` stays strided after reshape).
_PROJECT_CASES = (
    [("full", "3d") + c for c in _cases(("p", "grad"), CSR_FIELDS)]
    + [("columns", "3d") + c for c in _cases(("p", "grad", "columns"), CSR_FIELDS)]
    + [("full", "2d") + c for c in _cases(("p", "grad"), ())]
    + [("columns", "2d") + c for c in _cases(("p", "grad", "columns"), ())]
)


@pytest.mark.parametrize("mode,lead,name,layout", _PROJECT_CASES,
                         ids=["-".join(c) for c in _PROJECT_CASES])
def test_project_noncontiguous_input(mode, lead, name, layout):
    x = _project_inputs(subset=mode == "columns", lead=(2, 3) if lead == "3d" else (6,))
    want = _run_project(x)
    assert all(t.is_contiguous() for t in x.values() if t is not None)
    strided = dict(x)
    for key, t in x.items():
        if t is not None and name in (key, "all"):
            strided[key] = noncontiguous(t, layout)
    _check_same(_run_project(strided), want)


# ---------------------------------------------------------------------------------------
# chunk_sums (forward + autograd) and chunk_sums_backward_op (called directly)


def _chunk_inputs():
    B, T, C, V = 2, 11, 4, 6
    gen = torch.Generator().manual_seed(5)
    ids = torch.sort(torch.randint(0, C, (B, T), generator=gen), dim=1).values
    ids[torch.rand(B, T, generator=gen) < 0.2] = -1
    ids[1] = ids[1].flip(0)  # not sorted: chunks need not be runs
    lp = torch.randn(B, T, V, generator=gen)
    g = torch.randn(B, C, V, generator=gen)
    return dict(log_probs=lp, chunk_id=ids, grad_sums=g), C


def _run_chunks(x, C):
    lp = x["log_probs"].detach().requires_grad_()
    with compileops.use_backend("triton"):
        sums, sizes = chunk_sums_op(lp, x["chunk_id"], C)
        (grad_lp,) = torch.autograd.grad(sums, lp, x["grad_sums"])
        direct = chunk_sums_backward_op(x["grad_sums"], x["chunk_id"], torch.float32)
    return {"sums": sums, "sizes": sizes, "grad_log_probs": grad_lp,
            "chunk_sums_backward_op": direct}


_CHUNK_CASES = _cases(("log_probs", "chunk_id", "grad_sums"), ())


@pytest.mark.parametrize("name,layout", _CHUNK_CASES, ids=["-".join(c) for c in _CHUNK_CASES])
def test_chunk_sums_noncontiguous_input(name, layout):
    x, C = _chunk_inputs()
    want = _run_chunks(x, C)
    strided = {k: noncontiguous(t, layout) if name in (k, "all") else t for k, t in x.items()}
    _check_same(_run_chunks(strided, C), want)
