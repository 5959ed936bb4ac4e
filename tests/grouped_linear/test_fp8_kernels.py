"""The rowwise fp8 kernels (``compileops.grouped_linear.kernels.fp8``) under Triton's
interpreter (CPU) or on a GPU: the quantisation kernel bit for bit against the rule of
``compileops.grouped_linear.fp8``, and the fp8 grouped product (the M-jagged GEMM with the
scales in its epilogue) against its plain-PyTorch reference."""
import pytest
import torch

from compileops.grouped_linear import fp8
from compileops.grouped_linear.kernels import choose_config
from compileops.grouped_linear.kernels import fp8 as fp8_kernels

from tests.grouped_linear._helpers import kernel_device  # noqa: F401  (a fixture)
from tests.grouped_linear._helpers import offsets_of


@pytest.fixture
def device(kernel_device):
    return kernel_device


def _bits(q):
    return q.view(torch.uint8)


def _wide_range(rows, cols, dtype, device, seed=0):
    """Rows of N(0, 1) values scaled from 1e-6 to 1e6 (fp16: 1e-4 to 1e4, its range): scaled
    values cover e4m3's normal and subnormal codes, and the rounding up into the next binade
    (31.9 -> 32) that a plain fp32-to-e4m3 cast gets wrong in Triton's interpreter."""
    gen = torch.Generator().manual_seed(seed)
    decades = 4 if dtype == torch.float16 else 6
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-decades, decades, rows)[:, None]
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rowwise_quantisation_is_the_rule_bit_for_bit(device, dtype):
    x = _wide_range(48, 300, dtype, device)
    x[3] = 0  # an all-zero row: scale 1, codes 0
    before = x.clone()
    q, scale = fp8_kernels.quantize_rowwise(x)
    want_q, want_scale = fp8.quantize_rowwise(x.cpu())
    assert torch.equal(x, before)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape and scale.dtype == torch.float32
    assert torch.equal(_bits(q.cpu()), _bits(want_q))
    assert torch.equal(scale.cpu(), want_scale)
    assert scale[3].item() == 1.0


def test_rowwise_quantisation_of_strided_inputs_and_weights(device):
    x = _wide_range(40, 72, torch.bfloat16, device, seed=1).t()  # [72, 40], strides (1, 72)
    q, scale = fp8_kernels.quantize_rowwise(x)
    want_q, want_scale = fp8.quantize_rowwise(x.cpu())
    assert torch.equal(_bits(q.cpu()), _bits(want_q)) and torch.equal(scale.cpu(), want_scale)
    w = _wide_range(3 * 20, 36, torch.bfloat16, device, seed=2).reshape(3, 20, 36)
    want_q, want_scale = fp8.quantize_rowwise(w.cpu())
    for transpose in (False, True):
        q, scale = fp8_kernels.quantize_weight_rowwise(w, transpose=transpose)
        if transpose:  # dX's: the forward's copy written as W_g^T
            assert q.shape == (3, 36, 20) and q.is_contiguous()
            q = q.transpose(1, 2)
        assert q.shape == w.shape and scale.shape == w.shape[:2]
        assert torch.equal(_bits(q.cpu()), _bits(want_q))
        assert torch.equal(scale.cpu(), want_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transposed_weight_copy_is_the_forward_copy_transposed(device, dtype):
    """dX's weight: the forward's rowwise copy (one scale per output channel) written as
    ``W_g^T``, contiguous, bit for bit, for a strided weight too; a NaN keeps its channel
    NaN, an all-zero channel gets scale 1; w unchanged."""
    gen = torch.Generator().manual_seed(4)
    decades = 4 if dtype == torch.float16 else 6
    w = (torch.randn(3, 70, 45, generator=gen)
         * torch.logspace(-decades, decades, 45)[None, None, :]).to(dtype).to(device)
    w[1, 2, 5] = float("nan")
    w[2, 9, :] = 0
    before = w.clone()
    for weight in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):  # two stride orders
        q, scale = fp8_kernels.quantize_weight_rowwise(weight, transpose=True)
        want_q, want_scale = fp8.quantize_rowwise(weight.cpu())
        assert q.shape == (3, 45, 70) and q.is_contiguous() and scale.shape == (3, 70)
        finite = ~want_scale.isnan()
        # Codes of finite channels bit for bit. A NaN channel's codes are NaN in the rule; the
        # interpreter's fp32-to-e4m3 cast does not keep NaN, so that channel is held to its
        # meaning instead: every dequantised value NaN.
        assert torch.equal(_bits(q.transpose(1, 2).cpu())[finite], _bits(want_q)[finite])
        assert torch.equal(scale.cpu()[finite], want_scale[finite])
        assert scale[1, 2].isnan() and scale[2, 9].item() == 1.0
        assert fp8.dequantize(q.transpose(1, 2).cpu(), scale.cpu())[1, 2].isnan().all()
    assert torch.equal(w.nan_to_num(7.0), before.nan_to_num(7.0))
    empty = torch.zeros(2, 0, 8, dtype=dtype, device=device)
    q, scale = fp8_kernels.quantize_weight_rowwise(empty, transpose=True)
    assert q.shape == (2, 8, 0) and scale.shape == (2, 0)


