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
