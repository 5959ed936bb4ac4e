"""The recurrent mLSTM step (generation): ``compileops::mlstm_step`` and :func:`mlstm_step`.

* ``compileops::mlstm_step(q, k, v, igate, logf, c?, n?, m?, norm_weight?, norm_bias?,
  normed, norm_eps, eps, residual_weight) -> (out, c, n, m)``: one token per (batch, head).
  ``q, k [B, NH, DQK]``, ``v [B, NH, DV]``; ``igate`` and ``logf = log sigmoid(fgate)``
  ``[B, NH]`` in the accumulation dtype (fp32, fp64 for fp64 inputs); the state before the
  token ``c [B, NH, DQK, DV]``, ``n [B, NH, DQK]``, ``m [B, NH]`` (accumulation dtype; all
  three, or none for the empty state). Returns ``out`` (``[B, NH * DV]`` normed, ``[B, NH,
  DV]`` raw, v's dtype) and the state after the token, freshly allocated (the inputs are
  never modified). The math and the state convention: :mod:`compileops.mlstm.recurrent`.

* ``compileops::mlstm_step_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf,
  c?, n?, m?, norm_weight?, normed, norm_eps, eps, residual_weight) -> (dq, dk, dv, digate,
  dlogf, dc, dn, dm, dweight, dbias)``: the step's gradient, the states' included.

Both functional. The forward runs the Triton kernel (:mod:`.kernels.step`) or the plain
PyTorch reference (:func:`recurrent.step_from_log_gates`) as ``backends.select`` says. The
backward is not a kernel: generation needs none, so it is plain PyTorch on every backend
(one token: small), exact as autograd through the reference gives it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from compileops import backends
from compileops._library import custom_op, require, require_tensors
from compileops.mlstm import recurrent, reference
from compileops.mlstm.checks import (
    check_backward_grad,
    check_gates_floating,
    check_inputs,
)
from compileops.mlstm.op import _layernorm_backward

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- checks


def check_step_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, norm_weight: Optional[torch.Tensor],
    norm_bias: Optional[torch.Tensor], norm_eps: float, eps: float,
) -> None:
    """Shapes ``q, k [B, NH, DQK]``, ``v [B, NH, DV]``, ``igate, fgate [B, NH]``,
    ``norm_weight, norm_bias [NH * DV]``; one floating dtype for q, k, v; one device
    (:func:`compileops.mlstm.checks.check_inputs` for one token)."""
    check_inputs(q, k, v, igate, fgate, norm_weight, norm_bias, norm_eps, eps, one_token=True)


def check_step_state(q: torch.Tensor, v: torch.Tensor, c: Optional[torch.Tensor],
                     n: Optional[torch.Tensor], m: Optional[torch.Tensor]) -> None:
    """All of ``(C [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH])`` or none, in the
    accumulation dtype, on q's device."""
    given = [t is not None for t in (c, n, m)]
    require(all(given) or not any(given), lambda: "state must be a (C, n, m) triple: "
            "got a partial state")
    if c is None:
        return
    batch, heads, dqk = q.shape
    acc = reference.gate_dtype(q.dtype)
    for name, t, shape in (("state C", c, (batch, heads, dqk, v.shape[2])),
                           ("state n", n, (batch, heads, dqk)),
                           ("state m", m, (batch, heads))):
        require(tuple(t.shape) == shape, lambda: f"{name} must have shape "
                f"{list(shape)} ([B, NH, DQK, DV], [B, NH, DQK], [B, NH]), got "
                f"{list(t.shape)}")
        require(t.dtype == acc, lambda: f"{name} must be {acc} for {q.dtype} inputs (the "
                f"accumulation dtype), got {t.dtype}")
        require(t.device == q.device, lambda: f"{name} is on {t.device} but q is on "
                f"{q.device}; move them to the same device")


