"""The order of a compiled fp8 MoE backward: its peak no higher than the bf16 layer's.

Inductor orders a graph's kernels for the lowest peak memory it estimates
(``reorder_for_peak_memory``). With ``cache_fp8_weights=True`` the fp8 layer reads the cache's
e4m3 weight copies through an extern call, whose outputs Inductor counted as memory the step
allocates and frees after their last reader. Chasing that release, it ran the gate/up dX
product before the gate/up dW, so the layer's input gradient ``[tokens, dim]`` was already
allocated beside the dW, the step's peak: one such buffer above the bf16 layer at Qwen3-30B-A3B,
DeepSeek-V3 and Qwen3-235B-A22B (0.03-0.06 GiB). The lowering now tells the planner that the
step never frees the copies (on a hit nothing is allocated; on a miss the copy outlives the
step), and the backward runs the dW first, as the bf16 layer does.

At Mixtral-8x7B's widths the gate/up rows (2H = 28672) are too wide to quantise in
part-wide pieces, and the kernel that computes the SwiGLU derivative also writes its e4m3
codes. The planner then runs dX before the gate/up dW, and the input gradient (0.06 GiB) is
live at the dW: a known gap, pinned as an expected failure. Writing the codes in a
kernel of their own does not close it: the planner still runs dX first, rightly, since codes
written after the dW would be live beside the bf16 derivative and the dW (0.44 GiB more).
Only a dX that quantises the bf16 derivative as it loads it would keep the bf16 layer's peak.

Checked on the generated code (Triton codegen on CPU, nothing run; pointwise values stored
where a GPU compile stores them: ``_compat.reuse_realized_as_on_a_gpu``), at Qwen3-30B-A3B's
and Mixtral-8x7B's shapes.
"""
import re

import pytest
import torch

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from compileops.lowerings import _compat

# (dim, hidden, experts, top-k, tokens): the layers' real shapes (no tensor data is read:
# nothing runs). At a quarter of Qwen3-30B-A3B's widths the planner's estimates tie and it
# keeps the graph's order, which is right there too.
SHAPES = {"qwen3-30b": (2048, 768, 128, 8, 8192), "mixtral": (4096, 14336, 8, 2, 8192)}


def _moe_layer(options, shape):
    """The benchmark's SwiGLU MoE layer: router, top-k, permutation, gate/up + SwiGLU, down
    times the probability (``row_scale=``), combine."""
    _, _, experts, top_k, _ = SHAPES[shape]

    def layer(x, router, gate_up, down):
        probs, ids = torch.topk(torch.softmax(torch.nn.functional.linear(x, router).float(), -1),
                                top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        xs, order, offsets = permute_by_expert(x, ids, experts)
        p_sorted = probs.reshape(-1)[order]
        h = compileops.grouped_linear_swiglu(xs, gate_up, offsets, **options)
        y = compileops.grouped_linear(h, down, offsets, row_scale=p_sorted, **options)
        return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)
    return layer


def _inputs(shape):
    """Uninitialised bf16 tensors of the layer's shapes: only their metadata is traced."""
    dim, hidden, experts, _, tokens = SHAPES[shape]
    sizes = ((tokens, dim), (experts, dim), (experts, 2 * hidden, dim), (experts, dim, hidden))
    return [torch.empty(size, dtype=torch.bfloat16).requires_grad_() for size in sizes]


class _MoEModule(torch.nn.Module):
    """The layer with its weights as parameters, as in a model."""

    def __init__(self, layer, router, gate_up, down):
        super().__init__()
        self.layer = layer
        self.router, self.gate_up, self.down = (torch.nn.Parameter(w.detach())
                                                for w in (router, gate_up, down))

    def forward(self, x):
        return self.layer(x, self.router, self.gate_up, self.down)


def _backward_call(options, form, shape) -> list[str]:
    """The lines of the compiled backward's ``call`` (the kernels in the order they run)."""
    x, router, gate_up, down = _inputs(shape)
    if form == "module":
        fn, args = _MoEModule(_moe_layer(options, shape), router, gate_up, down), (x,)
    else:
        fn, args = _moe_layer(options, shape), (x, router, gate_up, down)
    sources: list[str] = []
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.reuse_realized_as_on_a_gpu(), \
            _compat.inductor_config_patch(force_pointwise_cat=True), \
            _compat.lower_only(sources), pytest.raises(_compat.LoweredOnly):
        torch.compile(fn, fullgraph=True)(*args)
    _, backward = sources
    call = backward[backward.index("def call(self, args):"):]
    return call.splitlines()


def _first(lines, pattern) -> int:
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no line matches {pattern!r}"
    return found[0]


FP8_CACHED = {"fp8": "rowwise", "cache_fp8_weights": True, "fp8_fast_accum": True}


@pytest.mark.parametrize("options, form, shape", [
    ({}, "function", "qwen3-30b"),
    # The weights as parameters: the backward looks the transposed copies up in the cache.
    (FP8_CACHED, "module", "qwen3-30b"),
    # As plain inputs: AOTAutograd moves those lookups into the forward, which saves the copies.
    (FP8_CACHED, "function", "qwen3-30b"),
    ({}, "module", "mixtral"),
    # Rows of 2H = 28672: quantised whole, in the derivative's kernel (module docstring).
    pytest.param(FP8_CACHED, "module", "mixtral", marks=pytest.mark.xfail(
        strict=True, reason="fp8 at Mixtral-8x7B's widths: the input gradient is live at "
        "the gate/up dW (0.06 GiB above the bf16 layer's peak)")),
], ids=["bf16", "fp8-cached-module", "fp8-cached-function", "bf16-mixtral",
        "fp8-cached-module-mixtral"])
def test_the_gate_up_dw_runs_before_the_input_gradient_is_allocated(options, form, shape):
    dim, hidden, experts, _, tokens = SHAPES[shape]
    lines = _backward_call(options, form, shape)
    gate_up_dw = _first(lines, re.escape(f"({experts}, {2 * hidden}, {dim}), ")
                        + r".*grouped_linear_wgrad")
    input_grad = _first(lines, re.escape(f"empty_strided_cpu(({tokens}, {dim}), ({dim}, 1), "
                                         "torch.bfloat16)"))
    assert gate_up_dw < input_grad, (
        "the layer's input gradient [tokens, dim] is allocated before the gate/up dW runs, "
        "so it is live at the step's peak:\n" + "\n".join(lines[input_grad:gate_up_dw + 1]))
