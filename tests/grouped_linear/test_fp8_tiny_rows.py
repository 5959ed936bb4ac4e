"""fp8 groups (rows, 1 x 128 tiles, 128 x 128 blocks) with tiny amaxes, next to normal ones.
``448 / amax`` overflows fp32 below about 1.3e-36, which would turn such a group into +-amax
or NaN; the rule (``compileops.grouped_linear.fp8``) gives a group below ``MIN_AMAX`` (about
5.3e-36) scale 1 and zeros, and every group above it e4m3's full precision. The Triton
quantisers against the rule bit for bit, and the fp8 grouped linear's forward and dX on both
backends and both recipes against the exact product of the unquantised operands."""
import pytest
import torch

import compileops
from compileops.grouped_linear import fp8
from compileops.grouped_linear.fp8_op import RECIPES
from compileops.grouped_linear.kernels import fp8 as fp8_kernels

#: 448 * 2^-126 (written out here: the smallest amax whose scale is a normal fp32 number).
MIN_AMAX = 448.0 * 2.0 ** -126
#: Group amaxes: 1e-38 and 1e-40 (subnormal in fp32; both overflow ``448 / amax``) and the
#: fp32 value just below MIN_AMAX are flushed; MIN_AMAX itself, 1e-30, 1e-15 and 1e-12 keep
#: e4m3's precision.
TINY = (1e-38, 1e-40, 1e-30, 1e-15, 1e-12, MIN_AMAX,
        torch.nextafter(torch.tensor(MIN_AMAX), torch.tensor(0.0)).item())


def _tiny(device, dtype) -> tuple:
    """:data:`TINY`, less the two amaxes at MIN_AMAX when bf16 runs through Triton's
    interpreter: its bf16-to-fp32 conversion misreads bf16 subnormals (5e-39 as 8.1e-39,
    9.2e-41 as 0), and in a group at MIN_AMAX (scale 2^-126) those quantise to nonzero codes.
    A GPU converts them exactly, and fp32 inputs cover these groups on CPU."""
    if device == "cpu" and dtype == torch.bfloat16:
        return TINY[:5]
    return TINY


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


@pytest.fixture(autouse=True)
def interpreter_or_gpu(device):
    import os

    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")


def _shrink(t: torch.Tensor, amax: float) -> None:
    """Scale contiguous ``t`` in place to largest magnitude ``amax`` (reached by its first
    value, made negative), with an exact zero in it (times an overflowed ``448 / amax``, a
    NaN)."""
    t.mul_(amax / t.abs().max() / 2)  # halved: no rounding up past amax
    flat = t.view(-1)
    flat[0], flat[flat.numel() // 2] = -amax, 0.0


def _rows(rows: int, cols: int, tiny_every: int, seed: int, tiny: tuple = TINY
          ) -> torch.Tensor:
    """``[rows, cols]`` unit normals; row ``i`` with ``i % tiny_every == 1`` shrunk to the
    next amax of ``tiny``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    for n, i in enumerate(range(1, rows, tiny_every)):
        _shrink(x[i], tiny[n % len(tiny)])
    return x


def _bits(q):
    return q.view(torch.uint8)


def _check_quantisation(got, want, x, block=None):
    """``got`` = ``(q, scale)`` of ``x``: ``want``'s (the rule's) bits, every scale 1 or a
    normal fp32 number, and every value back within the rule's error: exact zeros for a
    group below MIN_AMAX, else half a unit in e4m3's last place."""
    (q, scale), (want_q, want_scale) = got, want
    assert q.shape == want_q.shape and scale.shape == want_scale.shape
    assert torch.equal(_bits(q.cpu()), _bits(want_q))
    assert torch.equal(scale.cpu(), want_scale)
    scale = scale.cpu()
    assert bool(((scale == 1) | (scale >= 2.0 ** -126)).all()) and bool(scale.isfinite().all())
    back = fp8.dequantize(q.cpu(), scale, block)
    assert bool(torch.isfinite(back).all())
    err = (back.double() - x.cpu().double()).abs()
    x = x.cpu().reshape(-1, *x.shape[-2:])
    bound = torch.stack([_value_error(m, block or (1, x.shape[-1])) for m in x])
    assert bool((err.reshape(bound.shape) <= bound * (1 + 1e-6)).all())


def _flushed_rows(x: torch.Tensor) -> list:
    return [i for i in range(x.shape[0]) if float(x[i].float().abs().max()) < MIN_AMAX]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [48, 300])  # one pass over K, and two (K chunks of 64 on CPU)
