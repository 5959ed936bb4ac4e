"""The embedding ops eagerly: opcheck, Triton kernels (interpreter on CPU) vs reference,
bad input, determinism and batch invariance of the backward."""
import pytest
import torch

import compileops
from compileops import testing, use_backend
from compileops.embedding import reference

embedding_op = torch.ops.compileops.embedding.default
embedding_backward_op = torch.ops.compileops.embedding_backward.default


def _inputs(V=37, D=20, shape=(3, 11), id_dtype=torch.int64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=gen).to(dtype)
    ids = torch.randint(0, V, shape, generator=gen).to(id_dtype)
    return ids, weight


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_opcheck_forward(backend, out_dtype):
    ids, weight = _inputs(dtype=torch.bfloat16)
    weight.requires_grad_(True)
    with use_backend(backend):
        torch.library.opcheck(embedding_op, (ids, weight, out_dtype, None))
        torch.library.opcheck(embedding_op, (ids.int(), weight, out_dtype, 4))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck_backward(backend):
    ids, _ = _inputs()
    grad = torch.randn(*ids.shape, 20)
    with use_backend(backend):
        torch.library.opcheck(embedding_backward_op, (grad, ids, 37, None, torch.bfloat16))
        torch.library.opcheck(embedding_backward_op, (grad, ids.int(), 37, 3, torch.float32))


# --------------------------------------------------------------------------- kernels vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_triton_forward_equals_indexing(dtype, id_dtype, out_dtype):
    ids, weight = _inputs(V=53, D=70, shape=(5, 9), id_dtype=id_dtype, dtype=dtype)
    ids[0, 0], ids[0, 1] = 0, 52  # boundary ids
    with use_backend("triton"):
        out = compileops.embedding(ids, weight, out_dtype=out_dtype)
    expected = weight[ids.long()].to(out_dtype or dtype)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


def test_triton_forward_non_contiguous_table_and_ids():
    base = torch.randn(40, 64)
    weight = base[:, ::2]  # column stride 2
    ids = torch.randint(0, 40, (12, 6)).t()  # non-contiguous ids
    with use_backend("triton"):
        out = compileops.embedding(ids, weight)
    assert torch.equal(out, weight[ids])


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 7])
def test_triton_backward_matches_reference(weight_dtype, padding_idx):
    gen = torch.Generator().manual_seed(1)
    V, D = 31, 45
    ids = torch.randint(0, V, (4, 30), generator=gen)
    ids[1, :20] = 7  # a run longer than the kernel's unroll
    ids[2, :9] = 30
    grad = torch.randn(4, 30, D, generator=gen)
    with use_backend("triton"):
        got = embedding_backward_op(grad, ids, V, padding_idx, weight_dtype)
    want = reference.embedding_backward(grad, ids, V, padding_idx, weight_dtype)
    if weight_dtype == torch.float32:
        # Same additions in the same order: bitwise.
        assert torch.equal(got, want)
    else:
        # The fp32 sums are bitwise equal (checked above); Triton's CPU interpreter truncates the
        # final fp32->bf16 cast instead of rounding to nearest, so allow one bf16 ulp here. GPU
        # tests assert bitwise equality.
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)


def test_triton_backward_writes_every_row_of_a_poisoned_output():
    from compileops.embedding import kernels

    V, D = 300, 40  # > one zero-fill block, several column blocks
    ids = torch.randint(0, 50, (7, 9))
    ids[0, :4] = 299
    grad = torch.randn(7, 9, D)
    with use_backend("triton"):
        poisoned = torch.full((V, D), float("nan"))
        got = kernels.embedding_backward(grad, ids, V, 3, torch.float32, out=poisoned)
    assert not got.isnan().any()
    assert torch.equal(got, reference.embedding_backward(grad, ids, V, 3, torch.float32))


def test_triton_backward_stride_zero_and_non_contiguous_grad():
    ids = torch.randint(0, 9, (5, 6))
    expanded = torch.randn(1, 1, 8).expand(5, 6, 8)
    transposed = torch.randn(6, 5, 8).transpose(0, 1)
    for grad in (expanded, transposed):
        with use_backend("triton"):
            got = embedding_backward_op(grad, ids, 9, None, torch.float32)
        assert torch.equal(got, reference.embedding_backward(grad, ids, 9, None, torch.float32))
        assert grad.stride() == (expanded.stride() if grad is expanded else transposed.stride())


def test_empty_ids():
    weight = torch.randn(5, 4, requires_grad=True)
    ids = torch.empty(0, 3, dtype=torch.long)
    for backend in ("reference", "triton"):
        with use_backend(backend):
            out = compileops.embedding(ids, weight)
            assert out.shape == (0, 3, 4)
            out.sum().backward()
            assert torch.equal(weight.grad, torch.zeros(5, 4))
            weight.grad = None


