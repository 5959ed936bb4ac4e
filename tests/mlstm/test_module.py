"""compileops.nn.MultiHeadLayerNorm and compileops.nn.mLSTMLayer.

* the layer (cell and norm fused in one op) equals the unfused xLSTM-7B composition written
  out here (projections, soft-capped gates, raw cell, multi-head layernorm, output gate, out
  projection), forward and parameter gradients, on both backends;
* the norm equals both xlstm norms' math (xlstm_large's and the original cell's residual
  form), and state dicts in xlstm's key names and shapes load, in both weight modes, through
  :func:`convert_xlstm_state_dict`;
* ``torch.compile(layer, fullgraph=True)`` forward and backward, without graph breaks;
* ``examples/xlstm_block.py`` runs (subprocess, tiny sizes).
"""
import copy
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import compileops
from compileops.mlstm import convert_xlstm_state_dict, mLSTMLayer, mLSTMLayerConfig
from compileops.testing import assert_close_to_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "xlstm_block.py")

D, NH = 32, 2  # qk_dim 16 (DQK 8), v_dim 32 (DV 16)


def _layer(dtype=torch.float32, seed=0, **fields) -> mLSTMLayer:
    torch.manual_seed(seed)
    layer = mLSTMLayer(embedding_dim=D, num_heads=NH, **fields).to(dtype)
    with torch.no_grad():  # a trained-looking norm, not the ones/zeros init
        layer.multihead_norm.weight.add_(0.3 * torch.randn_like(layer.multihead_norm.weight))
        if layer.multihead_norm.bias is not None:
            layer.multihead_norm.bias.normal_(0.0, 0.3)
    return layer


def _x(seq=13, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, seq, D, generator=gen, dtype=torch.float64).to(dtype)


def _linear(x, lin):
    return F.linear(x, lin.weight, lin.bias)


def unfused(layer: mLSTMLayer, x: torch.Tensor) -> torch.Tensor:
    """The xLSTM-7B layer step by step (single weight mode), the norm run separately."""
    cap, nh = 15.0, layer.config.num_heads
    b, s, _ = x.shape
    q, k, v = (_linear(x, lin).reshape(b, s, nh, -1).transpose(1, 2)
               for lin in (layer.q, layer.k, layer.v))
    o = _linear(x, layer.ogate_preact)
    i = (cap * torch.tanh(_linear(x, layer.igate_preact) / cap)).transpose(1, 2)
    f = (cap * torch.tanh(_linear(x, layer.fgate_preact) / cap)).transpose(1, 2)
    h = compileops.mlstm(q, k, v, i, f, eps=1e-6)  # raw [B, NH, S, DV]
    h = layer.multihead_norm(h)  # [B, S, NH * DV]
    return _linear(torch.sigmoid(o) * h, layer.out_proj)


