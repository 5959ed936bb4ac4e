"""fp8 dW (``fp8_weight_grad=True``, rowwise): the per-group, per-column quantisation of the
operands bit for bit against its rule (:func:`compileops.grouped_linear.fp8.
quantize_group_columns`), the K-jagged product on e4m3 codes against its reference, the error
against fp64 that the docstrings state, the op's contract (opcheck, errors, empty shapes),
and the layers' backward: dW from the fp8 op, dX untouched, compiled as eager. Under Triton's
interpreter (CPU) or on a GPU."""
import contextlib
import os

import pytest
import torch

import compileops
from compileops.grouped_linear import fp8, kernels
from compileops.grouped_linear.fp8_wgrad_op import grouped_linear_wgrad_fp8_op
from compileops.grouped_linear.kernels import fp8_wgrad as fp8_kernels
from compileops.grouped_linear.kernels import grouped_linear_wgrad, grouped_linear_wgrad_fp8
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import empty_fp8_cache  # noqa: F401  (a fixture)
from tests.grouped_linear._helpers import kernel_device  # noqa: F401  (a fixture)
from tests.grouped_linear._helpers import offsets_of

pytestmark = pytest.mark.usefixtures("empty_fp8_cache")
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels on CPU tensors: interpreter only")

SPLITS = [10, 0, 23, 17]  # an empty group, spans not multiples of 16, and 6 rows past the last
M = sum(SPLITS) + 6


@pytest.fixture
def device(kernel_device):
    return kernel_device


def _offsets(device, splits=SPLITS):
    return offsets_of(splits).to(device)