def test_autograd_fp32_path_gives_weight_dtype_grad():
    ids, weight = _inputs(dtype=torch.bfloat16)
    weight.requires_grad_(True)
    for backend in ("reference", "triton"):
        with use_backend(backend):
            out = compileops.embedding(ids, weight, out_dtype=torch.float32)
            out.backward(torch.ones_like(out))
        assert weight.grad.dtype == torch.bfloat16
        counts = torch.bincount(ids.reshape(-1), minlength=37).to(torch.bfloat16)
        assert torch.equal(weight.grad, counts[:, None].expand(37, 20))
        weight.grad = None


def test_inputs_not_modified():
    ids, weight = _inputs()
    ids_copy, weight_copy = ids.clone(), weight.clone()
    grad = torch.randn(*ids.shape, 20)
    grad_copy = grad.clone()
    for backend in ("reference", "triton"):
        with use_backend(backend):
            compileops.embedding(ids, weight, out_dtype=torch.float64)
            embedding_backward_op(grad, ids, 37, 2, torch.float32)
    assert torch.equal(ids, ids_copy) and torch.equal(weight, weight_copy)
    assert torch.equal(grad, grad_copy)


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_bitwise_deterministic_over_10_runs(backend):
    ids, weight = _inputs(V=23, D=16, shape=(4, 40))
    weight = weight.to(torch.bfloat16).requires_grad_(True)
    with use_backend(backend):
        testing.assert_deterministic(
            lambda i, w: compileops.embedding(i, w, out_dtype=torch.float32), [ids, weight], runs=10
        )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_forward_batch_invariant(backend):
    ids, weight = _inputs(V=29, D=16, shape=(6, 7))
    with use_backend(backend):
        testing.assert_batch_invariant(lambda i: compileops.embedding(i, weight), [ids])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_batch_invariant(backend):
    """Rows touched only by batch A get bitwise the same gradient whether or not other
    sequences (with other ids, or the padding id) sit before, after or between them."""
    V, D = 60, 24
    gen = torch.Generator().manual_seed(3)
    ids_a = torch.randint(0, 30, (3, 20), generator=gen)
    ids_a[0, :15] = 4
    grad_a = torch.randn(3, 20, D, generator=gen)
    ids_b = torch.randint(30, 60, (5, 20), generator=gen)  # disjoint ids
    ids_b[1, :5] = 59  # the padding id, used below
    grad_b = torch.randn(5, 20, D, generator=gen)
    touched_a = torch.unique(ids_a)
    with use_backend(backend):
        alone = embedding_backward_op(grad_a, ids_a, V, None, torch.float32)
        for ids, grad in (
            (torch.cat([ids_a, ids_b]), torch.cat([grad_a, grad_b])),
            (torch.cat([ids_b, ids_a]), torch.cat([grad_b, grad_a])),
            (torch.cat([ids_b[:2], ids_a, ids_b[2:]]), torch.cat([grad_b[:2], grad_a, grad_b[2:]])),
        ):
            mixed = embedding_backward_op(grad, ids, V, 59, torch.float32)
            assert torch.equal(mixed[touched_a], alone[touched_a])
            assert torch.all(mixed[59] == 0)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bad", [-1, -5, 37, 1000])
def test_out_of_range_ids_raise_index_error(backend, bad):
    ids, weight = _inputs()
    ids[1, 2] = bad
    with use_backend(backend), pytest.raises(IndexError, match=f"id {bad} is out of range"):
        compileops.embedding(ids, weight)


def test_strict_mode_checks_on_host():
    ids, weight = _inputs()
    ids[0, 0] = 99
    compileops.set_strict_index_checks(True)
    try:
        with pytest.raises(IndexError, match="id 99 is out of range"):
            compileops.embedding(ids, weight)
    finally:
        compileops.set_strict_index_checks(False)