def _fw_bw(fn, layer, x, seed=5):
    layer.zero_grad(set_to_none=True)
    out = fn(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(out.device, out.dtype)
    out.backward(grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), grads


def _per_module(grads):
    """Parameter gradients joined per submodule (``q``: weight and bias).

    The input gate's bias gradient is near zero by symmetry (h does not change when every
    input gate of a head moves by the same amount, except through the floor ``exp(-m)`` and
    eps), so alone it is all cancellation error in fp32; joined with its weight's gradient it
    is judged on the scale of the gate's gradient."""
    joined = {}
    for name, g in grads.items():
        module = name.rsplit(".", 1)[0]
        joined[module] = torch.cat([joined[module], g.reshape(-1)]) if module in joined \
            else g.reshape(-1)
    return joined


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _require(backend: str, device: str) -> None:
    reason = compileops.backends.why_unavailable(backend, device)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("use_bias", [False, True])
def test_layer_equals_unfused_composition(backend, use_bias, device):
    """fp32, fused and unfused, each against the fp64 layer (reference backend) and against
    each other."""
    _require(backend, device)
    layer, x = _layer(use_bias=use_bias).to(device), _x().to(device)
    exact = copy.deepcopy(layer).double()
    with compileops.use_backend("reference"):
        ref, ref_grads = _fw_bw(exact, exact, x.double())
    with compileops.use_backend(backend):
        got, got_grads = _fw_bw(layer, layer, x)
        want, want_grads = _fw_bw(lambda x: unfused(layer, x), layer, x)
    assert got.shape == (2, 13, D)
    assert got_grads.keys() == want_grads.keys() == ref_grads.keys()
    assert_close_to_reference(got, want, max_relative_error=1e-5)
    assert_close_to_reference(got, ref, max_relative_error=1e-5)
    got_grads, want_grads = _per_module(got_grads), _per_module(want_grads)
    for module, ref_grad in _per_module(ref_grads).items():
        assert_close_to_reference(got_grads[module], ref_grad, max_relative_error=1e-5)
        assert_close_to_reference(want_grads[module], ref_grad, max_relative_error=1e-5)
        assert_close_to_reference(got_grads[module], want_grads[module],
                                  max_relative_error=1e-5)


def test_layer_equals_unfused_composition_fp64_reference():
    layer, x = _layer(torch.float64, use_bias=True), _x(dtype=torch.float64)
    with compileops.use_backend("reference"):
        got, got_grads = _fw_bw(layer, layer, x)
        want, want_grads = _fw_bw(lambda x: unfused(layer, x), layer, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name in got_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-9, atol=1e-11)


def test_gates_are_soft_capped():
    layer = _layer()
    with torch.no_grad():
        layer.igate_preact.bias.fill_(1e4)
        layer.fgate_preact.bias.fill_(-1e4)
        _, _, _, _, i, f = layer.projections(_x(seq=4))
    assert i.shape == f.shape == (2, NH, 4)
    torch.testing.assert_close(i, torch.full_like(i, 15.0))
    torch.testing.assert_close(f, torch.full_like(f, -15.0))


# --------------------------------------------------------------------------------------
# MultiHeadLayerNorm against xlstm's two norms (their math, written here)


def _xlstm_large_norm(h, weight, bias, eps):
    """xlstm_large's MultiHeadLayerNorm: input [B, S, NH, DH], fp32 statistics, the
    normalised value back in the input dtype, then weight and bias."""
    b, s, nh, dh = h.shape
    x = h.float()
    y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps)
    y = y.to(h.dtype).reshape(b, s, -1)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def test_norm_matches_xlstm_large_norm_and_its_state_dict():
    nh, dh = 3, 8
    xl_state = {"weight": torch.randn(nh * dh), "bias": torch.randn(nh * dh)}  # its shapes
    norm = compileops.nn.MultiHeadLayerNorm(nh, dh, eps=1e-6, use_bias=True)
    norm.load_state_dict(xl_state)
    assert list(norm.state_dict()) == ["weight", "bias"]
    h = torch.randn(2, nh, 5, dh)  # [B, NH, S, DH]
    want = _xlstm_large_norm(h.transpose(1, 2), xl_state["weight"], xl_state["bias"], 1e-6)
    assert_close_to_reference(norm(h), want, max_relative_error=1e-6)


def test_residual_norm_matches_the_original_cells_group_norm():
    """The original cell's MultiHeadLayerNorm: F.group_norm with weight ``1 + w``."""
    nh, dh = 2, 8
    norm = compileops.nn.MultiHeadLayerNorm(nh, dh, eps=1e-5, residual_weight=True)
    assert torch.equal(norm.weight, torch.zeros(nh * dh))  # its init
    with torch.no_grad():
        norm.weight.normal_()
    h = torch.randn(2, nh, 5, dh, dtype=torch.float64)
    b, _, s, _ = h.shape
    gn = F.group_norm(h.transpose(1, 2).reshape(b * s, nh * dh), nh,
                      weight=1.0 + norm.weight.double(), eps=1e-5).view(b, s, nh * dh)
    torch.testing.assert_close(norm.double()(h), gn)


def test_norm_defaults_shapes_and_errors():
    norm = compileops.nn.MultiHeadLayerNorm(4, 16)
    assert norm.weight.shape == (64,) and norm.bias is None
    assert torch.equal(norm.weight, torch.ones(64))
    h = torch.randn(2, 4, 3, 16, dtype=torch.bfloat16)
    assert norm(h).shape == (2, 3, 64) and norm(h).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[B, NH=4, S, DH=16\]"):
        norm(torch.randn(2, 3, 4, 16))
    bare = compileops.nn.MultiHeadLayerNorm(4, 16, use_weight=False)
    assert list(bare.state_dict()) == []
    kwargs = bare.mlstm_kwargs(h)  # no affine: a ones weight asks the op for the norm
    assert torch.equal(kwargs["norm_weight"], torch.ones(64, dtype=torch.bfloat16))


def test_layer_without_norm_affine_equals_unfused():
    layer = _layer(use_bias=False)
    layer.multihead_norm.weight = None
    x = _x(seq=6)
    with torch.no_grad(), compileops.use_backend("reference"):
        assert_close_to_reference(layer(x), unfused(layer, x), max_relative_error=1e-5)