def test_rowwise_quantiser_of_tiny_rows_is_the_rule(device, dtype, k):
    x = _rows(24, k, 3, seed=0, tiny=_tiny(device, dtype))
    x = x.to(dtype).to(device)
    got = fp8_kernels.quantize_rowwise(x)
    _check_quantisation(got, fp8.quantize_rowwise(x.cpu()), x)
    flushed = _flushed_rows(x)
    assert len(flushed) >= 2  # the check is exercised
    for i in flushed:
        assert got[1][i].item() == 1.0 and bool((got[0][i].float() == 0).all()), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_quantisers_of_tiny_channels_are_the_rule(device, dtype):
    """The weight's rowwise copy (one scale per output channel, over K) with tiny output
    channels, and with tiny input channels (tiny columns inside normal channels); dX's copy
    is the same, written transposed."""
    tiny = _tiny(device, dtype)
    w = _rows(3 * 40, 36, 4, seed=1, tiny=tiny).reshape(3, 40, 36)  # tiny output channels
    wt = _rows(3 * 36, 40, 4, seed=2, tiny=tiny)  # tiny rows of W^T: input channels
    wt = wt.reshape(3, 36, 40).transpose(1, 2)  # [G, N, K], every 4th column tiny
    for weight, transpose, flushes in ((w, False, True), (wt, False, False), (w, True, True)):
        weight = weight.to(dtype).to(device)
        q, scale = fp8_kernels.quantize_weight_rowwise(weight, transpose=transpose)
        if transpose:  # dX's: the forward's copy, written transposed
            q = q.transpose(1, 2)
        _check_quantisation((q, scale), fp8.quantize_rowwise(weight.cpu()), weight)
        assert bool((scale == 1).any()) == flushes  # tiny output channels flushed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_quantisers_of_tiny_tiles_and_blocks_are_the_rule(device, dtype):
    """1 x 128 tiles (activations): tiny rows, and one tiny tile in a normal row; 128 x 128
    blocks (weights): one block of each tiny amax, ragged at the edges."""
    tiny = _tiny(device, dtype)
    x = _rows(24, 300, 3, seed=3, tiny=tiny)
    tile = x[3, 128:256].clone()  # row 3 is normal
    _shrink(tile, 1e-38)
    x[3, 128:256] = tile
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2, 200, 300, generator=gen)
    places = [(0, 0, 1), (0, 1, 2), (1, 0, 0), (1, 1, 1), (1, 0, 2), (0, 1, 0), (1, 1, 2)]
    for (g, bn, bk), amax in zip(places, tiny):
        block = w[g, bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128].clone()
        _shrink(block, amax)
        w[g, bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128] = block
    for t, block in ((x, fp8.ACTIVATION_BLOCK), (w, fp8.WEIGHT_BLOCK)):
        t = t.to(dtype).to(device)
        got = fp8_kernels.quantize_blockwise(t, block)
        _check_quantisation(got, fp8.quantize_blockwise(t.cpu(), block), t, block)
        assert bool((got[1] == 1).any())  # some groups flushed
    # the tiny tile of the normal row 3 is zeros with scale 1, its neighbours are not
    q, scale = fp8_kernels.quantize_blockwise(x.to(dtype).to(device), fp8.ACTIVATION_BLOCK)
    assert scale[3, 1].item() == 1.0 and bool((q[3, 128:256].float() == 0).all())
    assert bool((q[3, :128].float() != 0).any()) and scale[3, 0].item() != 1.0


# --- the fp8 grouped linear: forward and dX with tiny rows of x, of W and of dY --------------

G, ROWS, N, K = 4, 9, 160, 200
#: Each group's weight is normal in ``[:128, :128]`` and tiny elsewhere (output channels
#: 128:160, input channels 128:200: whole rows, columns and 128 x 128 blocks), with this
#: group's amax.
WEIGHT_TINY = (1e-38, 1e-40, 1e-30, 1e-12)
#: fp32 sums against the exact ones, relative to ``|A| @ |B|^T``: in any order under the
#: interpreter (K * 2^-24 at most); Hopper's fp8 MMA adds each K step at reduced precision.
SUMS = {"cpu": 1e-4, "cuda": 2e-3}
#: fp32's smallest normal: products of two tiny operands (1e-30 x 1e-30) underflow in fp32,
#: whatever the quantisation.
UNDERFLOW = 2.0 ** -126


def _problem():
    """``x [G * ROWS, K]`` and ``dy [G * ROWS, N]`` with tiny rows (each holding an exact
    zero), ``w [G, N, K]`` as :data:`WEIGHT_TINY` says, offsets of ROWS rows per group."""
    x = _rows(G * ROWS, K, 3, seed=5)
    dy = _rows(G * ROWS, N, 3, seed=6)
    dy = dy.roll(1, 0)  # tiny dY rows where x's rows are normal
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(G, N, K, generator=gen) / K ** 0.5
    for g, amax in enumerate(WEIGHT_TINY):
        for region in (w[g, 128:, :], w[g, :128, 128:]):
            t = region.clone()
            _shrink(t, amax)
            region.copy_(t)
    offsets = torch.arange(1, G + 1, dtype=torch.int32) * ROWS
    return x, w, dy, offsets