BAD_FORWARD = [
    ("float ids", lambda ids, w: (ids.float(), w), "ids must be int32 or int64"),
    ("1-D weight", lambda ids, w: (ids, w[0]), "weight must be 2-D"),
    ("3-D weight", lambda ids, w: (ids, w[None]), "weight must be 2-D"),
    ("int weight", lambda ids, w: (ids, w.long()), "weight must be a floating-point tensor"),
    ("device mismatch", lambda ids, w: (ids.to("meta"), w), "ids is on meta but weight is on cpu"),
]


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_bad_forward_input_eager(case):
    _, make, message = case
    ids, weight = make(*_inputs())
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        compileops.embedding(ids, weight)


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_bad_forward_input_at_trace_time(case):
    _, make, message = case
    ids, weight = make(*_inputs())
    compiled = torch.compile(lambda i, w: compileops.embedding(i, w), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(ids, weight)


def test_bad_out_dtype_and_padding_idx():
    ids, weight = _inputs()
    with pytest.raises(TypeError, match="out_dtype must be a floating-point dtype"):
        compileops.embedding(ids, weight, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 37\)"):
        compileops.embedding(ids, weight, padding_idx=37)
    with pytest.raises(ValueError, match=r"padding_idx must be in \[0, 37\)"):
        compileops.embedding(ids, weight, padding_idx=-38)


def test_bad_backward_input():
    ids, _ = _inputs()
    with pytest.raises(ValueError, match=r"grad must be \[\*ids.shape, D\]"):
        embedding_backward_op(torch.randn(3, 10, 4), ids, 37, None, torch.float32)
    with pytest.raises(TypeError, match="weight_dtype must be a floating-point dtype"):
        embedding_backward_op(torch.randn(3, 11, 4), ids, 37, None, torch.int64)


def test_unknown_and_unavailable_backends():
    with pytest.raises(ValueError, match="unknown backend 'cutlass'"):
        use_backend("cutlass")


# --------------------------------------------------------------------------- backward kernel variants


def _run_pattern_ids(V=67, seed=5):
    """Ids whose sorted runs hit every code path of the backward kernel: a hot id at row 0 (37
    tokens: longer than any unroll or tile, several run blocks and long-run steps, not a
    multiple of the tile), a hot id at row V-1 (the last run of the sorted order, 20 tokens),
    runs of exactly 4, 5, 8, 9, 16 and 17 tokens (unroll and tile boundaries), the padding
    candidates 7 (short) and 11 (long), singletons; positions shuffled so order matters."""
    gen = torch.Generator().manual_seed(seed)
    runs = {0: 37, V - 1: 20, 3: 4, 5: 5, 13: 8, 21: 9, 30: 16, 41: 17, 7: 2, 11: 12}
    ids = [i for i, n in runs.items() for _ in range(n)]
    ids += torch.randint(0, V, (40,), generator=gen).tolist()
    ids = torch.tensor(ids)
    return ids[torch.randperm(ids.numel(), generator=gen)].reshape(2, -1)


def _backward_inputs(grad_dtype=torch.float32, V=67, D=40, seed=5):
    ids = _run_pattern_ids(V, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(*ids.shape, D, generator=gen).to(grad_dtype)
    grad.view(-1)[::7] = -0.0  # signed zeros must survive bitwise
    return ids, grad


def _assert_bitwise(got, want):
    assert got.dtype == want.dtype
    int_view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    assert torch.equal(got.view(int_view), want.view(int_view))


BACKWARD_VARIANTS = [
    {},
    {"impl": "legacy"},
    {"impl": "legacy", "unroll": 4, "tile": 4, "block_col": 16, "fill_rows": 16},
    {"long_mode": "tile"},
    {"long_mode": "tile", "tile": 4, "block_col": 16},
    {"run_block": 1, "unroll": 1, "tile": 1},
    {"run_block": 1, "unroll": 2, "tile": 2, "long_mode": "tile"},
    {"run_block": 2, "unroll": 4, "tile": 8},
    {"run_block": 8, "unroll": 8, "tile": 4, "block_col": 16},
    {"run_block": 4, "unroll": 3, "tile": 16, "block_col": 32},
    {"fill": "map"},
    {"fill_rows": 4, "fill_col": 16},
    {"fill_rows": 1, "fill_col": 8, "fill": "map"},
    {"maxnreg": None, "num_warps": 2},
    {"runs_per_fill": 16},
    {"runs_per_fill": 1, "fill_rows": 1, "fill_col": 16},
    {"runs_per_fill": 3, "fill_rows": 4, "run_block": 1, "unroll": 1},
    {"fill_evict": "evict_first", "prefetch": 64},  # hints: prefetch is CUDA-only, a no-op here
    # The separate long-run kernel: every long run (default long_min = unroll), or only the
    # runs of more than long_min entries (the others stay on the main kernel's long path).
    {"long_kernel": True},
    {"long_kernel": True, "run_block": 2, "unroll": 4, "long_tile": 4, "long_block_col": 16},
    {"long_kernel": True, "long_min": 16, "long_tile": 8, "long_block_col": 32, "tile": 4},
    {"long_kernel": True, "long_min": 9, "long_block": 8, "long_tile": 2, "long_stages": 1,
     "long_warps": 2, "run_block": 8, "unroll": 8},
    # Its register-resident body, narrow column blocks (one partial, D=40), several steps.
    {"long_kernel": True, "long_body": "registers", "long_block_col": 16, "long_tile": 8},
    {"long_kernel": True, "long_body": "registers", "long_min": 16, "long_block_col": 32,
     "long_tile": 4, "long_prefetch": 64},  # prefetch: CUDA-only hint, off here
    # The two-launch Triton sort (the CUDA default for <= 65536 ids) instead of torch.sort.
    {"sort": "triton"},
    {"sort": "triton", "long_kernel": True, "long_min": 16},
    # Hot-first order (most frequent ids first; runs not in id order) with the count map.
    {"sort": "triton", "fill": "map", "hot_first": True},
    {"sort": "triton", "fill": "map", "hot_first": True, "long_kernel": True, "long_min": 16},
    {"sort": "triton", "fill": "map", "hot_first": True, "long_mode": "tile", "run_block": 2,
     "unroll": 4, "tile": 8},
]


PADDINGS = [None, 7, 11, 0]  # none, on a short run, on a long run, on the hot row 0
VARIANT_CASES = [(v, PADDINGS[i % 4]) for i, v in enumerate(BACKWARD_VARIANTS)] + [
    (v, p) for v in BACKWARD_VARIANTS[:2] for p in PADDINGS[1:]
]


@pytest.mark.parametrize(
    "variant,padding_idx", VARIANT_CASES,
    ids=[(",".join(f"{k}={v[k]}" for k in v) or "default") + f"-pad{p}" for v, p in VARIANT_CASES],
)
def test_triton_backward_variants_bitwise_and_every_row_written_once(variant, padding_idx):
    """Every kernel variant (long runs across several steps and run blocks, hot ids at rows 0
    and V-1, run-length boundaries, padding on a short or long run) is bitwise the reference,
    including signed zeros, and writes every row of a NaN-poisoned output."""
    from compileops.embedding import kernels

    V, D = 67, 40
    ids, grad = _backward_inputs(V=V, D=D)
    want = reference.embedding_backward(grad, ids, V, padding_idx, torch.float32)
    poisoned = torch.full((V, D), float("nan"))
    got = kernels.embedding_backward(grad, ids, V, padding_idx, torch.float32, out=poisoned, **variant)
    assert got.data_ptr() == poisoned.data_ptr()
    _assert_bitwise(got, want)
    if padding_idx is not None:
        assert torch.all(got[padding_idx] == 0)


@pytest.mark.parametrize("variant", [{}, {"long_mode": "tile"}, {"impl": "legacy"}], ids=["default", "tile", "legacy"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float64])
def test_triton_backward_grad_dtypes_bitwise(variant, grad_dtype):
    """Half-precision grads summed in fp32 (fp32 out: no final rounding involved) and fp64
    grads summed in fp64, with the element-size dependent default run block and tile."""
    from compileops.embedding import kernels

    V = 67
    ids, grad = _backward_inputs(grad_dtype)
    out_dtype = torch.float64 if grad_dtype == torch.float64 else torch.float32
    got = kernels.embedding_backward(grad, ids.int(), V, None, out_dtype, **variant)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, None, out_dtype))


