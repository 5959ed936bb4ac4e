"""The mLSTM reference (compileops/mlstm/reference.py) against implementations written here:

* an fp64 step-by-step recurrence (the xLSTM paper's stabilised mLSTM, REFERENCE.md section 3):
  states ``C [DQK, DV]``, ``n [DQK]`` and the stabiliser ``m``, one time step at a time. The
  parallel form must give the same ``h``, ``n`` and ``m`` up to fp64 rounding;
* ``torch.nn.functional.layer_norm`` applied head by head, for ``multihead_layernorm``.

The ops' stats (``compileops.mlstm_with_stats``, both backends) are held to the recurrence too.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import compileops
from compileops.mlstm import reference
from tests.mlstm._helpers import BACKENDS, make_inputs


def recurrent_mlstm(q, k, v, igate, fgate, eps=1e-6):
    """The stabilised recurrent mLSTM, one step at a time (fp64 in, fp64 out).

    ``m_t = max(log sigmoid(f_t) + m_{t-1}, i_t)``; ``f'_t = exp(log sigmoid(f_t) + m_{t-1} -
    m_t)``, ``i'_t = exp(i_t - m_t)``; ``C_t = f'_t C_{t-1} + i'_t k_t v_t^T`` and ``n_t =
    f'_t n_{t-1} + i'_t k_t`` with ``k_t`` scaled by ``1 / sqrt(DQK)``; ``h_t = C_t^T q_t /
    (max(|n_t . q_t|, exp(-m_t)) + eps)``. Starts from ``C = 0``, ``n = 0``, ``m = -inf``.

    Returns ``(h [B, NH, S, DV], n [B, NH, S], m [B, NH, S])``, ``n`` the normaliser
    ``max(|n_t . q_t|, exp(-m_t))``.
    """
    batch, heads, seq, dqk = q.shape
    dv = v.shape[-1]
    c_state = q.new_zeros(batch, heads, dqk, dv)
    n_state = q.new_zeros(batch, heads, dqk)
    m_state = q.new_full((batch, heads), float("-inf"))
    hs, ns, ms = [], [], []
    for t in range(seq):
        log_f = F.logsigmoid(fgate[:, :, t])
        i_t = igate[:, :, t]
        m_new = torch.maximum(log_f + m_state, i_t)
        f_act = torch.exp(log_f + m_state - m_new)  # 0 at t = 0 (m_state = -inf)
        i_act = torch.exp(i_t - m_new)
        k_t = k[:, :, t] / math.sqrt(dqk)
        c_state = (f_act[..., None, None] * c_state
                   + i_act[..., None, None] * k_t[..., :, None] * v[:, :, t, None, :])
        n_state = f_act[..., None] * n_state + i_act[..., None] * k_t
        q_t = q[:, :, t]
        numerator = (q_t[..., :, None] * c_state).sum(dim=-2)  # [B, NH, DV]
        normaliser = torch.maximum((q_t * n_state).sum(dim=-1).abs(), torch.exp(-m_new))
        hs.append(numerator / (normaliser + eps)[..., None])
        ns.append(normaliser)
        ms.append(m_new)
        m_state = m_new
    if seq == 0:
        return v.new_zeros(v.shape), q.new_zeros(q.shape[:3]), q.new_zeros(q.shape[:3])
    return torch.stack(hs, dim=2), torch.stack(ns, dim=2), torch.stack(ms, dim=2)


def multihead_layernorm_by_heads(h, weight, bias, eps, residual_weight=False):
    """``F.layer_norm`` over DV, one head at a time, heads concatenated channel-wise."""
    b, nh, s, dv = h.shape
    if weight is not None and residual_weight:
        weight = 1 + weight
    outs = []
    for head in range(nh):
        sl = slice(head * dv, (head + 1) * dv)
        outs.append(F.layer_norm(h[:, head], (dv,), None if weight is None else weight[sl],
                                 None if bias is None else bias[sl], eps))
    return torch.cat(outs, dim=-1)  # [B, S, NH * DV]


# Tight: both sides are fp64 and differ only in summation order.
FP64 = dict(rtol=1e-10, atol=1e-12)

GATES = {
    # name: (fgate centre, igate scale)
    "open forget gates": (3.0, 1.0),
    "closing forget gates": (-2.0, 1.0),
    # exp(igate) overflows fp64 without the stabiliser: m must carry it.
    "huge input gates": (1.0, 400.0),
}


@pytest.mark.parametrize("gates", list(GATES))
@pytest.mark.parametrize("shape", [(2, 3, 37, 16, 32), (1, 2, 20, 8, 8), (1, 1, 1, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_parallel_reference_equals_recurrence(shape, gates, eps):
    fgate_bias, igate_scale = GATES[gates]
    x = make_inputs(*shape, fgate_bias=fgate_bias, seed=3)
    igate = x.igate * igate_scale
    h, n, m = reference.mlstm_parallel(x.q, x.k, x.v, igate, x.fgate, eps)
    h_rec, n_rec, m_rec = recurrent_mlstm(x.q, x.k, x.v, igate, x.fgate, eps)
    assert h.dtype == n.dtype == m.dtype == torch.float64
    assert torch.isfinite(h).all() and torch.isfinite(m).all()
    torch.testing.assert_close(m, m_rec, **FP64)
    torch.testing.assert_close(n, n_rec, **FP64)
    torch.testing.assert_close(h, h_rec, **FP64)


def test_recurrence_sees_both_normaliser_branches():
    """The contract cases run through both branches of ``max(|n . q|, exp(-m))``; check on
    the recurrence itself that a typical draw takes each."""
    x = make_inputs(2, 3, 37, 16, 32, seed=3)
    _, n, m = recurrent_mlstm(x.q, x.k, x.v, x.igate, x.fgate)
    floor = torch.exp(-m)
    assert (n > floor).any() and (n == floor).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_op_stats_equal_recurrence(backend, eps):
    """``mlstm_with_stats`` (raw output) returns the recurrence's ``h``, ``n`` and ``m``
    (the kernels keep ``m`` in log2 units: ``m = m_log2 * ln 2`` costs an ulp or two)."""
    x = make_inputs(1, 2, 37, 16, 24, seed=5)
    with compileops.use_backend(backend):
        out, n, m = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate, eps=eps)
    h_rec, n_rec, m_rec = recurrent_mlstm(x.q, x.k, x.v, x.igate, x.fgate, eps)
    assert out.dtype == n.dtype == m.dtype == torch.float64
    torch.testing.assert_close(m, m_rec, **FP64)
    torch.testing.assert_close(n, n_rec, **FP64)
    torch.testing.assert_close(out, h_rec, **FP64)


def test_reference_empty_sequence():
    x = make_inputs(2, 3, 0, 8, 4)
    h, n, m = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate)
    assert h.shape == (2, 3, 0, 4) and n.shape == m.shape == (2, 3, 0)


def test_reference_rounds_h_to_v_dtype_unless_asked_not_to():
    x = make_inputs(1, 2, 9, 8, 8, dtype=torch.bfloat16)
    h, n, m = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate)
    h32, _, _ = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate, round_h=False)
    assert h.dtype == torch.bfloat16 and h32.dtype == n.dtype == m.dtype == torch.float32
    assert torch.equal(h, h32.to(torch.bfloat16))


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual_weight", [False, True])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_multihead_layernorm_equals_layer_norm_per_head(weight, bias, residual_weight, eps):
    gen = torch.Generator().manual_seed(0)
    b, nh, s, dv = 2, 3, 5, 12
    h = torch.randn(b, nh, s, dv, generator=gen, dtype=torch.float64) * 3 + 1
    w = torch.randn(nh * dv, generator=gen, dtype=torch.float64) if weight else None
    bi = torch.randn(nh * dv, generator=gen, dtype=torch.float64) if bias else None
    got = reference.multihead_layernorm(h, w, bi, eps, residual_weight)
    want = multihead_layernorm_by_heads(h, w, bi, eps, residual_weight)
    assert got.shape == (b, s, nh * dv) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_multihead_layernorm_low_precision_stats_in_fp32():
    """bf16 h: statistics in fp32, the result cast to ``out_dtype`` (default h's dtype)."""
    gen = torch.Generator().manual_seed(1)
    h = (torch.randn(2, 2, 7, 16, generator=gen) * 4 + 2).to(torch.bfloat16)
    w = torch.randn(32, generator=gen)
    want = multihead_layernorm_by_heads(h.float(), w, None, 1e-6)
    got = reference.multihead_layernorm(h, w, None, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)
    got32 = reference.multihead_layernorm(h, w, None, 1e-6, out_dtype=torch.float32)
    torch.testing.assert_close(got32, want, rtol=1e-6, atol=1e-6)


def test_reference_mlstm_norms_the_unrounded_h():
    x = make_inputs(1, 2, 11, 8, 8, dtype=torch.float32)
    out, n, m = reference.mlstm(x.q, x.k, x.v, x.igate, x.fgate, x.norm_weight, x.norm_bias)
    h, n2, m2 = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate, round_h=False)
    assert torch.equal(out, reference.multihead_layernorm(h, x.norm_weight, x.norm_bias))
    assert torch.equal(n, n2) and torch.equal(m, m2)
    raw, _, _ = reference.mlstm(x.q, x.k, x.v, x.igate, x.fgate)
    assert raw.shape == x.v.shape