def test_non_finite_values_poison_their_row_only(device):
    """K = 3000: several K chunks per row, the NaN in the first (a NaN amax must survive the
    chunks after it)."""
    x = _wide_range(6, 3000, torch.float32, device, seed=3)
    x[1, 7] = float("nan")
    x[4, 0] = float("inf")
    q, scale = fp8_kernels.quantize_rowwise(x)
    back = fp8.dequantize(q.cpu(), scale.cpu())
    for row in (1, 4):
        assert not torch.isfinite(scale[row]).item()
        assert not torch.isfinite(back[row]).any()
    finite = [0, 2, 3, 5]
    want_q, want_scale = fp8.quantize_rowwise(x.cpu())
    assert torch.equal(_bits(q.cpu()[finite]), _bits(want_q[finite]))
    assert torch.equal(scale.cpu()[finite], want_scale[finite])


def test_empty_shapes(device):
    q, scale = fp8_kernels.quantize_rowwise(torch.zeros(0, 16, device=device))
    assert q.shape == (0, 16) and scale.shape == (0,)
    q, scale = fp8_kernels.quantize_rowwise(torch.zeros(3, 0, device=device))
    assert q.shape == (3, 0) and scale.tolist() == [1.0, 1.0, 1.0]
    q, scale = fp8_kernels.quantize_rowwise(torch.zeros(2, 3, 0, device=device))
    assert q.shape == (2, 3, 0) and scale.shape == (2, 3) and bool((scale == 1).all())
    q, scale = fp8_kernels.quantize_blockwise(torch.zeros(2, 0, 5, device=device), (1, 128))
    assert q.shape == (2, 0, 5) and scale.shape == (2, 0, 1)


def test_quantisation_rejects_fp8_and_integer_inputs(device):
    with pytest.raises(TypeError, match="floating-point"):
        fp8_kernels.quantize_rowwise(torch.zeros(2, 4, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="floating-point"):
        fp8_kernels.quantize_rowwise(torch.zeros(2, 4, device=device).to(fp8.E4M3))


def _problem(device, dtype, m=70, k=96, n=80, seed=4):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(4, n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    # an empty group, and 6 tail rows past offsets[-1] (written as zeros)
    offsets = torch.tensor([10, 10, 40, 64], dtype=torch.int32, device=device)
    return x, w, offsets


#: Relative error of the fp8 product's sums against exact fp32 ones. Under the interpreter the
#: sums are fp32. Hopper's fp8 MMA adds the products of each K step (128) at reduced
#: precision before they reach the fp32 accumulator: 1.1e-4 measured on an H200 at K = 96.
FP8_MMA_SUMS = {"cpu": 1e-6, "cuda": 1e-3}


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_product_is_its_reference(device, dtype):
    x, w, offsets = _problem(device, dtype)
    wq, ws = fp8_kernels.quantize_weight_rowwise(w)
    y = fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, out_dtype=dtype)
    want = fp8.grouped_linear_reference(x.cpu(), w.cpu(), offsets.cpu(), "rowwise")
    assert y.dtype == dtype and y.shape == (70, 80)
    # The same e4m3 products; only the order of the fp32 sums (and where the scales are
    # applied) differs, then one rounding to the output dtype: for bf16 up to one unit in the
    # last place (2^-8 relative), or two under the interpreter, whose fp32-to-bf16 cast
    # truncates.
    assert _rel(y, want) <= max(FP8_MMA_SUMS[device], 1e-6 if dtype == torch.float32 else 2 ** -7)
    assert torch.count_nonzero(y[64:]) == 0
    again = fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, out_dtype=dtype)
    assert torch.equal(y, again)  # run to run: the same bits


