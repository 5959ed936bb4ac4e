"""``cache_fp8_weights=True`` under ``torch.compile``: never stale, whatever reaches the op.

Inductor hands an extern op a view of a graph input (``w.transpose(1, 2)``, ``w[:, :H]``)
as a tensor rebuilt over the input's storage, with a version counter that never moves; the
lowering passes the graph input as the op's ``weight_base`` so the cache follows the
parameter's own counter. Every way a weight changes is applied in turn to one compiled
layer, static and ``dynamic=True``, and after each the cached compiled step (output, dX and
dW) must equal the same compiled step without the cache, bitwise: the same kernels on the
same operands."""
import contextlib
import os
import warnings

import pytest
import torch

import compileops
from compileops.grouped_linear import cached_fp8_weight_bytes
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import empty_fp8_cache  # noqa: F401  (a fixture)
from tests.grouped_linear._helpers import offsets_of

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                 not torch.cuda.is_available(),
                                 reason="the fp8 kernels run on a GPU or under the interpreter"),
              pytest.mark.usefixtures("empty_fp8_cache")]
SPLITS = [6, 0, 9, 5]
K, N = 40, 24


def _offsets():
    return offsets_of(SPLITS)


# How the layer reaches its weight from the parameter (stored as the layout says).
VIEWS = {
    # [G, N, K] passed as it is
    "parameter": (lambda g: (g, N, K), lambda w: w),
    # stored [G, K, N] (transformers' layout), transposed in the step
    "transpose": (lambda g: (g, K, N), lambda w: w.transpose(1, 2)),
    # the first N rows of a wider [G, 2N, K] parameter (a fused projection's half)
    "slice": (lambda g: (g, 2 * N, K), lambda w: w[:, :N]),
}


def _step(layer, x, w, dy, offsets, cache, scaling):
    """(y, dx, dw) of one compiled forward and backward."""
    x.grad = w.grad = None
    y = layer(x, w, offsets, cache, scaling)
    y.backward(dy)
    return y.detach(), x.grad.clone(), w.grad.clone()


def _compiled(view, dynamic):
    def layer(x, w, offsets, cache, scaling):
        return compileops.grouped_linear(x, view(w), offsets, fp8=scaling,
                                         cache_fp8_weights=cache)
    return torch.compile(layer, fullgraph=True, dynamic=dynamic)


def _changes(w, gen):
    """Every way a weight changes between steps, applied in turn (name, change)."""
    module = torch.nn.Module()
    module.weight = w
    optimizer = torch.optim.SGD([w], lr=0.25)

    def optimizer_step():
        w.grad = torch.randn(w.shape, generator=gen)
        optimizer.step()

    def load_state_dict():
        module.load_state_dict({"weight": torch.randn(w.shape, generator=gen)})

    def no_grad(fn):
        def change():
            with torch.no_grad():
                fn()
        return change

    return [
        ("mul_", no_grad(lambda: w.mul_(2.0))),
        ("copy_", no_grad(lambda: w.copy_(torch.randn(w.shape, generator=gen)))),
        ("load_state_dict", load_state_dict),
        ("optimizer step", optimizer_step),
        ("slice written in place", no_grad(lambda: w[1:3].add_(1.0))),
        ("EMA swap, back", no_grad(lambda: w.copy_(w * 0.5 + 0.1))),
    ]


# Every view static; dynamic=True and blockwise on the transposed view (the cache path is
# the same for every view and recipe: one case each keeps the suite's time down). "template":
# Triton generated for the CPU tensors, so rowwise runs the compiled templates, whose cached
# weight comes through its own lookup (and whose uncached weight is quantised as IR): one
# case, the weight a view taken in the step, dynamic=True.
CASES = [("rowwise", view, False, "extern") for view in VIEWS] + [
    ("rowwise", "transpose", True, "extern"), ("blockwise", "transpose", False, "extern"),
    ("rowwise", "slice", True, "template")]


@pytest.mark.parametrize("scaling,view,dynamic,codegen", CASES,
                         ids=[f"{s}-{v}-{'dynamic' if d else 'static'}-{c}"
                              for s, v, d, c in CASES])
