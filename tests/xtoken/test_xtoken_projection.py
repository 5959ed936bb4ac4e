"""compileops.xtoken.project / SparseProjection: math, fp32 contract, compile, invariance."""
from __future__ import annotations

import pytest
import torch

import compileops
from compileops.testing import (
    assert_batch_invariant,
    assert_close_to_reference,
    assert_deterministic,
)
from compileops.xtoken import ProjectionCSR, SparseProjection, build_csr, project
from compileops.xtoken.op import project_backward_op, project_op

from tests.xtoken._helpers import BACKENDS, random_coo, random_projection


def _dense(proj: SparseProjection) -> torch.Tensor:
    return proj.csr().to_dense().double()


def test_csr_layouts_hold_the_same_matrix():
    coo = random_coo()
    csr = build_csr(coo)
    dense = torch.zeros(coo.num_student, coo.num_teacher, dtype=torch.float64)
    keep = coo.teacher_ids >= 0
    dense.index_put_((coo.student_ids[keep], coo.teacher_ids[keep]),
                     coo.weights[keep].double(), accumulate=True)
    torch.testing.assert_close(csr.to_dense().double(), dense, rtol=1e-6, atol=0)
    cols = torch.zeros_like(dense)
    col_of = torch.repeat_interleave(torch.arange(csr.num_teacher), csr.col_indptr.diff())
    cols[csr.col_student_ids, col_of] = csr.col_weights.double()
    torch.testing.assert_close(cols, dense, rtol=1e-6, atol=0)
    assert csr.row_indptr[6] == csr.row_indptr[5]  # student 5 empty


@pytest.mark.parametrize("backend", BACKENDS)
def test_project_matches_dense_fp64(backend):
    proj = random_projection()
    M = _dense(proj)
    p = torch.rand(2, 5, proj.num_student, dtype=torch.float32, requires_grad=True)
    g = torch.randn(2, 5, proj.num_teacher)
    with compileops.use_backend(backend):
        out = project(p, proj)
        (grad_p,) = torch.autograd.grad(out, p, g)
    assert out.dtype == torch.float32 and out.shape == (2, 5, proj.num_teacher)
    assert_close_to_reference(out, p.double() @ M, max_relative_error=1e-6)
    assert_close_to_reference(grad_p, g.double() @ M.T, max_relative_error=1e-6,
                              what="grad_p")


@pytest.mark.parametrize("backend", BACKENDS)
def test_project_column_subset(backend):
    """Teacher top-k columns per token, duplicates included, without densifying M."""
    proj = random_projection()
    M = _dense(proj)
    gen = torch.Generator().manual_seed(1)
    p = torch.rand(3, 4, proj.num_student, requires_grad=True)
    cols = torch.randint(0, proj.num_teacher, (3, 4, 5), generator=gen)
    cols[0, 0, 1] = cols[0, 0, 0]
    cols[1, 2, :3] = cols[1, 2, 4]  # three duplicates
    g = torch.randn(3, 4, 5, generator=gen)
    with compileops.use_backend(backend):
        out = proj(p, cols)
        (grad_p,) = torch.autograd.grad(out, p, g)
    full = p.double() @ M
    assert_close_to_reference(out, full.gather(-1, cols), max_relative_error=1e-6)
    dense_g = torch.zeros(3, 4, proj.num_teacher, dtype=torch.float64).scatter_add_(
        -1, cols, g.double())
    assert_close_to_reference(grad_p, dense_g @ M.T, max_relative_error=1e-6, what="grad_p")


def test_triton_matches_reference():
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


def test_bf16_input_fp32_output_and_grad_in_input_dtype():
    proj = random_projection()
    p = torch.rand(4, proj.num_student).bfloat16().requires_grad_()
    out = proj(p)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, proj(p.detach().float()), rtol=0, atol=0)
    out.sum().backward()
    assert p.grad.dtype == torch.bfloat16


def _autocast_step(proj, x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = x @ w  # bf16 under autocast
        assert p.dtype == torch.bfloat16
        out = proj(p)
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_under_bf16_autocast(compiled):
    proj = random_projection()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, proj.num_student, generator=gen, requires_grad=True)
    step = torch.compile(_autocast_step, fullgraph=True) if compiled else _autocast_step
    out = step(proj, x, w)
    assert out.dtype == torch.float32
    # The op saw the bf16 activations cast to fp32: same bits as projecting them ourselves.
    p_bf16 = (x.detach().bfloat16() @ w.detach().bfloat16())
    torch.testing.assert_close(out.detach(), proj(p_bf16.float()), rtol=0, atol=0)
    g = torch.randn(out.shape, generator=gen)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32
    # The projection backward itself ran in fp32 (grad @ M^T), then went through the bf16 mm.
    grad_p = project_backward_op(g, proj.row_indptr, proj.row_teacher_ids, proj.row_weights,
                                 proj.num_teacher, None)
    assert grad_p.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grad_p_ac = project_backward_op(g.bfloat16(), proj.row_indptr, proj.row_teacher_ids,
                                        proj.row_weights, proj.num_teacher, None)
    assert grad_p_ac.dtype == torch.float32