def _check_log_gates(q: torch.Tensor, igate: torch.Tensor, logf: torch.Tensor) -> None:
    acc = reference.gate_dtype(q.dtype)
    for name, g in (("igate", igate), ("logf", logf)):
        require(g.dtype == acc, lambda: f"{name} must be {acc} for {q.dtype} inputs (the "
                f"gates' accumulation dtype), got {g.dtype}; compileops.mlstm_step "
                "converts")


def _unpack_state(state) -> State:
    """The public function's ``state``: None or a ``(C, n, m)`` triple of tensors."""
    if not isinstance(state, (tuple, list)) or len(state) != 3 or any(
            not isinstance(t, torch.Tensor) for t in state):
        raise TypeError("state must be None or a (C, n, m) triple of tensors, as "
                        "compileops.mlstm_step returns it")
    return tuple(state)


# --------------------------------------------------------------------------- the op


def _out_shape(q: torch.Tensor, v: torch.Tensor, normed: bool) -> tuple:
    batch, heads, _ = q.shape
    dv = v.shape[2]
    return (batch, heads * dv) if normed else (batch, heads, dv)


def _norm_step(h: torch.Tensor, weight, bias, norm_eps, residual_weight, dtype):
    """The multi-head layernorm of one token's ``h [B, NH, DV]`` -> ``[B, NH * DV]``."""
    out = reference.multihead_layernorm(h[:, :, None, :], weight, bias, norm_eps,
                                        residual_weight, dtype)
    return out[:, 0]


@custom_op("mlstm_step")
def mlstm_step_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, c: Optional[torch.Tensor], n: Optional[torch.Tensor],
    m: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
    norm_bias: Optional[torch.Tensor], normed: bool, norm_eps: float, eps: float,
    residual_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check_step_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    _check_log_gates(q, igate, logf)
    check_step_state(q, v, c, n, m)
    state = (c, n, m) if c is not None else None
    if backends.select("mlstm_step", q.device) == "triton":
        from compileops.mlstm.kernels import step

        return step.mlstm_step(q, k, v, igate, logf, state, norm_weight, norm_bias, normed,
                               norm_eps, eps, residual_weight)
    h, (c_new, n_new, m_new) = recurrent.step_from_log_gates(q, k, v, igate, logf, state, eps)
    if normed:
        out = _norm_step(h, norm_weight, norm_bias, norm_eps, residual_weight, v.dtype)
    else:
        out = h.to(v.dtype)
    return out, c_new, n_new, m_new  # all computed here: none aliases an input


@mlstm_step_op.register_fake
def _mlstm_step_fake(q, k, v, igate, logf, c, n, m, norm_weight, norm_bias, normed, norm_eps,
                     eps, residual_weight):
    check_step_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    _check_log_gates(q, igate, logf)
    check_step_state(q, v, c, n, m)
    acc = reference.gate_dtype(q.dtype)
    batch, heads, dqk = q.shape
    dv = v.shape[2]
    return (v.new_empty(_out_shape(q, v, normed)),
            q.new_empty((batch, heads, dqk, dv), dtype=acc),
            q.new_empty((batch, heads, dqk), dtype=acc),
            q.new_empty((batch, heads), dtype=acc))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, igate, logf, c, n, m, norm_weight, norm_bias, normed, norm_eps, eps, residual = \
        inputs
    ctx.save_for_backward(q, k, v, igate, logf, c, n, m, norm_weight)
    ctx.normed = normed
    ctx.norm_eps = norm_eps
    ctx.eps = eps
    ctx.residual_weight = residual
    ctx.bias_dtype = norm_bias.dtype if norm_bias is not None else None


