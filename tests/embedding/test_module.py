"""compileops.nn.Embedding is a drop-in for torch.nn.Embedding."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileops


def test_state_dict_interchangeable_with_torch_embedding():
    ref = torch.nn.Embedding(30, 6, padding_idx=2)
    ours = compileops.nn.Embedding(30, 6, padding_idx=2)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight"]
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 30, (3, 5))
    assert torch.equal(ours(ids), ref(ids))
    assert isinstance(ours, torch.nn.Embedding)


def test_gradients_match_torch_embedding_including_padding():
    ref = torch.nn.Embedding(30, 6, padding_idx=-1, dtype=torch.float64)
    ours = compileops.nn.Embedding(30, 6, padding_idx=-1, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    assert ours.padding_idx == 29
    ids = torch.randint(0, 30, (4, 8))
    ids[0, :3] = 29
    grad = torch.randn(4, 8, 6, dtype=torch.float64)
    ref(ids).backward(grad)
    ours(ids).backward(grad)
    assert torch.allclose(ours.weight.grad, ref.weight.grad, rtol=1e-12, atol=1e-12)
    assert torch.all(ours.weight.grad[29] == 0)


def test_from_pretrained_and_out_dtype():
    table = torch.randn(10, 4).to(torch.bfloat16)
    emb = compileops.nn.Embedding.from_pretrained(table, freeze=False)
    assert isinstance(emb, compileops.nn.Embedding)
    emb.out_dtype = torch.float32
    ids = torch.tensor([[0, 9]])
    out = emb(ids)
    assert out.dtype == torch.float32 and torch.equal(out, table.float()[ids])
    assert "out_dtype=torch.float32" in repr(emb)


@pytest.mark.parametrize("kwargs", [{"max_norm": 1.0}, {"sparse": True}, {"scale_grad_by_freq": True}])
def test_unsupported_options_are_refused(kwargs):
    with pytest.raises(NotImplementedError, match=next(iter(kwargs))):
        compileops.nn.Embedding(10, 4, **kwargs)


# Every option torch.nn.Embedding reads on each forward, with values to set after construction.
_OPTION_VALUES = {
    "max_norm": st.one_of(st.none(), st.floats(0.0, 3.0)),
    "norm_type": st.floats(0.5, 4.0),
    "padding_idx": st.one_of(st.none(), st.integers(-6, 5)),
    "scale_grad_by_freq": st.booleans(),
    "sparse": st.booleans(),
}


@settings(max_examples=40)
@given(changes=st.dictionaries(st.sampled_from(sorted(_OPTION_VALUES)), st.none(), min_size=1)
       .flatmap(lambda names: st.fixed_dictionaries({n: _OPTION_VALUES[n] for n in names})))
def test_options_set_after_construction_are_honoured_or_refused(changes):
    # As torch.nn.Embedding: an option set after construction takes effect at the next
    # forward. compileops either gives torch's result (forward and grad, bitwise in fp64) or
    # refuses the option with NotImplementedError naming it: never ignores it silently.
    ref = torch.nn.Embedding(6, 3, dtype=torch.float64)
    ours = compileops.nn.Embedding(6, 3, dtype=torch.float64)
    ours.load_state_dict(ref.state_dict())
    refused = []
    for name, value in changes.items():
        setattr(ref, name, value)
        try:
            setattr(ours, name, value)
        except NotImplementedError as e:
            assert name in str(e)
            refused.append(name)
    ids = torch.tensor([[0, 5, 5], [2, 0, 1]])
    if refused:
        # A refused option is never used, and one written behind __setattr__ is refused too.
        ours.__dict__.update({name: changes[name] for name in refused})
        with pytest.raises(NotImplementedError, match=refused[0]):
            ours(ids)
        return
    try:
        want = ref(ids)
        want.pow(2).sum().backward()
    except (AssertionError, RuntimeError, IndexError):  # torch refuses this padding_idx
        with pytest.raises((ValueError, RuntimeError, IndexError), match="padding_idx"):
            ours(ids)
        return
    got = ours(ids)
    got.pow(2).sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(ours.weight.grad, ref.weight.grad)
