"""The xtoken ops' semantics on both backends: chunk sums/averages against the one-hot bmm
anchor, the projection against a dense fp64 ``p @ M``, the fp32 contract under autocast, error
messages, and the :class:`~compileops.xtoken.SparseProjection` module."""
from __future__ import annotations

import pytest
import torch

import compileops
from compileops.testing import (
    assert_batch_invariant,
    assert_close_to_reference,
    assert_deterministic,
)
from compileops.xtoken import (
    ProjectionCSR,
    SparseProjection,
    build_csr,
    chunk_average,
    chunk_sums,
    project,
    valid_chunk_mask,
)
from compileops.xtoken.op import chunk_sums_backward_op, project_backward_op
from compileops.xtoken.reference import chunk_average_one_hot_bmm

from tests.xtoken._helpers import BACKENDS, chunk_runs, random_coo, random_projection

# ---------------------------------------------------------------------------------------
# chunk_sums / chunk_average / valid_chunk_mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_means(backend):
    lp = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0], [5.0, 7.0], [8.0, 9.0]]])
    ids = torch.tensor([[0, 0, -1, 2, 2]])  # chunk 1 empty, chunk 3 empty, -1 ignored
    with compileops.use_backend(backend):
        mean, sizes = chunk_average(lp, ids, 4)
        sums, sizes2 = chunk_sums(lp, ids, 4)
    want = torch.tensor([[[2.0, 3.0], [0.0, 0.0], [6.5, 8.0], [0.0, 0.0]]])
    assert torch.equal(mean, want)
    assert torch.equal(sizes, torch.tensor([[2.0, 0.0, 2.0, 0.0]]))
    assert torch.equal(sums[0, 2], torch.tensor([13.0, 16.0]))
    assert torch.equal(sizes, sizes2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contiguous", [True, False], ids=["runs", "scattered"])
def test_matches_one_hot_bmm(backend, contiguous):
    B, T, C, V = 3, 40, 12, 33
    ids = chunk_runs(B, T, C)
    if not contiguous:
        ids = ids[:, torch.randperm(T, generator=torch.Generator().manual_seed(1))]
    ids[0, :3] = C + 2  # out of range: ignored like -1
    lp = torch.randn(B, T, V, dtype=torch.float64).float().requires_grad_()
    with compileops.use_backend(backend):
        mean, sizes = chunk_average(lp, ids, C)
    want_mean, want_sizes = chunk_average_one_hot_bmm(lp.detach().double(), ids, C)
    assert_close_to_reference(mean, want_mean, max_relative_error=1e-6)
    assert torch.equal(sizes, want_sizes.float())
    # Backward: grad / size gathered back to each token; -1 tokens get 0.
    g = torch.randn(B, C, V)
    with compileops.use_backend(backend):
        (grad,) = torch.autograd.grad(mean, lp, g)
    lp64 = lp.detach().double().requires_grad_()
    (want_grad,) = torch.autograd.grad(chunk_average_one_hot_bmm(lp64, ids, C)[0], lp64,
                                       g.double())
    assert_close_to_reference(grad, want_grad, max_relative_error=1e-6, what="grad")
    assert torch.equal(grad[ids < 0], torch.zeros_like(grad[ids < 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_log_probs(backend):
    lp = torch.randn(2, 16, 8).bfloat16().requires_grad_()
    ids = chunk_runs(2, 16, 5)
    with compileops.use_backend(backend):
        sums, sizes = chunk_sums(lp, ids, 5)
    assert sums.dtype == torch.float32 and sizes.dtype == torch.float32
    want, _ = chunk_average_one_hot_bmm(lp.detach().double(), ids, 5)
    assert_close_to_reference(sums / sizes.clamp(min=1)[..., None], want,
                              max_relative_error=1e-6)
    (grad,) = torch.autograd.grad(sums.sum(), lp)
    assert grad.dtype == torch.bfloat16
    assert torch.equal(grad.float(), (ids >= 0).float()[..., None].expand(-1, -1, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_batch_invariant_and_deterministic(backend):
    lp = torch.randn(4, 24, 10, requires_grad=True)
    ids = chunk_runs(4, 24, 7)
    with compileops.use_backend(backend):
        assert_batch_invariant(lambda x, i: chunk_sums(x, i, 7), [lp.detach(), ids])
        assert_batch_invariant(lambda g, i: chunk_sums_backward_op(g, i, torch.float32),
                               [torch.randn(4, 7, 10), ids])
        assert_deterministic(lambda x: chunk_average(x, ids, 7)[0], [lp], runs=3)


def test_edge_shapes_and_errors():
    sums, sizes = chunk_sums(torch.randn(2, 3, 4), torch.full((2, 3), -1), 0)
    assert sums.shape == (2, 0, 4) and sizes.shape == (2, 0)
    sums, sizes = chunk_sums(torch.randn(2, 0, 4), torch.zeros(2, 0, dtype=torch.long), 3)
    assert torch.equal(sums, torch.zeros(2, 3, 4)) and torch.equal(sizes, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"chunk_id must be \[B, T\]"):
        chunk_sums(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), 3)
    with pytest.raises(RuntimeError, match="chunk_id must be int32 or int64"):
        chunk_sums(torch.randn(2, 3, 4), torch.zeros(2, 3), 3)
    with pytest.raises(RuntimeError, match="log_probs must be 3-D"):
        chunk_sums(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_chunks must be >= 0"):
        chunk_sums(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), -1)


def test_inputs_not_modified():
    lp = torch.randn(2, 10, 6)
    ids = chunk_runs(2, 10, 4)
    lp0, ids0 = lp.clone(), ids.clone()
    chunk_average(lp, ids, 4)
    assert torch.equal(lp, lp0) and torch.equal(ids, ids0)


def test_valid_chunk_mask():
    student = torch.tensor([[2.0, 0.0, 1.0, 3.0]])
    teacher = torch.tensor([[1.0, 4.0, 0.0, 2.0]])
    pair = torch.tensor([[True, True, True, False]])
    assert torch.equal(valid_chunk_mask(student, teacher, pair),
                       torch.tensor([[True, False, False, False]]))


# ---------------------------------------------------------------------------------------
# project / SparseProjection


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
def test_project_batch_invariant_and_deterministic(backend):
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


def test_module_state_dict_and_csr_roundtrip():
    proj = random_projection()
    state = proj.state_dict()
    assert set(state) == {"col_indptr", "col_student_ids", "col_weights",
                          "row_indptr", "row_teacher_ids", "row_weights"}
    again = SparseProjection(ProjectionCSR(**{k: v.clone() for k, v in state.items()}))
    p = torch.rand(3, proj.num_student)
    assert torch.equal(again(p), proj(p))
    assert "nnz=" in repr(proj)
