"""GPU reliability: tensors past 2**31 elements, and CUDA-graph capture and replay
under ``torch.compile(mode="reduce-overhead")`` for every op.

Large tensors. Each family has one ``check_*_large`` helper that takes its sizes and the
element boundary ``limit``: the GPU test runs it with ``limit = 2**31`` on tensors just past
that many elements (64-bit offsets, bf16), and a CPU twin runs the same helper with a small
``limit`` under Triton's interpreter and on the reference backend, so the slicing and the
oracles are exercised on every CI run. The oracles are cheap and computed on slices only: the
rows just below and past the boundary element, the group or chunk edges, the first and last
rows. Where the op promises bits (the embedding and the chunk sums: fp32 sums in token order)
the oracle is the same sequential fp32 sum and the check is ``torch.equal``; elsewhere it is an
fp64 (grouped linear) or fp32 (projection) product, with the op's stated tolerance.

CUDA graphs. Each op (forward and backward) is compiled with ``mode="reduce-overhead",
fullgraph=True`` and run three times, each time with new data copied into the same input
tensors (new ids, new group sizes, new chunk ids: every value is read on the device), so runs
2 and 3 are graph replays: the first warms up, the second records and replays, the third
replays. Every run's outputs and gradients must be bitwise eager's on the same inputs (the
SwiGLU gradients: bitwise the same function compiled without CUDA graphs, and within the op's
bf16 tolerance of eager; see :data:`GRAPH_CASES`). That the graphs ran is asserted by counting
``torch.cuda.CUDAGraph.replay`` calls (the public class the cudagraph trees replay through, in
torch 2.11 and 2.13 alike): the last run must replay at least two graphs, forward and
backward; and by Inductor's ``counters["inductor"]["cudagraph_skips"]`` staying 0.

Run on an H100 (torch 2.11, triton 3.6): the whole file in about 60 s, peak GPU memory per
large test 8.7-17.1 GiB. A real int32 offset in any of the kernels these tests cover (tried
by hand: the embedding gather and backward store, the grouped-linear row offsets, the chunk
backward and the projection's rows) makes its large test fail, as a wrong row or, more often,
an illegal memory access (which leaves the CUDA context unusable for the tests after it in the
same process).
"""
from __future__ import annotations

import bisect
import gc

import pytest
import torch

import compileops
from compileops import backends, use_backend
from compileops.grouped_linear.routing import dirichlet_offsets
from compileops.testing import assert_close_to_reference
from compileops.xtoken import ProjectionCOO, SparseProjection, chunk_sums, project
from compileops.xtoken import reference as xtoken_reference

LIMIT = 2**31  # elements: past this, 32-bit offsets overflow
GiB = 2**30
PEAK_LIMIT = 60 * GiB  # the most a large-tensor test may hold on the GPU
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # grouped linear vs fp64 (the op's contract)

