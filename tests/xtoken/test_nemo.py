"""``compileops.xtoken.nemo``: NeMo-RL's ``x_token.loss_utils`` API on our kernels.

Each function is compared with an oracle written here, in plain PyTorch/Python, from NeMo-RL's
documented semantics (not by calling compileops), on both backends. The ``ValueError`` tests
cover the inputs where NeMo-RL would return a silently wrong answer.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import compileops
from compileops.xtoken import nemo
from tests.gloo import run_ranks

BACKENDS = ("reference", "triton")


@pytest.fixture(params=BACKENDS)
def backend(request):
    with compileops.use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _fresh_caches():
    nemo.clear_caches()
    yield
    nemo.clear_caches()


def _close(actual, expected, dtype_of_math=torch.float32, what="value"):
    """``actual`` against an fp64 oracle, with the tolerance of fp32 math (or fp64)."""
    tol = 1e-12 if dtype_of_math == torch.float64 else 2e-6
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------
# Oracles (written from NeMo-RL's docs)


def oracle_sparse_mm(M: torch.Tensor, dense: torch.Tensor):
    """``M.t() @ dense`` in fp64 and the gradient of ``(out * g).sum()`` w.r.t. ``dense``,
    by torch.autograd on a dense matmul."""
    d = dense.detach().double().requires_grad_()
    out = M.double().t() @ d
    return out, lambda g: torch.autograd.grad(out, d, g.double())[0]


def oracle_chunk_average(log_probs, chunk_id, max_chunks):
    """One-hot ``[B, T, C]`` (``-1`` matches no chunk), bmm, divide by sizes; fp64."""
    one_hot = (chunk_id[..., None] == torch.arange(max_chunks)).double()
    lp = log_probs.detach().double().requires_grad_()
    sums = torch.bmm(one_hot.transpose(1, 2), lp)
    sizes = one_hot.sum(1)
    mean = sums / sizes.clamp(min=1)[..., None]
    return mean, sizes, lambda g: torch.autograd.grad(mean, lp, g.double())[0]


def oracle_parse(obj):
    """COO lists from the raw file object: dense slots row-major with sentinels, or the
    sparse dict's entries in order."""
    if isinstance(obj, dict) and "indices" in obj:
        idx, lik = obj["indices"].tolist(), obj["likelihoods"].tolist()
        students = [s for s, row in enumerate(idx) for _ in row]
        teachers = [t for row in idx for t in row]
        values = [v for row in lik for v in row]
        v_student = len(idx)
    else:
        students = [s for (s, _t) in obj]
        teachers = [t for (_s, t) in obj]
        values = [float(c) for c in obj.values()]
        v_student = max(students) + 1
    non_negative = [t for t in teachers if t >= 0]
    v_teacher = max(non_negative) + 1 if non_negative else 0
    return students, teachers, values, v_student, v_teacher


def oracle_dense_matrix(obj, student_vocab_size, teacher_vocab_size):
    """The projection as a dense fp64 matrix: ``-1`` teachers dropped, duplicates summed,
    axes ``max(configured, max id + 1)``."""
    students, teachers, values, _, _ = oracle_parse(obj)
    kept = [(s, t, v) for s, t, v in zip(students, teachers, values) if t != -1]
    V_s = max([student_vocab_size] + [s + 1 for s, _, _ in kept])
    V_t = max([teacher_vocab_size] + [t + 1 for _, t, _ in kept])
    M = torch.zeros(V_s, V_t, dtype=torch.float64)
    for s, t, v in kept:
        M[s, t] += v
    return M


def oracle_exact_map(indices, likelihoods, xtoken_loss, teacher_vocab_size):
    """Python loops over the student rows: top weight (earliest column on ties), the strict or
    relaxed rule, collisions (strict: lowest student; relaxed: highest weight, then lowest
    student), teacher ids outside the vocab dropped."""
    idx, lik = indices.tolist(), likelihoods.float().tolist()
    winner = {}  # teacher -> (student, weight)
    for s, (row_t, row_w) in enumerate(zip(idx, lik)):
        if not row_t:
            continue
        j = max(range(len(row_t)), key=lambda j: (row_w[j], -j))
        w, t = row_w[j], row_t[j]
        if xtoken_loss:
            ok = w >= 0.6
        else:
            ok = w == 1.0 and (len(row_t) < 2 or row_t[1] == -1)
        if not ok or not 0 <= t < teacher_vocab_size:
            continue
        if t not in winner or (xtoken_loss and w > winner[t][1]):
            winner[t] = (s, w)  # students come in ascending order: ties keep the lower one
    pairs = sorted((s, t) for t, (s, _w) in winner.items())
    common_s = [s for s, _ in pairs]
    common_t = [t for _, t in pairs]
    return {
        "common_student": common_s,
        "common_teacher": common_t,
        "uncommon_student": [s for s in range(len(idx)) if s not in common_s],
        "uncommon_teacher": [t for t in range(teacher_vocab_size) if t not in common_t],
    }


# ---------------------------------------------------------------------------------------
# Data


