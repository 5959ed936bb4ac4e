"""The Triton kernels (the ``triton`` backend) against the reference backend and with
non-contiguous inputs.

* Against the reference: bitwise for the chunk kernels (same fp32 token-order sums), to fp32
  rounding for the projection; out-of-range columns are masked as on CUDA.
* Strided inputs: a kernel that indexes a tensor as ``ptr + i`` silently reads the wrong
  elements of a strided view (``big[::2]``, a transposed matrix, ...). Each case runs an op
  once with dense inputs and once with the same values laid out non-contiguously, forward
  and backward, and requires bitwise-equal results (the same kernel adds in the same order
  either way). The views' gaps hold valid duplicates for index tensors (a stride-blind
  kernel reads wrong but in-bounds ids, so the test fails instead of crashing) and NaN for
  float tensors.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import compileops
from compileops.testing import assert_close_to_reference
from compileops.xtoken import ProjectionCSR, chunk_sums, project
from compileops.xtoken.op import chunk_sums_backward_op, chunk_sums_op, project_backward_op

from tests.xtoken._helpers import BACKENDS, chunk_runs, random_projection

# ---------------------------------------------------------------------------------------
# Against the reference backend


def test_chunk_kernels_equal_reference_bitwise_on_cpu():
    """Same fp32 token-order sums, so the interpreter and the reference agree exactly."""
    lp = torch.randn(2, 50, 70)
    ids = chunk_runs(2, 50, 9)
    out = {}
    for backend in BACKENDS:
        with compileops.use_backend(backend):
            out[backend] = chunk_sums(lp, ids, 9) + (
                chunk_sums_backward_op(torch.randn(2, 9, 70, generator=torch.Generator()
                                                   .manual_seed(0)), ids, torch.float32),)
    for a, b in zip(out["triton"], out["reference"]):
        assert torch.equal(a, b)


def test_projection_kernels_match_reference():
    proj = random_projection(num_student=70, num_teacher=130, k=4)
    p = torch.rand(3, 33, 70)
    cols = torch.randint(0, 130, (3, 33, 8))
    g_full = torch.randn(3, 33, 130)
    g_cols = torch.randn(3, 33, 8)
    out = {}
    for backend in BACKENDS:
        with compileops.use_backend(backend):
            out[backend] = (
                project(p, proj), project(p, proj, cols),
                project_backward_op(g_full, proj.row_indptr, proj.row_teacher_ids,
                                    proj.row_weights, 130, None),
                project_backward_op(g_cols, proj.row_indptr, proj.row_teacher_ids,
                                    proj.row_weights, 130, cols),
            )
    for a, b in zip(out["triton"], out["reference"]):
        assert_close_to_reference(a, b, max_relative_error=1e-6)


def _bad_columns(num_teacher):
    cols = torch.randint(0, num_teacher, (2, 3, 4), generator=torch.Generator().manual_seed(3))
    bad = torch.zeros_like(cols, dtype=torch.bool)
    for (i, j, k), v in {(0, 0, 1): -1, (0, 2, 3): num_teacher, (1, 1, 0): -(2**40),
                         (1, 2, 2): num_teacher + 1000, (1, 2, 3): 2**40}.items():
        cols[i, j, k] = v
        bad[i, j, k] = True
    return cols, bad


def test_kernels_mask_out_of_range_columns():
    """What CUDA does (no host check there): a bad column reads nothing out of bounds, gives
    0 in the forward and no gradient; the reference backend has the same semantics."""
    from compileops.xtoken import kernels, reference

    proj = random_projection()
    cols, bad = _bad_columns(proj.num_teacher)
    p = torch.rand(2, 3, proj.num_student)
    g = torch.randn(2, 3, 4)
    g[bad] = float("nan")  # must not leak into grad_p
    safe = torch.where(bad, torch.zeros_like(cols), cols)
    g_safe = torch.where(bad, torch.zeros_like(g), g)

    flat_p, flat_cols = p.reshape(6, -1), cols.reshape(6, 4)
    out = kernels.csr_gather_sum(flat_p, proj.col_indptr, proj.col_student_ids,
                                 proj.col_weights, flat_cols).reshape(2, 3, 4)
    ref = reference.project_forward(p, proj.col_indptr, proj.col_student_ids,
                                    proj.col_weights, cols)
    expected = torch.where(bad, torch.zeros_like(out), project(p, proj, safe))
    assert torch.equal(out, expected) and torch.equal(ref, expected)
    assert out[bad].eq(0).all() and out[~bad].ne(0).any()

    grad_p = kernels.csr_match_sum(g.reshape(6, 4), flat_cols, proj.row_indptr,
                                   proj.row_teacher_ids, proj.row_weights,
                                   proj.num_teacher).reshape(2, 3, -1)
    ref_grad = reference.project_backward(g, proj.row_indptr, proj.row_teacher_ids,
                                          proj.row_weights, proj.num_teacher, cols)
    expected_grad = project_backward_op(g_safe, proj.row_indptr, proj.row_teacher_ids,
                                        proj.row_weights, proj.num_teacher, safe)
    assert torch.isfinite(grad_p).all()
    torch.testing.assert_close(grad_p, expected_grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref_grad, expected_grad, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Non-contiguous inputs


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
