"""Compiled, the data-dependent checks cannot read values on the host: they run on the device
(``torch._assert_async``), so a bad value still raises, naming the argument the caller
passed, where eager raises its named error.

* ``permute_by_expert``: expert ids outside ``[0, num_experts)`` (compiled they would be
  counted in expert 0, or routed nowhere);
* ``grouped_linear_splits``: negative ``m_splits``, or splits adding up to more than M,
  including int64 splits that would wrap the int32 offsets to values that look valid;
* ``grouped_linear_splits`` with no groups given as an empty list.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compileops
import compileops.grouped_linear as G

BACKENDS = ["reference", "triton"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
@given(bad=st.sampled_from([-1, -7, 2, 3, 100]), where=st.integers(0, 5))
def test_compiled_permute_by_expert_refuses_bad_ids(backend, bad, where):
    x = torch.randn(3, 2)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    ids.view(-1)[where] = bad
    permute = torch.compile(G.permute_by_expert, fullgraph=True)
    with compileops.use_backend(backend):
        with pytest.raises(RuntimeError, match="expert_ids holds an id outside"):
            permute(x, ids, 2)
        with pytest.raises(IndexError, match=f"expert_ids holds expert {bad}"):
            G.permute_by_expert(x, ids, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_permute_by_expert_valid_ids_match_eager(backend):
    x = torch.randn(5, 3)
    ids = torch.tensor([[2, 0], [1, 1], [0, 2], [2, 2], [1, 0]])
    with compileops.use_backend(backend):
        got = torch.compile(G.permute_by_expert, fullgraph=True)(x, ids, 3)
        want = G.permute_by_expert(x, ids, 3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [[-1, 5], [2, 5], [2**31 - 1, 2**31 - 1], [2**32 + 2, 4]],
                         ids=["negative", "past M", "wrapping to negative",
                              "wrapping to valid"])
def test_compiled_splits_checked_naming_m_splits(backend, splits):
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    m_splits = torch.tensor(splits, dtype=torch.int64)
    compiled = torch.compile(compileops.grouped_linear_splits, fullgraph=True)
    with compileops.use_backend(backend):
        with pytest.raises(RuntimeError, match="m_splits must be >= 0 and add up to at most M"):
            compiled(x, w, m_splits)
        with pytest.raises(ValueError, match="m_splits"):
            compileops.grouped_linear_splits(x, w, m_splits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_valid_splits_match_eager(backend):
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    m_splits = torch.tensor([2, 3])
    with compileops.use_backend(backend):
        got = torch.compile(compileops.grouped_linear_splits, fullgraph=True)(x, w, m_splits)
        assert torch.equal(got, compileops.grouped_linear_splits(x, w, m_splits))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_groups_as_an_empty_list_compiled(backend):
    x = torch.randn(6, 4)

    def fn(x):
        return compileops.grouped_linear_splits(x, torch.zeros(0, 3, 4), [])

    with compileops.use_backend(backend):
        got = torch.compile(fn, fullgraph=True)(x)
        assert torch.equal(got, fn(x)) and torch.equal(got, torch.zeros(6, 3))
