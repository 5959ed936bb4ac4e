"""The embedding Triton kernels directly (interpreter on CPU): every ``BackwardConfig`` option
bitwise against the reference, each row written once, the launch's program kinds, the id
sorts and the per-id maps."""
import pytest
import torch

from compileops.embedding import reference


def _kernels():
    # Imported on use, after the conftest has switched the interpreter on.
    from compileops.embedding import kernels

    return kernels


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


def _backward(grad, ids, V, padding_idx, dtype, out=None, **options):
    kernels = _kernels()
    return kernels.embedding_backward(grad, ids, V, padding_idx, dtype,
                                      kernels.BackwardConfig(**options), out=out)


# --------------------------------------------------------------------------- backward options


def test_triton_backward_writes_every_row_of_a_poisoned_output():
    V, D = 300, 40  # > one zero-fill block, several column blocks
    ids = torch.randint(0, 50, (7, 9))
    ids[0, :4] = 299
    grad = torch.randn(7, 9, D)
    poisoned = torch.full((V, D), float("nan"))
    got = _kernels().embedding_backward(grad, ids, V, 3, torch.float32, out=poisoned)
    assert not got.isnan().any()
    assert torch.equal(got, reference.embedding_backward(grad, ids, V, 3, torch.float32))


BACKWARD_VARIANTS = [
    {},
    {"tile": 4, "block_col": 16},
    {"run_block": 1, "unroll": 1, "tile": 1},
    {"run_block": 1, "unroll": 2, "tile": 2},
    {"run_block": 2, "unroll": 4, "tile": 8},
    {"run_block": 8, "unroll": 8, "tile": 4, "block_col": 16},
    {"run_block": 4, "unroll": 3, "tile": 16, "block_col": 32},
    {"fill": "map"},
    {"fill_rows": 4, "fill_col": 16},
    {"fill_rows": 1, "fill_col": 8, "fill": "map"},
    {"maxnreg": None, "num_warps": 2},
    {"fill_rows": 1, "fill_col": 16},
    {"fill_rows": 4, "run_block": 1, "unroll": 1},
    # The two-launch Triton sort (the CUDA default for <= 65536 ids) instead of torch.sort.
    {"sort": "triton"},
    # Hot-first order (most frequent ids first; runs not in id order) with the count map.
    {"sort": "triton", "fill": "map", "hot_first": True},
    {"sort": "triton", "fill": "map", "hot_first": True, "run_block": 2, "unroll": 4, "tile": 8},
]


PADDINGS = [None, 7, 11, 0]  # none, on a short run, on a long run, on the hot row 0
VARIANT_CASES = [(v, PADDINGS[i % 4]) for i, v in enumerate(BACKWARD_VARIANTS)] + [
    (v, p) for v in BACKWARD_VARIANTS[:1] for p in PADDINGS[1:]
]


@pytest.mark.parametrize(
    "variant,padding_idx", VARIANT_CASES,
    ids=[(",".join(f"{k}={v[k]}" for k in v) or "default") + f"-pad{p}" for v, p in VARIANT_CASES],
)
def test_triton_backward_variants_bitwise_and_every_row_written_once(variant, padding_idx):
    """Every option (long runs across several steps and run blocks, hot ids at rows 0 and
    V-1, run-length boundaries, padding on a short or long run) is bitwise the reference,
    including signed zeros, and writes every row of a NaN-poisoned output."""
    V, D = 67, 40
    ids, grad = _backward_inputs(V=V, D=D)
    want = reference.embedding_backward(grad, ids, V, padding_idx, torch.float32)
    poisoned = torch.full((V, D), float("nan"))
    got = _backward(grad, ids, V, padding_idx, torch.float32, out=poisoned, **variant)
    assert got.data_ptr() == poisoned.data_ptr()
    _assert_bitwise(got, want)
    if padding_idx is not None:
        assert torch.all(got[padding_idx] == 0)


@pytest.mark.parametrize("variant", [{}, {"sort": "triton", "fill": "map", "hot_first": True}],
                         ids=["default", "hot-first"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float64])