def _wide(rows, cols, dtype, device, seed=0):
    """N(0, 1) columns scaled from 1e-3 to 1e3: every column's group amax differs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 3, cols)
    return x.to(dtype).to(device)


def _unpadded(q_t, padded, splits, rows):
    """The kernel's padded ``[C, W]`` codes back at their rows ``[C, M]`` (uint8, zeros past
    the last group), checking that each span starts on 16 codes and is zero-padded."""
    q = q_t.cpu().view(torch.uint8)
    out = torch.zeros((q.shape[0], rows), dtype=torch.uint8)
    start = dst = 0
    for count, end in zip(splits, padded.cpu().tolist()):
        assert dst % fp8_kernels.GROUP_ALIGN == 0 and end % fp8_kernels.GROUP_ALIGN == 0
        out[:, start:start + count] = q[:, dst:dst + count]
        assert not q[:, dst + count:end].any(), "padding must be zero codes"
        start, dst = start + count, end
    return out


#: The quantiser's tiles: the GPU's and the interpreter's, on either device (the tiles set
#: which rows each program reads and which chunks merge their amax).
TILES = {"gpu-tiles": (fp8_kernels.AMAX_TILE, fp8_kernels.CODES_TILE),
         "interpreter-tiles": (fp8_kernels.INTERPRETER_TILE,) * 2}


@pytest.mark.parametrize("tiles,align", [("gpu-tiles", 16), ("gpu-tiles", 64),
                                         ("gpu-tiles", 128), ("interpreter-tiles", 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_group_column_quantisation_is_the_rule_bit_for_bit(device, dtype, tiles, align,
                                                           monkeypatch):
    """Every code and scale as the rule has them, with spans aligned to 16, 64 and 128 rows:
    the GPU's 128-row amax tile is then cut to 16 and 64 rows, or whole (the product's row
    step sets the alignment: 64 for the 16-bit dW pick, 128 for the long tile)."""
    monkeypatch.setattr(fp8_kernels, "quantiser_tiles", lambda _: TILES[tiles])
    x = _wide(M, 40, dtype, device)
    x[10:33, 5] = 0  # a column all zero in one group: scale 1, zero codes
    x[2, 7] = float("nan")  # NaN scale for that group's column
    # a NaN in the second row chunk of group 2 only (rows 10-32): the chunks' amaxes merge
    x[30, 3] = float("nan")
    offsets = _offsets(device)
    before = x.clone()
    for given in (x, x.t().contiguous().t()):  # row-major and column-major inputs
        q_t, scale, padded = fp8_kernels.quantize_group_columns(given, offsets, align)
        want_q, want_scale = fp8.quantize_group_columns(x.cpu(), offsets.cpu())
        assert torch.allclose(x, before, rtol=0, atol=0, equal_nan=True)
        got = _unpadded(q_t, padded, SPLITS, M)
        want = want_q.view(torch.uint8)
        # Group 0's column 7 and group 2's column 3 hold a NaN: their codes are NaN in the
        # rule, but the interpreter's fp32-to-e4m3 cast does not keep NaN (and a NaN's sign
        # is nobody's rule), so those spans are held to their meaning instead, a NaN scale
        # (every dequantised value NaN).
        # Every other code bit for bit.
        for nan_span in ((slice(7, 8), slice(0, SPLITS[0])), (slice(3, 4), slice(10, 33))):
            got[nan_span] = want[nan_span]
        assert torch.equal(got, want)
        assert torch.equal(scale.cpu().nan_to_num(-1.0), want_scale.nan_to_num(-1.0))
    assert scale[1].eq(1).all() and scale[2, 5] == 1 and scale[0, 7].isnan()
    assert scale[2, 3].isnan() and scale.isnan().sum() == 2


def test_the_rule_quantises_each_group_on_its_own_column_amax():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0], [100.0, 0.25]])  # groups: rows 0-1, row 2
    q_t, scale = fp8.quantize_group_columns(x, torch.tensor([2, 3], dtype=torch.int32))
    assert torch.equal(scale, torch.tensor([[1.0, 4.0], [100.0, 0.25]]) / 448)
    assert torch.equal(q_t.float(), torch.tensor([[448.0, 224.0, 448.0],
                                                  [-224.0, 448.0, 448.0]]))


@pytest.mark.parametrize("config", [None, "long"], ids=["default-tile", "long-tile"])
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast-accum"])
def test_the_product_is_the_reference_up_to_its_sum_order(device, fast, config):
    """``long``: the tile fast accumulation takes from 1024 rows per group (128-row steps,
    spans padded to 128), here on groups of 0-23 rows."""
    config = kernels.FP8_WGRAD_LONG_CONFIG if config == "long" else None
    x = _wide(M, 24, torch.bfloat16, device, seed=1)
    dy = torch.randn(M, 40, generator=torch.Generator().manual_seed(2)).bfloat16().to(device)
    offsets = _offsets(device)
    dw = grouped_linear_wgrad_fp8(dy, x, offsets, torch.float32, fast_accum=fast,
                                  config=config)
    want = fp8.grouped_linear_wgrad_reference(dy.cpu(), x.cpu(), offsets.cpu())
    assert dw.shape == (len(SPLITS), 40, 24) and dw.dtype == torch.float32
    assert torch.equal(dw[1].cpu(), torch.zeros(40, 24))  # the empty group
    # fp32 sums of exact e4m3 products, in another order; on Hopper the MMA adds each step's
    # products at reduced precision (about 1e-4), over the whole reduction when fast
    tol = (4e-3 if fast else 5e-4) if device == "cuda" else 1e-6
    assert ((dw.cpu() - want).norm() / want.norm()).item() <= tol
    again = grouped_linear_wgrad_fp8(dy, x, offsets, torch.float32, fast_accum=fast,
                                     config=config)
    assert torch.equal(dw, again)  # deterministic


def test_fast_accumulation_takes_the_long_tile_only_for_long_groups():
    """The fp8 dW config (on an H100's spec): the long tile with fast accumulation from 1024
    rows per group; the 16-bit dW's pick otherwise, and always without fast accumulation
    (its 64-row steps set the promoted sums' error)."""
    h100 = kernels.H100_SXM
    long = kernels.FP8_WGRAD_LONG_CONFIG
    assert kernels.choose_fp8_wgrad_config(16384, 8, 4096, 14336, h100, fast_accum=True) == long
    assert kernels.choose_fp8_wgrad_config(32768, 32, 7168, 2048, h100, fast_accum=True) == long
    sixteen_bit = kernels.choose_wgrad_config(65536, 128, 2048, 768, torch.bfloat16, h100)
    assert kernels.choose_fp8_wgrad_config(65536, 128, 2048, 768, h100,
                                           fast_accum=True) == sixteen_bit
    assert kernels.choose_fp8_wgrad_config(16384, 8, 4096, 14336, h100, fast_accum=False) == (
        kernels.choose_wgrad_config(16384, 8, 4096, 14336, torch.bfloat16, h100))
    # a part whose shared memory holds fewer than two of the long tile's 48 KB stages
    small = kernels.DeviceSpec("small part", 100, 99 * 1024, (8, 9))
    assert kernels.choose_fp8_wgrad_config(16384, 8, 4096, 14336, small,
                                           fast_accum=True) != long


def test_no_groups_no_rows_and_no_columns(device):
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    dy = torch.randn(8, 8, device=device, dtype=torch.bfloat16)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    assert grouped_linear_wgrad_fp8(dy, x, none, torch.bfloat16).shape == (0, 8, 16)
    empty = torch.zeros(2, dtype=torch.int32, device=device)  # two groups of no rows
    assert torch.equal(grouped_linear_wgrad_fp8(dy, x, empty, torch.float32).cpu(),
                       torch.zeros(2, 8, 16))
    assert grouped_linear_wgrad_fp8(dy, x[:, :0], empty, torch.float32).shape == (2, 8, 0)


@interpreter
def test_error_against_fp64_is_fp8s_not_bf16s():
    """The docstrings' figures (``fp8_op``: 3.68-3.73e-2 for fp8 dW, 1.65e-3 for dW from the
    bf16 operands rounded to bf16) on a smaller case: one group of 256 rows, K = N = 128."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen).bfloat16()
    dy = torch.randn(256, 128, generator=gen).bfloat16()
    offsets = torch.tensor([256], dtype=torch.int32)
    exact = (dy.double().t() @ x.double())[None]

    def error(dw):
        return ((dw.double() - exact).norm() / exact.norm()).item()

    fp8_error = error(grouped_linear_wgrad_fp8(dy, x, offsets, torch.float32))
    bf16_dw, _ = grouped_linear_wgrad(dy, x, offsets, torch.float32, torch.float32,
                                      with_db=False)
    assert 3.0e-2 <= fp8_error <= 4.5e-2, fp8_error
    # rounded to nearest, as a GPU stores a bf16 weight's gradient
    assert 1.2e-3 <= error(bf16_dw.bfloat16()) <= 2.2e-3
    assert error(bf16_dw) <= 1e-6


@interpreter
def test_opcheck_and_the_reference_backend():
    x = _wide(M, 24, torch.bfloat16, "cpu", seed=3)
    dy = torch.randn(M, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    offsets = _offsets("cpu")
    torch.library.opcheck(grouped_linear_wgrad_fp8_op, (dy, x, offsets, torch.bfloat16, False))
    kernel = grouped_linear_wgrad_fp8_op(dy, x, offsets, torch.float32)
    with compileops.use_backend("reference"):
        reference = grouped_linear_wgrad_fp8_op(dy, x, offsets, torch.float32)
    assert ((kernel - reference).norm() / reference.norm()).item() <= 1e-6


def test_bad_inputs_are_refused_clearly():
    x = torch.randn(M, 24, dtype=torch.bfloat16)
    w = torch.randn(4, 16, 24, dtype=torch.bfloat16)
    offsets = _offsets("cpu")
    with pytest.raises(TypeError, match="fp64"):
        grouped_linear_wgrad_fp8_op(x.double(), x.double(), offsets, torch.float64)
    with pytest.raises(ValueError, match="rows"):
        grouped_linear_wgrad_fp8_op(x[:-1], x, offsets, torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_weight_grad=True applies to fp8='rowwise'"):
        compileops.grouped_linear(x, w, offsets, fp8="blockwise", fp8_weight_grad=True)
    with pytest.raises(ValueError, match="fp8_weight_grad=True computes the weight gradient"):
        compileops.grouped_linear(x, w, offsets, fp8_weight_grad=True)
    with pytest.raises(ValueError, match="fp8_weight_grad=True computes the weight gradient"):
        compileops.nn.GroupedLinear(4, 24, 16, bias=False, fp8_weight_grad=True)
    with pytest.raises(ValueError, match="fp8_weight_grad=True applies to fp8='rowwise'"):
        compileops.grouped_linear_swiglu(x, torch.randn(4, 32, 24, dtype=torch.bfloat16),
                                         offsets, fp8="blockwise", fp8_weight_grad=True)


def _layer(offsets, p, weight_grad):
    def layer(x, w_up, w_down):
        h = compileops.grouped_linear_swiglu(x, w_up, offsets, fp8="rowwise",
                                             fp8_weight_grad=weight_grad)
        return compileops.grouped_linear(h, w_down, offsets, row_scale=p, fp8="rowwise",
                                         fp8_weight_grad=weight_grad)
    return layer


def _leaves(device, seed=5, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 32, generator=gen)
    w_up = torch.randn(len(SPLITS), 48, 32, generator=gen) / 32 ** 0.5
    w_down = torch.randn(len(SPLITS), 32, 24, generator=gen) / 24 ** 0.5
    dy = torch.randn(M, 32, generator=gen)
    return [t.to(dtype).to(device) for t in (x, w_up, w_down, dy)]


def _grads(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    fn(*leaves).backward(dy)
    return [t.grad for t in leaves]


def test_the_layer_takes_dw_from_the_fp8_op_and_leaves_dx_alone(device):
    """An expert layer (SwiGLU gate/up, then the down projection times the router
    probability): with ``fp8_weight_grad`` every dX is the bits of the bf16-dW layer's, and
    the down projection's dW is the fp8 op on its operands (p times the narrower one, h)."""
    x, w_up, w_down, dy = _leaves(device)
    offsets = _offsets(device)
    p = torch.rand(M, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    fp8_dw = _grads(_layer(offsets, p, True), (x, w_up, w_down), dy)
    bf16_dw = _grads(_layer(offsets, p, False), (x, w_up, w_down), dy)
    assert torch.equal(fp8_dw[0], bf16_dw[0])
    h = compileops.grouped_linear_swiglu(x, w_up, offsets, fp8="rowwise")
    want = grouped_linear_wgrad_fp8_op(dy, h * p[:, None], offsets, torch.bfloat16)
    assert torch.equal(fp8_dw[2], want)
    for got, bf16 in zip(fp8_dw[1:], bf16_dw[1:]):
        assert not torch.equal(got, bf16)  # another product ...
        assert ((got.float() - bf16.float()).norm() / bf16.float().norm()).item() < 0.1


@interpreter
def test_compiled_layer_calls_the_fp8_dw_and_gives_the_eager_dw():
    """fp32 leaves: the compiled step's own pointwise kernels (``h * p``) run under the
    interpreter, whose casts to bf16 truncate where eager torch rounds."""
    x, w_up, w_down, dy = _leaves("cpu", dtype=torch.float32)
    offsets = _offsets("cpu")
    p = torch.rand(M, generator=torch.Generator().manual_seed(6))
    layer = _layer(offsets, p, True)
    eager = _grads(layer, (x, w_up, w_down), dy)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(layer, fullgraph=True)
        got, sources = _compat.run_and_get_code(
            lambda: _grads(compiled, (x, w_up, w_down), dy))
    code = "\n".join(sources)
    assert code.count("torch.ops.compileops.grouped_linear_wgrad_fp8.default(") == 2
    assert "grouped_linear_wgrad.default(" not in code
    # The down projection's dW: the same operands, the same op (the gate/up dW reads the
    # SwiGLU derivative, which the compiled backward fuses and rounds on its own)
    assert torch.equal(got[2], eager[2])
    assert ((got[1] - eager[1]).norm() / eager[1].norm()).item() < 1e-2


def test_module_passes_the_option(device):
    layer = compileops.nn.GroupedLinear(4, 32, 16, bias=False, fp8="rowwise",
                                        fp8_weight_grad=True, dtype=torch.bfloat16,
                                        device=device)
    assert "fp8_weight_grad=True" in repr(layer)
    x = torch.randn(M, 32, dtype=torch.bfloat16, device=device)
    offsets = _offsets(device)
    dy = torch.randn(M, 16, dtype=torch.bfloat16, device=device)
    layer(x, offsets, offsets=True).backward(dy)
    want = grouped_linear_wgrad_fp8_op(dy, x, offsets, torch.bfloat16)
    assert torch.equal(layer.weight.grad, want)
