"""compileops.nn.Embedding is a drop-in for torch.nn.Embedding."""
import pytest
import torch

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