def _random_sparse_matrix(V_s=23, V_t=17, nnz=60, seed=0) -> torch.Tensor:
    """An uncoalesced sparse COO ``[V_s, V_t]`` with duplicate entries and explicit zeros."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(0, V_s, (nnz,), generator=gen),
                       torch.randint(0, V_t, (nnz,), generator=gen)])
    idx[:, 1] = idx[:, 0]  # a duplicate
    vals = torch.rand(nnz, generator=gen)
    vals[3] = 0.0
    return torch.sparse_coo_tensor(idx, vals, (V_s, V_t), check_invariants=True)


def _dense_topk_obj(V_s=19, k=3, V_t=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, V_t, (V_s, k), generator=gen)
    indices[torch.rand(V_s, k, generator=gen) < 0.3] = -1
    likelihoods = torch.rand(V_s, k, generator=gen)
    likelihoods[indices == -1] = 0.0
    indices[:, 0][2] = 0  # teacher 0 in use
    return {"indices": indices, "likelihoods": likelihoods}


def _sparse_obj():
    # (student, teacher) -> count; a -1 teacher sentinel, unordered keys, int and float counts.
    return {(3, 5): 2, (0, 1): 1.5, (3, -1): 4, (1, 0): 7, (6, 2): 1, (0, 4): 3}


def _save(tmp_path, name, obj):
    path = tmp_path / name
    torch.save(obj, path)
    return path


# ---------------------------------------------------------------------------------------
# The names


# NeMo-RL's current loss_utils (NVIDIA-NeMo/RL 7ea279a): "*" marks keyword-only, "=" a default.
CURRENT_SIGNATURES = {
    "chunk_log_prob_sums": ["log_probs", "chunk_id", "max_chunks"],
    "chunk_average_finalize": ["chunk_sums", "chunk_sizes"],
    "chunk_average_log_probs": ["log_probs", "chunk_id", "max_chunks", "*cp_group="],
    "slice_sparse_projection_rows": ["sparse_matrix", "row_start", "row_end"],
    "valid_chunk_mask": ["s_sizes", "t_sizes", "pair_valid"],
    "parse_projection_file": ["path"],
    "get_sparse_projection_matrix": ["path", "device", "*student_vocab_size",
                                     "*teacher_vocab_size"],
    "get_topk_projection": ["path", "device"],
    "build_exact_token_map": ["path", "device", "*xtoken_loss", "*teacher_vocab_size"],
}
# The seed's API, which the current one drops or extends: still callable as it was.
SEED_ONLY_SIGNATURES = {"dp_all_reduce_sum": ["local"]}


def _signature(fn):
    return [("*" if p.kind is p.KEYWORD_ONLY else "") + p.name
            + ("=" if p.default is not p.empty else "")
            for p in inspect.signature(fn).parameters.values()]


def test_import_with_nemo_rl_names():
    from compileops.xtoken.nemo import (  # noqa: F401
        Fp32SparseMM,
        build_exact_token_map,
        chunk_average_finalize,
        chunk_average_log_probs,
        chunk_log_prob_sums,
        dp_all_reduce_sum,
        get_sparse_projection_matrix,
        get_topk_projection,
        parse_projection_file,
        slice_sparse_projection_rows,
        valid_chunk_mask,
    )

    signatures = {**CURRENT_SIGNATURES, **SEED_ONLY_SIGNATURES}
    assert set(signatures) | {"Fp32SparseMM"} <= set(nemo.__all__)
    for name, params in signatures.items():
        assert _signature(getattr(nemo, name)) == params, name
    apply = inspect.signature(Fp32SparseMM.apply).parameters
    assert list(apply) == ["sparse_M", "dense"]


# ---------------------------------------------------------------------------------------
# Fp32SparseMM


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "strided", "module"])
def test_fp32_sparse_mm_matches_dense_matmul(backend, dtype, kind):
    M = _random_sparse_matrix()
    M_dense = M.to_dense()
    arg = {
        "sparse_coo": M,
        "sparse_csr": M.coalesce().to_sparse_csr(),
        "strided": M_dense,
        "module": compileops.xtoken.SparseProjection.from_coo(compileops.xtoken.ProjectionCOO(
            M._indices()[0], M._indices()[1], M._values(), *M.shape)),
    }[kind]
    dense = torch.randn(23, 6, dtype=dtype, requires_grad=True)
    out = nemo.Fp32SparseMM.apply(arg, dense)
    want, want_grad = oracle_sparse_mm(M_dense, dense)
    assert out.shape == (17, 6) and out.dtype == torch.float32
    _close(out, want)
    g = torch.randn(17, 6)
    (grad,) = torch.autograd.grad(out, dense, g)
    assert grad.dtype == dtype
    _close(grad, want_grad(g), what="grad")


def test_fp32_sparse_mm_under_bf16_autocast(backend):
    M = _random_sparse_matrix(seed=1)
    dense = torch.randn(23, 5, requires_grad=True)
    g = torch.randn(17, 5)
    plain = nemo.Fp32SparseMM.apply(M, dense)
    (plain_grad,) = torch.autograd.grad(plain, dense, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nemo.Fp32SparseMM.apply(M, dense)
        assert out.dtype == torch.float32
        (grad,) = torch.autograd.grad(out, dense, g)
    assert torch.equal(out, plain) and torch.equal(grad, plain_grad)
    # bf16 input: fp32 math on the bf16 values, the gradient comes back in bf16.
    d16 = dense.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = nemo.Fp32SparseMM.apply(M, d16)
    want, want_grad = oracle_sparse_mm(M.to_dense(), d16)
    _close(out16, want)
    (grad16,) = torch.autograd.grad(out16, d16, g)
    assert grad16.dtype == torch.bfloat16
    torch.testing.assert_close(grad16.double(), want_grad(g), rtol=1e-2, atol=1e-2)


def test_fp32_sparse_mm_errors_and_matrix_cache():
    M = _random_sparse_matrix()
    with pytest.raises(ValueError, match=r"dense must be \[V_s, N\] with V_s = .* = 23"):
        nemo.Fp32SparseMM.apply(M, torch.randn(17, 4))
    with pytest.raises(ValueError, match="dense must be a 2-D"):
        nemo.Fp32SparseMM.apply(M, torch.randn(23))
    with pytest.raises(ValueError, match="sparse_M must be a 2-D"):
        nemo.Fp32SparseMM.apply(torch.randn(2, 3, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="sparse_M must be"):
        nemo.Fp32SparseMM.apply([[1.0]], torch.randn(1, 1))
    # A matrix modified in place is read again, not served stale from a cache.
    W = torch.eye(4)
    d = torch.randn(4, 3)
    assert torch.equal(nemo.Fp32SparseMM.apply(W, d), d)
    W.mul_(2.0)
    assert torch.equal(nemo.Fp32SparseMM.apply(W, d), 2.0 * d)


def test_fp32_sparse_mm_sees_changes_that_bypass_the_version_counter():
    """Audit finding: the CSR of a tensor was cached per (object, _version), and ``.data``
    changes do not bump the version, so the old weights kept being used."""
    d = torch.randn(4, 3)
    W = torch.eye(4)
    assert torch.equal(nemo.Fp32SparseMM.apply(W, d), d)
    W.data.mul_(2.0)
    assert torch.equal(nemo.Fp32SparseMM.apply(W, d), 2.0 * d)
    M = torch.eye(4).to_sparse()
    assert torch.equal(nemo.Fp32SparseMM.apply(M, d), d)
    M._values().data.mul_(3.0)  # (a sparse M.data is a copy)
    assert torch.equal(nemo.Fp32SparseMM.apply(M, d), 3.0 * d)


def test_fp32_sparse_mm_refuses_entries_outside_the_shape():
    """A sparse tensor built without its invariants checked can hold ids outside its shape;
    the kernels would read out of bounds."""
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 5]]), torch.ones(2), (2, 3),
                                  check_invariants=False)
    with pytest.raises(ValueError, match=r"sparse_M holds an entry at \(1, 5\), outside its "
                                         r"shape \(2, 3\)"):
        nemo.Fp32SparseMM.apply(bad, torch.randn(2, 4))


def test_csr_from_coalesced_leaves_entries_outside_the_shape_unread():
    """On CUDA the ids are not read on the host: an entry outside the shape is sorted past
    the last segment of both layouts, where no kernel reads."""
    from compileops.xtoken.projection import csr_from_coalesced

    indices = torch.tensor([[-1, 0, 0, 1, 1], [2, 0, 2, 1, 7]])
    csr = csr_from_coalesced(indices, torch.tensor([9.0, 1.0, 2.0, 3.0, 9.0]), 2, 3)
    assert csr.row_indptr.tolist() == [0, 2, 3] and csr.col_indptr.tolist() == [0, 1, 2, 3]
    assert csr.row_teacher_ids[:3].tolist() == [0, 2, 1]
    assert csr.row_weights[:3].tolist() == [1.0, 2.0, 3.0]
    assert csr.col_student_ids[:3].tolist() == [0, 1, 0]
    assert csr.col_weights[:3].tolist() == [1.0, 3.0, 2.0]


# ---------------------------------------------------------------------------------------
# chunk_average_log_probs / valid_chunk_mask / dp_all_reduce_sum


def _chunk_ids(B, T, C, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, C, (B, T), generator=gen), dim=1).values
    ids[torch.rand(B, T, generator=gen) < 0.2] = -1
    ids[1] = ids[1][torch.randperm(T, generator=gen)]  # one row not in runs
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunk_average_log_probs(backend, dtype):
    B, T, C, V = 3, 30, 9, 11
    ids = _chunk_ids(B, T, C)
    ids[2] = -1  # a row with no chunk at all
    lp = torch.randn(B, T, V).log_softmax(-1).to(dtype).requires_grad_()
    mean, sizes = nemo.chunk_average_log_probs(lp, ids, C)
    want, want_sizes, want_grad = oracle_chunk_average(lp, ids, C)
    # NeMo-RL divides the sums by float32 sizes: bf16 promotes to fp32, fp64 stays fp64.
    assert mean.dtype == torch.promote_types(dtype, torch.float32)
    assert mean.shape == (B, C, V)
    assert sizes.dtype == torch.float32 and torch.equal(sizes, want_sizes.float())
    _close(mean, want)  # fp32 sums of the (exact) inputs, also for bf16 and fp64
    g = torch.randn(B, C, V)
    (grad,) = torch.autograd.grad(mean, lp, g)
    assert grad.dtype == dtype
    if dtype == torch.bfloat16:  # one bf16 rounding of the gradient
        torch.testing.assert_close(grad.double(), want_grad(g), rtol=8e-3, atol=8e-3)
    else:
        _close(grad, want_grad(g), what="grad")


def test_chunk_average_log_probs_hand_computed_and_neg_inf(backend):
    lp = torch.tensor([[[-1.0, -2.0], [-3.0, -float("inf")], [-9.0, -9.0], [-5.0, -7.0]]])
    ids = torch.tensor([[0, 0, -1, 2]])
    mean, sizes = nemo.chunk_average_log_probs(lp, ids, 3)
    # A -inf log-prob stays in its own chunk (a one-hot bmm can turn 0 * -inf into NaN).
    assert torch.equal(mean, torch.tensor([[[-2.0, -float("inf")], [0.0, 0.0], [-5.0, -7.0]]]))
    assert torch.equal(sizes, torch.tensor([[2.0, 0.0, 1.0]]))


@pytest.mark.parametrize("bad", [3, 7, -2])
def test_chunk_average_log_probs_out_of_range_id(bad):
    ids = torch.tensor([[0, 1, -1, 2], [0, 0, 1, 1]])
    ids[1, 2] = bad
    message = rf"chunk_id\[1, 2\] = {bad} is outside \[-1, max_chunks\) = \[-1, 3\)"
    with pytest.raises(ValueError, match=message):
        nemo.chunk_average_log_probs(torch.randn(2, 4, 5), ids, 3)


def test_valid_chunk_mask(backend):
    gen = torch.Generator().manual_seed(0)
    s = torch.randint(0, 3, (4, 6), generator=gen).float()
    t = torch.randint(0, 3, (4, 6), generator=gen).float()
    pair = torch.rand(4, 6, generator=gen) < 0.7
    want = torch.tensor([[bool(s[b, c] > 0 and t[b, c] > 0 and pair[b, c]) for c in range(6)]
                         for b in range(4)])
    got = nemo.valid_chunk_mask(s, t, pair)
    assert got.dtype == torch.bool and torch.equal(got, want)
    with pytest.raises(ValueError, match="t_sizes has shape"):
        nemo.valid_chunk_mask(s, t[:, :1], pair)
    with pytest.raises(ValueError, match="pair_valid has shape"):
        nemo.valid_chunk_mask(s, t, pair[0])
    with pytest.raises(ValueError, match="pair_valid must be a bool tensor, got torch.int64"):
        nemo.valid_chunk_mask(s, t, pair.long() * 2)


@pytest.mark.parametrize("shape", [(6,), (), (2, 3, 4)])
def test_valid_chunk_mask_any_shape(shape):
    """NeMo-RL's mask is elementwise: 1-D (and other) inputs give the mask of their shape."""
    gen = torch.Generator().manual_seed(1)
    s = torch.randint(0, 3, shape, generator=gen).float()
    t = torch.randint(0, 3, shape, generator=gen)
    pair = torch.rand(shape, generator=gen) < 0.7
    got = nemo.valid_chunk_mask(s, t, pair)
    want = torch.tensor([bool(a > 0 and b > 0 and c) for a, b, c in
                         zip(s.reshape(-1).tolist(), t.reshape(-1).tolist(),
                             pair.reshape(-1).tolist())]).reshape(shape)
    assert got.shape == shape and torch.equal(got, want)


