"""Property fuzzing of the cross-tokenizer family: ``compileops.xtoken.project``
and ``SparseProjection`` (hence ``compileops::xtoken_project`` and its backward), and
``chunk_sums`` / ``chunk_average`` (``compileops::xtoken_chunk_sums`` and its backward), on
both backends, against fp64 oracles written here.

Drawn: vocabulary sizes (0 too), the projection's density, how it is built (CSR buffers
made here from a dense matrix, with int32/int64 indices and their own layouts; the module;
``SparseProjection.from_coo`` with duplicates and -1 sentinels), ``p`` of 1 to 3 dims in
fp32/bf16/fp16/fp64, an optional ``columns`` subset (int32/int64, out-of-range ids too),
chunk ids (random or runs, -1 and other ids outside ``[0, C)``), and the layouts of every
tensor and of grad_output (``tests/fuzzing.py``). Contracts (the docstrings):

* project: fp32 result whose error against fp64 ``p @ M`` is that of an fp32 sum of
  ``nnz(column)`` products; gradient ``grad @ M^T`` likewise, cast to p's dtype; a column
  outside ``[0, V_t)`` raises ``IndexError`` on CPU, and gives 0 and no gradient on CUDA;
* chunk_sums: fp32 sums added in token order (an fp32 sum's error; bitwise equal across the
  backends), exact sizes, ids outside ``[0, C)`` ignored; the backward a gather (bitwise);
  chunk_average: the sums divided by the sizes (one more fp32 rounding);
* no input (grad_output included) and no memory around one is written.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compileops.xtoken import (
    ProjectionCOO,
    ProjectionCSR,
    SparseProjection,
    chunk_average,
    chunk_sums,
    project,
)
from tests.fuzzing import (
    Example,
    UNDERFLOW,
    UNIT_ROUNDOFF,
    assert_bitwise,
    assert_ran_on,
    assert_within,
    cast_error,
    check_result,
    float_dtypes,
    gpu_variant,
    index_dtypes,
    known_bug,
    oracle_grads,
    recorded_backends,
    rounded,
    summation_bound,
    use,
)

FP32 = torch.float32

# Known bugs found by this fuzzing (each has a strict xfail test below). While one is open
# the main property steps around it, so the rest of the space keeps being fuzzed; delete
# the entry together with the fix.
KNOWN_BUGS: set[str] = set()  # none open; fixed ones keep their regression test below


# ---------------------------------------------------------------------------------------
# fp64 oracles (plain torch, from the docstrings)


def oracle_project(p, M, columns):
    """``p [*, V_s] @ M [V_s, V_t]``, or with ``columns [*, K]`` the entries ``(p @ M)[*,
    columns]``, 0 (and no gradient) for a column outside ``[0, V_t)``. fp64."""
    full = p @ M
    if columns is None:
        return full
    cols = columns.long()
    valid = (cols >= 0) & (cols < M.shape[1])
    if M.shape[1] == 0:
        return torch.zeros(cols.shape, dtype=p.dtype) + 0 * p.sum()
    picked = full.gather(-1, torch.where(valid, cols, 0))
    return torch.where(valid, picked, torch.zeros((), dtype=p.dtype))


def oracle_chunks(log_probs, chunk_id, max_chunks: int, average: bool):
    """``sums[b, c] = sum of log_probs[b, t] over chunk_id[b, t] == c``, ``sizes[b, c]`` their
    count; ids outside ``[0, C)`` count nowhere; ``average``: ``sums / max(sizes, 1)``. fp64."""
    ids = chunk_id.long()
    one_hot = (ids[..., None] == torch.arange(max_chunks)).double()  # [B, T, C]
    sums = torch.einsum("btc,btv->bcv", one_hot, log_probs)
    sizes = one_hot.sum(1)
    if average:
        sums = sums / sizes.clamp(min=1)[..., None]
    return sums, sizes


# ---------------------------------------------------------------------------------------
# Building projections


def csr_buffers(M: torch.Tensor):
    """Both CSR layouts of a dense fp32 ``M [V_s, V_t]`` (its nonzeros), int64 indices:
    ``(col_indptr, col_student_ids, col_weights, row_indptr, row_teacher_ids, row_weights)``;
    inside a segment, entries ordered by the other id."""
    nz = M != 0
    s, t = nz.nonzero(as_tuple=True)  # row-major: by (student, teacher)
    t2, s2 = nz.t().nonzero(as_tuple=True)  # by (teacher, student)
    zero = torch.zeros(1, dtype=torch.int64)
    return (torch.cat([zero, nz.sum(0).cumsum(0)]), s2, M[s2, t2].contiguous(),
            torch.cat([zero, nz.sum(1).cumsum(0)]), t, M[s, t].contiguous())


def draw_projection(ex: Example, V_s: int, V_t: int):
    """``(projection, M)``: a projection as passed to ``project`` and its dense fp32 matrix."""
    via = ex.draw(st.sampled_from(["csr", "module", "from_coo"]), "projection built by")
    density = ex.draw(st.sampled_from([0.0, 0.1, 0.4, 1.0]), "density")
    if via == "from_coo":
        n = ex.size("COO entries", 60, 400)
        students = ex.randint(-1, V_s, (n,)) if V_s else torch.full((n,), -1)
        teachers = ex.randint(-1, V_t, (n,)) if V_t else torch.full((n,), -1)
        if n and ex.draw(st.booleans(), "duplicate entries"):
            half = n // 2
            students[half:] = students[:n - half].clone()
            teachers[half:] = teachers[:n - half].clone()
        weights = torch.randn(n, generator=ex.gen).float()
        weights[::5] = 0.0  # dropped
        keep = (students >= 0) & (teachers >= 0)
        M64 = torch.zeros(V_s, V_t, dtype=torch.float64)
        M64.index_put_((students[keep], teachers[keep]), weights[keep].double(), accumulate=True)
        coo = ProjectionCOO(students, teachers, weights, V_s, V_t)
        return SparseProjection.from_coo(coo, device=ex.device), M64.float()
    keep = torch.rand(V_s, V_t, generator=ex.gen) < density
    M = torch.where(keep, torch.randn(V_s, V_t, generator=ex.gen), torch.zeros(()))
    names = ("col_indptr", "col_student_ids", "col_weights",
             "row_indptr", "row_teacher_ids", "row_weights")
    indptr_dtype = ex.draw(index_dtypes(), "indptr dtype")
    ids_dtype = ex.draw(index_dtypes(), "CSR ids dtype")
    buffers = []
    for name, values in zip(names, csr_buffers(M)):
        dtype = FP32 if "weights" in name else indptr_dtype if "indptr" in name else ids_dtype
        buffers.append(ex.exact(name, values.to(dtype)))
    csr = ProjectionCSR(*buffers)
    return (SparseProjection(csr) if via == "module" else csr), M


# ---------------------------------------------------------------------------------------
# project / SparseProjection


def check_project(data, device, *, zero=None, known_bugs=frozenset(KNOWN_BUGS)) -> None:
    """The property; ``zero``: "V_s", "V_t" or "K" is 0; ``known_bugs``: the
    :data:`KNOWN_BUGS` to step around."""
    ex = Example(data, device)
    dtype = ex.draw(float_dtypes(), "p dtype")
    least = 1 if "project zero sizes" in known_bugs else 0
    V_s = 0 if zero == "V_s" else ex.size("V_s", 37, 300, min_value=least)
    V_t = 0 if zero == "V_t" else ex.size("V_t", 37, 300, min_value=least)
    lead = tuple(ex.size(f"p lead dim {i}", 7, 40)
                 for i in range(ex.draw(st.integers(0, 2), "p lead dims")))
    projection, M = draw_projection(ex, V_s, V_t)
    p = ex.floats("p", (*lead, V_s), dtype)
    columns = None
    bad_columns = False
    if zero == "K" or ex.draw(st.booleans(), "columns"):
        K = 0 if zero == "K" else ex.size("K", 13, 64, min_value=least)
        cols = ex.randint(0, V_t, (*lead, K))
        if cols.numel() and (V_t == 0 or ex.draw(st.booleans(), "out-of-range columns")):
            flat = cols.reshape(-1)
            flat[:: max(1, flat.numel() // 3)] = ex.draw(st.sampled_from([-1, V_t, V_t + 5]),
                                                        "bad column id")
            bad_columns = True
        columns = ex.indices("columns", cols, ex.draw(index_dtypes(), "columns dtype"), free=True)
    n_out = V_t if columns is None else columns.shape[-1]
    grad_out = ex.floats("grad_out", (*lead, n_out), FP32)

    # fp64 oracle (and on absolute values, for the summation bounds).
    p64 = p.detach().cpu().double().requires_grad_()
    M64 = M.double()
    cols_cpu = None if columns is None else columns.cpu()
    want = oracle_project(p64, M64, cols_cpu)
    (want_grad,) = oracle_grads(want, [p64], grad_out)
    p_abs = p64.detach().abs().requires_grad_()
    abs_out = oracle_project(p_abs, M64.abs(), cols_cpu)
    (abs_grad,) = oracle_grads(abs_out, [p_abs], grad_out.abs())
    nz = M != 0
    col_nnz = nz.sum(0)  # [V_t]
    if columns is None:
        out_terms = col_nnz.expand(*lead, V_t)
    else:
        c = cols_cpu.long()
        valid = (c >= 0) & (c < V_t)
        out_terms = torch.where(valid, col_nnz[torch.where(valid, c, 0)] if V_t else 0 * c, 0)
    K = 0 if columns is None else columns.shape[-1]
    grad_terms = nz.sum(1) + K  # per student: its entries, each after a sum of <= K grads

    for backend in ex.backends():
        pa = p.detach().requires_grad_()
        snap = ex.snapshot()
        if bad_columns and ex.on_cpu:
            with use(backend), pytest.raises(IndexError, match="columns holds teacher id"):
                project(pa, projection, columns)
            snap.check(f"by the refused {backend} call")
            continue
        with recorded_backends() as calls:
            with use(backend):
                out = project(pa, projection, columns)
            snap.check(f"by the {backend} forward")
            check_result(out, (*lead, n_out), FP32, ex.device, f"{backend} project")
            bound = summation_bound(want, abs_out, out_terms, accumulate=FP32, out=FP32,
                                    inputs_exact=dtype != torch.float64)
            assert_within(out, want, bound, f"{backend} project vs fp64 p @ M")
            with use(backend):
                (grad,) = torch.autograd.grad(out, pa, grad_out)
        snap.check(f"by the {backend} backward")
        assert_ran_on(calls, backend, "forward and backward")
        check_result(grad, p.shape, dtype, ex.device, f"{backend} grad_p")
        bound = summation_bound(want_grad, abs_grad, grad_terms, accumulate=FP32, out=dtype)
        assert_within(grad, want_grad, bound, f"{backend} grad_p vs fp64 grad @ M^T")


@given(data=st.data())
def test_project(data):
    check_project(data, "cpu")


@pytest.mark.parametrize("zero", ["V_s", "V_t", "K"])
@given(data=st.data())
def test_project_zero_sizes(data, zero):
    check_project(data, "cpu", zero=zero, known_bugs=())


@gpu_variant
@given(data=st.data())
def test_project_gpu(data, device):
    check_project(data, device)


# ---------------------------------------------------------------------------------------
# chunk_sums / chunk_average


def check_chunks(data, device, *, no_chunks=False, known_bugs=frozenset(KNOWN_BUGS)) -> None:
    """The property; ``no_chunks``: ``max_chunks = 0``; ``known_bugs``: the
    :data:`KNOWN_BUGS` to step around."""
    ex = Example(data, device)
    dtype = ex.draw(float_dtypes(), "log_probs dtype")
    average = ex.draw(st.booleans(), "chunk_average")
    B = ex.size("B", 5, 9)
    T = ex.size("T", 37, 300)
    V = ex.size("V", 37, 300)
    least = 1 if "chunk backward with max_chunks 0" in known_bugs else 0
    C = 0 if no_chunks else ex.size("max_chunks", 13, 100, min_value=least)
    if ex.draw(st.sampled_from(["runs", "random"]), "chunk ids") == "runs":
        ids = torch.sort(ex.randint(0, max(C, 1), (B, T)), dim=1).values
        ids[torch.rand(B, T, generator=ex.gen) < 0.2] = -1
    else:
        ids = ex.randint(-2, C + 3, (B, T))
    chunk_id = ex.indices("chunk_id", ids, ex.draw(index_dtypes(), "chunk_id dtype"), free=True)
    log_probs = ex.floats("log_probs", (B, T, V), dtype)
    grad_out = ex.floats("grad_out", (B, C, V), FP32)

    lp64 = log_probs.detach().cpu().double().requires_grad_()
    ids_cpu = chunk_id.cpu()
    want, want_sizes = oracle_chunks(lp64, ids_cpu, C, average)
    (want_grad,) = oracle_grads(want, [lp64], grad_out)
    abs_sums, _ = oracle_chunks(lp64.detach().abs(), ids_cpu, C, average=False)
    terms = want_sizes[..., None]
    if average:
        # The fp32 sum's error divided by the size, then one more fp32 rounding.
        sum_bound = summation_bound(want * want_sizes.clamp(min=1)[..., None], abs_sums, terms,
                                    accumulate=FP32, out=FP32,
                                    inputs_exact=dtype != torch.float64)
        bound = (sum_bound / want_sizes.clamp(min=1)[..., None]
                 + 2 * (UNIT_ROUNDOFF[FP32] * want.abs() + UNDERFLOW[FP32]))
    else:
        bound = summation_bound(want, abs_sums, terms, accumulate=FP32, out=FP32,
                                inputs_exact=dtype != torch.float64)

    sums_by_backend = {}
    for backend in ex.backends():
        lpa = log_probs.detach().requires_grad_()
        fn = chunk_average if average else chunk_sums
        snap = ex.snapshot()
        with recorded_backends() as calls:
            with use(backend):
                out, sizes = fn(lpa, chunk_id, C)
            snap.check(f"by the {backend} forward")
            what = f"{backend} {fn.__name__}"
            check_result(out, (B, C, V), FP32, ex.device, what)
            check_result(sizes, (B, C), FP32, ex.device, f"{what} sizes")
            assert_bitwise(sizes, want_sizes.float(), f"{what} sizes")
            assert_within(out, want, bound, f"{what} vs fp64")
            sums_by_backend[backend] = out
            with use(backend):
                (grad,) = torch.autograd.grad(out, lpa, grad_out)
        snap.check(f"by the {backend} backward")
        assert_ran_on(calls, backend, "forward and backward")
        check_result(grad, (B, T, V), dtype, ex.device, f"{what} grad")
        truncating = ex.interpreted(backend)
        if average:
            # grad / size in fp32 (one rounding), gathered, cast to the log_probs dtype.
            err = 2 * (UNIT_ROUNDOFF[FP32] + cast_error(dtype, truncating=truncating))
            slack = 2 * (UNDERFLOW[FP32] + UNDERFLOW[dtype])
            assert_within(grad, want_grad, err * want_grad.abs() + slack, f"{what} grad vs fp64")
        else:
            assert_bitwise(grad, rounded(want_grad, dtype, truncating=truncating),
                           f"{what} grad (a gather)")
    if len(sums_by_backend) == 2:
        # Both add each chunk's rows one by one in token order in fp32: the same bits.
        assert_bitwise(sums_by_backend["triton"], sums_by_backend["reference"],
                       "triton vs reference chunk output")


@given(data=st.data())
def test_chunks(data):
    check_chunks(data, "cpu")


@given(data=st.data())
def test_chunks_no_chunks(data):
    check_chunks(data, "cpu", no_chunks=True, known_bugs=())


@gpu_variant
@given(data=st.data())
def test_chunks_gpu(data, device):
    check_chunks(data, device)
