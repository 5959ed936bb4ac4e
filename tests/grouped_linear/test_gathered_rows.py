"""The weight gradient reading the permuted tokens through the permutation's index
(``grouped_linear_wgrad``'s ``x_rows``, put in by ``lowerings/gathered_rows.py``): the op
against the op on the gathered copy, its checks, and a compiled MoE layer whose forward no
longer keeps the ``[M, K]`` copy, with the same gradients as without the pass."""
import pytest
import torch

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from compileops.lowerings import _compat

WGRAD = torch.ops.compileops.grouped_linear_wgrad.default


def _routed(dtype=torch.float32, tokens=24, k=40, n=48):
    gen = torch.Generator().manual_seed(2)
    rows = torch.randint(0, tokens, (70,), generator=gen)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    grad = torch.randn(70, n, generator=gen).to(dtype)
    offs = torch.tensor([16, 16, 37, 44, 64], dtype=torch.int32)  # an empty group, a tail
    return grad, x, rows, offs


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("with_db", [True, False])
def test_rows_through_the_index_are_the_gathered_copy(backend, with_db):
    grad, x, rows, offs = _routed()
    with compileops.use_backend(backend):
        want = WGRAD(grad, x[rows], offs, torch.float32, torch.float32, with_db)
        got = WGRAD(grad, x, offs, torch.float32, torch.float32, with_db, x_rows=rows)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_negative_rows_count_from_the_end(backend):
    """As in ``x[rows]``, which the compiled pass replaces: row -1 is the last."""
    grad, x, rows, offs = _routed()
    negative = torch.where(rows % 2 == 0, rows - x.shape[0], rows)
    assert (negative < 0).any()
    with compileops.use_backend(backend):
        want = WGRAD(grad, x[negative], offs, torch.float32, torch.float32)
        got = WGRAD(grad, x, offs, torch.float32, torch.float32, x_rows=negative)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_opcheck_with_rows():
    grad, x, rows, offs = _routed()
    torch.library.opcheck(WGRAD, (grad, x, offs, torch.float32, torch.float32, True),
                          {"x_rows": rows})


@pytest.mark.parametrize("bad, error, message", [
    (lambda rows: rows.to(torch.int32), TypeError, "x_rows must be int64"),
    (lambda rows: rows[:-1], ValueError, "grad has 70 rows but x_rows 69"),
    (lambda rows: rows[:, None], RuntimeError, "x_rows must be 1-D"),
    (lambda rows: torch.where(rows == rows[3], 24, rows), ValueError, r"\[-24, 24\)"),
    (lambda rows: torch.where(rows == rows[3], -25, rows), ValueError, r"\[-24, 24\)"),
])
def test_bad_rows_are_refused(bad, error, message):
    grad, x, rows, offs = _routed()
    with pytest.raises(error, match=message):
        WGRAD(grad, x, offs, torch.float32, torch.float32, True, x_rows=bad(rows))


# (dim, hidden, experts, top-k, tokens)
SHAPE = (64, 48, 4, 2, 32)


def _layer(x, router, gate_up, down):
    _, _, experts, top_k, _ = SHAPE
    probs, ids = torch.topk(torch.softmax(x @ router.t(), -1), top_k, dim=-1)
    xs, order, offsets = permute_by_expert(x, ids, experts)
    h = compileops.grouped_linear_swiglu(xs, gate_up, offsets)
    y = compileops.grouped_linear(h, down, offsets, row_scale=probs.reshape(-1)[order])
    return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)


def _inputs():
    dim, hidden, experts, _, tokens = SHAPE
    gen = torch.Generator().manual_seed(4)
    sizes = ((tokens, dim), (experts, dim), (experts, 2 * hidden, dim), (experts, dim, hidden))
    return [(torch.randn(size, generator=gen) / size[-1] ** 0.5).requires_grad_()
            for size in sizes]


def _compiled_step(with_pass: bool, sources: list | None = None):
    """Gradients of one compiled step (and, with ``sources``, only the generated code)."""
    from compileops.lowerings import install

    install()  # before the patch: installing inside it would be undone when it ends
    inputs = _inputs()
    torch._dynamo.reset()
    patch = {} if with_pass else {"joint_custom_pre_pass": None}
    with _compat.fresh_inductor_cache(), _compat.inductor_config_patch(**patch):
        if sources is not None:
            with _compat.lower_only(sources), pytest.raises(_compat.LoweredOnly):
                torch.compile(_layer, fullgraph=True)(*inputs)
            return None
        out = torch.compile(_layer, fullgraph=True)(*inputs)
        return torch.autograd.grad(out.square().sum(), inputs)


def _saved_shapes(sources) -> str:
    return "\n".join(line for line in sources[1].splitlines() if "rand_strided" in line)


def test_the_compiled_forward_keeps_no_permuted_copy():
    """With the pass the backward's inputs hold no ``[top_k * tokens, dim]`` tensor (the
    permuted tokens); without it they do, which is what the pass removes."""
    dim, _, _, top_k, tokens = SHAPE
    copy = f"rand_strided(({top_k * tokens}, {dim}), ({dim}, 1)"
    without, with_pass = [], []
    _compiled_step(False, without)
    _compiled_step(True, with_pass)
    assert copy in _saved_shapes(without), _saved_shapes(without)
    assert copy not in _saved_shapes(with_pass), _saved_shapes(with_pass)
    # The gate/up dW now reads x's rows through the index; the down dW reads h as it is.
    assert with_pass[1].count("x_rows=None") == without[1].count("x_rows=None") - 1


def test_the_compiled_gradients_are_those_without_the_pass():
    with_pass = _compiled_step(True)
    without = _compiled_step(False)
    for name, a, b in zip(("x", "router", "gate_up", "down"), with_pass, without):
        assert torch.equal(a, b), name