def test_dp_all_reduce_sum_without_process_group(backend):
    assert not dist.is_initialized()
    local = torch.tensor(5, dtype=torch.int64)
    out = nemo.dp_all_reduce_sum(local)
    assert out.dtype == torch.float32 and out.shape == () and out.item() == 5.0
    x = torch.tensor(2.5)
    out = nemo.dp_all_reduce_sum(x)
    out += 1
    assert x.item() == 2.5  # a fresh tensor, input untouched


def _dp_all_reduce(rank: int, world: int):
    local = torch.tensor(rank + 3, dtype=torch.int64)  # a count
    out = nemo.dp_all_reduce_sum(local)
    return (out.item(), out.dtype == torch.float32, local.item())


def _two_rank_checks(rank: int, world: int):
    """Everything the 2-process gloo tests run, in one group (spawning costs seconds)."""
    return {"dp_all_reduce_sum": _dp_all_reduce(rank, world),
            "cp_chunk_average": _cp_chunk_average(rank, world)}


@pytest.fixture(scope="module")
def two_ranks():
    results, exit_codes = run_ranks(_two_rank_checks, 2)
    assert exit_codes == [0, 0], results
    return results


def test_dp_all_reduce_sum_two_ranks(two_ranks):
    # oracle: the sum of the ranks' counts, on every rank; inputs unchanged
    assert {r: two_ranks[r]["dp_all_reduce_sum"] for r in (0, 1)} == {
        0: (7.0, True, 3), 1: (7.0, True, 4)}