@pytest.mark.parametrize("run_length", [1, 4, 5, 15, 16, 17, 32, 33])
@pytest.mark.parametrize("long_mode", ["rows", "tile"])
def test_triton_backward_single_run_lengths(run_length, long_mode):
    """One id repeated run_length times (plus a neighbour run): the long path's full steps,
    its partial last step, and runs that end exactly on a step boundary."""
    from compileops.embedding import kernels

    V, D = 9, 24
    ids = torch.tensor([4] * run_length + [8, 8, 1])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(run_length))]
    grad = torch.randn(ids.numel(), D, generator=torch.Generator().manual_seed(1))
    got = kernels.embedding_backward(grad, ids, V, None, torch.float32, long_mode=long_mode,
                                     run_block=2, unroll=4, tile=16)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, None, torch.float32))


@pytest.mark.parametrize("fill_rows", [None, 64, 2])
def test_triton_backward_fill_chunks_and_brackets(fill_rows):
    """Fill programs of several store chunks (D=100: 64-row chunks, 256 rows per program by
    default), touched rows on chunk and program boundaries and a hot row inside a bracket."""
    from compileops.embedding import kernels

    V, D = 300, 100
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([0, 63, 64, 127, 128, 255, 256, 299] + [200] * 30)
    ids = torch.cat([ids, torch.randint(0, V, (20,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    grad = torch.randn(ids.numel(), D, generator=gen)
    poisoned = torch.full((V, D), float("nan"))
    got = kernels.embedding_backward(grad, ids, V, 64, torch.float32, out=poisoned, fill_rows=fill_rows)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, 64, torch.float32))


def test_triton_backward_long_run_non_contiguous_grad():
    """Non-unit column stride (the default run block 1 and tile 4) with long runs."""
    from compileops.embedding import kernels

    ids, grad = _backward_inputs()
    transposed = grad.transpose(-1, -2).contiguous().transpose(-1, -2)
    strided = torch.randn(*ids.shape, 80)[..., ::2]
    for g in (transposed, strided):
        assert g.stride(-1) != 1
        got = kernels.embedding_backward(g, ids, 67, 11, torch.float32)
        _assert_bitwise(got, reference.embedding_backward(g, ids, 67, 11, torch.float32))


def test_triton_backward_bad_tuning_arguments():
    from compileops.embedding import kernels

    ids, grad = _backward_inputs()
    for kwargs, message in [
        ({"impl": "fast"}, "unknown impl"),
        ({"long_mode": "pipelined"}, "unknown long_mode"),
        ({"fill": "memset"}, "unknown fill"),
        ({"run_block": 8, "unroll": 4}, r"unroll \(4\) must be >= max\(1, run_block - 1\)"),
        ({"tile": 12}, "tile must be a power of two"),
        ({"run_block": 3}, "run_block must be a power of two"),
        ({"block_col": 100}, "block_col must be a power of two"),
        ({"runs_per_fill": -1}, "runs_per_fill must be >= 0"),
        ({"prefetch": 48}, "prefetch must be 0 or a power of two"),
        ({"fill_evict": "evict_normal"}, "fill_evict must be"),
        ({"long_kernel": True, "long_tile": 6}, "long_tile must be a power of two"),
        ({"long_kernel": True, "long_block_col": 48}, "long_block_col must be a power of two"),
        ({"long_kernel": True, "long_stages": 0}, "long_stages must be >= 1"),
        ({"long_kernel": True, "unroll": 8, "long_min": 5}, r"long_min \(5\) must be >= unroll"),
        ({"long_kernel": True, "long_min": 6, "long_block": 8}, r"long_block \(8\) must be <= long_min"),
        ({"long_kernel": True, "long_block": 3}, "long_block must be a power of two"),
        ({"long_kernel": True, "long_tile": 256, "long_stages": 8}, "bytes of shared memory"),
        ({"long_kernel": True, "long_body": "smem"}, "unknown long_body"),
        ({"sort": "radix"}, "unknown sort"),
        ({"long_kernel": True, "long_body": "registers", "long_prefetch": 48},
         "long_prefetch must be 0 or a power of two"),
    ]:
        with pytest.raises(ValueError, match=message):
            kernels.embedding_backward(grad, ids, 67, None, torch.float32, **kwargs)


@pytest.mark.parametrize("variant", [{}, {"sort": "triton"}, {"fill": "map"}, {"impl": "legacy"}],
                         ids=["default", "triton-sort", "map", "legacy"])
def test_triton_backward_strided_ids(variant):
    """A strided 1-D view of ids (``reshape(-1)`` keeps it strided) gives the reference's
    gradient with every sort and fill: the kernels index the ids as a dense vector."""
    from compileops.embedding import kernels

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (80,), generator=gen)[::2]
    assert not ids.reshape(-1).is_contiguous()
    grad = torch.randn(40, 8, generator=gen)
    got = kernels.embedding_backward(grad, ids, 50, None, torch.float32, **variant)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, 50, None, torch.float32))