def test_autocast_rule_hands_the_kernels_fp32(monkeypatch):
    """Both ops carry an fp32 autocast rule: the implementation receives fp32 inputs."""
    from compileops.xtoken import reference

    seen = []
    for name in ("project_forward", "project_backward"):
        real = getattr(reference, name)

        def spy(x, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, x.dtype))
            return _real(x, *args, **kwargs)

        monkeypatch.setattr(reference, name, spy)
    proj = random_projection()
    p = torch.rand(3, proj.num_student).bfloat16()
    g = torch.randn(3, proj.num_teacher).bfloat16()
    with compileops.use_backend("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = proj(p)
        grad_p = project_backward_op(g, proj.row_indptr, proj.row_teacher_ids,
                                     proj.row_weights, proj.num_teacher, None)
    assert seen == [("project_forward", torch.float32), ("project_backward", torch.float32)]
    assert out.dtype == grad_p.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_fullgraph_matches_eager_without_recompiles(backend):
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant_and_deterministic(backend):
    proj = random_projection()
    p = torch.rand(4, 3, proj.num_student, requires_grad=True)
    cols = torch.randint(0, proj.num_teacher, (4, 3, 4))
    with compileops.use_backend(backend):
        assert_batch_invariant(lambda p: proj(p), [p.detach()])
        assert_batch_invariant(lambda p, c: proj(p, c), [p.detach(), cols])
        assert_batch_invariant(
            lambda g: project_backward_op(g, proj.row_indptr, proj.row_teacher_ids,
                                          proj.row_weights, proj.num_teacher, None),
            [torch.randn(4, 3, proj.num_teacher)])
        assert_batch_invariant(
            lambda g, c: project_backward_op(g, proj.row_indptr, proj.row_teacher_ids,
                                             proj.row_weights, proj.num_teacher, c),
            [torch.randn(4, 3, 4), cols])
        assert_deterministic(lambda p: proj(p), [p], runs=3)
        assert_deterministic(lambda p: proj(p, cols), [p], runs=3)


def _op_args(proj, p, cols):
    return (p, proj.col_indptr, proj.col_student_ids, proj.col_weights,
            proj.row_indptr, proj.row_teacher_ids, proj.row_weights, cols)


@pytest.mark.parametrize("with_columns", [False, True])
def test_opcheck(with_columns):
    proj = random_projection(num_student=11, num_teacher=9, k=2)
    p = torch.rand(2, 3, 11, requires_grad=True)
    cols = torch.randint(0, 9, (2, 3, 4)) if with_columns else None
    torch.library.opcheck(project_op, _op_args(proj, p, cols))
    grad = torch.randn(2, 3, 4 if with_columns else 9)
    torch.library.opcheck(
        project_backward_op,
        (grad, proj.row_indptr, proj.row_teacher_ids, proj.row_weights, 9, cols),
    )


def test_no_gradient_to_projection_and_inputs_unchanged():
    proj = random_projection()
    before = [b.clone() for b in proj.buffers()]
    p = torch.rand(2, proj.num_student, requires_grad=True)
    p_copy = p.detach().clone()
    proj(p).sum().backward()
    assert all(not b.requires_grad for b in proj.buffers())
    assert all(torch.equal(a, b) for a, b in zip(before, proj.buffers()))
    assert torch.equal(p.detach(), p_copy)


def test_bad_inputs_raise_clear_errors():
    proj = random_projection()
    with pytest.raises(ValueError, match="student vocab"):
        proj(torch.rand(2, proj.num_student + 1))
    with pytest.raises(ValueError, match="columns must be"):
        proj(torch.rand(2, proj.num_student), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="columns must be int32 or int64"):
        proj(torch.rand(2, proj.num_student), torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="p must be a floating-point"):
        proj(torch.zeros(2, proj.num_student, dtype=torch.long))
    compiled = torch.compile(lambda p: proj(p), fullgraph=True)
    with pytest.raises(Exception, match="student vocab"):
        compiled(torch.rand(2, proj.num_student + 1))


def _bad_columns(num_teacher):
    cols = torch.randint(0, num_teacher, (2, 3, 4), generator=torch.Generator().manual_seed(3))
    bad = torch.zeros_like(cols, dtype=torch.bool)
    for (i, j, k), v in {(0, 0, 1): -1, (0, 2, 3): num_teacher, (1, 1, 0): -(2**40),
                         (1, 2, 2): num_teacher + 1000, (1, 2, 3): 2**40}.items():
        cols[i, j, k] = v
        bad[i, j, k] = True
    return cols, bad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["negative", "too-large"])
def test_out_of_range_columns_raise_index_error_on_cpu(backend, bad):
    proj = random_projection()
    p = torch.rand(2, 3, proj.num_student)
    cols = torch.zeros(2, 3, 4, dtype=torch.long)
    value = -1 if bad == "negative" else proj.num_teacher
    cols[1, 2, 3] = value
    cols_copy = cols.clone()
    with compileops.use_backend(backend):
        with pytest.raises(IndexError, match=f"teacher id {value}.*{proj.num_teacher} teacher"):
            proj(p, cols)
        with pytest.raises(IndexError, match=f"teacher id {value}"):
            project_backward_op(torch.randn(2, 3, 4), proj.row_indptr, proj.row_teacher_ids,
                                proj.row_weights, proj.num_teacher, cols)
    assert torch.equal(cols, cols_copy)


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


def test_module_state_dict_and_csr_roundtrip():
    proj = random_projection()
    state = proj.state_dict()
    assert set(state) == {"col_indptr", "col_student_ids", "col_weights",
                          "row_indptr", "row_teacher_ids", "row_weights"}
    again = SparseProjection(ProjectionCSR(**{k: v.clone() for k, v in state.items()}))
    p = torch.rand(3, proj.num_student)
    assert torch.equal(again(p), proj(p))
    assert "nnz=" in repr(proj)