# ---------------------------------------------------------------------------------------
# Projection files


@pytest.mark.parametrize("fmt", ["dense", "sparse"])
def test_parse_projection_file(backend, tmp_path, fmt):
    obj = _dense_topk_obj() if fmt == "dense" else _sparse_obj()
    path = _save(tmp_path, f"{fmt}.pt", obj)
    indices, values, v_s, v_t = nemo.parse_projection_file(path)
    students, teachers, vals, want_v_s, want_v_t = oracle_parse(obj)
    assert indices.dtype == torch.int64 and values.dtype == torch.float32
    assert indices.tolist() == [students, teachers]
    assert values.tolist() == torch.tensor(vals, dtype=torch.float32).tolist()
    assert (v_s, v_t) == (want_v_s, want_v_t)
    assert type(v_s) is int and type(v_t) is int
    assert -1 in indices[1].tolist()  # sentinels kept


def test_parse_projection_file_inferred_teacher_vocab(tmp_path):
    only_sentinels = {"indices": torch.full((3, 2), -1), "likelihoods": torch.zeros(3, 2)}
    only_zero = {"indices": torch.tensor([[0, -1]]), "likelihoods": torch.tensor([[1.0, 0.0]])}
    assert nemo.parse_projection_file(_save(tmp_path, "a.pt", only_sentinels))[2:] == (3, 0)
    assert nemo.parse_projection_file(_save(tmp_path, "b.pt", only_zero))[2:] == (1, 1)