def test_triton_backward_diag_launches_skip_their_part():
    """The benchmark-only ``diag`` launches skip exactly their part of the work."""
    from compileops.embedding import kernels

    V, D = 67, 40
    ids, grad = _backward_inputs(V=V, D=D)
    want = reference.embedding_backward(grad, ids, V, None, torch.float32)
    sorted_ids, order = kernels._sort_ids(ids.reshape(-1), V)
    config = kernels.backward_config(grad.reshape(-1, D))
    touched = torch.zeros(V, dtype=torch.bool)
    touched[ids.reshape(-1)] = True
    counts = torch.bincount(ids.reshape(-1), minlength=V)
    long_rows = counts > config["unroll"]
    for diag, written in [(1, ~long_rows), (2, touched), (3, ~touched)]:
        out = torch.full((V, D), float("nan"))
        kernels.launch_backward_kernel(sorted_ids, order, None, grad.reshape(-1, D), out, None,
                                       diag=diag, **config)
        assert not out[written].isnan().any() and out[~written].isnan().all(), diag
        _assert_bitwise(out[written], want[written])


# --------------------------------------------------------------------------- long-run kernel


LONG_SMALL = {"run_block": 2, "unroll": 4, "long_tile": 4}  # long: runs of more than 4 entries


@pytest.mark.parametrize("run_length", [5, 8, 9, 30])
def test_long_kernel_run_lengths_bitwise(run_length):
    """Long runs of 4-row pipelined steps: a single step (5), ending exactly on a step
    boundary (8) or one row past it (9), several steps (30: 7.5); the same length again as
    the last run of the sorted ids (row V-1), and the padding row with a long run of 7
    (zeros, written by the main kernel)."""
    from compileops.embedding import kernels

    V, D = 11, 20
    ids = torch.tensor([4] * run_length + [V - 1] * run_length + [6] * 7 + [2] * 3 + [0, 8])
    gen = torch.Generator().manual_seed(run_length)
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    grad = torch.randn(ids.numel(), D, generator=gen)
    grad.view(-1)[::5] = -0.0
    for padding_idx in (None, 6):
        poisoned = torch.full((V, D), float("nan"))
        got = kernels.embedding_backward(grad, ids, V, padding_idx, torch.float32, out=poisoned,
                                         long_kernel=True, **LONG_SMALL)
        _assert_bitwise(got, reference.embedding_backward(grad, ids, V, padding_idx, torch.float32))


