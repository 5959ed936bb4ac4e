"""The rowwise fp8 ops compiled as Inductor templates (on CPU tensors: Triton generated for
the CPU and run under the interpreter; on a GPU: compiled): the eager ops' bits, forward, dX
and dW; the quantisation as fused IR kernels, bit for bit the Triton quantisers on the
values where rounding is hardest; no extern call of the fp8 products left in the step, and
the weight cache's copies reached through their one lookup. Kernel lists:
test_snapshots.py."""
import contextlib
import os
import re

import pytest
import torch

import compileops
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import empty_fp8_cache  # noqa: F401  (a fixture)
from tests.grouped_linear._helpers import offsets_of

pytestmark = pytest.mark.usefixtures("empty_fp8_cache")

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="templates run on CPU tensors under the interpreter")

SPLITS = [10, 0, 15, 11]  # an empty group, and 4 rows past the last group
M = sum(SPLITS) + 4
FP8_PRODUCTS = ("grouped_linear_fp8", "grouped_linear_fp8_dx", "grouped_linear_fp8_dx_from_copy",
                "grouped_linear_row_scaled_fp8", "grouped_linear_swiglu_fp8_with_preact")


def _offsets():
    return offsets_of(SPLITS)


def _leaves(dtype, k=72, n=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(len(SPLITS), n, k, generator=gen) / k ** 0.5).to(dtype).requires_grad_()
    dy = torch.randn(M, n, generator=gen).to(dtype)
    return x, w, dy


def _eager_and_compiled(fn, x, w, dy, *, dynamic=False):
    """``((y, dx, dw) eager, (y, dx, dw) compiled, generated code)``: the compiled step runs
    the templates (for CPU tensors, through Triton code generation for the CPU)."""
    def step(run):
        x.grad = w.grad = None
        y = run(x, w)
        y.backward(dy)
        return y.detach(), x.grad.clone(), w.grad.clone()

    eager = step(fn)
    codegen = (contextlib.nullcontext() if x.is_cuda else _compat.triton_codegen_on_cpu())
    with _compat.fresh_inductor_cache(), codegen:
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        got, sources = _compat.run_and_get_code(lambda: step(compiled))
    return eager, got, "\n".join(sources)


def _kernel_bodies(code: str) -> list:
    """``[(name, body)]`` of the generated Triton kernels."""
    starts = [(m.group(1), m.start()) for m in re.finditer(r"def (triton_\w+)\(", code)]
    ends = [start for _, start in starts[1:]] + [len(code)]
    return [(name, code[start:end]) for (name, start), end in zip(starts, ends)]


def _extern_calls(code: str) -> set:
    return set(re.findall(r"torch\.ops\.compileops\.(\w+)\.default\(", code))


CASES = [  # (dtype, cache_fp8_weights, fp8_fast_accum, dynamic)
    (torch.bfloat16, False, False, False),
    (torch.float32, True, False, True),
    (torch.bfloat16, True, True, False),
]


@interpreter
@pytest.mark.parametrize("dtype,cache,fast,dynamic", CASES,
                         ids=["bf16", "fp32-cached-dynamic", "bf16-cached-fast"])
def test_the_templates_give_the_eager_ops_bits(dtype, cache, fast, dynamic):
    """One fp8 product forward and backward: y and dX (both fp8 products) and dW (bf16, from
    the unquantised x) equal the eager op's bitwise: the same kernel bodies and tiles on the
    same e4m3 operands, which the IR quantisers made with the eager quantisers' bits."""
    x, w, dy = _leaves(dtype)
    offsets = _offsets()

    def layer(x, w):
        return compileops.grouped_linear(x, w, offsets, fp8="rowwise", cache_fp8_weights=cache,
                                         fp8_fast_accum=fast)

    eager, got, code = _eager_and_compiled(layer, x, w, dy, dynamic=dynamic)
    for what, a, b in zip(("y", "dx", "dw"), got, eager):
        assert torch.equal(a, b), what
    assert "def triton_tem_fused_grouped_linear_fp8" in code
    assert re.search(r"def triton_tem_fused\w*_grouped_linear_fp8_dx_from_copy", code)
    externs = _extern_calls(code)
    assert not externs & set(FP8_PRODUCTS), externs
    # The weight: its cached copies through one lookup each (forward and dX) of the lean
    # lookup op, else IR in the forward only (dX reads the forward's copy); never the
    # custom op's wrappers.
    assert ("fp8_weight_cached" in externs) == cache
    assert "fp8_weight_rowwise" not in externs


