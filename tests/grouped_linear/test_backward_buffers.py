"""What a compiled MoE backward keeps in memory: the SwiGLU derivative's input gradient.

As users write the layer, the router probability that scales the down projection is itself an
expression in the graph (the top-k probabilities normalised, gathered into expert order), so
in the compiled backward the down projection's dX times the probability is a fused
expression with many reads, and the SwiGLU derivative reads it for both of its halves.
Inductor stores such an expression rather than compute it twice; it must store it in the
gradient's dtype (what eager holds), never its fp32 widening, a buffer twice the size: that
buffer made the fp8 Mixtral-8x7B layer's peak 0.44 GiB above the bf16 anchor's.

Checked on the generated code (Triton codegen on CPU, the interpreter running it), with the
derivative's two halves concatenated the way Inductor does on a GPU (pointwise; on the CPU
it otherwise writes each half into its slice of a buffer).
"""
import re

import pytest
import torch

import compileops
from compileops.lowerings import _compat

SIZES = [5, 0, 11, 16]  # rows per expert: M = 32 = tokens x top-k
TOKENS, TOP_K, D, H = 16, 2, 16, 24


def _inputs():
    gen = torch.Generator().manual_seed(0)
    m, groups = sum(SIZES), len(SIZES)
    xs = torch.randn(m, D, generator=gen).bfloat16()
    w13 = (torch.randn(groups, 2 * H, D, generator=gen) / D ** 0.5).bfloat16()
    w2 = (torch.randn(groups, D, H, generator=gen) / H ** 0.5).bfloat16()
    offsets = torch.cumsum(torch.tensor(SIZES), 0).to(torch.int32)
    top_probs = torch.rand(TOKENS, TOP_K, generator=gen) + 0.1
    order = torch.randperm(m, generator=gen)
    return xs, w13, w2, offsets, top_probs, order


def experts(xs, w13, w2, offsets, p, options):
    """The expert MLP, the probability multiplied in as written (``* p[:, None]``) or passed
    as ``row_scale=`` (``options["row_scale"] = True``)."""
    options = dict(options)
    row_scale = options.pop("row_scale", False)
    h = compileops.grouped_linear_swiglu(xs, w13, offsets, **options)
    if row_scale:
        return compileops.grouped_linear(h, w2, offsets, row_scale=p, **options)
    return compileops.grouped_linear(h, w2, offsets, **options) * p[:, None].to(h.dtype)


def routed_p(top_probs, order):
    """``p [M]``: each token's top-k probabilities ``[T, k]`` normalised, in expert order."""
    return (top_probs / top_probs.sum(-1, keepdim=True)).reshape(-1)[order]


def layer_with_routed_p(options):
    """The probability computed in the graph, as users' routers do."""
    def layer(xs, w13, w2, offsets, top_probs, order):
        return experts(xs, w13, w2, offsets, routed_p(top_probs, order), options)
    return layer


def layer_with_given_p(options):
    """The same layer, the probability an input of the graph."""
    return lambda xs, w13, w2, offsets, p: experts(xs, w13, w2, offsets, p, options)


def _fp32_hidden_buffers(fn, *args) -> int:
    """How many fp32 ``[M, H]`` buffers the compiled backward of ``fn(*args)`` allocates."""
    args = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.inductor_config_patch(force_pointwise_cat=True):
        compiled = torch.compile(fn, fullgraph=True)
        _, sources = _compat.run_and_get_code(
            lambda: compiled(*args).float().sum().backward())
    assert len(sources) == 2, "expected a forward and a backward graph"
    m = sum(SIZES)
    pattern = re.escape(f"empty_strided_cpu(({m}, {H}), ({H}, 1), torch.float32)")
    return len(re.findall(pattern, sources[1]))


@pytest.mark.parametrize("options", [{}, {"row_scale": True}, {"row_scale": True, "fp8": "rowwise"}],
                         ids=["times-p", "row-scale", "fp8-row-scale"])
def test_a_routed_probability_does_not_make_the_backward_store_an_fp32_gradient(options):
    xs, w13, w2, offsets, top_probs, order = _inputs()
    given = _fp32_hidden_buffers(layer_with_given_p(options), xs, w13, w2, offsets,
                                 routed_p(top_probs, order))
    routed = _fp32_hidden_buffers(layer_with_routed_p(options), xs, w13, w2, offsets,
                                  top_probs, order)
    # On the CPU, Inductor also stores the gate's sigmoid in fp32 (a reuse heuristic it
    # applies to CPU code only): present in both, so compared rather than counted.
    assert routed == given, (
        f"the compiled backward allocates {routed} fp32 [M, H] buffers with the probability "
        f"computed in the graph, {given} with it given: the widened gradient was stored")