def test_fp8_swiglu_product_and_its_pre_activations(device):
    x, w, offsets = _problem(device, torch.float32, seed=5)
    wq, ws = fp8_kernels.quantize_weight_rowwise(w)
    pre = torch.empty(70, 80, device=device)
    y = fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, swiglu=True,
                                               out_dtype=torch.float32, preact=pre)
    want_pre = fp8.grouped_linear_reference(x.cpu(), w.cpu(), offsets.cpu(), "rowwise")
    gate, up = want_pre.chunk(2, dim=-1)
    assert y.shape == (70, 40)
    assert _rel(pre[:64], want_pre[:64]) <= FP8_MMA_SUMS[device]
    assert _rel(y, torch.nn.functional.silu(gate) * up) <= FP8_MMA_SUMS[device]


def test_fp8_product_error_against_exact_is_torchaos(device):
    """Unit-normal data at a small MoE shape: within the relative error of torchao's rowwise
    fp8 grouped GEMM against bf16 (about 3.8e-2 measured; 4e-2 is the contract)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(256, 256, generator=gen)
    w = torch.randn(4, 128, 256, generator=gen)
    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    exact = torch.cat([x[64 * g:64 * (g + 1)].double() @ w[g].double().T for g in range(4)])
    wq, ws = fp8_kernels.quantize_weight_rowwise(w.to(device))
    y = fp8_kernels.grouped_linear_fp8_rowwise(x.to(device), wq, ws, offsets.to(device),
                                               out_dtype=torch.float32)
    assert 1e-3 < _rel(y, exact) <= 4e-2  # lossy, but within the contract


def test_fp8_product_rejects_bad_operands(device):
    x, w, offsets = _problem(device, torch.float32)
    wq, ws = fp8_kernels.quantize_weight_rowwise(w)
    with pytest.raises(TypeError, match="e4m3"):
        fp8_kernels.grouped_linear_fp8_rowwise(x, w, ws, offsets, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws[:, :3], offsets,
                                               out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[M, 96\]"):
        fp8_kernels.grouped_linear_fp8_rowwise(x[:, :5], wq, ws, offsets,
                                               out_dtype=torch.float32)


@pytest.mark.parametrize("block, shape", [((1, 128), (70, 300)), ((128, 128), (3, 200, 260))])
def test_blockwise_quantisation_is_the_rule_bit_for_bit(device, block, shape):
    """Activation blocks (1 x 128) and weight blocks (128 x 128), ragged at the edges; one
    block holds a NaN: its scale and values come back non-finite, the others exact."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-4, 4, shape[-1])
    x.view(-1)[17] = float("nan")
    x = x.bfloat16().to(device)
    q, scale = fp8_kernels.quantize_blockwise(x, block)
    want_q, want_scale = fp8.quantize_blockwise(x.cpu(), block)
    assert q.shape == x.shape and scale.shape == want_scale.shape
    finite = torch.isfinite(want_scale)
    assert (~finite).sum() == 1 and torch.equal(torch.isfinite(scale.cpu()), finite)
    assert torch.equal(scale.cpu()[finite], want_scale[finite])
    back, want = fp8.dequantize(q.cpu(), scale.cpu(), block), fp8.dequantize(want_q, want_scale, block)
    assert torch.equal(torch.isfinite(back), torch.isfinite(want))
    ok = torch.isfinite(want)
    assert torch.equal(_bits(q.cpu())[ok], _bits(want_q)[ok])