@interpreter
def test_the_expert_layer_compiles_to_templates_with_the_eager_forward():
    """SwiGLU (with its pre-activations), a user's epilogue, and the down projection times
    the router probability: the forward bitwise; the gradients to fp32 rounding (Inductor
    fuses the SwiGLU derivative, dY of the gate/up dX, into one kernel of its own)."""
    x, w, dy = _leaves(torch.float32)
    offsets = _offsets()
    p = torch.rand(M, generator=torch.Generator().manual_seed(5))

    def layer(x, w):
        h = compileops.grouped_linear_swiglu(x, w, offsets, fp8="rowwise").relu() * 2
        return compileops.grouped_linear(h, w[:, :, :16], offsets, row_scale=p, fp8="rowwise")

    eager, got, code = _eager_and_compiled(layer, x, w, dy)
    assert torch.equal(got[0], eager[0])
    for a, b in zip(got[1:], eager[1:]):
        assert ((a - b).norm() / b.norm()).item() <= 1e-5
    assert not _extern_calls(code) & set(FP8_PRODUCTS)
    assert "def triton_tem_fused_grouped_linear_swiglu_fp8_with_preact" in code
    assert "def triton_tem_fused_grouped_linear_row_scaled_fp8" in code


def _hard_rows(k: int) -> torch.Tensor:
    """Rows where the quantisation is easy to get wrong: values on e4m3 ties and just off
    them (amax 448, so the inverse is 1), values that round up into the next binade, e4m3
    subnormals, signed zeros, a row below the scale floor, an all-zero row, NaN and inf rows,
    huge and fp32-subnormal magnitudes, then random rows."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(M, k, generator=gen)
    ties = torch.tensor([448.0, 30.5, 31.5, 15.75, 0.005859375, -0.001953125 * 1.5, 1.0625,
                         -1.1875, 240.0, 232.0, 0.0, -0.0, 31.9, 15.99, 0.0009765625,
                         -0.0029296875])
    rows[0, :len(ties)] = ties
    rows[0, len(ties):] = 0.0
    rows[1] = ties.repeat(k // len(ties) + 1)[:k] * 1.0000001
    rows[2] *= 1e-37  # below MIN_AMAX: scale 1, zeros
    rows[3] = 0.0
    rows[4, 5] = float("nan")
    rows[5, 7] = float("inf")
    rows[6] *= 1e30
    rows[7] *= 1e-39  # fp32 subnormals
    rows[8] = torch.linspace(-448.0, 448.0, k)
    rows[9, k - 1] = float("nan")  # in the last part of a row read in parts
    rows[10, k // 2] = -float("inf")
    return rows


@interpreter
@pytest.mark.parametrize("row_limit", [None, 16], ids=["whole-rows", "rows-in-parts"])
def test_the_ir_quantisation_has_the_quantisers_bits_on_hard_values(row_limit, monkeypatch):
    """x and dY full of hard rows; one expert's weight below the scale floor: the compiled
    product's output and dX equal the eager ones bit for bit (NaN where eager has NaN).
    ``rows-in-parts`` lowers Inductor's persistent-reduction limit (as a row wider than it
    is read) so the rows are quantised in parts: x's 48 in 3 parts, dY's 40 in 4."""
    if row_limit is not None:
        monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", row_limit)
    k, n = 48, 40
    gen = torch.Generator().manual_seed(4)
    x = _hard_rows(k).requires_grad_()
    w = torch.randn(len(SPLITS), n, k, generator=gen) / k ** 0.5
    w[2] *= 1e-38
    w = w.requires_grad_()
    dy = _hard_rows(n)
    offsets = _offsets()

    def layer(x, w):
        return compileops.grouped_linear(x, w, offsets, fp8="rowwise")

    eager, got, code = _eager_and_compiled(layer, x, w, dy)
    for what, a, b in zip(("y", "dx"), got[:2], eager[:2]):
        assert torch.equal(a.isnan(), b.isnan()), what
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), what
    assert not _extern_calls(code) & set(FP8_PRODUCTS)
    # The reductions over one part of a row: x's (16 of 48) and dY's (10 of 40).
    parts = {"r0_numel = 16", "r0_numel = 10"}
    assert all(p in code for p in parts) == (row_limit is not None), code


@interpreter
def test_blockwise_and_the_reference_backend_stay_extern_calls():
    x, w, dy = _leaves(torch.float32, k=144, n=16)
    offsets = _offsets()

    def blockwise(x, w):
        return compileops.grouped_linear(x, w, offsets, fp8="blockwise")

    eager, got, code = _eager_and_compiled(blockwise, x, w, dy)
    assert "grouped_linear_fp8" in _extern_calls(code)
    assert torch.equal(got[0], eager[0])

    def rowwise(x, w):
        return compileops.grouped_linear(x, w, offsets, fp8="rowwise")

    with compileops.use_backend("reference"):
        eager, got, code = _eager_and_compiled(rowwise, x, w, dy)
    assert "grouped_linear_fp8" in _extern_calls(code)
    assert torch.equal(got[0], eager[0])


GPU_SPLITS = [700, 0, 1300, 260, 1, 900, 511, 333]  # skewed, an empty and a 1-row group


@pytest.mark.gpu
@pytest.mark.parametrize("cache,fast,dynamic", [(False, False, False), (True, True, False),
                                                (True, True, True)],
                         ids=["default", "cached-fast", "cached-fast-dynamic"])
def test_on_the_gpu_the_templates_give_the_eager_ops_bits(cache, fast, dynamic):
    """bf16 on CUDA at a size with TMA loads and the GPU tile configs: the SwiGLU product
    with the router probability in the down projection's epilogue, forward bitwise; then
    the plain product forward and backward (y, dX, dW) bitwise."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(7)
    m, d, h = sum(GPU_SPLITS) + 5, 512, 384
    offsets = offsets_of(GPU_SPLITS).cuda()
    x = torch.randn(m, d, generator=gen).bfloat16().cuda().requires_grad_()
    gate_up = (torch.randn(len(GPU_SPLITS), 2 * h, d, generator=gen) / d ** 0.5)
    gate_up = gate_up.bfloat16().cuda().requires_grad_()
    down = (torch.randn(len(GPU_SPLITS), d, h, generator=gen) / h ** 0.5)
    down = down.bfloat16().cuda().requires_grad_()
    p = torch.rand(m, generator=gen).bfloat16().cuda()
    options = dict(fp8="rowwise", cache_fp8_weights=cache, fp8_fast_accum=fast)

    def experts(x, gate_up):
        hidden = compileops.grouped_linear_swiglu(x, gate_up, offsets, **options)
        return compileops.grouped_linear(hidden, down, offsets, row_scale=p, **options)

    dy = torch.randn(m, d, generator=gen).bfloat16().cuda()
    eager, got, code = _eager_and_compiled(experts, x, gate_up, dy, dynamic=dynamic)
    assert torch.equal(got[0], eager[0])
    assert not _extern_calls(code) & set(FP8_PRODUCTS)

    def plain(x, gate_up):
        return compileops.grouped_linear(x, gate_up, offsets, **options)

    dy = torch.randn(m, 2 * h, generator=gen).bfloat16().cuda()
    eager, got, code = _eager_and_compiled(plain, x, gate_up, dy, dynamic=dynamic)
    for what, a, b in zip(("y", "dx", "dw"), got, eager):
        assert torch.equal(a, b), what