@pytest.mark.parametrize("grad_dtype,id_dtype", [
    (torch.float32, torch.int64), (torch.bfloat16, torch.int32), (torch.float16, torch.int64),
    (torch.float64, torch.int32)], ids=["fp32", "bf16", "fp16", "fp64"])
def test_long_kernel_grad_dtypes_bitwise(grad_dtype, id_dtype):
    """Every grad dtype (fp32 sums, fp64 for fp64 grads; fp32/fp64 out so that no final
    rounding is involved), int32 and int64 ids, D not a multiple of the column block, several
    long runs (the hot row 0, the last row V-1, padding 11 on a long run) and short ones."""
    from compileops.embedding import kernels

    V = 67
    ids, grad = _backward_inputs(grad_dtype, D=24)
    out_dtype = torch.float64 if grad_dtype == torch.float64 else torch.float32
    poisoned = torch.full((V, 24), float("nan"), dtype=out_dtype)
    got = kernels.embedding_backward(grad, ids.to(id_dtype), V, 11, out_dtype, out=poisoned,
                                     long_kernel=True, long_block_col=16, long_tile=8)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, 11, out_dtype))


def test_long_kernel_non_contiguous_and_stride_zero_grads():
    """Non-unit column stride (the default run block 1 and tile 4 then) and a stride-0
    (expanded) grad, whose every row is the same memory, with long runs."""
    from compileops.embedding import kernels

    ids, _ = _backward_inputs()
    strided = torch.randn(*ids.shape, 48)[..., ::2]
    expanded = torch.randn(1, 1, 24).expand(*ids.shape, 24)
    for g in (strided, expanded):
        got = kernels.embedding_backward(g, ids, 67, 7, torch.float32, long_kernel=True)
        _assert_bitwise(got, reference.embedding_backward(g, ids, 67, 7, torch.float32))


def test_long_kernel_and_main_kernel_write_disjoint_rows():
    """With ``long_kernel`` the main kernel writes exactly the rows that are not runs of more
    than ``long_min`` entries, the long-run kernel exactly those: each row once."""
    from compileops.embedding import kernels

    V, D = 67, 40
    ids, grad = _backward_inputs(V=V, D=D)
    flat = grad.reshape(-1, D)
    want = reference.embedding_backward(grad, ids, V, 11, torch.float32)
    counts = torch.bincount(ids.reshape(-1), minlength=V)
    sorted_ids, order = kernels._sort_ids(ids.reshape(-1), V)
    for long_min in (None, 16):
        config = kernels.backward_config(flat, long_kernel=True, long_min=long_min)
        long_rows = counts > config["long_min"]
        long_rows[11] = False  # padding: the main kernel writes its zeros
        main_out = torch.full((V, D), float("nan"))
        kernels.launch_backward_kernel(sorted_ids, order, None, flat, main_out, 11,
                                       launch_long=False, **config)
        assert main_out[long_rows].isnan().all() and not main_out[~long_rows].isnan().any()
        _assert_bitwise(main_out[~long_rows], want[~long_rows])
        long_out = torch.full((V, D), float("nan"))
        kernels.launch_long_runs_kernel(sorted_ids, order, flat, long_out, 11,
                                        **kernels._long_launch_args(config))
        assert long_out[~long_rows].isnan().all() and not long_out[long_rows].isnan().any()
        _assert_bitwise(long_out[long_rows], want[long_rows])


def _run_end_probe():
    """A kernel storing ``_run_end`` of each given start (defined on first use, as the
    package defines its kernels, after the conftest's interpreter switch)."""
    global _RUN_END_PROBE
    if _RUN_END_PROBE is None:
        import triton
        import triton.language as tl

        from compileops.embedding.kernels import _run_end

        @triton.jit
        def probe(sorted_ids_ptr, starts_ptr, ends_ptr, n_tokens, SEARCH: tl.constexpr):
            i = tl.program_id(0)
            start = tl.load(starts_ptr + i)
            row = tl.load(sorted_ids_ptr + start)
            tl.store(ends_ptr + i, _run_end(sorted_ids_ptr, start, row, n_tokens, SEARCH))

        # The interpreter resolves names in the module's globals only, not in closures.
        probe.fn.__globals__["_run_end"] = _run_end
        _RUN_END_PROBE = probe
    return _RUN_END_PROBE