def test_fp8_blockwise_products_are_their_reference(device):
    """Forward, SwiGLU with its pre-activations, and dX (the weight's blocks read
    transposed), K = 300 and N = 260: ragged blocks in both dims."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(70, 300, generator=gen).to(device)
    w = (torch.randn(4, 260, 300, generator=gen) / 300 ** 0.5).to(device)
    offsets = torch.tensor([10, 10, 40, 64], dtype=torch.int32, device=device)
    wq, ws = fp8_kernels.quantize_blockwise(w, fp8.WEIGHT_BLOCK)
    want = fp8.grouped_linear_reference(x.cpu(), w.cpu(), offsets.cpu(), "blockwise")
    y = fp8_kernels.grouped_linear_fp8_blockwise(x, wq, ws, offsets, out_dtype=torch.float32)
    assert _rel(y, want) <= FP8_MMA_SUMS[device] and torch.count_nonzero(y[64:]) == 0
    pre = torch.empty(70, 260, device=device)
    h = fp8_kernels.grouped_linear_fp8_blockwise(x, wq, ws, offsets, out_dtype=torch.float32,
                                                 swiglu=True, preact=pre)
    gate, up = want.chunk(2, dim=-1)
    assert _rel(pre[:64], want[:64]) <= FP8_MMA_SUMS[device]
    assert _rel(h, torch.nn.functional.silu(gate) * up) <= FP8_MMA_SUMS[device]
    dy = torch.randn(70, 260, generator=gen).to(device)
    dx = fp8_kernels.grouped_linear_fp8_blockwise(dy, wq, ws, offsets, out_dtype=torch.float32,
                                                  transposed=True)
    want_dx = fp8.grouped_linear_reference(dy.cpu(), w.cpu().transpose(1, 2), offsets.cpu(),
                                           "blockwise")
    assert _rel(dx, want_dx) <= FP8_MMA_SUMS[device]
    with pytest.raises(ValueError, match="128 x 128 blocks"):
        fp8_kernels.grouped_linear_fp8_blockwise(x, wq, ws[:, :1], offsets,
                                                 out_dtype=torch.float32)


#: Fast accumulation against the fp32 sums of the same e4m3 products: at most 3.4e-3 at the
#: MoE layers' products with bf16 outputs (benchmarks/RESULTS.md, fp8, "The products").
FAST_ACCUM_SUMS = 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_fast_accumulation_at_the_wide_tiles_is_its_reference(out_dtype):
    """Groups of hundreds of rows with fast accumulation: bf16 activations take the widest
    fp8 tiles (128 x 256, the persistent loop flattened; SwiGLU 128 x 128 pairs), fp32 ones
    the default accumulation's 128 x 128 (the wide tile's stages and an fp32 output tile do
    not fit one block's shared memory together). Skewed groups with an empty and a one-row
    group, a partial last column tile (640 = 2 x 256 + 128) and tail rows past the last
    group, against the reference of the same e4m3 operands; the same bits run to run."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    splits = [700, 0, 1300, 260, 1, 900, 511, 333]
    m, k, n = sum(splits) + 7, 1024, 640
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(m, k, generator=gen).to(out_dtype).cuda()
    w = (torch.randn(len(splits), n, k, generator=gen) / k ** 0.5).to(out_dtype).cuda()
    offsets = offsets_of(splits).cuda()
    plain = choose_config(m, len(splits), n, k, fp8.E4M3, x.device, fp8_fast_accum=True,
                          out_dtype=out_dtype)
    pair = choose_config(m, len(splits), n // 2, k, fp8.E4M3, x.device, swiglu=True,
                         fp8_fast_accum=True, out_dtype=out_dtype)
    wide = out_dtype == torch.bfloat16
    assert (plain.block_m, plain.block_n, plain.flatten) == (128, 256 if wide else 128, True)
    assert (pair.block_m, pair.block_n, pair.flatten) == (128, 128, False), pair
    wq, ws = fp8_kernels.quantize_weight_rowwise(w)
    # The same e4m3 operands (x's values are exact in fp32), their products summed in fp32.
    want = fp8.grouped_linear_reference(x.float().cpu(), w.float().cpu(), offsets.cpu(),
                                        "rowwise")
    rows = int(offsets[-1])

    y = fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, out_dtype=out_dtype,
                                               fast_accum=True)
    assert _rel(y[:rows], want[:rows]) <= FAST_ACCUM_SUMS
    assert torch.count_nonzero(y[rows:]) == 0
    assert torch.equal(y, fp8_kernels.grouped_linear_fp8_rowwise(
        x, wq, ws, offsets, out_dtype=out_dtype, fast_accum=True))

    pre = torch.empty(m, n, device="cuda", dtype=out_dtype)
    h = fp8_kernels.grouped_linear_fp8_rowwise(x, wq, ws, offsets, swiglu=True,
                                               out_dtype=out_dtype, preact=pre,
                                               fast_accum=True)
    gate, up = want.chunk(2, dim=-1)
    assert _rel(pre[:rows], want[:rows]) <= FAST_ACCUM_SUMS
    assert _rel(h[:rows], (torch.nn.functional.silu(gate) * up)[:rows]) <= 2 * FAST_ACCUM_SUMS
    assert torch.count_nonzero(h[rows:]) == 0
