"""The fp8 (e4m3) quantisation rule of ``compileops.grouped_linear.fp8`` against a reference
written out here: every finite e4m3 value enumerated from its bits, rounding to the nearest
with ties to the even code, groups and amaxes in plain Python loops."""
import math

import pytest
import torch

from compileops.grouped_linear import fp8

# Every finite e4m3fn value by code (0x7f and 0xff are NaN; no infinities).
_CODES = [c for c in range(256) if c & 0x7F != 0x7F]
_VALUES = torch.tensor(_CODES, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()


def e4m3_round(value: float) -> float:
    """Round to nearest e4m3fn, ties to the even code, saturating at +-448."""
    if math.isnan(value):
        return math.nan
    value = max(-448.0, min(448.0, value))
    best = min(range(len(_CODES)), key=lambda i: (abs(_VALUES[i] - value), _CODES[i] & 1))
    return _VALUES[best]


#: Groups with a smaller amax get scale 1: 448 * 2^-126, the smallest amax whose scale
#: ``amax / 448`` is a normal fp32 number.
MIN_AMAX = 448.0 * 2.0 ** -126


def reference_group(values: list) -> tuple:
    """(q values, scale) for one group under the module's rule, in fp32 steps."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    amax = max((abs(v) for v in values), default=0.0)
    if any(math.isnan(v) for v in values):
        amax = math.nan
    if amax < MIN_AMAX:  # all-zero or tiny
        return [e4m3_round(f32(v)) for v in values], 1.0
    inverse = f32(448.0 / amax) if amax != math.inf else 0.0
    return [e4m3_round(f32(v * inverse)) for v in values], f32(amax / 448.0)


def test_rowwise_matches_the_written_out_rule():
    x = torch.randn(5, 37, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    x[1] *= 1e-6  # small values: subnormal codes
    x[2] *= 1e4
    x[3, 7] = 0.0
    q, scale = fp8.quantize_rowwise(x)
    assert q.dtype == fp8.E4M3 and q.shape == x.shape and scale.shape == (5,)
    for row in range(5):
        want_q, want_scale = reference_group(x[row].tolist())
        assert q[row].double().tolist() == want_q
        assert scale[row].item() == want_scale


#: Tiny group amaxes: 1e-40 is subnormal in fp32; 1e-38 and 1e-36 overflow ``448 / amax``
#: in fp32, 1e-30 and 1e-12 do not; MIN_AMAX and the fp32 value below it are the edge.
TINY = (1e-38, 1e-40, 1e-36, 1e-30, 1e-12, MIN_AMAX,
        torch.nextafter(torch.tensor(MIN_AMAX), torch.tensor(0.0)).item())


def _tiny_rows(cols: int, seed: int) -> torch.Tensor:
    """Normal rows with a row of each :data:`TINY` amax between them, each tiny row holding
    an exact zero (times an overflowed ``448 / amax``, a NaN) and its amax exactly (as its
    first value)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * len(TINY) + 1, cols, generator=gen)
    for i, amax in enumerate(TINY):
        row = x[2 * i + 1]
        row.mul_(amax / row.abs().max() / 2)  # halved: no rounding up past amax
        row[0], row[cols // 2] = -amax, 0.0
    return x


def test_tiny_groups_get_scale_one_below_min_amax_and_full_precision_above():
    """Rows and 1 x 128 tiles with tiny amaxes beside normal ones: the written-out rule bit
    for bit; below MIN_AMAX scale 1 and zeros that keep the values' signs, at and above it
    a normal scale and e4m3's precision."""
    assert fp8.MIN_AMAX == MIN_AMAX
    x = _tiny_rows(300, seed=9)
    q, scale = fp8.quantize_rowwise(x)
    for row in range(x.shape[0]):
        want_q, want_scale = reference_group(x[row].tolist())
        assert q[row].double().tolist() == want_q, row
        assert scale[row].item() == want_scale, row
    qb, scale_b = fp8.quantize_blockwise(x, fp8.ACTIVATION_BLOCK)
    for row in range(x.shape[0]):
        for bk in range(3):
            want_q, want_scale = reference_group(x[row, bk * 128:(bk + 1) * 128].tolist())
            assert qb[row, bk * 128:(bk + 1) * 128].double().tolist() == want_q, (row, bk)
            assert scale_b[row, bk].item() == want_scale, (row, bk)
    back = fp8.dequantize(q, scale)
    assert bool(torch.isfinite(back).all())
    for i, amax in enumerate(TINY):
        row = x[2 * i + 1]
        if amax < MIN_AMAX:
            assert scale[2 * i + 1].item() == 1.0, amax
            assert torch.equal(back[2 * i + 1], row * 0), amax  # zeros, of row's signs
        else:
            assert scale[2 * i + 1].item() >= 2.0 ** -126, amax
            err = (back[2 * i + 1] - row).abs()
            bound = torch.maximum(row.abs() * 2.0 ** -4, scale[2 * i + 1] * 2.0 ** -10)
            assert bool((err <= bound).all()), amax
            assert float(q[2 * i + 1].float().abs().max()) == 448.0, amax


def test_blockwise_matches_the_written_out_rule_with_ragged_blocks():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 5, 7, generator=gen) * torch.logspace(-3, 3, 7)
    block = (2, 3)  # small blocks, the same code path as 128 x 128: 3 x 3 blocks, ragged
    q, scale = fp8.quantize_blockwise(w, block)
    assert q.shape == w.shape and scale.shape == (2, 3, 3)
    for g in range(2):
        for bn in range(3):
            for bk in range(3):
                tile = w[g, bn * 2:(bn + 1) * 2, bk * 3:(bk + 1) * 3]
                want_q, want_scale = reference_group(tile.flatten().tolist())
                got = q[g, bn * 2:(bn + 1) * 2, bk * 3:(bk + 1) * 3].double().flatten()
                assert got.tolist() == want_q, (g, bn, bk)
                assert scale[g, bn, bk].item() == want_scale


