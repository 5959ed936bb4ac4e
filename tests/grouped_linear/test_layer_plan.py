"""What the compiled MoE layer runs, checked on CPU.

* The router probability of the down projection (``grouped_linear(..., row_scale=p)``) is
  an input of the template, applied per row: its producers (the top-k normalisation, the
  gather by the routing order) never become a per-element epilogue of the GEMM. They did in
  static compiles of a top-2 layer, which spilled the down projection's registers on an
  H100 (Mixtral-8x7B forward 14.2 ms against 9.5 ms for ``torch._grouped_mm``).
* The tile config of every grouped-linear call of ``benchmarks/bench_moe_layer.py``'s layer,
  at every shape of its table, static and ``dynamic=True``, as the lowering picks it for an
  H100 and an H200 (the script's ``--plan``, run in a subprocess): pinned, so a change of
  pick is a visible, reviewed change.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import ROOT

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


# ---------------------------------------------------------------------------------------
# The pinned configs of the benchmark's layer

# (op, m, n, k, groups) -> (block_m, block_n, block_k, num_warps, num_stages, flatten,
# programs_per_sm, tma, tma_store); dW rows: the eager dW kernel's pick on the part, with its
# variant flags (ragged_tma, tma_store, epilogue_subtile, group_n) instead of the last two.
SWIGLU_128 = (128, 128, 64, 8, 3, False, 1, True, False)
SWIGLU_128_TMA_STORE = (128, 128, 64, 8, 3, False, 1, True, True)  # the H200's measured pick
FWD_128x256 = (128, 256, 64, 8, 4, True, 1, True, False)
WGRAD_LONG = (64, 128, 256, 8, 3, True, 1, (True, True, False, 8))
WGRAD_MID = (64, 128, 256, 8, 4, True, 1, (True, True, True, 8))
WGRAD_SHORT = (64, 128, 128, 4, 3, False, 2, (True, False, False, 1))


def _layer_plan(m, d, h, g, wgrad, swiglu=SWIGLU_128):
    """The six grouped-linear calls of one layer, T * k = ``m`` routed rows."""
    return {
        ("grouped_linear_swiglu_with_preact", m, h, d, g): swiglu,
        ("grouped_linear_row_scaled", m, d, h, g): FWD_128x256,
        ("grouped_linear_dx", m, h, d, g): FWD_128x256,  # dh = dy W_down
        ("grouped_linear_dx", m, d, 2 * h, g): FWD_128x256,  # dx = d(preact) W_gate_up
        ("wgrad down", m, d, h, g): wgrad,
        ("wgrad gate_up", m, 2 * h, d, g): wgrad,
    }


# Per part and bench shape (D, H, experts, top-k, tokens), static and dynamic alike. Each
# part's measured row (config.TUNED); the H200's dW is not measured: the generic rule, which
# gives the H100's dW tiles there.
PINNED = {
    part: {
        "mixtral": _layer_plan(16384, 4096, 14336, 8, WGRAD_LONG, swiglu),  # 2048 rows/expert
        "qwen3-30b": _layer_plan(65536, 2048, 768, 128, WGRAD_MID, swiglu),  # 512
        "deepseek-v3": _layer_plan(32768, 7168, 2048, 32, WGRAD_LONG, swiglu),  # 1024
        "qwen3-235b": _layer_plan(65536, 4096, 1536, 128, WGRAD_MID, swiglu),  # 512
    }
    for part, swiglu in (("h100", SWIGLU_128), ("h200", SWIGLU_128_TMA_STORE))
}
DEVICES = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}


def _summary(call) -> tuple:
    c = call["config"]
    tile = (c["block_m"], c["block_n"], c["block_k"], c["num_warps"], c["num_stages"],
            c["flatten"], c["programs_per_sm"])
    if call["tma"] is None:  # a dW call: its variant flags
        return (*tile, (c["ragged_tma"], c["tma_store"], c["epilogue_subtile"], c["group_n"]))
    return (*tile, call["tma"], c["tma_store"])


@pytest.fixture(scope="module")
def bench_plan():
    """``bench_moe_layer.py --plan``: every shape, static and dynamic, H100 and H200."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # nothing runs: the plan is the GPU's
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_moe_layer.py"),
                           "--plan"], capture_output=True, text=True, timeout=900, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_layer_configs_are_pinned(bench_plan):
    seen = set()
    for entry in bench_plan:
        shape, mode, device = entry["shape"], entry["mode"], entry["device"]
        seen.add((shape, mode, DEVICES[device]))
        got = {(c["op"], c["m"], c["n"], c["k"], c["groups"]): _summary(c)
               for c in entry["calls"]}
        assert len(got) == len(entry["calls"]), entry["calls"]  # one config per call
        assert got == PINNED[DEVICES[device]][shape], (shape, mode, device)
    assert seen == {(s, m, d) for d in PINNED for s in PINNED[d] for m in ("static", "dynamic")}