# --------------------------------------------------------------------------------------
# xlstm state dicts (keys and shapes as xlstm/xlstm_large/model.py builds them)


def xlstm_layer_state(d, nh, *, fused=False, use_bias=False, seed=0, qk_factor=0.5,
                      v_factor=1.0):
    """An xlstm ``mLSTMLayer`` state dict: single mode q, k [qk, D], v, ogate_preact [v, D],
    igate_preact / fgate_preact [NH, D] + bias [NH]; fused mode qkv_opreact [2qk + 2v, D]
    (rows q | k | v | o), ifgate_preact [2NH, D] + bias (rows i | f); multihead_norm.weight
    [v] (+ bias), out_proj [D, v] (+ bias)."""
    gen = torch.Generator().manual_seed(seed)
    qk, v = int(d * qk_factor), int(d * v_factor)

    def r(*shape):
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])

    sd = {}
    if fused:
        sd["qkv_opreact.weight"] = r(2 * qk + 2 * v, d)
        if use_bias:
            sd["qkv_opreact.bias"] = r(2 * qk + 2 * v)
        sd["ifgate_preact.weight"] = r(2 * nh, d)
        sd["ifgate_preact.bias"] = r(2 * nh)
    else:
        for name, width in (("q", qk), ("k", qk), ("v", v), ("ogate_preact", v)):
            sd[f"{name}.weight"] = r(width, d)
            if use_bias:
                sd[f"{name}.bias"] = r(width)
        for name in ("igate_preact", "fgate_preact"):
            sd[f"{name}.weight"], sd[f"{name}.bias"] = r(nh, d), r(nh)
    sd["multihead_norm.weight"] = 1 + 0.1 * r(v)
    if use_bias:
        sd["multihead_norm.bias"] = r(v)
    sd["out_proj.weight"] = r(d, v)
    if use_bias:
        sd["out_proj.bias"] = r(d)
    return sd


@pytest.mark.parametrize("use_bias", [False, True])
def test_xlstm_state_dicts_load_in_both_weight_modes(use_bias):
    for mode in ("single", "fused"):
        sd = xlstm_layer_state(D, NH, fused=mode == "fused", use_bias=use_bias)
        layer = mLSTMLayer(embedding_dim=D, num_heads=NH, use_bias=use_bias, weight_mode=mode)
        layer.load_state_dict(sd)  # strict: same keys, same shapes
        assert set(layer.state_dict()) == set(sd)


@pytest.mark.parametrize("use_bias", [False, True])
def test_converter_round_trip_and_equal_outputs(use_bias):
    fused_sd = xlstm_layer_state(D, NH, fused=True, use_bias=use_bias, seed=3)
    single_sd = convert_xlstm_state_dict(fused_sd, "single")
    assert "qkv_opreact.weight" not in single_sd and single_sd["q.weight"].shape == (16, D)
    assert single_sd["ogate_preact.weight"].shape == (D, D)
    assert torch.equal(single_sd["fgate_preact.bias"], fused_sd["ifgate_preact.bias"][NH:])
    back = convert_xlstm_state_dict(single_sd, "fused")
    assert back.keys() == fused_sd.keys()
    for key in fused_sd:
        assert torch.equal(back[key], fused_sd[key]), key
    assert convert_xlstm_state_dict(single_sd, "single").keys() == single_sd.keys()

    fused = mLSTMLayer(embedding_dim=D, num_heads=NH, use_bias=use_bias, weight_mode="fused")
    single = mLSTMLayer(embedding_dim=D, num_heads=NH, use_bias=use_bias)
    fused.load_state_dict(fused_sd)
    single.load_state_dict(single_sd)
    x = _x(seq=7)
    with torch.no_grad(), compileops.use_backend("reference"):
        torch.testing.assert_close(fused(x), single(x), rtol=1e-6, atol=1e-6)
    # Our own state dicts convert the same way.
    again = convert_xlstm_state_dict(fused.state_dict(), "single")
    for key, value in single.state_dict().items():
        assert torch.equal(again[key], value), key