def test_activation_and_weight_blocks_are_deepseek_v3s():
    x = torch.randn(3, 300)
    _, scale = fp8.quantize_blockwise(x, fp8.ACTIVATION_BLOCK)
    assert scale.shape == (3, 3)  # 128 + 128 + 44
    w = torch.randn(4, 200, 300)
    _, scale = fp8.quantize_blockwise(w, fp8.WEIGHT_BLOCK)
    assert scale.shape == (4, 2, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_error_is_e4m3s_half_ulp(dtype):
    """Normal range: within 2^-4 relative (3 mantissa bits); below it within half the
    smallest subnormal step (2^-10 of the scale)."""
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    for q, scale, block in ((*fp8.quantize_rowwise(x), None),
                            (*fp8.quantize_blockwise(x, fp8.ACTIVATION_BLOCK),
                             fp8.ACTIVATION_BLOCK)):
        back = fp8.dequantize(q, scale, block)
        per_value = (scale.unsqueeze(-1) if block is None else
                     scale.repeat_interleave(128, dim=-1)[..., :256])
        err = (back - x.float()).abs()
        bound = torch.maximum(x.float().abs() * 2.0 ** -4, per_value * 2.0 ** -10)
        assert bool((err <= bound * (1 + 1e-6)).all())
        # The largest magnitude of each group lands on +-448 exactly.
        assert float(q.float().abs().amax()) == 448.0


def test_all_zero_groups_get_scale_one_and_come_back_zero():
    x = torch.zeros(4, 256)
    x[2, 130] = 5.0  # one tile of row 2 is not zero
    five = torch.tensor(5.0 / 448.0, dtype=torch.float32).item()
    q, scale = fp8.quantize_rowwise(x)
    assert scale.tolist() == [1.0, 1.0, five, 1.0]
    q, scale = fp8.quantize_blockwise(x, fp8.ACTIVATION_BLOCK)
    assert scale[2].tolist() == [1.0, five] and scale[0].tolist() == [1.0, 1.0]
    assert bool((fp8.dequantize(q, scale, fp8.ACTIVATION_BLOCK)[[0, 1, 3]] == 0).all())


def test_empty_inputs():
    q, scale = fp8.quantize_rowwise(torch.zeros(0, 16))
    assert q.shape == (0, 16) and scale.shape == (0,)
    q, scale = fp8.quantize_rowwise(torch.zeros(3, 0))
    assert q.shape == (3, 0) and scale.tolist() == [1.0, 1.0, 1.0]
    q, scale = fp8.quantize_blockwise(torch.zeros(0, 200, 16), fp8.WEIGHT_BLOCK)
    assert q.shape == (0, 200, 16) and scale.shape == (0, 2, 1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values_poison_only_their_group(bad):
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    x[1, 5] = bad
    for block in (None, fp8.ACTIVATION_BLOCK):
        q, scale = (fp8.quantize_rowwise(x) if block is None
                    else fp8.quantize_blockwise(x, block))
        back = fp8.dequantize(q, scale, block)
        hit = back[1] if block is None else back[1, :128]
        assert not bool(torch.isfinite(hit).any()), "a non-finite group came back finite"
        clean = torch.cat([back[0], back[2]] + ([] if block is None else [back[1, 128:]]))
        assert bool(torch.isfinite(clean).all())


def test_inputs_are_not_modified_and_bad_inputs_raise():
    x = torch.randn(4, 130, dtype=torch.bfloat16)
    before = x.clone()
    fp8.quantize_rowwise(x)
    fp8.quantize_blockwise(x, fp8.ACTIVATION_BLOCK)
    assert torch.equal(x, before)
    with pytest.raises(TypeError, match="floating-point"):
        fp8.quantize_rowwise(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="not fp8"):
        fp8.quantize_rowwise(torch.ones(3, 4).to(fp8.E4M3))
    with pytest.raises(ValueError, match="at least 2 dims"):
        fp8.quantize_blockwise(torch.ones(4), fp8.ACTIVATION_BLOCK)
    with pytest.raises(ValueError, match="positive"):
        fp8.quantize_blockwise(torch.ones(4, 4), (0, 128))
    with pytest.raises(TypeError, match="must be"):
        fp8.dequantize(torch.ones(3, 4), torch.ones(3))


def test_compiled_quantisation_gives_the_same_bits():
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(4)) * 7
    eager = fp8.quantize_blockwise(x, fp8.ACTIVATION_BLOCK)
    compiled = torch.compile(fp8.quantize_blockwise, fullgraph=True)(x, fp8.ACTIVATION_BLOCK)
    assert torch.equal(eager[0].view(torch.uint8), compiled[0].view(torch.uint8))
    assert torch.equal(eager[1], compiled[1])


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_fp8_grouped_linear_is_within_torchaos_error_of_bf16(scaling):
    """The fp8 forward's contract: relative L2 <= 4e-2 against the bf16 grouped linear on
    unit-normal data (torchao's rowwise fp8 grouped GEMM measures 3.8e-2), at a small MoE
    shape with a ragged K, an empty group and rows of no group."""
    from compileops.grouped_linear.reference import grouped_linear_forward

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 200, generator=gen).bfloat16()
    w = (torch.randn(4, 160, 200, generator=gen) / 200 ** 0.5).bfloat16()
    offsets = torch.tensor([90, 90, 200, 280], dtype=torch.int32)  # group 1 empty; 20 spare
    want = grouped_linear_forward(x.double(), w.double(), offsets)
    got = fp8.grouped_linear_reference(x, w, offsets, scaling)
    bf16 = grouped_linear_forward(x, w, offsets)
    rel = lambda a: float((a.double() - want).norm() / want.norm())  # noqa: E731
    assert got.dtype == x.dtype and got.shape == (300, 160)
    assert bool((got[280:] == 0).all())
    assert rel(got) <= 4e-2, rel(got)
    assert rel(got) > rel(bf16)  # fp8 does lose precision: the check can see it
    with pytest.raises(ValueError, match="scaling"):
        fp8.grouped_linear_reference(x, w, offsets, "tensorwise")