def _every_rounding_case() -> torch.Tensor:
    """fp32 values covering each way a value rounds to e4m3: every finite e4m3 value, every
    midpoint between neighbours (ties to even and to odd), one fp32 step either side of each
    midpoint, values around half the smallest subnormal, both zeros; both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    middles = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    tiny = torch.tensor([2.0 ** -10, 2.0 ** -11, 2.0 ** -12, 1e-30, 0.0])
    near = torch.cat([middles.nextafter(torch.tensor(448.0)),
                      middles.nextafter(torch.tensor(0.0)), tiny.nextafter(torch.tensor(1.0))])
    positive = torch.cat([grid, middles, near, tiny])
    return torch.cat([positive, -positive])


def _rounds_as_the_rule(device: str) -> None:
    """The IR quantisation (compiled ``fp8_weight_rowwise``) and the Triton quantiser (the
    eager op) give the bits of the rule's torch reference on every rounding case, at unit
    scale (rows whose amax is 448) and at scales that are not powers of two, with NaN,
    infinite and zero rows; the grid rounding is compiled in only for the interpreter."""
    from compileops.grouped_linear import fp8 as fp8_rule

    cases = _every_rounding_case()
    width = 512
    rows = -(-cases.numel() // (width - 1))
    padded = torch.zeros(rows * (width - 1))
    padded[:cases.numel()] = cases
    unit = torch.cat([torch.full((rows, 1), 448.0), padded.view(rows, width - 1)], dim=1)
    gen = torch.Generator().manual_seed(11)
    scaled = unit * torch.rand(rows, 1, generator=gen).mul(3.0).add(0.01)
    special = torch.randn(4, width, generator=gen)
    special[0, 3], special[1, 5], special[2] = float("nan"), float("inf"), 0.0
    weight = torch.cat([unit, scaled, special]).reshape(1, -1, width).to(device)

    def quantise(w):
        return torch.ops.compileops.fp8_weight_rowwise(w, False)

    expected = fp8_rule.quantize_rowwise(weight)
    eager = quantise(weight)
    codegen = _compat.triton_codegen_on_cpu() if device == "cpu" else contextlib.nullcontext()
    with _compat.fresh_inductor_cache(), codegen:
        compiled, sources = _compat.run_and_get_code(torch.compile(quantise, fullgraph=True),
                                                     weight)
    code = "\n".join(sources)
    assert "fp8_weight_rowwise" not in _extern_calls(code)  # the IR quantisation ran
    assert ("12582912.0" in code) == (device == "cpu")  # the grid rounding's constant
    nan = expected[0].float().isnan()
    for name, (q, scale) in (("eager", eager), ("compiled", compiled)):
        # Every bit where the rule gives a number; NaN where it gives NaN (any NaN code),
        # except under the interpreter, whose cast turns NaN into a number.
        same_bits = q.view(torch.uint8) == expected[0].view(torch.uint8)
        assert bool(same_bits[~nan].all()), name
        assert device == "cpu" or bool(q.float()[nan].isnan().all()), name
        assert torch.equal(scale.isnan(), expected[1].isnan()), name
        assert torch.equal(scale.nan_to_num(), expected[1].nan_to_num()), name


@interpreter
def test_under_the_interpreter_the_grid_rounding_rounds_as_the_rule():
    _rounds_as_the_rule("cpu")


@pytest.mark.gpu
def test_on_the_gpu_the_cast_alone_rounds_as_the_rule():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _rounds_as_the_rule("cuda")


@interpreter
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_wide_rows_are_quantised_in_one_pass(dynamic):
    """4096 gathered rows of 2048 (twice the row Inductor keeps in registers), forward and
    backward: every quantisation of rows (x, fused with the gather; dY, 2048 wide too) is
    one persistent reduction over half a row that reads both halves at each step, not a
    loop that reads every row twice (lowered only: the kernels' names and sizes). With
    ``dynamic=True`` too: the weight is a parameter, whose shape torch.compile keeps static,
    and the rows' width is tied to it."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4096, 2048, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter(torch.randn(2, 2048, 2048, generator=gen).to(torch.bfloat16))
    index = torch.randperm(4096, generator=gen)
    offsets = offsets_of([1000, 3096])

    def layer(x, index, w):
        return compileops.grouped_linear(x[index], w, offsets, fp8="rowwise",
                                         cache_fp8_weights=True)

    sources = []
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.lower_only(sources), pytest.raises(_compat.LoweredOnly):
        torch.compile(layer, fullgraph=True, dynamic=dynamic)(x, index, w)
    forward, backward = sources
    for code in (forward, backward):
        quantisers = [k for k, body in _kernel_bodies(code)
                      if "grouped_linear_fp8" in k and "_tem_" not in k and "float8e4nv" in body]
        assert quantisers and all(k.startswith("triton_per_") for k in quantisers), quantisers
        assert "r0_numel = 1024" in code


@interpreter
def test_gathered_rows_are_quantised_from_their_source_also_when_it_is_written_after(
        monkeypatch):
    """Rows gathered with repeats (the permuted tokens), kept as an output and quantised in
    parts: the source's rows are quantised and the codes gathered as the rows are, and the
    function then writes the source in place. Compiled equals eager: the write waits for
    the quantisation."""
    monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", 16)
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(64, 48, generator=gen).bfloat16()
    w = (torch.randn(2, 32, 48, generator=gen) / 48 ** 0.5).bfloat16().requires_grad_()
    index = torch.randint(0, 64, (128,), generator=gen)
    offsets = offsets_of([50, 78])

    def layer(x, w, index):
        rows = x[index]
        x.mul_(2)
        return compileops.grouped_linear(rows, w, offsets, fp8="rowwise"), rows

    x = x0.clone()
    eager = layer(x, w, index)
    x = x0.clone()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        got, sources = _compat.run_and_get_code(torch.compile(layer, fullgraph=True), x, w,
                                                index)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    assert torch.equal(x, x0 * 2)
    # The quantisation (a persistent reduction over a third of a row) reduces x's 64 rows,
    # not the 128 gathered ones; one kernel then gathers the kept rows and their codes
    # (row stride 48 times a loaded index, from two inputs, into two outputs).
    bodies = _kernel_bodies("\n".join(sources))
    quantisers = [body for name, body in bodies
                  if name.startswith("triton_per_") and "grouped_linear_fp8" in name]
    assert len(quantisers) == 1 and "xnumel = 64\n" in quantisers[0], quantisers
    gathers = [body for name, body in bodies if name.startswith("triton_poi_")
               and len(set(re.findall(r"tl\.load\((in_ptr\d+) \+ \(x\d+ \+ 48\*tmp\d+\)", body))) == 2
               and len(re.findall(r"tl\.store\(", body)) == 2]
    assert len(gathers) == 1, [name for name, _ in bodies]


def _rows_quantised_compiled(layer, *args) -> int:
    """Compiles ``layer`` (returning ``(fp8 product, gathered rows)``), checks both outputs
    are the eager ones bit for bit, and returns how many rows the one row quantiser of the
    fp8 product reduces."""
    eager = layer(*args)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        got, sources = _compat.run_and_get_code(torch.compile(layer, fullgraph=True), *args)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    bodies = _kernel_bodies("\n".join(sources))
    quantisers = [body for name, body in bodies
                  if name.startswith("triton_per_") and "grouped_linear_fp8" in name]
    assert len(quantisers) == 1, [name for name, _ in bodies]
    return int(re.search(r"xnumel = (\d+)\n", quantisers[0]).group(1))


@interpreter
@pytest.mark.parametrize("rows_of", ["top-2 copies", "top-2 copies, scaled", "a permutation"])
def test_rows_gathered_from_fewer_rows_are_quantised_before_the_gather(rows_of, monkeypatch):
    """Tokens ``[2, 32, 48]`` read as their 64 rows and gathered to 128 (each token twice,
    as a top-2 router's permutation makes them): the 64 source rows are quantised and the
    codes and scales gathered, bit for bit the eager op's. Rows that are computed from the
    gathered values (scaled) or no more rows than the source (a permutation) are quantised
    where they are. Quantised in parts (the persistent-reduction limit lowered to 16)."""
    monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", 16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 32, 48, generator=gen).bfloat16()
    x[0, 3] *= 1e4  # rows of very different magnitudes: wrong scales would show
    x[1, 7] = 0.0
    w = (torch.randn(2, 40, 48, generator=gen) / 48 ** 0.5).bfloat16()
    copies = 1 if rows_of == "a permutation" else 2
    token = torch.arange(64).repeat_interleave(copies)[torch.randperm(64 * copies,
                                                                      generator=gen)]
    offsets = offsets_of([50, 64 * copies - 50])
    factor = 2.0 if rows_of.endswith("scaled") else 1.0

    def layer(x, w, token):
        rows = x.view(-1, 48)[token]
        return compileops.grouped_linear(rows * factor if factor != 1.0 else rows, w,
                                         offsets, fp8="rowwise"), rows

    quantised_rows = 64 if rows_of == "top-2 copies" else 64 * copies
    assert _rows_quantised_compiled(layer, x, w, token) == quantised_rows


@interpreter
def test_rows_gathered_from_a_row_slice_take_the_slices_rows(monkeypatch):
    """Rows gathered from ``x[6:]`` (70 rows of 48, each of the last 64 twice): the
    buffer's rows are quantised and the gather reads the codes and scales at the slice's
    offset, bit for bit the eager op's (row 9, 1e4 times the others, is row 3 of the
    slice: a scale read one row off would show)."""
    monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", 16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 48, generator=gen).bfloat16()
    x[9] *= 1e4
    w = (torch.randn(2, 40, 48, generator=gen) / 48 ** 0.5).bfloat16()
    token = torch.arange(64).repeat_interleave(2)[torch.randperm(128, generator=gen)]
    offsets = offsets_of([50, 78])

    def layer(x, w, token):
        rows = x[6:][token]
        return compileops.grouped_linear(rows, w, offsets, fp8="rowwise"), rows

    assert _rows_quantised_compiled(layer, x, w, token) == 70


@interpreter
@pytest.mark.parametrize("dynamic,early", [(False, False), (False, True), (True, True)],
                         ids=["static", "static-realized-early", "dynamic-realized-early"])
def test_gathered_dy_kept_for_dw_is_written_by_its_quantiser(dynamic, early, monkeypatch):
    """The MoE layer's backward: dY of the product is the combine's gradient gathered to
    the permuted rows, read by the dX product (quantised with the weight's scales) and kept
    for the bf16 dW. Rows of 48 quantised in 3 parts (the persistent-reduction limit
    lowered to 16): the rows are written in part-wide pieces by the kernel that quantises
    them, and no other kernel writes them. Every gradient is the eager one, bit for bit.
    Also where Inductor has realized dY as whole rows before the quantisation is lowered
    (``early``: the dW op's operands realized as they are lowered)."""
    monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", 16)
    gen = torch.Generator().manual_seed(11)
    # x in fp32 and the rows cast: the interpreter has no bf16 atomic add for x's gradient.
    x = torch.randn(64, 40, generator=gen).bfloat16().float().requires_grad_()
    # A parameter, whose shape torch.compile keeps static under dynamic=True too: the rows'
    # width is then static, and they are quantised in parts.
    w = torch.nn.Parameter((torch.randn(2, 48, 40, generator=gen) / 40 ** 0.5).bfloat16())
    token = torch.arange(64).repeat_interleave(2)[torch.randperm(128, generator=gen)]
    offsets = offsets_of([50, 78])
    # bf16 values in fp32: the interpreter casts fp32 to bf16 without rounding to nearest.
    grad = torch.randn(64, 48, generator=gen).bfloat16().float()
    grad[5] *= 2 ** 13  # a token's rows far larger than the others: a scale a row off shows

    def layer(x, w, token):
        y = compileops.grouped_linear(x[token].bfloat16(), w, offsets, fp8="rowwise")
        return torch.zeros(64, 48).index_add(0, token, y.float())

    def step(run):
        x.grad = w.grad = None
        run(x, w, token).backward(grad)
        return x.grad.clone(), w.grad.clone()

    eager = step(layer)
    wgrad = torch.ops.compileops.grouped_linear_wgrad.default
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.operands_realized_early(wgrad, early):
        compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
        got, sources = _compat.run_and_get_code(lambda: step(compiled))
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    _assert_the_quantiser_writes_the_rows(
        next(code for code in sources if "tangents_1" in code), "grouped_linear_fp8_dx_from_copy")


@interpreter
def test_computed_rows_gathered_and_saved_for_dw_are_written_by_their_quantiser(
        monkeypatch):
    """Tokens scaled (a norm's last step, which Inductor computes inside the gather) and
    gathered to 128 rows of 48, saved for dW: no source buffer to quantise before the
    gather, so the rows are written in part-wide pieces (3, the persistent-reduction limit
    lowered to 16) by the kernel that quantises them, and no other forward kernel writes
    them. Output and gradients are the eager ones, bit for bit."""
    monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", 16)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(64, 48, generator=gen).bfloat16()
    x[9] *= 2 ** 13
    # Powers of two: exact products (the interpreter stores fp32 into bf16 without rounding
    # to nearest, so a rounding producer would differ from eager before any fp8).
    gain = (2.0 ** torch.randint(-2, 3, (48,), generator=gen)).bfloat16()
    w = (torch.randn(2, 40, 48, generator=gen) / 48 ** 0.5).bfloat16().requires_grad_()
    token = torch.arange(64).repeat_interleave(2)[torch.randperm(128, generator=gen)]
    offsets = offsets_of([50, 78])
    grad = torch.randn(128, 40, generator=gen).bfloat16()

    def layer(x, gain, w, token):
        return compileops.grouped_linear((x * gain)[token], w, offsets, fp8="rowwise")

    def step(run):
        w.grad = None
        y = run(x, gain, w, token)
        y.backward(grad)
        return y.detach(), w.grad.clone()

    eager = step(layer)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(layer, fullgraph=True)
        got, sources = _compat.run_and_get_code(lambda: step(compiled))
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    _assert_the_quantiser_writes_the_rows(
        next(code for code in sources if "tangents_1" not in code), "grouped_linear_fp8")


def _assert_the_quantiser_writes_the_rows(code: str, op_name: str) -> None:
    """In ``code`` (one compiled graph), one persistent kernel quantises the rows of the
    ``op_name`` product, 128 rows of 48 in 3 parts: it stores three pieces of the rows, three
    of the codes and the scales, and no other kernel (templates aside) writes 128 x 48
    elements."""
    bodies = _kernel_bodies(code)
    quantisers = [body for name, body in bodies
                  if name.startswith("triton_per_") and op_name in name]
    assert len(quantisers) == 1, [name for name, _ in bodies]
    assert len(re.findall(r"tl\.store\(", quantisers[0])) == 7
    writers = [name for name, body in bodies
               if "_tem_" not in name and re.search(r"xnumel = 6144\b", body)]
    assert not writers, writers


@interpreter
@pytest.mark.parametrize("pieces", [(16, 16), (24, 24), (20, 28)],
                         ids=["parts-are-pieces", "parts-inside-pieces", "a-part-across-pieces"])
def test_a_concatenated_dy_is_quantised_where_its_pieces_are_computed(pieces, monkeypatch):
    """dY of a gate/up product made as the SwiGLU derivative makes it, two pieces
    concatenated, and quantised in parts (the persistent-reduction limit lowered to 16): the
    compiled dX equals the eager op's on the same dY bit for bit (hard values, NaN where
    eager has NaN).

    * pieces of 16: 2 parts, each a piece, read where the pieces are computed, so the
      pieces' producer fuses into the quantisation's one persistent kernel (the SwiGLU
      derivative at Qwen3-30B-A3B's H = 768);
    * pieces of 24: 4 parts of 12, two inside each piece (not the fewest, 3 of 16, which
      would cross the pieces' border), read from the pieces at their offsets;
    * pieces of 20 and 28: no split fits them; the crossing part is read from the
      concatenation."""
    monkeypatch.setattr(_compat, "PERSISTENT_ROW_LIMIT", 16)
    first, second = pieces
    gen = torch.Generator().manual_seed(7)
    # bf16 pieces from exact operations: Triton's interpreter stores fp32 into bf16 without
    # rounding to nearest, so a rounding producer would differ from eager before any fp8.
    u = _hard_rows(first).to(torch.bfloat16)
    v = _hard_rows(second).flip(0).to(torch.bfloat16)
    w = torch.randn(len(SPLITS), 32, first + second, generator=gen) / (first + second) ** 0.5
    w = w.to(torch.bfloat16).transpose(1, 2).contiguous()  # [G, 2H, K]: dX's weight
    offsets = _offsets()

    # dX reads the forward's weight copy, transposed (as the layers' backward passes it).
    weight_q_t, weight_scale = torch.ops.compileops.fp8_weight_rowwise(w, True)

    def dx(u, v, weight_q_t, weight_scale):
        dy = torch.cat([u * 2, -v], dim=-1)
        return torch.ops.compileops.grouped_linear_fp8_dx_from_copy(dy, weight_q_t,
                                                                    weight_scale, offsets)

    eager = dx(u, v, weight_q_t, weight_scale)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        got, sources = _compat.run_and_get_code(torch.compile(dx, fullgraph=True), u, v,
                                                weight_q_t, weight_scale)
    assert torch.equal(got.isnan(), eager.isnan())
    assert torch.equal(got.nan_to_num(), eager.nan_to_num())
    code = "\n".join(sources)
    assert not _extern_calls(code) & set(FP8_PRODUCTS)
    kernels = re.findall(r"def (triton_\w+)\(", code)
    fused = [k for k in kernels
             if k.startswith("triton_per_") and "neg" in k and "mul" in k
             and "grouped_linear_fp8_dx_from_copy" in k]
    assert bool(fused) == (pieces == (16, 16)), kernels
    part = {(16, 16): 16, (24, 24): 12, (20, 28): 16}[pieces]
    assert f"r0_numel = {part}\n" in code