def test_projection_files_with_sentinels_round_trip(tmp_path):
    # dense top-k: the COO slots reshape back to the file's arrays, sentinels included
    obj = _dense_topk_obj(V_s=8, k=4)
    indices, values, v_s, _ = nemo.parse_projection_file(_save(tmp_path, "dense.pt", obj))
    assert torch.equal(indices[1].reshape(v_s, 4), obj["indices"])
    assert torch.equal(values.reshape(v_s, 4), obj["likelihoods"])
    assert torch.equal(indices[0].reshape(v_s, 4), torch.arange(8)[:, None].expand(8, 4))
    # sparse: back to the same dict; written again and parsed again, the same COO
    obj = _sparse_obj()
    first = nemo.parse_projection_file(_save(tmp_path, "sparse.pt", obj))
    again = {(s, t): v for (s, t), v in zip(first[0].t().tolist(), first[1].tolist())}
    assert again == {k: float(v) for k, v in obj.items()}
    second = nemo.parse_projection_file(_save(tmp_path, "sparse2.pt", again))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert first[2:] == second[2:]


def test_parse_projection_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        nemo.parse_projection_file(tmp_path / "missing.pt")
    for i, obj in enumerate([[1, 2], {}, {"a": 1}]):
        with pytest.raises(ValueError, match="unknown projection format"):
            nemo.parse_projection_file(_save(tmp_path, f"u{i}.pt", obj))
    bad_shape = {"indices": torch.zeros(3, 2, dtype=torch.long), "likelihoods": torch.zeros(3, 1)}
    with pytest.raises(ValueError, match="'indices' .* and 'likelihoods' .* same shape"):
        nemo.parse_projection_file(_save(tmp_path, "s.pt", bad_shape))
    float_idx = {"indices": torch.zeros(3, 2), "likelihoods": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match="'indices' must be an integer tensor"):
        nemo.parse_projection_file(_save(tmp_path, "f.pt", float_idx))
    with pytest.raises(ValueError, match=r"found \(1, 2, 3\)"):
        nemo.parse_projection_file(_save(tmp_path, "k.pt", {(1, 2, 3): 1.0}))


@pytest.mark.parametrize("fmt", ["dense", "sparse"])
@pytest.mark.parametrize("sizes", [(0, 0), (40, 25)])
def test_get_sparse_projection_matrix(backend, tmp_path, fmt, sizes):
    obj = _dense_topk_obj() if fmt == "dense" else _sparse_obj()
    path = _save(tmp_path, f"{fmt}.pt", obj)
    V_s, V_t = sizes
    M = nemo.get_sparse_projection_matrix(path, "cpu", student_vocab_size=V_s,
                                          teacher_vocab_size=V_t)
    want = oracle_dense_matrix(obj, V_s, V_t)
    assert M.layout == torch.sparse_coo and M.is_coalesced() and M.dtype == torch.float32
    assert M.shape == want.shape
    _close(M.to_dense(), want)
    again = nemo.get_sparse_projection_matrix(
        path, torch.device("cpu"), student_vocab_size=V_s, teacher_vocab_size=V_t)
    assert again is not M and again.is_coalesced()  # a copy: equal, sharing no memory
    assert torch.equal(again._indices(), M._indices()) and torch.equal(again._values(), M._values())
    assert again._values().data_ptr() != M._values().data_ptr()
    assert nemo.get_sparse_projection_matrix(
        path, "cpu", student_vocab_size=V_s + 1, teacher_vocab_size=V_t).shape[0] == want.shape[0] + (V_s > 0)
    # and through the projection, forward and backward
    dense = torch.randn(M.shape[0], 4, requires_grad=True)
    out = nemo.Fp32SparseMM.apply(M, dense)
    want_out, want_grad = oracle_sparse_mm(want, dense)
    _close(out, want_out)
    g = torch.randn(M.shape[1], 4)
    _close(torch.autograd.grad(out, dense, g)[0], want_grad(g), what="grad")


def test_get_sparse_projection_matrix_errors(tmp_path):
    path = _save(tmp_path, "s.pt", _sparse_obj())
    with pytest.raises(TypeError):
        nemo.get_sparse_projection_matrix(path, "cpu", 10, 10)  # keyword-only sizes
    with pytest.raises(ValueError, match=r"teacher_vocab_size must be an int in \[0, "):
        nemo.get_sparse_projection_matrix(path, "cpu", student_vocab_size=1,
                                          teacher_vocab_size=-4)
    with pytest.raises(ValueError, match=r"student_vocab_size must be an int in \[0, "):
        nemo.get_sparse_projection_matrix(path, "cpu", student_vocab_size=2.0,
                                          teacher_vocab_size=1)
    M = nemo.get_sparse_projection_matrix(path, "cpu", student_vocab_size=torch.tensor(9),
                                          teacher_vocab_size=1)  # integer-like sizes
    assert M.shape == (9, 6)
    neg = _save(tmp_path, "n.pt", {(0, 1): 1.0, (2, -3): 1.0})
    with pytest.raises(ValueError, match=r"n\.pt: entry \(2, -3\) -> 1\.0: teacher id -3 is negative"):
        nemo.get_sparse_projection_matrix(neg, "cpu", student_vocab_size=1,
                                          teacher_vocab_size=1)
    with pytest.raises(FileNotFoundError):
        nemo.get_sparse_projection_matrix(tmp_path / "x.pt", "cpu", student_vocab_size=1,
                                          teacher_vocab_size=1)