def test_triton_backward_grad_dtypes_bitwise(variant, grad_dtype):
    """Half-precision grads summed in fp32 (fp32 out: no final rounding involved) and fp64
    grads summed in fp64, with the element-size dependent default run block and tile."""
    V = 67
    ids, grad = _backward_inputs(grad_dtype)
    out_dtype = torch.float64 if grad_dtype == torch.float64 else torch.float32
    got = _backward(grad, ids.int(), V, None, out_dtype, **variant)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, None, out_dtype))


@pytest.mark.parametrize("run_length", [1, 4, 5, 15, 16, 17, 32, 33])
def test_triton_backward_single_run_lengths(run_length):
    """One id repeated run_length times (plus a neighbour run): the long path's full steps,
    its partial last step, and runs that end exactly on a step boundary."""
    V, D = 9, 24
    ids = torch.tensor([4] * run_length + [8, 8, 1])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(run_length))]
    grad = torch.randn(ids.numel(), D, generator=torch.Generator().manual_seed(1))
    got = _backward(grad, ids, V, None, torch.float32, run_block=2, unroll=4, tile=16)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, None, torch.float32))


@pytest.mark.parametrize("fill_rows", [None, 64, 2])
def test_triton_backward_fill_chunks_and_brackets(fill_rows):
    """Fill programs of several store chunks (D=100: 64-row chunks, 256 rows per program by
    default), touched rows on chunk and program boundaries and a hot row inside a bracket."""
    V, D = 300, 100
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([0, 63, 64, 127, 128, 255, 256, 299] + [200] * 30)
    ids = torch.cat([ids, torch.randint(0, V, (20,), generator=gen)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    grad = torch.randn(ids.numel(), D, generator=gen)
    poisoned = torch.full((V, D), float("nan"))
    got = _backward(grad, ids, V, 64, torch.float32, out=poisoned, fill_rows=fill_rows)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, V, 64, torch.float32))


def test_triton_backward_long_run_non_contiguous_grad():
    """Non-unit column stride (the default run block 1 and tile 4) with long runs."""
    ids, grad = _backward_inputs()
    transposed = grad.transpose(-1, -2).contiguous().transpose(-1, -2)
    strided = torch.randn(*ids.shape, 80)[..., ::2]
    for g in (transposed, strided):
        assert g.stride(-1) != 1
        got = _kernels().embedding_backward(g, ids, 67, 11, torch.float32)
        _assert_bitwise(got, reference.embedding_backward(g, ids, 67, 11, torch.float32))


def test_triton_backward_bad_tuning_arguments():
    ids, grad = _backward_inputs()
    for kwargs, message in [
        ({"fill": "memset"}, "unknown fill"),
        ({"sort": "radix"}, "unknown sort"),
        ({"run_block": 8, "unroll": 4}, r"unroll \(4\) must be >= max\(1, run_block - 1\)"),
        ({"tile": 12}, "tile must be a power of two"),
        ({"run_block": 3}, "run_block must be a power of two"),
        ({"block_col": 100}, "block_col must be a power of two"),
        ({"fill_rows": 3}, "fill_rows must be a power of two"),
        ({"fill_col": 48}, "fill_col must be a power of two"),
    ]:
        with pytest.raises(ValueError, match=message):
            _backward(grad, ids, 67, None, torch.float32, **kwargs)


@pytest.mark.parametrize("variant", [{}, {"sort": "triton"}, {"fill": "map"}],
                         ids=["default", "triton-sort", "map"])
