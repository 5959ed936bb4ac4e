"""Real shapes on a GPU (skipped without CUDA): Qwen-sized vocabularies, T=2048."""
from __future__ import annotations

import pytest
import torch

from compileops.testing import assert_close_to_reference
from compileops.xtoken import ProjectionCOO, SparseProjection, chunk_average
from compileops.xtoken.reference import chunk_average_one_hot_bmm

pytestmark = pytest.mark.gpu


def _topk_projection(V_s, V_t, k, device):
    gen = torch.Generator().manual_seed(0)
    s = torch.arange(V_s).repeat_interleave(k)
    t = torch.randint(0, V_t, (V_s * k,), generator=gen)
    w = torch.rand(V_s * k, generator=gen)
    return SparseProjection.from_coo(ProjectionCOO(s, t, w, V_s, V_t), device)


def test_chunk_average_real_shape_vs_one_hot_bmm():
    B, T, C, V = 1, 2048, 2000, 151936
    lp = torch.randn(B, T, V, device="cuda").log_softmax(-1)
    ids = torch.sort(torch.randint(0, C, (B, T), device="cuda"), dim=1).values
    ids[:, ::7] = -1
    mean, sizes = chunk_average(lp, ids, C)
    want, want_sizes = chunk_average_one_hot_bmm(lp.double(), ids, C)
    assert_close_to_reference(mean, want, max_relative_error=1e-6)
    assert torch.equal(sizes, want_sizes.float())
    again, _ = chunk_average(lp, ids, C)
    assert torch.equal(mean, again)


def test_projection_real_shape_vs_dense_column_slices():
    V, T, k = 151936, 2048, 8
    proj = _topk_projection(V, V, k, "cuda")
    p = torch.rand(T, V, device="cuda").softmax(-1).requires_grad_()
    out = proj(p)
    assert out.dtype == torch.float32 and out.shape == (T, V)
    # Check 512 teacher columns against dense fp64 slices of M.
    cols = torch.randperm(V, device="cuda")[:512]
    M_cols = torch.zeros(V, 512, dtype=torch.float64, device="cuda")
    M_dense_rows = proj.csr()
    for i, c in enumerate(cols.tolist()):
        lo, hi = int(M_dense_rows.col_indptr[c]), int(M_dense_rows.col_indptr[c + 1])
        M_cols[M_dense_rows.col_student_ids[lo:hi], i] = M_dense_rows.col_weights[lo:hi].double()
    assert_close_to_reference(out[:, cols], p.detach().double() @ M_cols, max_relative_error=1e-5)
    # Top-k subset equals the corresponding full columns bitwise-close.
    topk = torch.randint(0, V, (T, 8), device="cuda")
    sub = proj(p, topk)
    torch.testing.assert_close(sub, out.gather(1, topk), rtol=1e-6, atol=1e-9)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_ac = proj(p.bfloat16())
    assert out_ac.dtype == torch.float32
    g = torch.randn_like(out)
    (gp,) = torch.autograd.grad(out, p, g)
    (gp2,) = torch.autograd.grad(proj(p), p, g)
    assert torch.equal(gp, gp2)


def test_nemo_fp32_sparse_mm_cuda_matrix_per_call_conversion(tmp_path):
    """NeMo-RL's call pattern: the loader's CUDA sparse matrix into Fp32SparseMM on every
    step. The conversion runs on the device without a host sync and gives the bitwise result
    of the SparseProjection built from the same file; an in-place change counts at once."""
    from compileops.xtoken import nemo

    V, T, k = 151936, 512, 8
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(0, V, (V, k), generator=gen)
    indices[:, -1] = -1
    path = tmp_path / "projection.pt"
    torch.save({"indices": indices, "likelihoods": torch.rand(V, k, generator=gen)}, path)
    M = nemo.get_sparse_projection_matrix(path, "cuda", student_vocab_size=V,
                                          teacher_vocab_size=V)
    module = SparseProjection.from_file(path, "cuda", num_student=V, num_teacher=V)
    dense = torch.rand(V, T, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = nemo.Fp32SparseMM.apply(M, dense)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, nemo.Fp32SparseMM.apply(module, dense))
    M._values().data.mul_(2.0)
    assert torch.equal(nemo.Fp32SparseMM.apply(M, dense), 2.0 * out)
    again = nemo.get_sparse_projection_matrix(path, "cuda", student_vocab_size=V,
                                              teacher_vocab_size=V)
    assert torch.equal(nemo.Fp32SparseMM.apply(again, dense), out)  # the cache kept its own


def test_nemo_fp32_sparse_mm_cuda_entries_outside_the_shape_are_not_read():
    """A CUDA sparse tensor built without its invariants checked: the ids are not read on the
    host, and the entries outside the shape are left out of every CSR segment."""
    from compileops.xtoken import nemo

    idx = torch.tensor([[0, 1, 1, 70000, -3], [2, 0, 1, 1, 2]], device="cuda")
    vals = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0], device="cuda")
    M = torch.sparse_coo_tensor(idx, vals, (2, 3), check_invariants=False)
    dense = torch.randn(2, 4, device="cuda")
    out = nemo.Fp32SparseMM.apply(M, dense)
    want = torch.tensor([[0.0, 0.0, 1.0], [2.0, 3.0, 0.0]], device="cuda").t() @ dense
    torch.testing.assert_close(out, want)
    torch.cuda.synchronize()