def test_every_weight_change_is_seen_compiled(scaling, view, dynamic, codegen):
    if codegen == "template" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU templates run under the interpreter")
    shape, as_weight = VIEWS[view]
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape(len(SPLITS)), generator=gen) / K ** 0.5)
    x = torch.randn(sum(SPLITS) + 4, K, generator=gen).requires_grad_()
    dy = torch.randn(x.shape[0], N, generator=gen)
    offsets = _offsets()
    layer = _compiled(as_weight, dynamic)
    templates = (_compat.triton_codegen_on_cpu() if codegen == "template"
                 else contextlib.nullcontext())
    with compileops.use_backend("triton"), _compat.fresh_inductor_cache(), templates:
        first = _step(layer, x, w, dy, offsets, True, scaling)
        changes = _changes(w, gen)
        if codegen == "template":  # every other change: the interpreter's steps are slow
            changes = changes[::2]
        for name, change in changes:
            change()
            got = _step(layer, x, w, dy, offsets, True, scaling)
            want = _step(layer, x, w, dy, offsets, False, scaling)
            for what, a, b in zip(("y", "dx", "dw"), got, want):
                assert torch.equal(a, b), f"{what} stale after {name}"
            assert not torch.equal(got[0], first[0]), name


def test_dynamic_batch_sizes_keep_one_graph_and_the_cache():
    """dynamic=True: other token counts reuse the graph, and the copies of an unchanged
    weight (the cache follows the parameter, not the rebuilt view)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from tests.grouped_linear._helpers import record_triton_launches

    counter = CompileCounterWithBackend("inductor")
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(len(SPLITS), K, N, generator=gen) / K ** 0.5)

    def layer(x, offsets):
        return compileops.grouped_linear(x, w.transpose(1, 2), offsets, fp8="rowwise",
                                         cache_fp8_weights=True)

    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    mp = pytest.MonkeyPatch()
    try:
        launches = record_triton_launches(mp)
        with compileops.use_backend("triton"):
            for rows in (20, 33, 17):
                splits = torch.tensor([rows // 4, 0, rows // 2, rows - rows // 4 - rows // 2])
                x = torch.randn(rows, K, generator=gen)
                launches.clear()
                got = compiled(x, torch.cumsum(splits, 0).to(torch.int32))
                # all but x's own quantisation
                weight_quantisations = launches.count("rowwise_quantize_kernel") - 1
                want = compileops.grouped_linear(x, w.transpose(1, 2),
                                                 torch.cumsum(splits, 0).to(torch.int32),
                                                 fp8="rowwise")
                assert torch.equal(got, want)
                assert weight_quantisations == (1 if rows == 20 else 0), launches
    finally:
        mp.undo()
    assert counter.frame_count == 1


def test_a_weight_computed_in_the_graph_is_not_cached_and_says_so():
    """A cast inside the compiled graph is a new tensor each step that nothing tracks: the
    lowering turns the cache off for it (quantised every call) and warns at compile time.
    The warning comes from lowering, which a compile served from Inductor's on-disk cache
    skips, so this compile starts from empty caches."""
    gen = torch.Generator().manual_seed(2)
    master = torch.nn.Parameter(torch.randn(len(SPLITS), N, K, generator=gen,
                                            dtype=torch.float64) / K ** 0.5)
    x = torch.randn(sum(SPLITS), K, generator=gen)
    offsets = _offsets()

    def layer(x):
        return compileops.grouped_linear(x, master.float() * 1.0, offsets, fp8="rowwise",
                                         cache_fp8_weights=True)

    compiled = torch.compile(layer, fullgraph=True)
    with compileops.use_backend("triton"), _compat.fresh_inductor_cache():
        with pytest.warns(UserWarning, match="computed inside the compiled graph"):
            compiled(x)
        with torch.no_grad():
            master.mul_(-1.5)
        with warnings.catch_warnings():
            # no second warning: the graph is compiled once
            warnings.filterwarnings("error", message=".*computed inside the compiled graph")
            got = compiled(x)
        want = compileops.grouped_linear(x, master.detach().float(), offsets, fp8="rowwise")
    assert torch.equal(got, want)
    assert cached_fp8_weight_bytes() == 0


#: In-place writes of the weight inside the graph: the whole tensor, and through views
#: (AOTAutograd keeps those as ``copy_`` into a ``slice`` / ``select`` of the input).
WRITES = {
    "whole": lambda w: w.mul_(2.0),
    "slice": lambda w: w[:, :4].mul_(2.0),
    "select": lambda w: w[0].zero_(),
    "select-of-slice": lambda w: w[:, 0, 0].fill_(5.0),
    # a list written in place (weight decay, an EMA): Tensor(a!)[] arguments
    "foreach": lambda w: torch._foreach_mul_([w], 0.5),
    "foreach-of-views": lambda w: torch._foreach_add_([w[:, :4], w[:, 4:8]], 1.0),
}


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("later", ["eager", "compiled"])
def test_a_weight_written_in_the_same_graph_is_not_cached(later, write):
    """A compiled function that reads the weight, then writes it in place (under no_grad),
    whole or through a view: its version is raised before the graph runs, so a copy made
    inside it would be stored under the new version with the old values. The lowering turns
    the cache off there (and warns); a later cached call, eager or compiled, sees the written
    weight."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.nn.Parameter(torch.randn(len(SPLITS), N, K, generator=gen) / K ** 0.5)
    x = torch.randn(sum(SPLITS), K, generator=gen)
    offsets = _offsets()
    before = weight.detach().clone()
    after = before.clone()
    WRITES[write](after)

    def read_then_double(x, w):
        y = compileops.grouped_linear(x, w, offsets, fp8="rowwise", cache_fp8_weights=True)
        WRITES[write](w)
        return y

    def read(x, w):
        return compileops.grouped_linear(x, w, offsets, fp8="rowwise", cache_fp8_weights=True)

    reader = torch.compile(read, fullgraph=True) if later == "compiled" else read
    with compileops.use_backend("triton"), torch.no_grad(), _compat.fresh_inductor_cache():
        with pytest.warns(UserWarning, match="also writes its weight in place"):
            first = torch.compile(read_then_double, fullgraph=True)(x, weight)
        got = reader(x, weight)
        want_first = compileops.grouped_linear(x, before, offsets, fp8="rowwise")
        want = compileops.grouped_linear(x, after, offsets, fp8="rowwise")
    assert torch.equal(weight.detach(), after)
    assert torch.equal(first, want_first)
    assert torch.equal(got, want)


