"""The dW kernel (K-jagged, kernels/kjagged.py) under the interpreter, with emulated TMA
descriptors: the TMA path against the fp64 reference; the variants (``Config.ragged_tma`` /
``tma_store`` / ``epilogue_subtile``, alone and together, as in choose_wgrad_config's
defaults) give the same dW and db bits as the config without them; which flags reach the
kernel and where they fall back; the combination refused up front; the tile order
(``group_n``), the dynamic schedule and the flattened chunk loop. Their sm90 builds are
checked in test_codegen_sm90.py, their speed by benchmarks/tuning/sweep_grouped_linear.py."""
import dataclasses

import pytest
import torch

from compileops.grouped_linear import kernels
from compileops.grouped_linear.kernels import Config
from compileops.grouped_linear.kernels.kjagged import (
    check_wgrad_variant,
    is_wgrad_variant,
    wgrad_variant_flags,
)
from compileops.testing import assert_close_to_reference
from tests.grouped_linear._helpers import TOL, grads_fp64, make_grouped

BASE = Config(16, 32, 32, num_warps=4, num_stages=1)
VARIANTS = {
    "ragged": dict(ragged_tma=True),
    "tma-store": dict(tma_store=True),
    "tma-store-halves": dict(tma_store=True, epilogue_subtile=True),
    "ragged-tma-store": dict(ragged_tma=True, tma_store=True),
    "ragged-tma-store-halves": dict(ragged_tma=True, tma_store=True, epilogue_subtile=True),
}


def nan_filled(t):
    """A new floating tensor filled with NaN (other dtypes, e.g. TMA scratch, as they come)."""
    return t.fill_(float("nan")) if t.is_floating_point() else t


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def make(n, dtype, sizes=(32, 0, 21, 7, 16), k=40, extra_rows=6):
    gen = torch.Generator().manual_seed(0)
    m = sum(sizes) + extra_rows
    x = torch.randn(m, k, generator=gen).to(dtype)
    grad = torch.randn(m, n, generator=gen).to(dtype)
    x[53] = float("inf")  # group 3's first row, right after group 2's partial last chunk
    grad[-1] = float("inf")  # a tail row past offsets[-1]: must reach nothing
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    return grad, x, offs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wgrad_tma_path_matches_reference(dtype):
    """The dW kernel's TMA variant (interpreter-emulated descriptors): whole 16-row chunks
    through the descriptors, each group's partial last chunk masked, so the next group's rows
    never reach a group's dW, even when they hold inf (0 * inf would poison it)."""
    sizes = [32, 0, 21, 7, 16]
    x, w, offs, b = make_grouped(sizes, k=40, n=48, dtype=dtype, extra_rows=6)
    grad = torch.randn(x.shape[0], 48).to(dtype)
    _, _, want_dw, want_db = grads_fp64(x, w, offs, b, grad)  # dW_g for g != 2 ignore row 32
    x[32] = float("inf")  # first row of group 2: must only reach dW_2
    dw, db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, use_tma=True)
    ptr_dw, ptr_db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, use_tma=False)
    for g in (0, 1, 3, 4):
        assert torch.isfinite(dw[g]).all(), g
        assert_close_to_reference(dw[g].float(), want_dw[g], max_relative_error=TOL[dtype],
                                  what=f"dW_{g}")
    assert torch.equal(dw[1], torch.zeros_like(dw[1])) and torch.equal(db[1], torch.zeros_like(db[1]))
    assert_close_to_reference(db.float(), want_db, max_relative_error=TOL[dtype], what="db")
    assert torch.equal(db, ptr_db)
    finite = torch.isfinite(dw) & torch.isfinite(ptr_dw)
    assert torch.allclose(dw[finite].float(), ptr_dw[finite].float(), rtol=TOL[dtype], atol=1e-6)


@pytest.mark.parametrize("n", [64, 48], ids=["n%block_n==0", "n%block_n!=0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_is_bitwise_the_default(variant, dtype, n):
    """Chunks 16 rows, groups of 32 / 0 / 21 / 7 / 16 rows: full, empty and partial last
    chunks (the ragged loads' zero fill), N = 64 (TMA store of whole 32-row N-tiles) and 48
    (its pointer-store fallback: a TMA box would cross into the next group's rows)."""
    grad, x, offs = make(n, dtype)
    cfg = dataclasses.replace(BASE, **VARIANTS[variant])
    want_dw, want_db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, config=BASE,
                                                    use_tma=True)
    dw, db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, config=cfg, use_tma=True)
    assert torch.equal(bits(dw), bits(want_dw)) and torch.equal(bits(db), bits(want_db))
    for g in (0, 2, 4):  # the inf rows belong to group 3 and the tail only
        assert torch.isfinite(dw[g]).all() and torch.isfinite(db[g]).all(), g
    assert torch.equal(dw[1], torch.zeros_like(dw[1])) and torch.equal(db[1], torch.zeros_like(db[1]))