def test_get_topk_projection(backend, tmp_path):
    obj = _dense_topk_obj()
    obj["likelihoods"] = obj["likelihoods"].double()  # returned as float32
    path = _save(tmp_path, "d.pt", obj)
    indices, likelihoods = nemo.get_topk_projection(path, "cpu")
    assert indices.dtype == torch.int64 and likelihoods.dtype == torch.float32
    assert indices.tolist() == obj["indices"].tolist()
    assert likelihoods.tolist() == obj["likelihoods"].float().tolist()
    again = nemo.get_topk_projection(path, torch.device("cpu"))
    assert torch.equal(again[0], indices) and torch.equal(again[1], likelihoods)
    assert again[0].data_ptr() != indices.data_ptr()  # each caller's own copy
    with pytest.raises(ValueError, match="needs the dense top-k format"):
        nemo.get_topk_projection(_save(tmp_path, "s.pt", _sparse_obj()), "cpu")
    with pytest.raises(FileNotFoundError):
        nemo.get_topk_projection(tmp_path / "x.pt", "cpu")


def _exact_map_obj():
    """Rows chosen to hit each rule: see the comments."""
    S = -1
    rows = [
        ([4, S, S], [1.0, 0.0, 0.0]),    # 0: strict and relaxed -> 4
        ([4, S, S], [1.0, 0.0, 0.0]),    # 1: collides with 0 on 4 (both rules: 0 wins)
        ([5, 6, S], [1.0, 0.0, 0.0]),    # 2: column 1 is not a sentinel: not strict; relaxed -> 5
        ([S, 7, S], [0.0, 1.0, 0.0]),    # 3: top in column 1, column 1 not -1: relaxed only -> 7
        ([8, S, 9], [0.7, 0.0, 0.3]),    # 4: strict no (0.7); relaxed -> 8, collides with 5
        ([9, 8, S], [0.2, 0.9, 0.0]),    # 5: relaxed -> 8 with 0.9: beats 4
        ([2, 3, S], [0.5, 0.5, 0.0]),    # 6: no rule
        ([20, S, S], [1.0, 0.0, 0.0]),   # 7: teacher 20 outside the vocab: dropped
        ([1, 3, S], [0.75, 0.75, 0.0]),  # 8: tie inside the row: column 0 (teacher 1)
        ([3, S, S], [0.6, 0.0, 0.0]),    # 9: relaxed -> 3 at the threshold
        ([6, S, S], [0.8, 0.0, 0.0]),    # 10: relaxed -> 6
        ([6, S, S], [0.8, 0.0, 0.0]),    # 11: same weight as 10 on 6: lower id (10) wins
    ]
    return {"indices": torch.tensor([r[0] for r in rows]),
            "likelihoods": torch.tensor([r[1] for r in rows])}


def _check_exact_map(got, want):
    assert set(got) == set(want)
    for key, value in got.items():
        assert value.dtype == torch.int64, key
        assert value.tolist() == want[key], key


@pytest.mark.parametrize("xtoken_loss", [False, True], ids=["strict", "relaxed"])
def test_build_exact_token_map(backend, tmp_path, xtoken_loss):
    obj = _exact_map_obj()
    path = _save(tmp_path, "m.pt", obj)
    got = nemo.build_exact_token_map(path, "cpu", xtoken_loss=xtoken_loss,
                                     teacher_vocab_size=12)
    want = oracle_exact_map(obj["indices"], obj["likelihoods"], xtoken_loss, 12)
    if xtoken_loss:
        assert list(zip(want["common_student"], want["common_teacher"])) == [
            (0, 4), (2, 5), (3, 7), (5, 8), (8, 1), (9, 3), (10, 6)]
    else:
        assert list(zip(want["common_student"], want["common_teacher"])) == [(0, 4)]
    _check_exact_map(got, want)
    again = nemo.build_exact_token_map(path, torch.device("cpu"), xtoken_loss=xtoken_loss,
                                       teacher_vocab_size=12)
    _check_exact_map(again, want)
    assert again["uncommon_student"].data_ptr() != got["uncommon_student"].data_ptr()
    # random files, against the same oracle
    for seed in range(3):
        rnd = _dense_topk_obj(V_s=40, k=3, V_t=15, seed=seed)
        strict_rows = torch.arange(40) % 3 == 0
        rnd["likelihoods"][strict_rows, 0] = 1.0
        rnd["indices"][strict_rows & (torch.arange(40) < 20), 1] = -1
        rnd["likelihoods"][5::7, 1] = 0.65
        p = _save(tmp_path, f"r{seed}.pt", rnd)
        got = nemo.build_exact_token_map(p, "cpu", xtoken_loss=xtoken_loss,
                                         teacher_vocab_size=13)
        _check_exact_map(got, oracle_exact_map(rnd["indices"], rnd["likelihoods"],
                                               xtoken_loss, 13))


def test_build_exact_token_map_one_column_and_errors(tmp_path):
    obj = {"indices": torch.tensor([[2], [2], [0]]),
           "likelihoods": torch.tensor([[1.0], [1.0], [0.5]])}
    path = _save(tmp_path, "k1.pt", obj)
    got = nemo.build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=3)
    _check_exact_map(got, oracle_exact_map(obj["indices"], obj["likelihoods"], False, 3))
    assert got["common_student"].tolist() == [0]
    with pytest.raises(ValueError, match="xtoken_loss must be a bool"):
        nemo.build_exact_token_map(path, "cpu", xtoken_loss="false", teacher_vocab_size=3)
    with pytest.raises(ValueError, match=r"teacher_vocab_size must be an int in \[1, "):
        nemo.build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=0)
    with pytest.raises(ValueError, match="needs the dense top-k format"):
        nemo.build_exact_token_map(_save(tmp_path, "s.pt", _sparse_obj()), "cpu",
                                   xtoken_loss=True, teacher_vocab_size=3)