def test_triton_backward_strided_ids(variant):
    """A strided 1-D view of ids (``reshape(-1)`` keeps it strided) gives the reference's
    gradient with every sort and fill: the kernels index the ids as a dense vector."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (80,), generator=gen)[::2]
    assert not ids.reshape(-1).is_contiguous()
    grad = torch.randn(40, 8, generator=gen)
    got = _backward(grad, ids, 50, None, torch.float32, **variant)
    _assert_bitwise(got, reference.embedding_backward(grad, ids, 50, None, torch.float32))


@pytest.mark.parametrize("padding_idx", [None, 11])
def test_run_and_fill_programs_write_complementary_rows(padding_idx):
    """The two-stream schedule's two launches: ``RUN_PROGRAMS`` writes exactly the touched
    rows (the padding row's zeros included), ``FILL_PROGRAMS`` (with a touched map, int8
    flags or int32 counts) exactly the untouched ones; ``ALL_PROGRAMS`` writes every row."""
    kernels = _kernels()
    V, D = 67, 40
    ids, grad = _backward_inputs(V=V, D=D)
    flat_ids, flat = ids.reshape(-1), grad.reshape(-1, D)
    want = reference.embedding_backward(grad, ids, V, padding_idx, torch.float32)
    tiles = kernels.BackwardConfig().resolve(flat, torch.float32)
    sorted_ids, order = kernels.sort_ids(flat_ids, V)
    touched = torch.bincount(flat_ids, minlength=V) > 0
    no_ids = torch.empty(1, dtype=torch.int32)
    for programs, touched_map, written in [
        (kernels.RUN_PROGRAMS, None, touched),
        (kernels.FILL_PROGRAMS, kernels.touched_map(flat_ids, V), ~touched),
        (kernels.FILL_PROGRAMS, kernels.id_counts(flat_ids, V), ~touched),
        (kernels.ALL_PROGRAMS, None, torch.ones(V, dtype=torch.bool)),
    ]:
        out = torch.full((V, D), float("nan"))
        if programs == kernels.FILL_PROGRAMS:  # as the schedule runs it: no sorted ids
            kernels.launch_backward_kernel(no_ids, no_ids, touched_map, flat, out, padding_idx,
                                           tiles, programs)
        else:
            kernels.launch_backward_kernel(sorted_ids, order, touched_map, flat, out,
                                           padding_idx, tiles, programs)
        assert not out[written].isnan().any() and out[~written].isnan().all(), programs
        _assert_bitwise(out[written], want[written])


def test_config_resolves_the_documented_defaults():
    """The defaults scale with the grad's element size (``run_block`` 4/2/1 and ``tile``
    32/8/4 for 2/4/8-byte grads; 1 and 4 when the grad's columns are not contiguous),
    ~16 KB of rows per fill program, and the column blocks are capped at the dim."""
    kernels = _kernels()
    config = kernels.BackwardConfig()
    for dtype, run_block, tile in [(torch.bfloat16, 4, 32), (torch.float32, 2, 8),
                                   (torch.float64, 1, 4)]:
        tiles = config.resolve(torch.empty(8, 4096, dtype=dtype), torch.bfloat16)
        assert (tiles.run_block, tiles.tile, tiles.unroll) == (run_block, tile, 4)
        assert (tiles.block_col, tiles.num_warps, tiles.fill_rows, tiles.fill_col) == (512, 4, 2, 1024)
    strided = torch.empty(8, 200, dtype=torch.bfloat16)[:, ::2]
    tiles = config.resolve(strided, torch.float32)
    assert (tiles.run_block, tiles.tile, tiles.block_col, tiles.fill_col) == (1, 4, 128, 128)
    assert (tiles.num_warps, tiles.fill_rows, tiles.fill_chunk) == (2, 64, 64)
    assert kernels.BackwardConfig(run_block=8).resolve(strided, torch.float32).unroll == 7


# --------------------------------------------------------------------------- sorts and maps


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,sort_block,high", [
    (1, 16, 5), (2, 2, 1), (15, 16, 3), (16, 16, 100), (17, 16, 4), (300, 8, 7),
    (1000, 16, 50), (1024, 16, 2**31 - 1),  # 64 blocks: the widest merge tile
])
def test_triton_id_sort_is_torch_stable_sort(n, sort_block, high, id_dtype):
    """The two-launch Triton sort under the interpreter (small blocks, so that many sorted
    blocks are merged): exactly torch.sort(stable=True)'s ids and token positions, heavy
    repeats, a padded last block, ids up to 2**31 - 1."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, high, (n,), generator=gen, dtype=torch.int64)
    ids[: n // 4] = high - 1
    ids = ids.to(id_dtype)
    before = ids.clone()
    got_ids, got_order = _kernels().stable_sort_ids(ids, sort_block=sort_block)
    want_ids, want_order = torch.sort(ids.to(torch.int32), stable=True)
    assert got_ids.dtype == torch.int32 and got_order.dtype == torch.int64
    assert torch.equal(got_ids, want_ids) and torch.equal(got_order, want_order)
    assert torch.equal(ids, before)


@pytest.mark.parametrize("n,sort_block,vocab", [(1, 16, 5), (17, 16, 4), (300, 8, 37),
                                                (1000, 16, 50), (1024, 16, 2**20)])
def test_triton_id_sort_hot_first(n, sort_block, vocab):
    """Hot-first keys: ids by decreasing count, ties by id, each id's tokens contiguous and in
    position order; the sorted ids are the tokens' own ids (also for an out-of-range id)."""
    kernels = _kernels()
    gen = torch.Generator().manual_seed(n)
    ids = (torch.rand(n, generator=gen) ** 3 * vocab).long()
    ids[: n // 5] = vocab - 1
    counts = kernels.id_counts(ids, vocab)
    assert torch.equal(counts, torch.bincount(ids, minlength=vocab).int())
    got_ids, got_order = kernels.stable_sort_ids(ids, sort_block=sort_block, counts=counts)
    key = (n - counts.long()[ids]) * vocab + ids  # count descending, then id
    want_order = torch.sort(key, stable=True).indices
    assert torch.equal(got_order, want_order) and torch.equal(got_ids, ids[want_order].int())
    if n >= 17:  # an out-of-range id keeps its value in the sorted ids (the kernels assert)
        bad = ids.clone()
        bad[3] = vocab + 5
        bad_ids, bad_order = kernels.stable_sort_ids(bad, sort_block=sort_block, counts=counts)
        assert torch.equal(bad_ids, bad[bad_order].int()) and (bad_ids == vocab + 5).sum() == 1


def test_hot_first_needs_a_map_and_the_triton_sort():
    kernels = _kernels()
    ids, grad = torch.tensor([1, 2, 2]), torch.randn(3, 4)
    with pytest.raises(ValueError, match="hot_first needs"):
        _backward(grad, ids, 5, None, torch.float32, hot_first=True,
                  sort="triton")  # fill="search" on the one-launch schedule
    with pytest.raises(ValueError, match="hot_first needs"):
        _backward(grad, ids, 5, None, torch.float32, hot_first=True, sort="torch", fill="map")
    assert kernels.hot_first_fits(65536, 2**30) and not kernels.hot_first_fits(65536, 2**31)


def test_triton_id_sort_bad_arguments():
    stable_sort_ids = _kernels().stable_sort_ids
    with pytest.raises(ValueError, match="sort_block must be a power of two"):
        stable_sort_ids(torch.zeros(4, dtype=torch.int64), sort_block=12)
    with pytest.raises(ValueError, match=r"sorts at most 1024 ids with sort_block 16, got 1025"):
        stable_sort_ids(torch.zeros(1025, dtype=torch.int64), sort_block=16)
    empty_ids, empty_order = stable_sort_ids(torch.zeros(0, dtype=torch.int32))
    assert empty_ids.numel() == 0 and empty_order.numel() == 0


def test_sort_ids_choices_and_maps():
    """``sort_ids``: both sorts give torch.sort's order (``"auto"`` is ``torch.sort`` on the
    CPU, int32 keys), hot-first order only with the Triton sort; the touched map flags
    exactly the ids present."""
    kernels = _kernels()
    ids = torch.tensor([5, 1, 5, 0, 5, 1], dtype=torch.int64)
    want_ids, want_order = torch.sort(ids.int(), stable=True)
    assert kernels.resolve_sort("auto", ids, 6) == "torch"
    for sort in ("auto", "torch", "triton"):
        got_ids, got_order = kernels.sort_ids(ids, 6, sort)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_order, want_order), sort
    with pytest.raises(ValueError, match="hot-first order needs the Triton sort"):
        kernels.sort_ids(ids, 6, "torch", counts=kernels.id_counts(ids, 6))
    with pytest.raises(ValueError, match="unknown sort"):
        kernels.sort_ids(ids, 6, "radix")
    assert kernels.touched_map(ids, 7).tolist() == [1, 1, 0, 0, 0, 1, 0]