def test_variant_without_db_is_bitwise_the_default():
    grad, x, offs = make(64, torch.bfloat16)
    cfg = dataclasses.replace(BASE, ragged_tma=True, tma_store=True)
    want, _ = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                           config=BASE, use_tma=True, with_db=False)
    got, none = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                             config=cfg, use_tma=True, with_db=False)
    assert none is None and torch.equal(bits(got), bits(want))


def test_flags_reach_the_kernel_only_where_they_apply():
    dw = torch.empty(4, 64, 40, dtype=torch.bfloat16)
    flags = wgrad_variant_flags
    off = dict(RAGGED_TMA=False, TMA_STORE=False, EPILOGUE_SUBTILE=False, FLATTEN=False)
    assert flags(BASE, True, 100, 64, 40, dw) == off  # no variant flags: all off
    both = dataclasses.replace(BASE, ragged_tma=True, tma_store=True)
    on = dict(off, RAGGED_TMA=True, TMA_STORE=True)
    assert flags(both, True, 100, 64, 40, dw) == on
    halves = dataclasses.replace(both, epilogue_subtile=True)
    assert flags(halves, True, 100, 64, 40, dw) == dict(on, EPILOGUE_SUBTILE=True)
    assert flags(halves, False, 100, 64, 40, dw) == off  # pointer path: every variant falls back
    # 48 % 32: a box would spill into the next group's rows; ragged loads still apply
    assert flags(halves, True, 100, 48, 40, dw) == dict(off, RAGGED_TMA=True)
    assert flags(both, True, 100, 64, 41, dw) == dict(off, RAGGED_TMA=True)  # dW rows not 16-B aligned
    assert flags(both, True, 100, 64, 40, dw.float()) == dict(off, RAGGED_TMA=True)  # fp32 dW
    assert flags(both, True, 2**30, 64, 40, dw) == dict(off, TMA_STORE=True)  # rows past ragged


def test_meaningless_combination_is_refused():
    grad, x, offs = make(64, torch.bfloat16)
    with pytest.raises(ValueError):  # halves of what? (no TMA store)
        kernels.grouped_linear_wgrad(
            grad, x, offs, torch.bfloat16, torch.bfloat16,
            config=dataclasses.replace(BASE, epilogue_subtile=True), use_tma=True)


def test_default_configs():
    """16-bit on a GPU: ragged TMA loads by default, plus TMA stores and super-blocks of 8
    N-tiles for long groups (mean group size >= 512; below 1024 with four stages and the
    store in halves); fp32 and the interpreter get configs without variant flags."""
    cuda = kernels.H100_SXM  # a GPU description: no GPU needed
    long = kernels.choose_wgrad_config(65536, 64, 2048, 768, torch.bfloat16, cuda)
    assert long == Config(64, 128, 256, 8, 3, flatten=True, ragged_tma=True, tma_store=True,
                          group_n=8)
    mid = kernels.choose_wgrad_config(65536, 65, 2048, 768, torch.bfloat16, cuda)
    assert mid == kernels.choose_wgrad_config(65536, 128, 2048, 768, torch.bfloat16, cuda)
    assert mid == Config(64, 128, 256, 8, 4, flatten=True, ragged_tma=True, tma_store=True,
                         epilogue_subtile=True, group_n=8)
    short = kernels.choose_wgrad_config(65536, 129, 2048, 768, torch.bfloat16, cuda)
    assert short == Config(64, 128, 128, 4, 3, programs_per_sm=2, ragged_tma=True)
    for cfg in (long, mid, short):
        check_wgrad_variant(cfg)
    assert not is_wgrad_variant(
        kernels.choose_wgrad_config(65536, 64, 2048, 768, torch.float32, cuda))
    assert not is_wgrad_variant(
        kernels.choose_wgrad_config(65536, 64, 2048, 768, torch.bfloat16, torch.device("cpu")))