def test_adapters_compile_fullgraph_with_backward():
    """A loss written with the adapters traces without graph breaks, forward and backward (the
    chunk-id check is skipped while compiling); the projection goes in as a SparseProjection.
    ``aot_eager`` keeps it fast: Inductor's handling of these ops is tested in test_compile."""
    M = _random_sparse_matrix(V_s=6, V_t=3, nnz=10)
    proj = compileops.xtoken.SparseProjection.from_coo(compileops.xtoken.ProjectionCOO(
        M._indices()[0], M._indices()[1], M._values(), *M.shape))

    def loss(lp, ids, p):
        mean, sizes = nemo.chunk_average_log_probs(lp, ids, 4)
        keep = sizes > 1
        return (mean.sum(-1) * keep).sum() + nemo.Fp32SparseMM.apply(proj, p).square().sum()

    lp = torch.randn(2, 8, 5, requires_grad=True)
    ids = torch.tensor([[0, 0, 1, 1, -1, 2, 2, 3], [0, 1, 1, 1, 2, -1, -1, 3]])
    p = torch.randn(6, 4, requires_grad=True)
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(lp, ids, p)
    got_grads = torch.autograd.grad(got, (lp, p))
    want = loss(lp, ids, p)
    want_grads = torch.autograd.grad(want, (lp, p))
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_valid_chunk_mask_compiles_fullgraph():
    s = torch.tensor([[2.0, 0.0, 1.0]])
    t = torch.tensor([[1.0, 3.0, 1.0]])
    pair = torch.tensor([[True, True, False]])
    got = torch.compile(nemo.valid_chunk_mask, fullgraph=True, backend="aot_eager")(s, t, pair)
    assert torch.equal(got, torch.tensor([[True, False, False]]))


# ---------------------------------------------------------------------------------------
# NeMo-RL's current API: chunk_log_prob_sums / chunk_average_finalize / cp_group= /
# slice_sparse_projection_rows. Oracles transcribe its documented semantics in plain PyTorch.


def oracle_chunk_log_prob_sums(log_probs, chunk_id, max_chunks):
    """One-hot ``[B, C, T]`` (``-1`` matches no chunk) times ``log_probs``, in fp64; the
    sizes are the one-hot's row counts."""
    one_hot = (chunk_id[:, None, :] == torch.arange(max_chunks)[None, :, None]).double()
    return one_hot @ log_probs.detach().double(), one_hot.sum(-1)


def oracle_chunk_average_finalize(chunk_sums, chunk_sizes):
    """The sums over the sizes plus 1e-10 (added in the sizes' dtype), torch's promotion."""
    return chunk_sums / (chunk_sizes[..., None] + 1e-10), chunk_sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_chunk_log_prob_sums_and_finalize(backend, dtype):
    B, T, C, V = 2, 17, 5, 6
    ids = _chunk_ids(B, T, C, seed=3)
    lp = torch.randn(B, T, V).log_softmax(-1).to(dtype).requires_grad_()
    sums, sizes = nemo.chunk_log_prob_sums(lp, ids, C)
    want_sums, want_sizes = oracle_chunk_log_prob_sums(lp, ids, C)
    # fp32 accumulation (NeMo-RL's bmm returns bf16 sums for bf16 input; see the docs)
    assert sums.dtype == torch.promote_types(dtype, torch.float32) and sums.shape == (B, C, V)
    assert sizes.dtype == torch.float32 and torch.equal(sizes.double(), want_sizes)
    _close(sums, want_sums)
    mean, sizes_out = nemo.chunk_average_finalize(sums, sizes)
    want_mean, _ = oracle_chunk_average_finalize(sums.detach(), sizes)
    assert sizes_out is sizes and mean.dtype == sums.dtype
    assert torch.equal(mean.detach(), want_mean)  # the same formula: bitwise
    # chunk_average_log_probs is exactly this composition
    composed, _ = nemo.chunk_average_log_probs(lp, ids, C, cp_group=None)
    assert torch.equal(composed, mean)
    # gradient of the sums: each token gets its chunk's gradient, -1 tokens nothing
    g = torch.randn(B, C, V, dtype=sums.dtype)
    (grad,) = torch.autograd.grad(sums, lp, g)
    one_hot = (ids[:, None, :] == torch.arange(C)[None, :, None]).double()
    want_grad = one_hot.transpose(1, 2) @ g.double()
    torch.testing.assert_close(grad.double(), want_grad, rtol=8e-3 if dtype == torch.bfloat16
                               else 1e-6, atol=1e-6)


def test_chunk_average_finalize_promotes_like_nemo_rl():
    """NeMo-RL's own bf16 sums (from its bmm) divided by fp32 sizes come back fp32; an empty
    chunk's zero sum stays 0."""
    sums = torch.tensor([[[1.5, -3.0], [0.0, 0.0]]], dtype=torch.bfloat16)
    sizes = torch.tensor([[3.0, 0.0]])
    mean, _ = nemo.chunk_average_finalize(sums, sizes)
    assert mean.dtype == torch.float32
    assert mean.tolist() == [[[0.5, -1.0], [0.0, 0.0]]]


def test_chunk_average_finalize_errors():
    sums, sizes = torch.zeros(2, 3, 4), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"chunk_sizes must be chunk_sums.shape\[:-1\] = \(2, 3\)"):
        nemo.chunk_average_finalize(sums, sizes[0])
    with pytest.raises(ValueError, match="chunk_sizes must be a floating-point tensor, got torch.int64"):
        nemo.chunk_average_finalize(sums, sizes.long())
    with pytest.raises(ValueError, match="chunk_sums must be a floating-point tensor, got list"):
        nemo.chunk_average_finalize([1.0], sizes)