def _backward(ctx, grad_out, grad_c, grad_n, grad_m):
    q, k, v, igate, logf, c, n, m, norm_weight = ctx.saved_tensors
    acc = reference.gate_dtype(q.dtype)
    batch, heads, dqk = q.shape
    dv_len = v.shape[2]
    # Cotangents of outputs that no loss reached may come as None.
    if grad_out is None:
        grad_out = v.new_zeros(_out_shape(q, v, ctx.normed))
    if grad_c is None:
        grad_c = q.new_zeros((batch, heads, dqk, dv_len), dtype=acc)
    if grad_n is None:
        grad_n = q.new_zeros((batch, heads, dqk), dtype=acc)
    if grad_m is None:
        grad_m = q.new_zeros((batch, heads), dtype=acc)
    dq, dk, dv, digate, dlogf, dc, dn, dm, dweight, dbias = mlstm_step_backward_op(
        grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, c, n, m, norm_weight,
        ctx.normed, ctx.norm_eps, ctx.eps, ctx.residual_weight)
    has_state = c is not None
    return (dq, dk, dv, digate, dlogf,
            dc if has_state else None, dn if has_state else None, dm if has_state else None,
            dweight.to(norm_weight.dtype) if norm_weight is not None else None,
            dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None,
            None, None, None, None)


backends.register_autograd(mlstm_step_op, _backward, _setup_context)


