"""The torchtitan integration's experts math (``compileops/integrations/_titan_experts.py``),
which imports no torchtitan: torchtitan's ``GroupedExperts`` computation on compileops ops,
against the same math written out in fp32, and the fp8 weight-cache rule.

Tolerance: both sides take bf16-rounded inputs and weights; compileops rounds the SwiGLU output
and the down product to bf16 (u = 2^-8 each) and the row scale to bf16: relative L2 <= 4u.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compileops.grouped_linear import cached_fp8_weight_bytes, clear_fp8_weight_cache
from compileops.integrations._titan_experts import Options, experts_forward

U = 2.0 ** -8
E, D, H = 4, 32, 16
COUNTS = [3, 0, 5, 4]  # an empty expert; 12 routed rows, then 2 rows of padding


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS) + 2, D, generator=g)
    w1, w3 = (torch.randn(E, H, D, generator=g) / D ** 0.5 for _ in range(2))
    w2 = torch.randn(E, D, H, generator=g) / H ** 0.5
    scale = torch.rand(x.shape[0], generator=g)
    return x, w1.to(dtype), w2.to(dtype), w3.to(dtype), scale


def _written_out(x, w1, w2, w3, scale):
    """torchtitan's experts in fp32 on bf16-rounded inputs and weights, then the score."""
    r = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(COUNTS):
        rows = r(x[start:start + n])
        h = F.silu(rows @ r(w1[e]).T) * (rows @ r(w3[e]).T)
        out[start:start + n] = (h @ r(w2[e]).T) * scale[start:start + n, None]
        start += n
    return out


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("with_scale", [True, False])
def test_experts_forward_is_torchtitans_experts_math(with_scale):
    x, w1, w2, w3, scale = _inputs()
    x.requires_grad_()
    counts = torch.tensor(COUNTS)
    got = experts_forward(x, w1, w2, w3, counts, scale if with_scale else None)
    want = _written_out(x.detach(), w1, w2, w3,
                        scale if with_scale else torch.ones_like(scale))
    assert got.dtype == x.dtype and got.shape == x.shape
    assert _rel(got, want) <= 4 * U
    assert torch.equal(got[sum(COUNTS):], torch.zeros(2, D))  # padding rows: zeros
    got.sum().backward()  # differentiable through the compileops ops
    assert x.grad is not None and torch.equal(x.grad[sum(COUNTS):], torch.zeros(2, D))


@pytest.mark.parametrize("dtype, cached", [(torch.float32, False), (torch.bfloat16, True)])
def test_fp8_weight_cache_only_for_weights_that_are_bf16_already(dtype, cached, monkeypatch):
    """A bf16 copy made at every call is a new storage each time: caching its e4m3 copy would
    only hold memory until the next insertion. bf16 weights (FSDP's bf16 unsharded
    parameters) are cached."""
    from compileops.grouped_linear import fp8_cache

    looked_up = []
    lookup = fp8_cache.quantised_weight

    def recording(weight, *args, **kwargs):
        looked_up.append(weight.data_ptr())
        return lookup(weight, *args, **kwargs)

    monkeypatch.setattr(fp8_cache, "quantised_weight", recording)
    x, w1, w2, w3, scale = _inputs(dtype)
    clear_fp8_weight_cache()
    try:
        out = experts_forward(x, w1, w2, w3, torch.tensor(COUNTS), scale,
                              Options(fp8="rowwise"))
        assert bool(looked_up) == cached
        if cached:  # the parameters themselves, not copies
            assert set(looked_up) == {w.data_ptr() for w in (w1, w2, w3)}
            assert cached_fp8_weight_bytes() > 0
    finally:
        clear_fp8_weight_cache()
    # fp8 rowwise: about 3.7e-2 relative error per e4m3 product, two products in series
    want = _written_out(x, w1.float(), w2.float(), w3.float(), scale)
    assert _rel(out, want) <= 2 * 4e-2


def test_gate_up_pair_is_the_concatenated_form_bitwise():
    """``gate_up="pair"`` reads w1 and w3 where they are: output and every gradient are the
    bits of the concatenated form (F = 32, a multiple of the interpreter's K step, so dX sums
    in the same order too)."""
    g = torch.Generator().manual_seed(1)
    f = 32
    x = torch.randn(sum(COUNTS) + 2, D, generator=g)
    w1, w3 = (torch.randn(E, f, D, generator=g) / D ** 0.5 for _ in range(2))
    w2 = torch.randn(E, D, f, generator=g) / f ** 0.5
    scale = torch.rand(x.shape[0], generator=g)
    grad = torch.randn(x.shape, generator=g)

    def run(gate_up):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        out = experts_forward(leaves[0], *leaves[1:], torch.tensor(COUNTS), scale,
                              Options(gate_up=gate_up))
        out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    for what, a, b in zip(("out", "dx", "dw1", "dw2", "dw3"), run("pair"),
                          run("concatenated")):
        assert torch.equal(a, b), what


def test_options_refuse_an_unknown_fp8_recipe():
    with pytest.raises(ValueError, match="gate_up must be one of"):
        Options(gate_up="interleaved")
    with pytest.raises(ValueError, match="fp8 must be one of"):
        Options(fp8="blockwise")
    assert Options().kwargs() == {}
    assert Options(fp8="rowwise").kwargs(cacheable=False) == dict(
        fp8="rowwise", cache_fp8_weights=False, fp8_fast_accum=True, fp8_weight_grad=False)
    with pytest.raises(ValueError, match="fp8_weight_grad=True computes"):
        Options(fp8_weight_grad=True)


@pytest.mark.parametrize("cached", [False, True])
def test_fp8_weight_grad_reaches_every_experts_weight(cached, monkeypatch):
    """``fp8_weight_grad``: the gradients of w1, w2 and w3 come from the fp8 dW op (three
    calls: gate, up and down, or the concatenated gate/up and down), dX as without it."""
    from compileops.grouped_linear import fp8_op

    calls = []
    original = fp8_op.grouped_linear_wgrad_fp8_op

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8_op, "grouped_linear_wgrad_fp8_op", counting)
    x, w1, w2, w3, scale = _inputs(torch.bfloat16)

    def grads(weight_grad):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
        options = Options(fp8="rowwise", cache_fp8_weights=cached, fp8_weight_grad=weight_grad)
        experts_forward(leaves[0], *leaves[1:], torch.tensor(COUNTS), scale,
                        options).float().square().sum().backward()
        return [t.grad for t in leaves]

    clear_fp8_weight_cache()
    try:
        with_fp8_dw, without = grads(True), grads(False)
    finally:
        clear_fp8_weight_cache()
    assert len(calls) == (3 if cached else 2), calls
    assert torch.equal(with_fp8_dw[0], without[0])
    for a, b in zip(with_fp8_dw[1:], without[1:]):
        assert not torch.equal(a, b) and _rel(a, b) <= 0.1