def test_converter_on_a_whole_model_state_dict():
    """xLSTMLarge's keys: backbone.blocks.{i}.mlstm_layer.*, FFN and norms left alone."""
    model = {"embedding.weight": torch.randn(10, D), "lm_head.weight": torch.randn(10, D),
             "backbone.out_norm.weight": torch.ones(D)}
    for i in range(2):
        block = f"backbone.blocks.{i}."
        model[block + "norm_mlstm.weight"] = torch.ones(D)
        model[block + "ffn.proj_up_gate_z.weight"] = torch.randn(128, D)
        for key, t in xlstm_layer_state(D, NH, fused=True, seed=i).items():
            model[block + "mlstm_layer." + key] = t
    single = convert_xlstm_state_dict(model)
    for i in range(2):
        prefix = f"backbone.blocks.{i}.mlstm_layer."
        layer_sd = {k[len(prefix):]: v for k, v in single.items() if k.startswith(prefix)}
        mLSTMLayer(embedding_dim=D, num_heads=NH).load_state_dict(layer_sd)
        assert torch.equal(single[f"backbone.blocks.{i}.ffn.proj_up_gate_z.weight"],
                           model[f"backbone.blocks.{i}.ffn.proj_up_gate_z.weight"])
    assert torch.equal(single["embedding.weight"], model["embedding.weight"])


def test_converter_errors():
    sd = xlstm_layer_state(D, NH, fused=True)
    del sd["out_proj.weight"]
    with pytest.raises(KeyError, match="v_dim"):
        convert_xlstm_state_dict(sd)
    assert "v.weight" in convert_xlstm_state_dict(sd, v_dim=D)
    with pytest.raises(ValueError, match="weight_mode"):
        convert_xlstm_state_dict(sd, "qkv")
    single = xlstm_layer_state(D, NH)
    del single["k.weight"]
    with pytest.raises(KeyError, match="k.weight"):
        convert_xlstm_state_dict(single, "fused")


def test_config_and_errors():
    cfg = mLSTMLayerConfig(embedding_dim=64, num_heads=4)
    layer = mLSTMLayer(cfg, qk_dim_factor=0.25)
    assert layer.q.weight.shape == (16, 64) and layer.v.weight.shape == (64, 64)
    assert cfg.qk_dim_factor == 0.5  # the given config is not modified
    assert layer.multihead_norm.head_dim == 16
    with pytest.raises(ValueError, match="multiple of num_heads"):
        mLSTMLayer(embedding_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="weight_mode"):
        mLSTMLayer(embedding_dim=32, num_heads=2, weight_mode="qkv")
    with pytest.raises(ValueError, match=r"x \[B, S, D\]"):
        layer(torch.randn(3, 64))


# --------------------------------------------------------------------------------------
# torch.compile and the example


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layer_fullgraph_fw_bw_equals_eager(device):
    """Inductor, fullgraph, forward and backward, no graph break. (CPU: the mLSTM ops are
    extern calls of the eager kernels, under Triton's interpreter here; CUDA: the forward is
    the Triton template.)"""
    _require("triton", device)
    layer, x = _layer(use_bias=True).to(device), _x(seq=10).to(device)
    counters.clear()
    with compileops.use_backend("triton"):
        got, got_grads = _fw_bw(torch.compile(layer, fullgraph=True), layer, x)
        want, want_grads = _fw_bw(layer, layer, x)
    assert not counters["graph_break"]
    assert_close_to_reference(got, want, max_relative_error=1e-5)
    got_grads = _per_module(got_grads)
    for module, grad in _per_module(want_grads).items():
        assert_close_to_reference(got_grads[module], grad, max_relative_error=1e-5)


def test_example_runs():
    """Tiny flags keep it short; the timeout is generous for a loaded 2-core machine."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, EXAMPLE, "--dim", "16", "--heads", "2", "--blocks", "1", "--seq", "8",
         "--vocab", "32", "--steps", "2", "--generate", "3", "--long-seq", "40"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    losses = [float(line.split()[3]) for line in run.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), run.stdout
    # The generation loop on mlstm_step agrees with the full forward.
    assert "same greedy tokens: True" in run.stdout, run.stdout
    assert "long sequence S=40: forward+backward" in run.stdout, run.stdout
    print(f"example took {time.perf_counter() - start:.1f} s")


def test_layer_prefill_then_steps_equal_forward():
    """mLSTMLayer.prefill returns the cell state; mLSTMLayer.step continues one token at a
    time: together they equal forward on the whole sequence (fp64, Triton interpreter)."""
    layer = _layer(torch.float64)
    x = _x(seq=21, dtype=torch.float64)
    with compileops.use_backend("triton"):
        whole = layer(x)
        y, state = layer.prefill(x[:, :16])
        ys = [y]
        for t in range(16, 21):
            y_t, state = layer.step(x[:, t], state)
            ys.append(y_t[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), whole, atol=1e-10, rtol=1e-10)
