"""What the compiled MoE layer runs, checked on CPU.

The router probability of the down projection (``grouped_linear(..., row_scale=p)``) is an
input of the template, applied per row: its producers (the top-k normalisation, the gather by
the routing order) never become a per-element epilogue of the GEMM. They did in static
compiles of a top-2 layer, which spilled the down projection's registers on an H100
(Mixtral-8x7B forward 14.2 ms against 9.5 ms for ``torch._grouped_mm``).
"""
import re

import pytest
import torch

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from compileops.lowerings import _compat

EXPERTS, DIM, HIDDEN, TOKENS = 4, 32, 48, 24


def moe_layer(x, router, router_bias, gate_up, down, top_k: int):
    """The SwiGLU MoE layer of the benchmark, small: router, top-k, the probabilities
    normalised over the k slots, expert-sorted rows, gate/up + SwiGLU, down times the
    probability, combine."""
    logits = torch.nn.functional.linear(x, router).float() + router_bias
    probs, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    xs, order, offsets = permute_by_expert(x, ids, EXPERTS)
    # Before the gate/up product, as in the benchmark: with the scale computed after it,
    # Inductor did not fuse the scale's producers into the down projection even before.
    p_sorted = probs.reshape(-1)[order]
    h = compileops.grouped_linear_swiglu(xs, gate_up, offsets)
    y = compileops.grouped_linear(h, down, offsets, row_scale=p_sorted)
    return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)


def _layer_inputs(seed=0):
    """bf16 input and weights (as the benchmark; training: all need gradients)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, DIM, generator=gen)
    router = torch.randn(EXPERTS, DIM, generator=gen) / DIM**0.5
    gate_up = torch.randn(EXPERTS, 2 * HIDDEN, DIM, generator=gen) / DIM**0.5
    down = torch.randn(EXPERTS, DIM, HIDDEN, generator=gen) / HIDDEN**0.5
    x, router, gate_up, down = (t.bfloat16().requires_grad_() for t in (x, router, gate_up, down))
    return x, router, torch.zeros(EXPERTS), gate_up, down


def _template_signatures(code: str) -> list[str]:
    return re.findall(r"def (triton_tem_\w+)\(([^)]*)\)", code)


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_row_scale_is_a_template_input_not_an_epilogue(dynamic, top_k):
    """The forward's grouped-linear templates read their own inputs only (X, W, OFFS, the row
    scale, the pre-activation buffer): no epilogue loads (``in_ptr`` arguments). Top-2
    static was the case where the scale's producers fused into the down projection's
    epilogue, gathered again for each of the tile's 128 x 256 elements."""
    args = _layer_inputs()
    sources: list[str] = []
    # Code generation only: Inductor's softmax calls libdevice, which the interpreter lacks.
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.lower_only(sources):
        with pytest.raises(_compat.LoweredOnly):
            torch.compile(moe_layer, fullgraph=True, dynamic=dynamic)(*args, top_k)
    forward, backward = sources
    templates = _template_signatures(forward)
    assert len(templates) == 2, templates  # gate/up + SwiGLU, down * p
    for name, params in templates:
        params = [p.strip() for p in params.split(",")]
        assert not any(p.startswith("in_ptr") for p in params), (name, params)
    assert any("row_scaled" in name for name, _ in templates), templates