@custom_op("mlstm_step_backward")
def mlstm_step_backward_op(
    grad_out: torch.Tensor, grad_c: torch.Tensor, grad_n: torch.Tensor, grad_m: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, c: Optional[torch.Tensor], n: Optional[torch.Tensor],
    m: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor], normed: bool,
    norm_eps: float, eps: float, residual_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`mlstm_step_op`'s ``(out, c, n, m)`` for the cotangents ``grad_*``:
    ``(dq, dk, dv, digate, dlogf, dc, dn, dm, dweight, dbias)``; dq, dk, dv in q's dtype,
    the rest in the accumulation dtype; ``dc, dn, dm`` empty without a state, ``dweight,
    dbias [NH * DV]`` empty when not ``normed``. Plain PyTorch on every backend
    (:func:`_step_backward`)."""
    _check_step_backward(grad_out, grad_c, grad_n, grad_m, q, v, normed)
    return _step_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, c, n, m,
                          norm_weight, normed, norm_eps, eps, residual_weight)


@mlstm_step_backward_op.register_fake
def _mlstm_step_backward_fake(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, c, n,
                              m, norm_weight, normed, norm_eps, eps, residual_weight):
    _check_step_backward(grad_out, grad_c, grad_n, grad_m, q, v, normed)
    acc = reference.gate_dtype(q.dtype)
    channels = q.shape[1] * v.shape[2] if normed else 0
    has_state = c is not None

    def state_like(t):
        return t.new_empty(t.shape) if has_state else q.new_empty((0,), dtype=acc)

    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            igate.new_empty(igate.shape), logf.new_empty(logf.shape), state_like(c),
            state_like(n), state_like(m), q.new_empty((channels,), dtype=acc),
            q.new_empty((channels,), dtype=acc))


def _check_step_backward(grad_out, grad_c, grad_n, grad_m, q, v, normed):
    batch, heads, dqk = q.shape
    for name, g, shape in (("grad_out", grad_out, _out_shape(q, v, normed)),
                           ("grad_c", grad_c, (batch, heads, dqk, v.shape[2])),
                           ("grad_n", grad_n, (batch, heads, dqk)),
                           ("grad_m", grad_m, (batch, heads))):
        check_backward_grad(g, shape, name)


def _step_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, c, n, m,
                   norm_weight, normed, norm_eps, eps, residual_weight):
    """The step's gradient by hand (autograd through :func:`recurrent.step_from_log_gates`
    gives the same; tests/mlstm/test_step.py). With ``a = logf + m``, ``m' = max(a, igate)``,
    ``decay = exp(a - m')``, ``gain = exp(igate - m')``, ``r = q . n' / sqrt(DQK)``, ``z =
    max(|r|, exp(-m')) + eps`` and ``h = q C' / sqrt(DQK) / z``, it runs the chain back:
    the norm, ``z`` (through its live branch), ``C'`` and ``n'``, then ``decay`` and
    ``gain``, whose exponents meet in ``m'``, which goes to the larger of ``a`` and
    ``igate`` (half each on a tie, as ``torch.maximum``)."""
    acc = reference.gate_dtype(q.dtype)
    batch, heads, dqk = q.shape
    scale = 1.0 / math.sqrt(dqk)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    has_state = c is not None
    # The forward again (one token: cheaper than keeping it).
    a = logf + m if has_state else torch.full_like(igate, float("-inf"))
    m_new = torch.maximum(a, igate)
    decay = torch.exp(a - m_new)
    gain = torch.exp(igate - m_new)
    outer = ka[..., :, None] * va[..., None, :]
    c_new = gain[..., None, None] * outer
    n_new = gain[..., None] * ka
    if has_state:
        c_new = c_new + decay[..., None, None] * c
        n_new = n_new + decay[..., None] * n
    numerator = (qa[..., None, :] @ c_new).squeeze(-2) * scale  # [B, NH, DV]
    row_sum = (qa * n_new).sum(-1) * scale
    floor = torch.exp(-m_new)
    z = torch.maximum(row_sum.abs(), floor) + eps
    h = numerator / z[..., None]

    if normed:
        dh, dweight, dbias = _layernorm_backward(grad_out[:, None], h[:, :, None], norm_weight,
                                                 norm_eps, residual_weight, acc)
        dh = dh[:, :, 0]
    else:
        dh = grad_out.to(acc)
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    d_num = dh / z[..., None]
    dh_dot_h = (dh * h).sum(-1)
    d_z = -dh_dot_h / z
    live = row_sum.abs() > floor
    d_row = torch.where(live, d_z * torch.sign(row_sum), torch.zeros_like(d_z))
    # Through the floor branch, -d_z * floor = (dh . h) * floor / z. Where floor overflows
    # (m' below about -88 in fp32: an input gate far below 0 before anything entered), h is 0
    # and floor / z is 1, so the term is dh . h; -d_z * floor would be 0 * inf, NaN.
    through_floor = torch.where(torch.isinf(floor), dh_dot_h, -d_z * floor)
    d_m_new = grad_m.to(acc) + torch.where(live, torch.zeros_like(d_z), through_floor)
    d_c_new = grad_c.to(acc) + scale * qa[..., :, None] * d_num[..., None, :]
    d_n_new = grad_n.to(acc) + scale * d_row[..., None] * qa
    dq = scale * (c_new @ d_num[..., None]).squeeze(-1) + scale * d_row[..., None] * n_new
    # C' = decay C + gain k v^T, n' = decay n + gain k.
    d_c_v = (d_c_new @ va[..., None]).squeeze(-1)  # [B, NH, DQK]
    dk = gain[..., None] * (d_c_v + d_n_new)
    dv = gain[..., None] * (ka[..., None, :] @ d_c_new).squeeze(-2)
    d_gain = (ka * d_c_v).sum(-1) + (ka * d_n_new).sum(-1)
    d_igate = d_gain * gain
    d_m_new = d_m_new - d_gain * gain
    if has_state:
        dc = decay[..., None, None] * d_c_new
        dn = decay[..., None] * d_n_new
        d_decay = (d_c_new * c).sum((-2, -1)) + (d_n_new * n).sum(-1)
        d_a = d_decay * decay
        d_m_new = d_m_new - d_decay * decay
        share = torch.where(a > igate, 1.0, torch.where(a < igate, 0.0, 0.5)).to(acc)
        d_a = d_a + share * d_m_new
        d_igate = d_igate + (1.0 - share) * d_m_new
        dlogf, dm = d_a, d_a.clone()
    else:  # a = -inf: m' = igate, and logf reaches nothing
        d_igate = d_igate + d_m_new
        dlogf = torch.zeros_like(logf)
        dc = dn = dm = None
    empty = q.new_empty((0,), dtype=acc)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_igate.to(igate.dtype),
            dlogf.to(logf.dtype), dc if has_state else empty, dn if has_state else empty.clone(),
            dm if has_state else empty.clone(), dweight, dbias)


# --------------------------------------------------------------------------- public function


def mlstm_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, state: Optional[State] = None, *,
    norm_weight: Optional[torch.Tensor] = None, norm_bias: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6, eps: float = 1e-6, residual_weight: bool = False,
) -> tuple[torch.Tensor, State]:
    """One recurrent mLSTM step (generation): ``(out, (C, n, m))``.

    Shapes: ``q, k [B, NH, DQK]``, ``v [B, NH, DV]`` (one token per sequence), gate
    pre-activations ``igate, fgate [B, NH]``, ``norm_weight, norm_bias [NH * DV]``.
    ``state = (C [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH])`` in fp32 (fp64 for fp64
    inputs), the state before the token; None: the empty state (``C = 0, n = 0, m = -inf``,
    the start of a sequence). The state returned, after the token, feeds the next call;
    ``compileops.mlstm(..., return_last_state=True)`` returns one in the same convention
    (``compileops.mlstm.recurrent``), so a prompt runs in parallel and generation goes on
    step by step.

    Math (``compileops.mlstm.recurrent``): ``m' = max(log sigmoid(fgate) + m, igate)``,
    ``C' = exp(log sigmoid(fgate) + m - m') C + exp(igate - m') k v^T`` (``n'`` alike with
    ``k``), ``h = (q C' / sqrt(DQK)) / (max(|q . n'| / sqrt(DQK), exp(-m')) + eps)``; then,
    when ``norm_weight`` or ``norm_bias`` is given, the multi-head layernorm of
    :func:`compileops.mlstm` (per head over DV, fp32 statistics, ``residual_weight``: scale
    by ``1 + weight``). A loop of steps gives :func:`compileops.mlstm`'s output on the whole
    sequence.

    Returns ``out`` ``[B, NH * DV]`` when normed, else the raw ``h [B, NH, DV]``, in v's
    dtype, and the new state (fresh tensors: the inputs are never modified).

    Precision (axis B, relative L2 against the fp64 reference on the same rounded inputs;
    tests/mlstm/test_step.py): the state is updated in fp32 (fp64 for fp64 inputs) whatever
    q, k, v are, so it stays within 2e-6 (1e-12 in fp64); the output within 1e-12 (fp64),
    2e-6 (fp32), 1e-3 (fp16) and 8e-3 (bf16): its own rounding. A loop of steps matches
    :func:`compileops.mlstm` on the whole sequence within 1e-10 in fp64 and 1e-2 in bf16.
    The Triton kernel is deterministic and batch-invariant (bitwise).

    Gradients: the step is meant for generation, where none is needed, so its backward
    (``compileops::mlstm_step_backward``) is not a Triton kernel but plain PyTorch on every
    backend: exact (autograd through the reference gives the same), the state's gradients
    included, and cheap for one token, but not tuned. Train over sequences with
    :func:`compileops.mlstm`.
    """
    require_tensors((("q", q), ("k", k), ("v", v), ("igate", igate), ("fgate", fgate)))
    check_gates_floating(igate, fgate)
    c = n = m = None
    if state is not None:
        c, n, m = _unpack_state(state)
    normed = norm_weight is not None or norm_bias is not None
    acc = reference.gate_dtype(q.dtype)
    out, c_new, n_new, m_new = mlstm_step_op(
        q, k, v, reference.floor_input_gate(igate.to(acc)), F.logsigmoid(fgate.to(acc)), c, n,
        m, norm_weight, norm_bias, normed, float(norm_eps), float(eps), bool(residual_weight))
    return out, (c_new, n_new, m_new)


__all__ = ["check_step_inputs", "check_step_state", "mlstm_step", "mlstm_step_backward_op",
           "mlstm_step_op"]