def test_a_read_after_a_write_through_a_view_in_the_same_graph_sees_the_write():
    """Read, write a slice of the weight, read again, in one compiled call: the second read
    is of the written weight (a copy cached by the first read would be the old one)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(len(SPLITS), N, K, generator=gen) / K ** 0.5)
    x = torch.randn(sum(SPLITS), K, generator=gen)
    offsets = _offsets()
    after = weight.detach().clone()
    after[:, :4].mul_(2.0)

    def read_write_read(x, w):
        y = compileops.grouped_linear(x, w, offsets, fp8="rowwise", cache_fp8_weights=True)
        w[:, :4].mul_(2.0)
        return y, compileops.grouped_linear(x, w, offsets, fp8="rowwise",
                                            cache_fp8_weights=True)

    with compileops.use_backend("triton"), torch.no_grad(), _compat.fresh_inductor_cache():
        with pytest.warns(UserWarning, match="also writes its weight in place"):
            _, second = torch.compile(read_write_read, fullgraph=True)(x, weight)
        want = compileops.grouped_linear(x, after, offsets, fp8="rowwise")
    assert torch.equal(second, want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_module_and_load_state_dict(backend):
    """The module form, compiled whole: a checkpoint loaded after a step is what runs."""
    torch.manual_seed(3)
    layer = compileops.nn.GroupedLinear(len(SPLITS), K, N, bias=False, fp8="rowwise",
                                        cache_fp8_weights=True)
    splits = torch.tensor(SPLITS)
    x = torch.randn(sum(SPLITS), K)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    state = {"weight": torch.randn_like(layer.weight)}
    with compileops.use_backend("triton"):
        before = compiled(x, splits)
        layer.load_state_dict(state)
        got = compiled(x, splits)
        want = compileops.grouped_linear_splits(x, state["weight"], splits, fp8="rowwise")
    assert torch.equal(got, want) and not torch.equal(got, before)


def test_every_fp8_op_keeps_out_of_cuda_graphs():
    """A CUDA graph replays its kernels without the cache's Python lookup, so a captured
    step would read the weights' e4m3 copies from the capture: every fp8 op (and the
    compiled products' weight lookup) is tagged for Inductor to leave out of CUDA graphs."""
    names = ("fp8_weight_rowwise", "fp8_weight_cached", "grouped_linear_fp8", "grouped_linear_fp8_dx",
             "grouped_linear_row_scaled_fp8", "grouped_linear_swiglu_fp8_with_preact")
    for name in names:
        op = getattr(torch.ops.compileops, name).default
        assert torch.Tag.cudagraph_unsafe in op.tags, name


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_reduce_overhead_sees_every_weight_change(scaling):
    """mode="reduce-overhead" (CUDA graphs) with the cache: after each change of the weight
    the compiled step equals the eager one (rowwise: the template's bits)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter((torch.randn(len(SPLITS), N, K, generator=gen) / K ** 0.5).cuda())
    x = torch.randn(sum(SPLITS) + 4, K, generator=gen).cuda()
    offsets = _offsets().cuda()

    def layer(x):
        return compileops.grouped_linear(x, w, offsets, fp8=scaling, cache_fp8_weights=True)

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(4):
            for _ in range(3):  # warm-up and capture
                got = compiled(x).clone()
            want = layer(x)
            assert torch.equal(got, want), f"stale after change {step}"
            w.mul_(1.5)