def _value_error(a: torch.Tensor, block: tuple) -> torch.Tensor:
    """The rule's bound on ``|dequantize(quantize(a)) - a|`` per value of ``a [R, C]`` in
    groups of ``block`` (rows, cols): ``|a|`` in a group below MIN_AMAX (it comes back as
    zeros), else half a unit in e4m3's last place, ``|a| / 16``, or half its smallest
    subnormal step, ``scale / 1024``, with ``scale = amax / 448``."""
    rows, cols = block
    r, c = a.shape
    tr, tc = -(-r // rows), -(-c // cols)
    magnitude = a.double().abs()
    padded = torch.nn.functional.pad(magnitude, (0, tc * cols - c, 0, tr * rows - r))
    amax = padded.reshape(tr, rows, tc, cols).amax(dim=(1, 3))
    amax = amax.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:r, :c]
    kept = torch.maximum(magnitude / 16, amax / 448 / 1024)
    return torch.where(amax < MIN_AMAX, magnitude, kept)


def _check_product(got, a, w, offsets, scaling, dx, device):
    """``got [M, *]``, the fp8 product of ``a [M, *]`` with ``W_g^T`` (``dx``: with ``W_g``):
    finite; exact zeros where every product term has an operand in a group below MIN_AMAX
    (a flushed row of ``a``, or a flushed output channel); elsewhere within the rule's
    error of the exact product of the unquantised operands."""
    assert bool(torch.isfinite(got).all()), "a finite input came back non-finite"
    got = got.detach().cpu().double()
    a_block = (1, a.shape[1]) if scaling == "rowwise" else fp8.ACTIVATION_BLOCK
    from_copy = dx and scaling == "rowwise"
    flushed_rows = set()
    for g in range(G):
        rows = slice(int(offsets[g]) - ROWS, int(offsets[g]))
        b = w[g].T if dx else w[g]  # [out, reduction]
        # blockwise: a square block's scale is its transpose's
        b_block = (1, b.shape[1]) if scaling == "rowwise" else fp8.WEIGHT_BLOCK
        ad, bd = a[rows].double(), b.double()
        if from_copy:
            # Rowwise dX reads the forward's copy (per output channel n of W, along dX's
            # reduction) and quantises dY times those scales per row: the result is
            # (dY + e_s / s_w) . (W + e_w), e_s the scaled rows' quantisation error.
            w_scale = fp8.quantize_rowwise(w[g].float())[1].double()  # [N]
            scaled = (a[rows].float() * w_scale.float()[None, :])
            ea = _value_error(scaled, a_block) / w_scale[None, :]
            eb = _value_error(w[g], (1, w.shape[2])).T
            group_flushed = _flushed_rows(scaled)
        else:
            ea, eb = _value_error(a[rows], a_block), _value_error(b, b_block)
            group_flushed = _flushed_rows(a[rows])
        flushed_rows |= {rows.start + i for i in group_flushed}
        exact = ad @ bd.T
        bound = (ea @ bd.abs().T + ad.abs() @ eb.T + ea @ eb.T
                 + SUMS[device] * (ad.abs() @ bd.abs().T)) * (1 + 1e-6) + UNDERFLOW
        err = (got[rows] - exact).abs()
        assert bool((err <= bound).all()), (g, float((err / bound).max()))
        zero = torch.zeros_like(exact, dtype=torch.bool)
        for i in range(rows.start, rows.stop):
            zero[i - rows.start] = i in flushed_rows
        if WEIGHT_TINY[g] < MIN_AMAX:  # output channels 128: (forward) / 128: (dX) flushed
            zero[:, 128:] = True
        assert bool((got[rows][zero] == 0).all()), g
        # and only there (where fp32 can hold the product): the check can tell
        nonzero = ~zero & (exact.abs() > 1e-30)
        if from_copy:
            # Columns 128: take their terms from output channels 128: (tiny throughout) and
            # from tiny columns of normal channels. dY's row scaled by those channels' tiny
            # scales sits far below the row's other values and rounds to zero, so those
            # columns may come back zero: within the bound above, not a flush of the rule.
            nonzero[:, 128:] = False
        assert bool((got[rows][nonzero] != 0).all()), g
    assert flushed_rows  # the zero checks were exercised


@pytest.mark.parametrize("scaling", RECIPES)
def test_tiny_rows_in_the_fp8_grouped_linear_forward_and_dx(device, scaling):
    """Tiny rows of x (forward), of W (output channels: forward; input channels: dX; and
    128 x 128 blocks) and of dY (dX), on both backends: finite, within the rule's error of
    the exact products, exact zeros where the rule flushes; the backends agree up to the
    order of their fp32 sums."""
    x, w, dy, offsets = _problem()
    backends = ["triton", "reference"] if device == "cpu" else ["triton"]
    results = {}
    for backend in backends:
        xb = x.clone().to(device).requires_grad_()
        with compileops.use_backend(backend):
            y = compileops.grouped_linear(xb, w.to(device), offsets.to(device), fp8=scaling)
            y.backward(dy.to(device))
        results[backend] = y.detach().cpu(), xb.grad.cpu()
        _check_product(y, x, w, offsets, scaling, False, device)
        _check_product(xb.grad, dy, w, offsets, scaling, True, device)
    if len(results) == 2:
        for got, want in zip(results["triton"], results["reference"]):
            assert float((got.double() - want.double()).norm() / want.double().norm()) <= 1e-6