_RUN_END_PROBE = None


def test_long_kernel_run_end_search_boundaries():
    """``_run_end``: one coarse load covers 64 x 64 positions, the fine one 64. Runs ending
    on either boundary, one short of it or one past it (4097, 8193: more coarse steps), the
    last run of the sorted ids, searched from their starts (a tiny probe kernel: summing such
    runs in the interpreter would be slow; the sums are tested above)."""
    from compileops.embedding import kernels

    probe = _run_end_probe()
    lengths = [1, 63, 64, 65, 4095, 4096, 4097, 8193, 5, 129]
    sorted_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                         torch.tensor(lengths))
    ends = torch.cumsum(torch.tensor(lengths), 0).to(torch.int32)
    starts = ends - torch.tensor(lengths, dtype=torch.int32)
    got = torch.empty_like(ends)
    probe[(len(lengths),)](sorted_ids, starts, got, sorted_ids.numel(), SEARCH=kernels._RUN_END_SEARCH)
    assert got.tolist() == ends.tolist()


def test_long_kernel_diag_skips_long_runs():
    """``diag=1`` with the long kernel on: neither launch writes the long runs."""
    from compileops.embedding import kernels

    V, D = 67, 40
    ids, grad = _backward_inputs(V=V, D=D)
    sorted_ids, order = kernels._sort_ids(ids.reshape(-1), V)
    config = kernels.backward_config(grad.reshape(-1, D), long_kernel=True, long_min=9)
    long_rows = torch.bincount(ids.reshape(-1), minlength=V) > config["unroll"]
    out = torch.full((V, D), float("nan"))
    kernels.launch_backward_kernel(sorted_ids, order, None, grad.reshape(-1, D), out, None,
                                   diag=1, **config)
    assert out[long_rows].isnan().all() and not out[~long_rows].isnan().any()


_SM90_LONG_KERNEL = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from compileops.embedding import kernels

def compile_long(ptr, tile, cols, stages, warps, body=0, maxnreg=None):
    # Real-launch specialisations: unit column stride, 16-divisible pointers and sizes.
    names = ["sorted_ids_ptr", "order_ptr", "grad_ptr", "out_ptr", "n_tokens", "num_embeddings",
             "dim", "padding_idx", "stride_g_row"]
    types = ["*i32", "*i32", ptr, ptr, "i32", "i32", "i32", "i32", "i32"]
    consts = dict(stride_g_col=1, HAS_PADDING=False, ACC_FP64=False, LONG_MIN=4, LONG_BLOCK=4,
                  LONG_TILE=tile, LONG_BLOCK_COL=cols, LONG_STAGES=stages, SEARCH=64,
                  LONG_BODY=body, LONG_PREFETCH=0)
    sig = dict(zip(names, types), **{k: "constexpr" for k in consts})
    divisible = [i for i, n in enumerate(names) if n != "padding_idx"]
    src = ASTSource(fn=kernels.embedding_long_runs_kernel, signature=sig, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, debug=True, sanitize_overflow=False,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))

def resource_usage(kernel):
    """ptxas' (REG, STACK, LOCAL) of a compiled kernel, via the cuobjdump Triton ships."""
    import os, re, subprocess, tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", text)
    return [int(g) for g in m.groups()] if m else None

out = {}
# The register body (launch_long_runs_kernel's maxnreg: 255 past 32 rows per step).
out["registers-32x64"] = {"usage": resource_usage(compile_long("*bf16", 64, 32, 1, 1, body=1,
                                                               maxnreg=255))}
for name, args in {"bf16-16x1024-s3": ("*bf16", 16, 1024, 3, 4),
                   "bf16-32x512-s4": ("*bf16", 32, 512, 4, 2)}.items():
    k = compile_long(*args)
    loop = k.asm["ttgir"].split("scf.for", 1)[1]
    out[name] = {"async_in_loop": "ttg.async_copy_global_to_local" in loop and "ttg.async_wait" in loop,
                 "shared": k.metadata.shared}
