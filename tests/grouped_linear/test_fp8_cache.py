"""``cache_fp8_weights=True``: the weight's e4m3 copies made once per version of the weight,
reused until it changes, never stale for an update through autograd's view of it; the
Triton launches counted under the interpreter (the kernels run on CPU there)."""
import gc
import os
import threading

import pytest
import torch

import compileops
from compileops.grouped_linear import cached_fp8_weight_bytes, clear_fp8_weight_cache
from compileops.grouped_linear.fp8_op import RECIPES
from tests.grouped_linear._helpers import record_triton_launches

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts the interpreter's Triton launches")
SPLITS = [6, 0, 9, 5]  # an empty group, and 4 rows past the last group
WEIGHT_QUANTISERS = {"rowwise_quantize_kernel", "blockwise_quantize_kernel"}


@pytest.fixture(autouse=True)
def empty_cache():
    clear_fp8_weight_cache()
    yield
    clear_fp8_weight_cache()


@pytest.fixture
def launches(monkeypatch):
    """The names of the Triton kernels launched, in order."""
    return record_triton_launches(monkeypatch)


def _layer(seed=0, k=40, n=24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, k, generator=gen).requires_grad_()
    w = (torch.randn(len(SPLITS), n, k, generator=gen) / k ** 0.5).requires_grad_()
    offs = torch.cumsum(torch.tensor(SPLITS), 0).to(torch.int32)
    dy = torch.randn(24, n // 2, generator=gen)
    return x, w, offs, dy


def _step(x, w, offs, dy, scaling, cache, fn=compileops.grouped_linear_swiglu):
    """``(y, dx, dw)`` of one forward and backward; grads cleared first."""
    x.grad = w.grad = None
    with compileops.use_backend("triton"):
        y = fn(x, w, offs, fp8=scaling, cache_fp8_weights=cache)
        y.backward(dy)
    return y.detach(), x.grad.clone(), w.grad.clone()


def _weight_quantisations(names, scaling):
    """Launches that quantise the weight: all but the activation's and dY's (one each)."""
    quantisers = [n for n in names if n in WEIGHT_QUANTISERS]
    return len(quantisers) - 2


@pytest.mark.parametrize("scaling", RECIPES)
def test_copies_are_made_once_per_version_and_reused(scaling, launches):
    x, w, offs, dy = _layer()
    want = _step(x, w, offs, dy, scaling, cache=False)
    launches.clear()
    first = _step(x, w, offs, dy, scaling, cache=True)
    # rowwise: the forward's layout and dX's; blockwise: one layout for both products
    assert _weight_quantisations(launches, scaling) == (2 if scaling == "rowwise" else 1)
    launches.clear()
    second = _step(x, w, offs, dy, scaling, cache=True)
    assert _weight_quantisations(launches, scaling) == 0, launches
    for a, b, c in zip(want, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert cached_fp8_weight_bytes() > 0


@pytest.mark.parametrize("scaling", RECIPES)
def test_an_optimizer_step_invalidates_the_copy(scaling, launches):
    x, w, offs, dy = _layer(seed=1)
    opt = torch.optim.SGD([w], lr=0.5)
    _step(x, w, offs, dy, scaling, cache=True)
    opt.step()  # an in-place update: the weight's version moves on
    launches.clear()
    got = _step(x, w, offs, dy, scaling, cache=True)
    assert _weight_quantisations(launches, scaling) == (2 if scaling == "rowwise" else 1)
    want = _step(x, w, offs, dy, scaling, cache=False)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    with torch.no_grad():
        w.copy_(torch.randn_like(w))  # as load_state_dict writes
    got = _step(x, w, offs, dy, scaling, cache=True)
    want = _step(x, w, offs, dy, scaling, cache=False)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_writes_through_data_need_a_clear():
    """``param.data`` has its own version counter: such a write is not seen (the documented
    limit), and clear_fp8_weight_cache() makes the next call quantise the new values."""
    x, w, offs, dy = _layer(seed=2)
    stale = _step(x, w, offs, dy, "rowwise", cache=True)
    w.data.mul_(2.0)
    assert torch.equal(_step(x, w, offs, dy, "rowwise", cache=True)[0], stale[0])
    clear_fp8_weight_cache()
    got = _step(x, w, offs, dy, "rowwise", cache=True)
    want = _step(x, w, offs, dy, "rowwise", cache=False)
    assert torch.equal(got[0], want[0]) and not torch.equal(got[0], stale[0])


@pytest.mark.parametrize("scaling", RECIPES)
def test_writes_that_keep_the_version_after_an_optimizer_step(scaling):
    """FSDP2's pattern, in one process: the optimizer steps the sharded parameters, then the
    next all-gather writes the new values into the same unsharded storage with its version
    counter kept as it was. Any optimizer's step drops the copies, so the forward after it
    quantises the new values; without a step such a write is not seen (the documented
    limit)."""
    x, w, offs, dy = _layer(seed=6)
    shard = torch.nn.Parameter(torch.zeros(3))  # stands for the sharded parameter
    optimizer = torch.optim.SGD([shard], lr=0.1)

    def all_gather(values):
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
            w.copy_(values)

    stale = _step(x, w, offs, dy, scaling, cache=True)
    version, pointer = w._version, w.data_ptr()
    shard.grad = torch.ones(3)
    optimizer.step()
    all_gather(w.detach() * 2.0)
    assert (w._version, w.data_ptr()) == (version, pointer)  # the same storage and version
    got = _step(x, w, offs, dy, scaling, cache=True)
    want = _step(x, w, offs, dy, scaling, cache=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not torch.equal(got[0], stale[0])
    all_gather(w.detach() * 0.5)  # no optimizer step since the copies were made
    assert torch.equal(_step(x, w, offs, dy, scaling, cache=True)[0], got[0])


def test_a_freed_weight_leaves_the_cache_and_never_matches_a_new_one():
    x, w, offs, dy = _layer(seed=3)
    _step(x, w, offs, dy, "rowwise", cache=True)
    assert cached_fp8_weight_bytes() > 0
    del w
    gc.collect()
    assert cached_fp8_weight_bytes() == 0
    for seed in (4, 5):  # new weights, possibly at the freed one's address
        _, w, _, _ = _layer(seed=seed)
        got = _step(x, w, offs, dy, "rowwise", cache=True)
        want = _step(x, w, offs, dy, "rowwise", cache=False)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        del w
        gc.collect()


def test_compiled_steps_see_each_optimizer_step():
    """Compiled, the cached layer equals the uncached one bitwise at every step (the compiled
    SwiGLU derivative rounds differently from the eager one, so compiled meets compiled)."""
    x, w, offs, dy = _layer(seed=6)

    def compiled(cache):
        return torch.compile(
            lambda x, w: compileops.grouped_linear_swiglu(x, w, offs, fp8="rowwise",
                                                          cache_fp8_weights=cache),
            fullgraph=True)

    layers = {True: compiled(True), False: compiled(False)}
    opt = torch.optim.SGD([w], lr=0.5)
    for _ in range(3):
        got = {}
        for cache, layer in layers.items():
            x.grad = w.grad = None
            with compileops.use_backend("triton"):
                y = layer(x, w)
                y.backward(dy)
            got[cache] = (y.detach(), x.grad.clone(), w.grad.clone())
        assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
        opt.step()  # w.grad: the last (uncached) step's, the same values


def test_module():
    torch.manual_seed(0)
    layer = compileops.nn.GroupedLinear(4, 40, 24, bias=False, fp8="rowwise",
                                        cache_fp8_weights=True)
    assert "cache_fp8_weights=True" in repr(layer)
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    splits = torch.tensor(SPLITS)
    with compileops.use_backend("triton"):
        want = compileops.grouped_linear_splits(x, layer.weight, splits, fp8="rowwise")
        for _ in range(2):
            assert torch.equal(layer(x, splits), want)


def test_lookups_from_threads():
    """Threads sharing weights (the lock's job): every lookup returns its own weight's copy,
    made at its version. A stand-in quantiser: the interpreter's launches are not thread-safe."""
    from compileops.grouped_linear import fp8_cache

    weights = [torch.full((2, 3, 4), float(i)) for i in range(4)]
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(200):
            i = int(torch.randint(0, 4, (1,), generator=gen))
            w = weights[i]
            q, _ = fp8_cache.quantised_weight(w, ("stand-in",),
                                              lambda: (w.clone(), torch.ones(2)))
            if not torch.equal(q, w):
                errors.append((i, q.flatten()[0].item()))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


def test_inference_tensors_are_not_cached():
    x, w, offs, _ = _layer(seed=7)
    with torch.inference_mode():
        wi, xi = w.detach().clone(), x.detach().clone()
        with compileops.use_backend("triton"):
            y = compileops.grouped_linear(xi, wi, offs, fp8="rowwise", cache_fp8_weights=True)
            want = compileops.grouped_linear(xi, wi, offs, fp8="rowwise")
    assert torch.equal(y, want) and cached_fp8_weight_bytes() == 0


def test_no_copies_are_cached_or_read_while_a_cuda_graph_captures(monkeypatch, launches):
    """A capture records the launches, not the host's lookups: under capture every call
    quantises (so each replay does), and nothing made then is stored or read from the cache.
    The capture itself needs a GPU; here the check that detects it is stood in for."""
    from compileops.grouped_linear import fp8_cache

    x, w, offs, dy = _layer(seed=8)
    _step(x, w, offs, dy, "rowwise", cache=True)  # an entry from before the capture
    cached = cached_fp8_weight_bytes()
    monkeypatch.setattr(fp8_cache, "_capturing", lambda weight: True)
    launches.clear()
    got = _step(x, w, offs, dy, "rowwise", cache=True)
    assert _weight_quantisations(launches, "rowwise") == 2  # not read from the cache
    assert cached_fp8_weight_bytes() == cached  # nothing stored
    want = _step(x, w, offs, dy, "rowwise", cache=False)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_cache_without_fp8_is_a_clear_error():
    x, w, offs, _ = _layer()
    for fn in (compileops.grouped_linear, compileops.grouped_linear_swiglu):
        with pytest.raises(ValueError, match="cache_fp8_weights=True .*needs fp8"):
            fn(x, w, offs, cache_fp8_weights=True)
    with pytest.raises(ValueError, match="cache_fp8_weights=True .*needs fp8"):
        compileops.nn.GroupedLinear(4, 40, 24, bias=False, cache_fp8_weights=True)


def test_a_freed_weight_releases_its_copies_at_once():
    """The copies go with the weight (a finaliser), not at the next insert or step: nothing
    is left holding them once the weight is freed."""
    import weakref

    from compileops.grouped_linear import fp8_cache

    x, w, offs, dy = _layer(seed=9)
    _step(x, w, offs, dy, "rowwise", cache=True)
    copies = [weakref.ref(entry[2][0]) for entry in fp8_cache._entries.values()]
    assert len(copies) == 2 and all(ref() is not None for ref in copies)
    del w
    gc.collect()
    assert all(ref() is None for ref in copies)  # freed, with no other cache call since
    assert cached_fp8_weight_bytes() == 0


def test_a_storage_freed_under_a_live_parameter_releases_its_copies():
    """``param.data = other`` frees the old storage while the parameter lives on: its copies
    go with it (the finaliser is on the storage)."""
    x, w, offs, dy = _layer(seed=10)
    _step(x, w, offs, dy, "rowwise", cache=True)
    assert cached_fp8_weight_bytes() > 0
    w.data = torch.randn_like(w)
    gc.collect()
    assert cached_fp8_weight_bytes() == 0


def test_swap_tensors_works_on_cached_weights():
    """The cache keeps no weak reference to the weight tensor, which would make
    ``torch.utils.swap_tensors`` refuse it: ``load_state_dict`` and ``Module.to`` with
    swapping on still work after a cached call, and the next call uses the new weight."""
    torch.manual_seed(11)
    layer = compileops.nn.GroupedLinear(len(SPLITS), 40, 24, bias=False, fp8="rowwise",
                                        cache_fp8_weights=True)
    x = torch.randn(24, 40)
    splits = torch.tensor(SPLITS)
    state = {"weight": torch.randn_like(layer.weight)}
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with compileops.use_backend("triton"), torch.no_grad():
            layer(x, splits)
            layer.load_state_dict(state)
            got = layer(x, splits)
            want = compileops.grouped_linear_splits(x, state["weight"], splits, fp8="rowwise")
            assert torch.equal(got, want)
            layer.to(torch.float64)
            assert layer.weight.dtype == torch.float64
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def test_two_parameters_over_one_storage_never_share_a_copy():
    """``nn.Parameter(p.data)`` shares p's storage with a version counter of its own: after
    one write each, both counters read the same, yet a cached call on the second must see
    its write, not the copy made for the first before it."""
    gen = torch.Generator().manual_seed(12)
    first = torch.nn.Parameter(torch.randn(len(SPLITS), 24, 40, generator=gen))
    x = torch.randn(24, 40, generator=gen)
    offs = torch.cumsum(torch.tensor(SPLITS), 0).to(torch.int32)
    with compileops.use_backend("triton"), torch.no_grad():
        first.mul_(1.0)
        compileops.grouped_linear(x, first, offs, fp8="rowwise", cache_fp8_weights=True)
        second = torch.nn.Parameter(first.data)
        second.mul_(-2.0)
        assert second._version == first._version
        got = compileops.grouped_linear(x, second, offs, fp8="rowwise", cache_fp8_weights=True)
        want = compileops.grouped_linear(x, second.clone(), offs, fp8="rowwise")
    assert torch.equal(got, want)


def test_eager_views_of_a_parameter_share_its_copies(launches):
    """A view made afresh each call (``w.transpose(1, 2)``) follows its parameter's version
    and lifetime: the second call reuses the first one's copies, and a write to the
    parameter is seen through the view."""
    x, w, offs, dy = _layer(seed=10)
    stored = torch.nn.Parameter(w.detach().transpose(1, 2).contiguous())  # [G, K, N]

    def call():
        with compileops.use_backend("triton"):
            return compileops.grouped_linear(x.detach(), stored.transpose(1, 2), offs,
                                             fp8="rowwise", cache_fp8_weights=True)

    first = call()
    launches.clear()
    assert torch.equal(call(), first)
    assert [n for n in launches if n in WEIGHT_QUANTISERS] == ["rowwise_quantize_kernel"]  # x
    with torch.no_grad():
        stored.mul_(2.0)
    with compileops.use_backend("triton"):
        want = compileops.grouped_linear(x.detach(), stored.transpose(1, 2), offs, fp8="rowwise")
    assert torch.equal(call(), want) and not torch.equal(want, first)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_compiled_graphs_lookup_op_serves_the_cache_detached(transposed, launches):
    """``compileops::fp8_weight_cached``, what a compiled step calls for a cached weight:
    the same copies as ``fp8_weight_rowwise`` with the cache on (made once, then served),
    its fake outputs the real ones' shapes and dtypes, and the cache's own tensors never
    given autograd history, even when called with grad enabled on a weight that requires
    grad."""
    w = torch.randn(3, 24, 40, dtype=torch.bfloat16).requires_grad_()
    lookup = torch.ops.compileops.fp8_weight_cached.default
    torch.library.opcheck(lookup, (w, transposed, w), test_utils=("test_schema", "test_faketensor"))
    clear_fp8_weight_cache()
    launches.clear()
    first = lookup(w, transposed, w)  # grad enabled: the outputs are views, not the entries
    assert launches == ["rowwise_quantize_kernel"]
    with torch.no_grad():
        again = lookup(w, transposed, w)
        made_by_the_op = torch.ops.compileops.fp8_weight_rowwise(w, transposed, True, w)
    assert launches == ["rowwise_quantize_kernel"]  # served from the cache since
    for a, b, c in zip(first, again, made_by_the_op):
        assert a.data_ptr() == b.data_ptr() == c.data_ptr()
        assert not b.requires_grad and b.grad_fn is None
    fresh_q, fresh_scale = compileops.grouped_linear.fp8_op.fp8_weight_rowwise_op(
        w.detach().clone(), transposed)
    assert torch.equal(again[0].view(torch.uint8), fresh_q.view(torch.uint8))
    assert torch.equal(again[1], fresh_scale)
    assert tuple(again[0].shape) == ((3, 40, 24) if transposed else (3, 24, 40))