def test_chunk_log_prob_sums_out_of_range_id():
    ids = torch.tensor([[0, 1, -1, 3]])
    with pytest.raises(ValueError, match=r"chunk_id\[0, 3\] = 3 is outside \[-1, max_chunks\)"):
        nemo.chunk_log_prob_sums(torch.randn(1, 4, 2), ids, 3)


def test_cp_group_without_torch_distributed():
    assert not dist.is_initialized()
    lp, ids = torch.randn(1, 4, 3), torch.tensor([[0, 0, 1, -1]])
    with pytest.raises(ValueError, match="cp_group.* torch.distributed is not initialised"):
        nemo.chunk_average_log_probs(lp, ids, 2, cp_group=object())


# One sequence split across 2 context-parallel ranks: chunk 1 and chunk 3 span the split.
CP_IDS = torch.tensor([[0, 0, 1, 1, 1, -1, 1, 3, 3, 3], [2, 2, -1, 0, 0, 0, 0, 1, 3, -1]])
CP_CHUNKS, CP_VOCAB = 5, 3


def _cp_inputs():
    gen = torch.Generator().manual_seed(11)
    lp = torch.randn(2, CP_IDS.shape[1], CP_VOCAB, generator=gen).log_softmax(-1)
    g = torch.randn(2, CP_CHUNKS, CP_VOCAB, generator=gen)
    return lp, g


def _cp_chunk_average(rank: int, world: int):
    lp, g = _cp_inputs()
    half = CP_IDS.shape[1] // world
    mine = slice(rank * half, (rank + 1) * half)
    local = lp[:, mine].clone().requires_grad_()
    local_ids = CP_IDS[:, mine].clone()
    mean, sizes = nemo.chunk_average_log_probs(local, local_ids, CP_CHUNKS,
                                               cp_group=dist.group.WORLD)
    (grad,) = torch.autograd.grad(mean, local, g)
    return mean.tolist(), sizes.tolist(), grad.tolist(), local_ids.tolist() == CP_IDS[:, mine].tolist()


def test_chunk_average_log_probs_cp_group_two_ranks(two_ranks):
    """Each rank holds half the tokens; the chunk sums and sizes are summed across the group
    before the division, so both ranks get the full sequence's chunk means; the gradient
    passes the sum unchanged, so each rank gets its own tokens' part of the full gradient."""
    results = {r: two_ranks[r]["cp_chunk_average"] for r in (0, 1)}
    lp, g = _cp_inputs()
    want, want_sizes, want_grad = oracle_chunk_average(lp, CP_IDS, CP_CHUNKS)
    full_grad = want_grad(g)
    assert results[0][:2] == results[1][:2]  # the same chunk means on every rank
    for rank in (0, 1):
        mean, sizes, grad, ids_unchanged = results[rank]
        assert ids_unchanged
        assert torch.equal(torch.tensor(sizes, dtype=torch.float64), want_sizes)
        _close(torch.tensor(mean), want)
        half = CP_IDS.shape[1] // 2
        _close(torch.tensor(grad), full_grad[:, rank * half:(rank + 1) * half], what="grad")


def _uncoalesced(V_s=9, V_t=7, nnz=30, seed=5, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randint(0, V_s, (nnz,), generator=gen),
                       torch.randint(0, V_t, (nnz,), generator=gen)])
    return torch.sparse_coo_tensor(idx, torch.rand(nnz, generator=gen, dtype=dtype), (V_s, V_t),
                                   check_invariants=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [(0, 9), (2, 6), (4, 4), (8, 9)])
def test_slice_sparse_projection_rows(dtype, rows):
    M = _uncoalesced(dtype=dtype)
    before = (M._indices().clone(), M._values().clone())
    start, end = rows
    got = nemo.slice_sparse_projection_rows(M, start, end)
    assert got.layout == torch.sparse_coo and got.is_coalesced()
    assert got.dtype == dtype and got.shape == (end - start, 7)
    # the oracle: the dense rows of M (duplicates summed)
    assert torch.equal(got.to_dense(), M.coalesce().to_dense()[start:end])
    _close(got.to_dense(), M.to_dense().double()[start:end], dtype_of_math=dtype)
    assert torch.equal(M._indices(), before[0]) and torch.equal(M._values(), before[1])
    # and through the projection, like the full matrix
    dense = torch.randn(end - start, 4, dtype=torch.float64)
    out = nemo.Fp32SparseMM.apply(got, dense)
    want, _ = oracle_sparse_mm(M.to_dense()[start:end], dense)
    _close(out, want)


def test_slice_sparse_projection_rows_shares_no_memory():
    M = _uncoalesced().coalesce()
    got = nemo.slice_sparse_projection_rows(M, 0, 9)
    got._values().mul_(0)
    assert M._values().abs().sum() > 0


def test_slice_sparse_projection_rows_errors():
    M = _uncoalesced()
    with pytest.raises(ValueError, match=r"need 0 <= row_start <= row_end <= V_s = 9, got "
                                         r"row_start=2, row_end=10"):
        nemo.slice_sparse_projection_rows(M, 2, 10)
    with pytest.raises(ValueError, match="row_start=5, row_end=4"):
        nemo.slice_sparse_projection_rows(M, 5, 4)
    with pytest.raises(ValueError, match="row_start must be an int"):
        nemo.slice_sparse_projection_rows(M, -1, 4)
    with pytest.raises(ValueError, match="row_end must be an int"):
        nemo.slice_sparse_projection_rows(M, 0, True)
    with pytest.raises(ValueError, match="sparse_matrix must be a 2-D sparse COO tensor"):
        nemo.slice_sparse_projection_rows(M.to_dense(), 0, 4)
