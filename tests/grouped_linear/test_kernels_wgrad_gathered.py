"""The dW kernel reading an operand through a row index (``grouped_linear_wgrad``'s
``dy_rows`` / ``x_rows``: the MoE layer's tokens in expert order, read where they are) under
the interpreter: the same dW and db bits as the kernel on the gathered copy, on every path
(pointer, TMA, ragged TMA with the flattened chunk loop, the dynamic schedule), with rows of
the source that only one group reads holding inf; and the index checked up front."""
import dataclasses

import pytest
import torch

from compileops.grouped_linear import kernels
from compileops.grouped_linear.kernels import Config

BASE = Config(16, 32, 32, num_warps=4, num_stages=1)
PATHS = {
    "pointer": (BASE, False),
    "tma": (BASE, True),
    "ragged-tma-store": (dataclasses.replace(BASE, ragged_tma=True, tma_store=True), True),
    "flat": (dataclasses.replace(BASE, ragged_tma=True, tma_store=True, flatten=True), True),
    "dynamic": (dataclasses.replace(BASE, ragged_tma=True, dynamic_tiles=True), True),
}
SIZES = (32, 0, 21, 7, 16)  # full, empty and partial last 16-row chunks


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def routed(dtype, n=48, k=40, tokens=30, extra_rows=6):
    """Sources ``dy_src [tokens, n]`` and ``x_src [tokens, k]`` and an index ``[M]`` into each
    (drawn apart, so a kernel that reads one operand through the other's index fails), as a
    permutation to experts makes them, then ``extra_rows`` rows past the last group. Token 7
    of X and token 11 of dY hold inf; only group 3's first row reads them."""
    gen = torch.Generator().manual_seed(3)
    m = sum(SIZES) + extra_rows
    x_src = torch.randn(tokens, k, generator=gen).to(dtype)
    dy_src = torch.randn(tokens, n, generator=gen).to(dtype)
    group3 = sum(SIZES[:3])
    indices = []
    for inf_token in (11, 7):
        rows = torch.randint(0, tokens, (m,), generator=gen)
        rows[rows == inf_token] = inf_token + 1
        rows[group3] = inf_token
        indices.append(rows)
    x_src[7] = float("inf")
    dy_src[11] = float("inf")
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    return dy_src, x_src, indices[0], indices[1], offs


@pytest.mark.parametrize("with_db", [True, False], ids=["db", "no-db"])
@pytest.mark.parametrize("gathered", ["x", "dy", "both"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("path", list(PATHS))
def test_gathered_rows_are_bitwise_the_gathered_copy(path, dtype, gathered, with_db):
    cfg, tma = PATHS[path]
    if cfg.flatten and with_db:
        pytest.skip("the flattened loop runs without db")
    dy_src, x_src, dy_index, x_index, offs = routed(dtype)
    dy_rows = dy_index if gathered != "x" else None
    x_rows = x_index.to(torch.int32) if gathered != "dy" else None  # either integer type
    dy, x = dy_src[dy_index], x_src[x_index]
    want_dw, want_db = kernels.grouped_linear_wgrad(dy, x, offs, dtype, dtype, config=cfg,
                                                    use_tma=tma, with_db=with_db)
    dw, db = kernels.grouped_linear_wgrad(
        dy_src if dy_rows is not None else dy, x_src if x_rows is not None else x, offs,
        dtype, dtype, config=cfg, use_tma=tma, with_db=with_db, dy_rows=dy_rows,
        x_rows=x_rows)
    assert torch.equal(bits(dw), bits(want_dw))
    assert (db is None) == (not with_db)
    if with_db:
        assert torch.equal(bits(db), bits(want_db))
    # The inf rows reach exactly the groups that read them, and an empty group is zeros.
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    for g in (0, 2, 4):
        assert torch.isfinite(dw[g]).all(), g


def test_gathered_rows_sources_of_another_length():
    """The sources hold any number of rows; the product's rows are the index's."""
    dy_src, x_src, dy_index, x_index, offs = routed(torch.float32, tokens=40)
    dw, _ = kernels.grouped_linear_wgrad(dy_src, x_src, offs, torch.float32, torch.float32,
                                         use_tma=False, dy_rows=dy_index, x_rows=x_index,
                                         with_db=False)
    want, _ = kernels.grouped_linear_wgrad(dy_src[dy_index], x_src[x_index], offs,
                                           torch.float32, torch.float32, use_tma=False,
                                           with_db=False)
    assert torch.equal(bits(dw), bits(want))


def test_gathered_rows_k_zero_still_gives_db():
    dy_src, _, dy_index, _, offs = routed(torch.float32)
    x = torch.empty(dy_index.shape[0], 0)
    dw, db = kernels.grouped_linear_wgrad(dy_src, x, offs, torch.float32, torch.float32,
                                          dy_rows=dy_index)
    _, want_db = kernels.grouped_linear_wgrad(dy_src[dy_index], x, offs, torch.float32,
                                              torch.float32)
    assert dw.shape == (len(SIZES), dy_src.shape[1], 0) and torch.equal(db, want_db)


@pytest.mark.parametrize("bad, message", [
    (dict(x_rows=torch.zeros(3, dtype=torch.int64)), "x_rows must be int32 or int64"),
    (dict(x_rows=torch.zeros(82)), "x_rows must be int32 or int64"),
    (dict(dy_rows=torch.zeros(82, 1, dtype=torch.int64)), "grad_rows must be"),
    (dict(dy_rows=torch.zeros(81, dtype=torch.int64)), "x has 82 rows, the product 81"),
])
def test_bad_row_indices_are_refused_before_any_launch(bad, message):
    grad, x = torch.randn(82, 48), torch.randn(82, 40)
    offs = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    with pytest.raises(ValueError, match=message):
        kernels.grouped_linear_wgrad(grad, x, offs, torch.float32, torch.float32, **bad)