@pytest.mark.parametrize("n", [256, 192], ids=["n%block_n==0", "n%block_n!=0"])
@pytest.mark.parametrize("g", [64, 128, 256], ids=["long", "mid", "short"])
def test_default_gpu_configs_are_bitwise_their_plain_form(g, n):
    """choose_wgrad_config's sm90 defaults at their real tile sizes (interpreter, emulated
    TMA): same bits as without the variant flags, groups with partial last chunks."""
    cuda = kernels.H100_SXM  # a GPU description: no GPU needed
    m = 65536
    cfg = kernels.choose_wgrad_config(m, g, n, 256, torch.bfloat16, cuda)
    plain = dataclasses.replace(cfg, ragged_tma=False, tma_store=False, epilogue_subtile=False)
    grad, x, offs = make(n, torch.bfloat16, sizes=(70, 0, 64, 130), k=256)
    x[53] = 1.0
    x[70] = float("inf")  # group 2's first row, inside group 0's partial last 64-row chunk
    want_dw, want_db = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16,
                                                    torch.bfloat16, config=plain, use_tma=True)
    dw, db = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                          config=cfg, use_tma=True)
    assert torch.equal(bits(db), bits(want_db))
    for grp in (0, 1, 3):  # group 2 holds the inf row
        assert torch.isfinite(dw[grp]).all(), grp
        assert torch.equal(bits(dw[grp]), bits(want_dw[grp])), grp


# ------------------------------------------------------------------ dW tile order (group_n)


def _tile_coords_probe():
    """A kernel storing ``kjagged_tile_coords(rest)`` for every ``rest`` of one group (defined
    on first use, after the conftest's interpreter switch)."""
    import triton
    import triton.language as tl

    from compileops.grouped_linear.kernels.tiles import kjagged_tile_coords

    @triton.jit
    def probe(out_ptr, num_n, num_k, GROUP_N: tl.constexpr):
        rest = tl.program_id(0)
        tile_n, tile_k = kjagged_tile_coords(rest, num_n, num_k, GROUP_N)
        tl.store(out_ptr + rest * 2, tile_n)
        tl.store(out_ptr + rest * 2 + 1, tile_k)

    # The interpreter resolves names in the function's module globals, not in closures.
    probe.fn.__globals__["kjagged_tile_coords"] = kjagged_tile_coords
    return probe


@pytest.mark.parametrize("num_n,num_k", [(16, 28), (7, 3), (1, 5), (5, 1)])
@pytest.mark.parametrize("group_n", [1, 3, 4, 16])
def test_tile_order_is_a_bijection(group_n, num_n, num_k):
    """Every (tile_n, tile_k) of a group exactly once, for super-blocks that divide num_n,
    do not (a narrower last one), or exceed it; group_n 1 is the K-tile-fastest order."""
    out = torch.empty(num_n * num_k * 2, dtype=torch.int32)
    _tile_coords_probe()[(num_n * num_k,)](out, num_n, num_k, GROUP_N=group_n)
    pairs = [tuple(p) for p in out.view(-1, 2).tolist()]
    assert sorted(pairs) == [(n, k) for n in range(num_n) for k in range(num_k)]
    if group_n == 1:
        assert pairs == [(n, k) for n in range(num_n) for k in range(num_k)]
    elif num_n > 1:
        assert pairs[1] == (1, 0)  # N-tile fastest


@pytest.mark.parametrize("group_n", [2, 3])
def test_tile_order_is_bitwise_the_default(group_n):
    """dW and db with super-blocks of N-tiles (num_n = 4: one that divides, one that leaves a
    narrower last block), with the default's ragged loads and TMA stores: the same bits as
    K-tile-fastest order, and close to the fp64 product per group."""
    grad, x, offs = make(112, torch.float32)
    base = dataclasses.replace(BASE, ragged_tma=True, tma_store=True)
    want_dw, want_db = kernels.grouped_linear_wgrad(grad, x, offs, torch.float32, torch.float32,
                                                    config=base, use_tma=True)
    cfg = dataclasses.replace(base, group_n=group_n)
    dw, db = kernels.grouped_linear_wgrad(grad, x, offs, torch.float32, torch.float32,
                                          config=cfg, use_tma=True)
    assert torch.equal(bits(dw), bits(want_dw)) and torch.equal(bits(db), bits(want_db))
    start = 0
    for g, end in enumerate(offs.tolist()):
        ref = grad[start:end].double().T @ x[start:end].double()
        torch.testing.assert_close(dw[g].double(), ref, rtol=1e-4, atol=1e-4)
        start = end


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dynamic_schedule_is_bitwise_the_static(dtype, tma):
    """``dynamic_tiles`` (tiles claimed from an atomic ticket counter) computes every tile
    exactly once with the same code: the static schedule's bits, on the TMA path with the
    long-group default's flags and on the pointer path. 20 tiles on 4 interpreted programs,
    run one after another: program 0 claims every ticket, past its for loop's rounds into
    the while remainder. Launched twice, so the counter must start at 0 in each launch."""
    grad, x, offs = make(64, dtype)
    flags = dict(ragged_tma=True, tma_store=True, group_n=2) if tma else {}
    static = dataclasses.replace(BASE, **flags)
    want_dw, want_db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, config=static,
                                                    use_tma=tma)
    cfg = dataclasses.replace(static, dynamic_tiles=True)
    for _ in range(2):
        dw, db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, config=cfg,
                                              use_tma=tma)
        assert torch.equal(bits(dw), bits(want_dw)) and torch.equal(bits(db), bits(want_db))