print(json.dumps(out))
'''


def test_long_kernel_compiles_for_sm90_pipelined():
    """Ahead-of-time sm_90 compile (no GPU needed): the long-run loop's gather is
    software-pipelined (cp.async into shared memory, waited on inside the loop), with
    ``LONG_STAGES - 1`` tile buffers of shared memory. The register body (64 rows per step,
    32 columns, one warp) compiles with no spills (no stack, no local memory)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        pytest.skip("triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_LONG_KERNEL], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (tile, cols, stages) in {"bf16-16x1024-s3": (16, 1024, 3),
                                       "bf16-32x512-s4": (32, 512, 4)}.items():
        assert got[name]["async_in_loop"], f"{name}: the gather loop is not pipelined"
        buffers = (stages - 1) * tile * cols * 2
        assert buffers <= got[name]["shared"] < buffers + 4096, (name, got[name]["shared"])
    usage = got["registers-32x64"]["usage"]
    if usage is None:
        pytest.skip("no cuobjdump in this Triton install: spill check not run")
    regs, stack, local = usage
    assert stack == 0 and local == 0, usage


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,sort_block,high", [
    (1, 16, 5), (2, 2, 1), (15, 16, 3), (16, 16, 100), (17, 16, 4), (300, 8, 7),
    (1000, 16, 50), (1024, 16, 2**31 - 1),  # 64 blocks: the widest merge tile
])
def test_triton_id_sort_is_torch_stable_sort(n, sort_block, high, id_dtype):
    """The two-launch Triton sort under the interpreter (small blocks, so that many sorted
    blocks are merged): exactly torch.sort(stable=True)'s ids and token positions, heavy
    repeats, a padded last block, ids up to 2**31 - 1."""
    from compileops.embedding.sort import stable_sort_ids

    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, high, (n,), generator=gen, dtype=torch.int64)
    ids[: n // 4] = high - 1
    ids = ids.to(id_dtype)
    before = ids.clone()
    got_ids, got_order = stable_sort_ids(ids, sort_block=sort_block)
    want_ids, want_order = torch.sort(ids.to(torch.int32), stable=True)
    assert got_ids.dtype == torch.int32 and got_order.dtype == torch.int64
    assert torch.equal(got_ids, want_ids) and torch.equal(got_order, want_order)
    assert torch.equal(ids, before)


@pytest.mark.parametrize("n,sort_block,vocab", [(1, 16, 5), (17, 16, 4), (300, 8, 37),
                                                (1000, 16, 50), (1024, 16, 2**20)])
def test_triton_id_sort_hot_first(n, sort_block, vocab):
    """Hot-first keys: ids by decreasing count, ties by id, each id's tokens contiguous and in
    position order; the sorted ids are the tokens' own ids (also for an out-of-range id)."""
    from compileops.embedding import kernels
    from compileops.embedding.sort import stable_sort_ids

    gen = torch.Generator().manual_seed(n)
    ids = (torch.rand(n, generator=gen) ** 3 * vocab).long()
    ids[: n // 5] = vocab - 1
    counts = kernels._id_counts(ids, vocab)
    assert torch.equal(counts, torch.bincount(ids, minlength=vocab).int())
    got_ids, got_order = stable_sort_ids(ids, sort_block=sort_block, counts=counts)
    key = (n - counts.long()[ids]) * vocab + ids  # count descending, then id
    want_order = torch.sort(key, stable=True).indices
    assert torch.equal(got_order, want_order) and torch.equal(got_ids, ids[want_order].int())
    if n >= 17:  # an out-of-range id keeps its value in the sorted ids (the kernels assert)
        bad = ids.clone()
        bad[3] = vocab + 5
        bad_ids, bad_order = stable_sort_ids(bad, sort_block=sort_block, counts=counts)
        assert torch.equal(bad_ids, bad[bad_order].int()) and (bad_ids == vocab + 5).sum() == 1


def test_hot_first_needs_a_map_and_the_triton_sort():
    from compileops.embedding import kernels
    from compileops.embedding.sort import hot_first_fits

    ids, grad = torch.tensor([1, 2, 2]), torch.randn(3, 4)
    with pytest.raises(ValueError, match="hot_first needs"):
        kernels.embedding_backward(grad, ids, 5, None, torch.float32, hot_first=True,
                                   sort="triton")  # fill="search" on the one-launch schedule
    with pytest.raises(ValueError, match="hot_first needs"):
        kernels.embedding_backward(grad, ids, 5, None, torch.float32, hot_first=True,
                                   sort="torch", fill="map")
    assert hot_first_fits(65536, 2**30) and not hot_first_fits(65536, 2**31)


def test_triton_id_sort_bad_arguments():
    from compileops.embedding.sort import stable_sort_ids

    with pytest.raises(ValueError, match="sort_block must be a power of two"):
        stable_sort_ids(torch.zeros(4, dtype=torch.int64), sort_block=12)
    with pytest.raises(ValueError, match=r"sorts at most 1024 ids with sort_block 16, got 1025"):
        stable_sort_ids(torch.zeros(1025, dtype=torch.int64), sort_block=16)
    empty_ids, empty_order = stable_sort_ids(torch.zeros(0, dtype=torch.int32))
    assert empty_ids.numel() == 0 and empty_order.numel() == 0