# The CPU twins: the reference backend in bf16 (the GPU tests' dtype), and the Triton kernels
# under the interpreter in fp32 (the interpreter truncates fp32 -> bf16 casts instead of
# rounding them, which would break the bitwise oracles of the embedding and chunk backwards).
CPU_TWINS = [
    pytest.param("reference", torch.bfloat16, id="reference-bf16"),
    pytest.param("triton", torch.float32, id="interpreter-fp32"),
]
TWIN_LIMIT = 2**12


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """Give the GPU memory of one test back before the next (the large tests hold 10-20 GiB)."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _cpu_backend(backend: str) -> use_backend:
    if backend == "triton" and not backends.triton_interpret_enabled():
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set by the "
                    "conftest on machines without CUDA)")
    return use_backend(backend)


def _gpu_room(need_gib: float) -> None:
    """Skip unless ``need_gib`` GiB are free on the GPU; start counting the peak."""
    free, _ = torch.cuda.mem_get_info()
    if free < need_gib * GiB:
        pytest.skip(f"needs {need_gib} GiB of free GPU memory, {free / GiB:.1f} GiB free")
    torch.cuda.reset_peak_memory_stats()


def _assert_peak_below_limit() -> None:
    peak = torch.cuda.max_memory_allocated()
    print(f"peak GPU memory {peak / GiB:.1f} GiB")
    assert peak < PEAK_LIMIT, f"peak GPU memory {peak / GiB:.1f} GiB >= {PEAK_LIMIT / GiB} GiB"


def boundary_rows(limit: int, row_len: int, n_rows: int, around: int = 3) -> list[int]:
    """Rows of a row-major ``[n_rows, row_len]`` tensor to check: the row holding element
    ``limit`` and ``around`` rows either side, plus the first two and the last two rows."""
    rb = limit // row_len
    assert 0 < rb - around and rb + around < n_rows - 1, "no rows past the boundary"
    rows = {0, 1, n_rows - 2, n_rows - 1, *range(rb - around, rb + around + 1)}
    return sorted(rows)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {tuple(got.shape)}/{got.dtype}, expected {tuple(want.shape)}/{want.dtype}")
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
        raise AssertionError(f"{what} differs bitwise: {int((diff != 0).sum())} of "
                             f"{diff.numel()} elements, max |diff| {float(diff.max()):.3e}")


def _sequential_sum(rows: torch.Tensor) -> torch.Tensor:
    """fp32 sum of ``rows [n, D]`` added one by one in order, from +0.0 (the ops' order)."""
    acc = torch.zeros(rows.shape[-1], dtype=torch.float32, device=rows.device)
    for row in rows:
        acc += row.float()
    return acc


# =========================================================================================
# Large tensors: the checks, parametrised by size and boundary


def check_embedding_large(V: int, D: int, n_tokens: int, limit: int, device,
                          dtype=torch.bfloat16) -> None:
    """Table ``[V, D]``, output and grad ``[n_tokens, D]`` and grad_weight ``[V, D]``, all past
    ``limit`` elements. Forward: the gathered rows near both boundaries are bitwise the table's.
    Backward: each checked row of grad_weight is bitwise the fp32 sum, in token order, of its
    tokens' grad rows (hot ids spread over the whole token range take the long-run path and
    read grad rows on both sides of the boundary), and untouched rows are zero."""
    assert V * D > limit and n_tokens * D > limit
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(V, D, device=device, dtype=dtype, generator=gen).requires_grad_()
    vb = limit // D  # the table row holding element `limit`; also the output/grad row
    hot = [vb - 1, vb, vb + 1, V - 1]
    untouched = [vb + 2, V - 2]
    assert vb >= 4 and V - 2 > vb + 2
    ids = torch.randint(0, V, (n_tokens,), device=device, generator=gen)
    ids = torch.where(torch.isin(ids, torch.tensor(untouched, device=device)), ids - 3, ids)
    stride = max(len(hot) + 1, n_tokens // 64)
    for j, row in enumerate(hot):  # ~64 tokens per hot id, spread over all token positions
        ids[j::stride] = row
    ids[vb] = V - 1  # the token at the output boundary reads the table's last row
    ids[vb + 1] = vb
    ids[-len(hot):] = torch.tensor(hot, device=device)

    out = compileops.embedding(ids, weight)
    assert out.shape == (n_tokens, D) and out.dtype == dtype
    toks = sorted(set(boundary_rows(limit, D, n_tokens)) | {2, 3, stride, stride + 1})
    toks_t = torch.tensor(toks, device=device)
    _assert_bitwise(out[toks_t], weight.detach()[ids[toks_t]], "embedding rows")

    grad = torch.randn(n_tokens, D, device=device, dtype=dtype, generator=gen)
    (grad_weight,) = torch.autograd.grad(out, weight, grad)
    del out
    assert grad_weight.shape == (V, D) and grad_weight.dtype == dtype
    for v in sorted(set(boundary_rows(limit, D, V)) | set(hot) | set(untouched)):
        tokens = (ids == v).nonzero().flatten()
        if v in untouched:
            assert tokens.numel() == 0
        if v in hot:
            assert tokens.numel() > 16 and int(tokens[-1]) * D > limit  # long runs, both sides
        want = _sequential_sum(grad[tokens]).to(dtype)
        _assert_bitwise(grad_weight[v], want, f"grad_weight row {v} ({tokens.numel()} tokens)")


def check_grouped_linear_large(M: int, K: int, N: int, limit: int, device, span: int,
                               dtype=torch.bfloat16) -> None:
    """x ``[M, K]`` and dX past ``limit`` elements, 4 groups: one ends ``span`` rows before
    the boundary row, the next straddles it, two more follow, and 7 tail rows belong to none.
    Forward and dX on the rows near the boundary, the group edges and the last rows against
    fp64 (tail rows exactly zero); dW and db of every group against fp64, summed in chunks."""
    assert M * K > limit
    mb = limit // K  # the row holding element `limit`
    ends = [mb - span, mb + span, (mb + span + M - 7) // 2, M - 7]
    assert 0 < ends[0] and ends[1] < ends[2] < ends[3]
    groups = len(ends)
    offsets = torch.tensor(ends, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(M, K, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (torch.randn(groups, N, K, device=device, generator=gen) / K**0.5).to(dtype)
    w.requires_grad_()
    b = torch.randn(groups, N, device=device, dtype=dtype, generator=gen).requires_grad_()
    y = compileops.grouped_linear(x, w, offsets, b)
    assert y.shape == (M, N)

    rows = set(boundary_rows(limit, K, M)) | {e + d for e in ends for d in (-1, 0) if e + d < M}
    rows |= set(range(M - 9, M))
    rows = sorted(rows)
    gids = [bisect.bisect_right(ends, r) for r in rows]  # == groups: a tail row
    in_group = [r for r, g in zip(rows, gids) if g < groups]
    tail = [r for r, g in zip(rows, gids) if g == groups]
    rows_t = torch.tensor(in_group, device=device)
    gid_t = torch.tensor([g for g in gids if g < groups], device=device)
    w64 = w.detach().double()[gid_t]  # [R, N, K]
    tol = TOL[dtype]

    want = torch.einsum("rk,rnk->rn", x.detach()[rows_t].double(), w64)
    want += b.detach().double()[gid_t]
    assert_close_to_reference(y[rows_t], want, max_relative_error=tol, what="y near the boundary")
    tail_t = torch.tensor(tail, device=device)
    assert torch.equal(y[tail_t], torch.zeros_like(y[tail_t])), "tail rows of y"

    grad = torch.randn(M, N, device=device, dtype=dtype, generator=gen)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), grad)
    del y
    assert dx.shape == (M, K)
    want = torch.einsum("rn,rnk->rk", grad[rows_t].double(), w64)
    assert_close_to_reference(dx[rows_t], want, max_relative_error=tol, what="dX near the boundary")
    assert torch.equal(dx[tail_t], torch.zeros_like(dx[tail_t])), "tail rows of dX"
    del dx, w64
    chunk = 16384
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        want_w = torch.zeros(N, K, dtype=torch.float64, device=device)
        want_b = torch.zeros(N, dtype=torch.float64, device=device)
        for c in range(start, end, chunk):
            gc_ = grad[c:min(c + chunk, end)].double()
            want_w += gc_.t() @ x.detach()[c:min(c + chunk, end)].double()
            want_b += gc_.sum(0)
        assert_close_to_reference(dw[g], want_w, max_relative_error=tol, what=f"dW[{g}]")
        assert_close_to_reference(db[g], want_b, max_relative_error=tol, what=f"db[{g}]")


def _chunk_ids(B: int, T: int, C: int, limit: int, V: int, device, gen) -> torch.Tensor:
    """Sorted chunk ids (runs of ~T / C tokens) with ~10% -1 gaps; a gap right after the token
    holding element ``limit`` of ``[B, T, V]``, the first batch's last token a gap, the last
    batch's last token in chunk C - 1."""
    ids = torch.sort(torch.randint(0, C, (B, T), device=device, generator=gen), dim=1).values
    ids.masked_fill_(torch.rand(B, T, device=device, generator=gen) < 0.1, -1)
    b, t = divmod(limit // V, T)
    ids[b, t + 1] = -1
    ids[0, -1] = -1
    ids[-1, -1] = C - 1
    return ids


def check_chunk_sums_large(B: int, T: int, V: int, C: int, limit: int, device,
                           dtype=torch.bfloat16) -> None:
    """log_probs ``[B, T, V]`` and its gradient past ``limit`` elements. The chunks of the
    tokens near the boundary element and of the first and last tokens: sums bitwise the fp32
    sequential sum of their rows in token order, sizes exact; empty chunks zero. Backward:
    each checked token's row bitwise its chunk's grad row (zero for a -1 token)."""
    assert B * T * V > limit
    gen = torch.Generator(device=device).manual_seed(2)
    lp = torch.randn(B, T, V, device=device, dtype=dtype, generator=gen).requires_grad_()
    ids = _chunk_ids(B, T, C, limit, V, device, gen)
    sums, sizes = chunk_sums(lp, ids, C)
    assert sums.shape == (B, C, V) and sums.dtype == torch.float32

    valid = (ids >= 0) & (ids < C)
    for b in range(B):
        counts = torch.bincount(ids[b][valid[b]], minlength=C).float()
        _assert_bitwise(sizes[b], counts, f"sizes[{b}]")
    empty = sizes == 0
    assert torch.all(sums[empty] == 0), "empty chunks"
    tokens = [divmod(r, T) for r in boundary_rows(limit, V, B * T)]
    tokens += [(b, t) for b in range(B) for t in (0, T - 1)]
    checked = sorted({(b, int(ids[b, t])) for b, t in tokens if 0 <= int(ids[b, t]) < C})
    assert (B - 1, C - 1) in checked
    for b, c in checked:
        members = (ids[b] == c).nonzero().flatten()
        assert float(sizes[b, c]) == members.numel()
        _assert_bitwise(sums[b, c], _sequential_sum(lp.detach()[b, members]), f"sums[{b}, {c}]")

    grad_sums = torch.randn(B, C, V, device=device, generator=gen)
    (grad,) = torch.autograd.grad(sums, lp, grad_sums)
    del sums
    assert grad.shape == (B, T, V) and grad.dtype == dtype
    assert any(int(ids[b, t]) == -1 for b, t in tokens)
    for b, t in sorted(set(tokens)):
        c = int(ids[b, t])
        want = grad_sums[b, c].to(dtype) if 0 <= c < C else torch.zeros(V, dtype=dtype,
                                                                        device=device)
        _assert_bitwise(grad[b, t], want, f"grad of log_probs[{b}, {t}] (chunk {c})")


def _topk_projection(V_s: int, V_t: int, k: int, device) -> SparseProjection:
    """k random teacher columns per student row (every student has entries), weights in
    [0.1, 1.1)."""
    gen = torch.Generator().manual_seed(3)
    students = torch.arange(V_s).repeat_interleave(k)
    teachers = torch.randint(0, V_t, (V_s * k,), generator=gen)
    weights = torch.rand(V_s * k, generator=gen) + 0.1
    return SparseProjection.from_coo(ProjectionCOO(students, teachers, weights, V_s, V_t), device)


def check_projection_large(N: int, V_s: int, V_t: int, k: int, limit: int, device,
                           dtype=torch.bfloat16) -> None:
    """p ``[N, V_s]`` and its gradient past ``limit`` elements (the kernel also reads a
    column-major copy of p, where the students past ``limit // N`` sit beyond the boundary).
    Forward ``p @ M`` (fp32) and backward ``grad @ M^T`` (fp32, cast to p's dtype) on the rows
    near the boundary and the first and last rows, against the fp32 reference on those rows."""
    assert N * V_s > limit
    proj = _topk_projection(V_s, V_t, k, device)
    csr = proj.csr()
    gen = torch.Generator(device=device).manual_seed(4)
    p = torch.randn(N, V_s, device=device, dtype=dtype, generator=gen).requires_grad_()
    out = project(p, proj)
    assert out.shape == (N, V_t) and out.dtype == torch.float32
    rows = torch.tensor(boundary_rows(limit, V_s, N), device=device)
    want = xtoken_reference.project_forward(p.detach()[rows], csr.col_indptr,
                                            csr.col_student_ids, csr.col_weights)
    torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)

    grad = torch.randn(N, V_t, device=device, generator=gen)
    (grad_p,) = torch.autograd.grad(out, p, grad)
    del out
    assert grad_p.shape == (N, V_s) and grad_p.dtype == dtype
    want = xtoken_reference.project_backward(grad[rows], csr.row_indptr, csr.row_teacher_ids,
                                             csr.row_weights, V_t)
    # fp32 sums rounded once to p's dtype (bf16: within one ulp, 2**-7 relative)
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad_p[rows].float(), want, rtol=rtol, atol=1e-5)


# -----------------------------------------------------------------------------------------
# Large tensors on the GPU (bf16; sizes just past 2**31 elements)

# Embedding: D = 4096 (an 8B model's width), V = n_tokens = 2**19 + 64 rows:
# 2_147_745_792 elements in the table, the output, the grad and grad_weight (4.0 GiB each).
EMB_D, EMB_ROWS = 4096, 2**19 + 64
# Grouped linear: K = 4096, M = 2**19 + 4096 rows: x and dX 2_164_260_864 elements (4.0 GiB).
GL_M, GL_K, GL_N = 2**19 + 4096, 4096, 256
# Chunk sums: B = 2, T = 7168, V = 151936 (Qwen's vocab): 2_178_154_496 elements (4.1 GiB).
CH_B, CH_T, CH_V, CH_C = 2, 7168, 151936, 2048
# Projection: N = 14336 tokens, V_s = 151936: p and its gradient 2_178_154_496 elements.
PR_N, PR_VS, PR_VT, PR_K = 14336, 151936, 8192, 2


@pytest.mark.gpu
@pytest.mark.slow
def test_embedding_table_output_and_grads_past_2_31_elements():
    _gpu_room(24)  # table, output, grad, grad_weight: 4 x 4.0 GiB, plus the sort
    check_embedding_large(EMB_ROWS, EMB_D, EMB_ROWS, LIMIT, "cuda")
    _assert_peak_below_limit()


@pytest.mark.gpu
@pytest.mark.slow
def test_grouped_linear_x_and_dx_past_2_31_elements():
    _gpu_room(16)  # x, dX: 2 x 4.0 GiB; y, grad 0.25 GiB each; fp64 oracle chunks ~1 GiB
    check_grouped_linear_large(GL_M, GL_K, GL_N, LIMIT, "cuda", span=1000)
    _assert_peak_below_limit()


@pytest.mark.gpu
@pytest.mark.slow
def test_chunk_sums_log_probs_and_grad_past_2_31_elements():
    _gpu_room(20)  # log_probs, its grad: 2 x 4.1 GiB; sums, grad_sums: 2 x 2.3 GiB (fp32)
    check_chunk_sums_large(CH_B, CH_T, CH_V, CH_C, LIMIT, "cuda")
    _assert_peak_below_limit()


@pytest.mark.gpu
@pytest.mark.slow
def test_projection_p_and_grad_past_2_31_elements():
    # p 4.1 GiB + its column-major copy 4.1 GiB (forward); the fp32 gradient 8.1 GiB and its
    # bf16 cast 4.1 GiB (backward); out, grad 0.44 GiB each
    _gpu_room(26)
    check_projection_large(PR_N, PR_VS, PR_VT, PR_K, LIMIT, "cuda")
    _assert_peak_below_limit()


# -----------------------------------------------------------------------------------------
# ... and their CPU twins: the same checks, a 2**12-element boundary


@pytest.mark.parametrize("backend,dtype", CPU_TWINS)
def test_embedding_large_logic_on_cpu(backend, dtype):
    with _cpu_backend(backend):
        check_embedding_large(136, 32, 136, TWIN_LIMIT, "cpu", dtype)


@pytest.mark.parametrize("backend,dtype", CPU_TWINS)
def test_grouped_linear_large_logic_on_cpu(backend, dtype):
    with _cpu_backend(backend):
        check_grouped_linear_large(320, 16, 8, TWIN_LIMIT, "cpu", span=16, dtype=dtype)


@pytest.mark.parametrize("backend,dtype", CPU_TWINS)
def test_chunk_sums_large_logic_on_cpu(backend, dtype):
    with _cpu_backend(backend):
        check_chunk_sums_large(2, 40, 64, 12, TWIN_LIMIT, "cpu", dtype)


@pytest.mark.parametrize("backend,dtype", CPU_TWINS)
def test_projection_large_logic_on_cpu(backend, dtype):
    with _cpu_backend(backend):
        check_projection_large(40, 128, 24, 2, TWIN_LIMIT, "cpu", dtype)


# =========================================================================================
# CUDA graphs: compiled with mode="reduce-overhead", replayed on fresh data, bitwise eager


def graph_case(name: str, device):
    """``(fn, make, wrt, eager_tol)``: the function to compile, ``make(seed)`` -> its inputs
    (new values of the same shapes and dtypes for each seed), the indices of the inputs to
    differentiate, and ``eager_tol``: None where the compiled outputs and gradients are
    bitwise eager's, else the relative error the gradients may have against eager (see
    :data:`GRAPH_CASES`)."""
    dev = torch.device(device)

    def generator(seed):
        return torch.Generator(device=dev).manual_seed(seed)

    if name == "embedding":
        V, D = 1000, 128

        def make(seed):
            gen = generator(seed)
            ids = torch.randint(0, V, (4, 256), device=dev, generator=gen)
            ids[0, : 64] = seed % V  # a hot id: the backward's long-run path
            return [ids, torch.randn(V, D, device=dev, dtype=torch.bfloat16, generator=gen)]

        return (lambda ids, w: compileops.embedding(ids, w)), make, [1], None

    if name.startswith("grouped_linear"):
        groups, m, k, n = 8, 2048, 512, 256
        swiglu = name != "grouped_linear"
        recompute = name.endswith("recompute")

        def make(seed):
            gen = generator(seed)
            offs = dirichlet_offsets(groups, m - 7, seed=seed, device=dev)  # 7 tail rows
            offs[0] = 0  # an empty group
            width = 2 * n if swiglu else n
            return [torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen),
                    (torch.randn(groups, width, k, device=dev, generator=gen)
                     / k**0.5).to(torch.bfloat16),
                    offs,
                    torch.randn(groups, width, device=dev, dtype=torch.bfloat16, generator=gen)]

        if swiglu:
            def fn(x, w, offs, b):
                return compileops.grouped_linear_swiglu(x, w, offs, b, recompute=recompute)
        else:
            def fn(x, w, offs, b):
                return compileops.grouped_linear(x, w, offs, b)
        return fn, make, [0, 1, 3], (TOL[torch.bfloat16] if swiglu else None)

    if name.startswith("xtoken_project"):
        V_s, V_t, top = 3000, 2000, 8
        proj = _topk_projection(V_s, V_t, 3, dev)
        with_columns = name.endswith("columns")

        def make(seed):
            gen = generator(seed)
            p = torch.randn(2, 64, V_s, device=dev, dtype=torch.bfloat16, generator=gen)
            if not with_columns:
                return [p]
            return [p, torch.randint(0, V_t, (2, 64, top), device=dev, generator=gen)]

        if with_columns:
            def fn(p, columns):
                return proj(p, columns)
        else:
            def fn(p):
                return proj(p)
        return fn, make, [0], None

    if name == "xtoken_chunk_sums":
        B, T, V, C = 2, 256, 1000, 64

        def make(seed):
            gen = generator(seed)
            ids = torch.sort(torch.randint(0, C, (B, T), device=dev, generator=gen), 1).values
            ids.masked_fill_(torch.rand(B, T, device=dev, generator=gen) < 0.2, -1)
            return [torch.randn(B, T, V, device=dev, generator=gen), ids]

        return (lambda lp, ids: chunk_sums(lp, ids, C)), make, [0], None

    raise ValueError(name)


# Every op, forward and backward. The SwiGLU backward's pointwise derivative
# (op._swiglu_derivative: sigmoid and products in fp32) is fused by Inductor, whose sigmoid
# rounds differently from eager's: on an H100 (torch 2.11) 22 of 1M elements of dX were one
# bf16 ulp off eager's already in the first, graph-free run. So for the two SwiGLU cases the
# gradients are checked bitwise against the same function compiled without CUDA graphs
# (what the replay must reproduce) and against eager within the op's bf16 contract
# (relative error 1e-2); their outputs, and everything of the other cases, are bitwise eager's.
GRAPH_CASES = ["embedding", "grouped_linear", "grouped_linear_swiglu",
               "grouped_linear_swiglu_recompute", "xtoken_project", "xtoken_project_columns",
               "xtoken_chunk_sums"]


def _outputs_and_grads(fn, inputs, wrt, seed):
    """``[(name, tensor)]``: the outputs of ``fn(*inputs)`` and the gradients of the inputs
    ``wrt`` for seeded random output gradients, each cloned at once (a compiled graph's
    outputs are overwritten by its next replay)."""
    out = fn(*inputs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    results = [(f"output {i}", o.detach().clone()) for i, o in enumerate(outs)]
    diff = [o for o in outs if o.requires_grad]
    if wrt:
        gen = torch.Generator(device=diff[0].device).manual_seed(1000 + seed)
        grads_out = [torch.randn(o.shape, device=o.device, generator=gen).to(o.dtype)
                     for o in diff]
        grads = torch.autograd.grad(diff, [inputs[j] for j in wrt], grads_out)
        results += [(f"grad of input {j}", g.clone()) for j, g in zip(wrt, grads)]
    return results


def run_replays(name: str, device, compile_fn, replays: list | None = None, runs: int = 3,
                baseline_compile=None):
    """Compile ``graph_case(name)``'s function with ``compile_fn``, call it ``runs`` times,
    each time after copying new data into the same input tensors, and check every output and
    gradient bitwise against eager on the same inputs. For a case with an ``eager_tol``, the
    gradients are instead checked against eager within it, and everything bitwise against
    the function compiled with ``baseline_compile`` (on the GPU: without CUDA graphs). With
    ``replays`` (the list that the ``graph_replays`` fixture fills), returns how many CUDA
    graphs the last run replayed."""
    fn, make, wrt, eager_tol = graph_case(name, device)
    baseline = None
    if eager_tol is not None and baseline_compile is not None:
        baseline = baseline_compile(lambda *args: fn(*args))
    inputs = make(0)
    for j in wrt:
        inputs[j].requires_grad_()
    compiled = compile_fn(fn)
    previous = None
    replayed = None
    for run in range(runs):
        with torch.no_grad():
            for dst, src in zip(inputs, make(run + 1)):
                dst.copy_(src)
        if replays is not None:
            torch.compiler.cudagraph_mark_step_begin()
            before = len(replays)
        got = _outputs_and_grads(compiled, inputs, wrt, run)
        if replays is not None:
            torch.cuda.synchronize()
            replayed = len(replays) - before
        want = _outputs_and_grads(fn, inputs, wrt, run)
        for (what, g), (_, w) in zip(got, want, strict=True):
            if eager_tol is not None and what.startswith("grad"):
                assert_close_to_reference(g, w, max_relative_error=eager_tol,
                                          what=f"{name}, run {run + 1}: {what} vs eager")
            else:
                _assert_bitwise(g, w, f"{name}, run {run + 1}: {what}")
        if baseline is not None:
            base = _outputs_and_grads(baseline, inputs, wrt, run)
            for (what, g), (_, w) in zip(got, base, strict=True):
                _assert_bitwise(g, w, f"{name}, run {run + 1}: {what} vs compiled without "
                                      "CUDA graphs")
        if previous is not None:  # new data gave a new result: not a stale replay
            assert not torch.equal(got[0][1], previous[0][1]), f"{name}: run {run + 1}"
        previous = got
    return replayed


@pytest.fixture
def graph_replays(monkeypatch):
    """Every ``torch.cuda.CUDAGraph.replay`` call made during the test, in order."""
    calls = []
    real = torch.cuda.CUDAGraph.replay

    def replay(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", GRAPH_CASES)
def test_cuda_graph_replay_is_bitwise_eager(name, graph_replays):
    from torch._dynamo.utils import counters

    counters.clear()
    replayed = run_replays(
        name, "cuda", lambda f: torch.compile(f, mode="reduce-overhead", fullgraph=True),
        replays=graph_replays, baseline_compile=lambda f: torch.compile(f, fullgraph=True))
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"cudagraphs were skipped {skips} times (see the cudagraphs log)"
    # The last run replays the forward graph and, through autograd, the backward graph.
    assert replayed >= 2, (f"the last run replayed {replayed} CUDA graphs, expected forward "
                           "+ backward")


@pytest.mark.parametrize("name", ["embedding", "xtoken_chunk_sums"])
def test_replay_harness_logic_on_cpu(name):
    """The harness above on CPU (aot_eager, reference backend): refills, gradients (one
    output, and two with one not differentiable) and the bitwise comparison, without CUDA
    graphs. (Every case passes this way; two keep the CPU run short.)"""
    with use_backend("reference"):
        run_replays(name, "cpu", lambda f: torch.compile(f, backend="aot_eager", fullgraph=True))