# ------------------------------------------------------------ dW flattened chunk loop (flatten)


@pytest.mark.parametrize("extra", [{}, dict(group_n=2), dict(tma_store=False),
                                   dict(epilogue_subtile=True)],
                         ids=["tma-store", "group_n2", "pointer-store", "store-halves"])
@pytest.mark.parametrize("n", [64, 48], ids=["n%block_n==0", "n%block_n!=0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_flat_loop_is_bitwise_the_tile_loop(dtype, n, extra):
    """``flatten`` without db: each program's tiles as one loop over their row chunks
    (kjagged_flat_loop), the next tile's state worked out in a branch once per tile. Same
    dW bits as the tile loop; groups of 32 / 0 / 21 / 7 / 16 rows (an empty group's tiles
    are one zero-filled chunk each, partial last chunks), inf rows that must reach nothing."""
    grad, x, offs = make(n, dtype)
    tiles = dataclasses.replace(BASE, **dict(dict(ragged_tma=True, tma_store=True), **extra))
    want, _ = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, config=tiles,
                                           use_tma=True, with_db=False)
    cfg = dataclasses.replace(tiles, flatten=True)
    assert wgrad_variant_flags(cfg, True, *grad.shape, x.shape[1], want, False)["FLATTEN"]
    dw, db = kernels.grouped_linear_wgrad(grad, x, offs, dtype, dtype, config=cfg, use_tma=True,
                                          with_db=False)
    assert db is None and torch.equal(bits(dw), bits(want))
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if g != 3:  # group 3 holds the inf row
            ref = grad[start:end].double().T @ x[start:end].double()
            torch.testing.assert_close(dw[g].double(), ref, rtol=2e-2, atol=2e-2)
        start = end


@pytest.mark.parametrize("sizes", [(5,), (0, 0, 3), (40, 1, 0, 17, 64, 2, 33)],
                         ids=["fewer-tiles-than-programs", "mostly-empty", "many-tiles"])
def test_flat_loop_chunk_count(sizes, monkeypatch):
    """The loop's trip count (kjagged_program_chunks: per group, the program's tiles times
    the group's chunks, counted without a loop over tiles) for programs with no tile, with
    tiles of empty groups only, and with several tiles in several groups: a wrong count
    would leave tiles unwritten (NaN here) or run past the last one."""
    gen = torch.Generator().manual_seed(1)
    m = sum(sizes) + 3
    grad, x = torch.randn(m, 64, generator=gen), torch.randn(m, 72, generator=gen)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    tiles = dataclasses.replace(BASE, ragged_tma=True, tma_store=True)
    want, _ = kernels.grouped_linear_wgrad(grad, x, offs, torch.float32, torch.float32,
                                           config=tiles, use_tma=True, with_db=False)
    cfg = dataclasses.replace(tiles, flatten=True)
    empty = torch.empty  # dW starts as NaN: every element must be written
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan_filled(empty(*a, **kw)))
    dw, _ = kernels.grouped_linear_wgrad(grad, x, offs, torch.float32, torch.float32,
                                         config=cfg, use_tma=True, with_db=False)
    monkeypatch.undo()
    assert torch.equal(bits(dw), bits(want))


def test_flat_loop_only_without_db_and_static():
    """With db (its MMA would run in every chunk), the dynamic schedule or without the ragged
    loads, ``flatten`` leaves the dW launch on the tile loop."""
    dw = torch.empty(5, 64, 40, dtype=torch.bfloat16)
    cfg = dataclasses.replace(BASE, ragged_tma=True, tma_store=True, flatten=True)
    assert wgrad_variant_flags(cfg, True, 82, 64, 40, dw, False)["FLATTEN"]
    assert not wgrad_variant_flags(cfg, True, 82, 64, 40, dw, True)["FLATTEN"]
    assert not wgrad_variant_flags(cfg, False, 82, 64, 40, dw, False)["FLATTEN"]
    assert not wgrad_variant_flags(
        dataclasses.replace(cfg, dynamic_tiles=True), True, 82, 64, 40, dw, False)["FLATTEN"]
    assert not wgrad_variant_flags(
        dataclasses.replace(cfg, ragged_tma=False), True, 82, 64, 40, dw, False)["FLATTEN"]


def test_dynamic_schedule_rounds_then_remainder():
    """The launch above really runs both loops: 5 groups x 2 x 2 tiles, 4 programs."""
    total, progs = 5 * 2 * 2, kernels.num_programs(None, "cpu")
    rounds = -(-total // progs) + -(-total // (4 * progs)) + 4
    assert 1 + (total - progs) > rounds  # program 0's tiles: its own, then every ticket

