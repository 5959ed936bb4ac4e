"""The routing helpers' backwards (permute and combine) are gathers: no atomic
scatter-add, whose order (and so the last bits of the token gradient) changes from run to
run on a GPU. ``permute_by_expert`` gives each token ``k`` copies; autograd's own
``index_select`` backward would ``index_add`` them (it did, until the FSDP2 per-rank check
found it)."""
import re
from unittest import mock

import pytest
import torch

from compileops.grouped_linear import checks
from compileops.grouped_linear.routing import permute_by_expert, unpermute_and_combine
from compileops.testing import aot_graph_text

ACCUMULATING = ("index_add", "scatter_add", "index_put", "scatter_reduce", "_unsafe_index_put")


def _moe_routing(x, ids, w, probs):
    xs, order, offsets = permute_by_expert(x, ids, 4)
    return unpermute_and_combine(xs * w, order, probs)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_backward_graph_has_no_accumulating_scatter(top_k):
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    ids = torch.randint(0, 4, (6, top_k))
    w = torch.randn(1, 5, requires_grad=True)
    probs = torch.rand(6, top_k, requires_grad=True)
    _, backward = aot_graph_text(_moe_routing, x, ids, w, probs)
    assert backward, "no backward graph was built"
    for op in ACCUMULATING:  # as a call, in place or not (a saved tensor may carry the name)
        assert not re.search(rf"aten\.{op}_?\.", backward), (
            f"{op} in the routing backward:\n{backward}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_token_gradient_sums_the_copies_in_slot_order(dtype):
    torch.manual_seed(1)
    tokens, top_k, dim = 9, 3, 7
    x = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, 4, (tokens, top_k))
    xs, order, _ = permute_by_expert(x, ids, 4)
    assert torch.equal(xs, x.detach()[order // top_k])
    grad = torch.randn_like(xs)
    (dx,) = torch.autograd.grad(xs, x, grad)
    per_slot = torch.empty_like(grad)
    per_slot[order] = grad  # row t*k + j: the copy of token t in slot j
    expected = per_slot.reshape(tokens, top_k, dim).sum(1)
    assert torch.equal(dx, expected)


@pytest.mark.parametrize("as_permutation", [False, True], ids=["sorted", "scattered"])
@pytest.mark.parametrize("order", [[5, 0, 9, 1], [1, 1, 0, 2], [-1, 3, 2, 0]],
                         ids=["too large", "duplicate", "negative"])
def test_combine_never_indexes_with_the_callers_order_values(order, as_permutation):
    # order comes from the caller. On CPU a bad one is refused before anything runs; on CUDA
    # (no host sync) a device-side assert reports it while the kernels already run, so they
    # must only index with in-range values derived from it (a gather or scatter with the
    # caller's values would be an illegal memory access there, not an error). Played on CPU
    # with the host check off and the assert recorded instead of raised.
    y = torch.randn(4, 3, requires_grad=True)
    weights = torch.rand(2, 2, requires_grad=True)
    order = torch.tensor(order)
    with pytest.raises((IndexError, ValueError), match="order must be a permutation"):
        unpermute_and_combine(y, order, weights, order_is_permutation=as_permutation)
    asserted = []
    with mock.patch.object(checks, "check_order_eagerly", lambda order: False), \
            mock.patch.object(torch, "_assert_async", lambda ok, msg: asserted.append(bool(ok))):
        out = unpermute_and_combine(y, order, weights, order_is_permutation=as_permutation)
        out.sum().backward()
    assert asserted == [False]
    assert torch.isfinite(out).all() and torch.isfinite(y.grad).all()


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_combine_of_a_permutation_sorts_once_with_the_same_bits(top_k):
    # order_is_permutation=True inverts permute_by_expert's order with a scatter into distinct
    # slots instead of a second sort: same outputs and gradients, bitwise, and no argsort.
    torch.manual_seed(2)
    tokens, dim = 11, 6
    x = torch.randn(tokens, dim, requires_grad=True)
    ids = torch.randint(0, 5, (tokens, top_k))
    probs = torch.rand(tokens, top_k, requires_grad=True)
    results = []
    for trusted in (False, True):
        xs, order, _ = permute_by_expert(x, ids, 5)
        out = unpermute_and_combine(xs * 2, order, probs, order_is_permutation=trusted)
        grads = torch.autograd.grad(out, (x, probs), torch.linspace(-1, 1, out.numel()).view_as(out))
        results.append((out, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)

    def trusted_routing(x, probs):
        xs, order, _ = permute_by_expert(x, ids, 5)
        return unpermute_and_combine(xs, order, probs, order_is_permutation=True)

    forward, _ = aot_graph_text(trusted_routing, x, probs)
    assert "argsort" not in forward and forward.count("aten.sort") == 1, forward
