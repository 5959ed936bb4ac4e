"""The mLSTM custom ops: the parallel cell with its multi-head layernorm fused.

* ``compileops::mlstm_parallel(q, k, v, igate, logf, norm_weight?, norm_bias?, normed,
  norm_eps, eps, residual_weight, save_h) -> (out, h, m_log2, b)``: ``out`` is ``[B, S, NH * DV]``
  (normed) or ``[B, NH, S, DV]`` (raw); ``h [B, NH, S, DV]`` is the raw h kept for the norm's
  backward when ``save_h`` (else empty); ``m_log2, b [B, NH, S]`` (fp32, fp64 for fp64
  inputs) are the stabiliser in log2 units (``m = m_log2 * ln 2``) and the signed row sum,
  ``n = max(|b|, exp(-m))``.
* ``compileops::mlstm_parallel_backward(grad, q, k, v, igate, logf, norm_weight?, h, m_log2,
  b, normed, norm_eps, eps, residual_weight) -> (dq, dk, dv, digate, dlogf, dweight, dbias)``.

The gates enter as ``igate`` and ``logf = cumsum(log sigmoid(fgate))``, both ``[B, NH, S]`` in
the accumulation dtype (fp32, fp64 for fp64): the public function computes ``logf`` with
torch ops, so autograd (and Inductor, which fuses them) handles the cumsum and the sigmoid.

Both functional; the forward's autograd calls the backward op, so the compiled backward
graph holds a compileops op too.

Gradient: exact, as autograd through the reference gives it: the normaliser
``max(|b|, exp(-m))`` through its live branch, and the stabiliser ``m_i = max_j logD_ij``
(``h`` depends on it through ``eps`` only: ``dm_i = -eps / (n_i + eps) * (dh_i . h_i)``),
routed to the row's maximal column (on exact ties, the latest:
:func:`stabiliser_column_grad`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.mlstm import reference
from compileops.mlstm.reference import LOG2E
from compileops.mlstm.checks import (
    check_backward_grad,
    check_inputs,
    check_kernel_head_dims,
    check_log_gates,
)



#: :func:`set_fast_gate_gradients`'s setting, read by the backward ops when they run.
_FAST_GATE_GRADIENTS = False


def set_fast_gate_gradients(enabled: bool) -> None:
    """Process-wide: the Triton backward of 16-bit inputs in the chunkwise form takes the
    forget and input gates' gradients the older, cheaper way (``enabled=True``) or the
    accurate way (``False``, the default). The parallel form always takes the older way
    (paired, it measured no closer to fp64 on an H200, and slower).

    The forget gate's gradient is a reverse cumulative sum of each position's ``dlogD`` row
    sum less its column sum; the two sums of a pair ``(i, j)`` come from the dQ and the dK/dV
    programs. By default the dK/dV programs sum the very bf16-rounded products the dQ
    programs multiply, and the chunkwise form takes what crosses each chunk's end from the
    chunk's own keys and the state entering it, so each pair cancels where it should. The
    fast way sums each kernel's own rounding and the later chunks' sums along the whole row.
    Measured on an H200 (bf16, B 2, NH 4, DQK 128, DV 256, four gate distributions,
    benchmarks/RESULTS.md): the forget gate's gradient within 7.4e-3 of fp64 at S = 1024 and
    8192 by default, up to 7.5e-2 and 1.1e-1 the fast way. What the default costs, compiled
    fw+bw at 65,536 tokens: 13-15% at TFLA's head (NH 16, DQK 128, DV 256; 7.17 against 6.34
    ms raw at S = 4096), 5% at xLSTM-7B's (15.86 against 15.07 ms at 8192): in the dK/dV
    programs, the dQ product rebuilt below the diagonal and a row sum per tile, and one more
    read of the states entering the chunks. Read each time a backward runs (compiled too:
    the backward ops are not traced through), not per call or per thread. fp32 and fp64 are
    unaffected: nothing is rounded between the two sums there."""
    if not isinstance(enabled, bool):
        # bool("False") is True: a string or a number from a config file must not turn the
        # less accurate sums on by accident.
        raise TypeError(f"set_fast_gate_gradients takes True or False, got "
                        f"{type(enabled).__name__} {enabled!r}")
    global _FAST_GATE_GRADIENTS
    _FAST_GATE_GRADIENTS = enabled


def fast_gate_gradients() -> bool:
    """Whether :func:`set_fast_gate_gradients` is on."""
    return _FAST_GATE_GRADIENTS


def _use_triton(op: str, q: torch.Tensor, v: torch.Tensor) -> bool:
    if backends.select(op, q.device) != "triton":
        return False
    check_kernel_head_dims(q, v)
    return True


def _dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.contiguous() if t is not None else None


def _out_shape(q, v, normed):
    b, nh, s, _ = q.shape
    dv = v.shape[-1]
    return (b, s, nh * dv) if normed else (b, nh, s, dv)



@custom_op("mlstm_parallel")
def mlstm_parallel_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    normed: bool, norm_eps: float, eps: float, residual_weight: bool, save_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    if _use_triton("mlstm_parallel", q, v):
        from compileops.mlstm import kernels

        # The kernels index the gates and the norm's affine densely.
        out, h, m, b = kernels.mlstm_forward(
            q, k, v, igate.contiguous(), logf.contiguous(), _dense(norm_weight),
            _dense(norm_bias), normed, norm_eps, eps, residual_weight, save_h and normed)
        return out, (h if h is not None else v.new_empty((0,))), m, b
    h, b, m = reference.cell_from_log_gates(q, k, v, igate, logf, eps)
    if normed:
        out = reference.multihead_layernorm(h, norm_weight, norm_bias, norm_eps,
                                            residual_weight, v.dtype)
    else:
        out = h.to(v.dtype)
    kept = h.to(v.dtype) if (save_h and normed) else v.new_empty((0,))
    return out, kept, m * LOG2E, b


@mlstm_parallel_op.register_fake
def _mlstm_parallel_fake(q, k, v, igate, logf, norm_weight, norm_bias, normed, norm_eps,
                         eps, residual_weight, save_h):
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    acc = reference.gate_dtype(q.dtype)
    out = v.new_empty(_out_shape(q, v, normed))
    h = v.new_empty(v.shape) if (save_h and normed) else v.new_empty((0,))
    m = q.new_empty(q.shape[:3], dtype=acc)
    return out, h, m, q.new_empty(q.shape[:3], dtype=acc)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, igate, logf, norm_weight, norm_bias, normed, norm_eps, eps, residual, _ = inputs
    out, h, m, b = output
    ctx.mark_non_differentiable(h, m, b)
    kept_h = h if normed else out
    ctx.save_for_backward(q, k, v, igate, logf, norm_weight, kept_h, m, b)
    ctx.normed = normed
    ctx.norm_eps = norm_eps
    ctx.eps = eps
    ctx.residual_weight = residual
    ctx.bias_dtype = norm_bias.dtype if norm_bias is not None else None


def _backward(ctx, grad_out, _grad_h, _grad_m, _grad_b):
    q, k, v, igate, logf, norm_weight, h, m, b = ctx.saved_tensors
    if ctx.normed and h.numel() == 0 and q.numel():
        raise RuntimeError("mlstm_parallel was called with save_h=False but a gradient is "
                           "needed: call compileops.mlstm, which keeps h when it must")
    dq, dk, dv, digate, dlogf, dweight, dbias = mlstm_parallel_backward_op(
        grad_out, q, k, v, igate, logf, norm_weight, h, m, b, ctx.normed, ctx.norm_eps,
        ctx.eps, ctx.residual_weight)
    dweight = dweight.to(norm_weight.dtype) if norm_weight is not None else None
    dbias = dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return dq, dk, dv, digate, dlogf, dweight, dbias, None, None, None, None, None


backends.register_autograd(mlstm_parallel_op, _backward, _setup_context)


@custom_op("mlstm_parallel_backward")
def mlstm_parallel_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor, norm_weight: Optional[torch.Tensor],
    h: torch.Tensor, m: torch.Tensor, b: torch.Tensor, normed: bool, norm_eps: float,
    eps: float, residual_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """Gradients of :func:`mlstm_parallel_op`'s ``out`` for ``grad_out``: ``(dq, dk, dv,
    digate, dlogf, dweight [NH * DV], dbias [NH * DV])``; the gates' and the norm's in the
    accumulation dtype (the norm's empty when not ``normed``). ``h``: the raw h when ``normed``,
    else the output itself."""
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    acc = reference.gate_dtype(q.dtype)
    if _use_triton("mlstm_parallel_backward", q, v):
        return _kernel_backward(grad_out, q, k, v, igate, logf, norm_weight, h, m, b, normed,
                                norm_eps, eps, residual_weight, acc)
    return _reference_backward(grad_out, q, k, v, igate, logf, norm_weight, normed, norm_eps,
                               eps, residual_weight, acc)


@mlstm_parallel_backward_op.register_fake
def _mlstm_parallel_backward_fake(grad_out, q, k, v, igate, logf, norm_weight, h, m, b,
                                  normed, norm_eps, eps, residual_weight):
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    acc = reference.gate_dtype(q.dtype)
    channels = q.shape[1] * v.shape[3] if normed else 0
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            igate.new_empty(igate.shape), logf.new_empty(logf.shape),
            q.new_empty((channels,), dtype=acc), q.new_empty((channels,), dtype=acc))


def _kernel_backward(grad_out, q, k, v, igate, logf, norm_weight, h, m, b, normed,
                     norm_eps, eps, residual_weight, acc):
    from compileops.mlstm import kernels
    from compileops.mlstm.kernels import gates

    cfg = kernels.choose_backward_config(q, q.shape[-1], v.shape[-1])
    dh, r, beta, dm, parts_w, parts_b = kernels.norm_backward(
        grad_out, h, _dense(norm_weight), m.contiguous(), b.contiguous(), normed, norm_eps,
        eps, residual_weight, cfg)
    dq, dk, dv, row_grad, col_grad, _ = kernels.cell_backward(
        q, k, v, dh, igate.contiguous(), logf.contiguous(), m, r, beta, cfg,
        # The parallel form keeps the older sums: paired, on an H200 its bf16 forget-gate
        # gradient was no closer to fp64 (1.1-1.5e-2 against 0.8-1.5e-2 at S = 1024) and its
        # fw+bw 24% slower (benchmarks/RESULTS.md); kernel="auto" trains 16-bit inputs
        # chunkwise from 513 tokens instead, where the paired sums pay.
        paired=False)
    col_grad = col_grad + stabiliser_column_grad(igate - logf, dm, gates.running_sum)
    # logD_ij = F_i - F_j + igate_j: dF gets the row sums of dlogD minus its column sums
    # (dm: the stabiliser's share, which sits in row i too).
    dlogf = row_grad + dm - col_grad
    if normed:
        dweight = parts_w.sum(dim=(0, 1)).reshape(-1)
        dbias = parts_b.sum(dim=(0, 1)).reshape(-1)
    else:
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    return dq, dk, dv, col_grad, dlogf, dweight, dbias


def stabiliser_column_grad(keys: torch.Tensor, dm: torch.Tensor,
                           running_sum=None) -> torch.Tensor:
    """Where the stabiliser's gradient lands among the columns: ``[..., S]``.

    ``m_i = max_{j<=i} logD_ij = F_i + max_{j<=i} (igate_j - F_j)``, so row i's maximal
    column is the running argmax of ``keys = igate - F``; it never decreases along i, so
    the rows sharing a column are a contiguous run, and each column's share of ``dm`` is a
    difference of two prefix sums (no scatter: deterministic on every device).
    ``running_sum``: the prefix sum (default ``torch.cumsum``, whose CUDA scan depends on
    the number of rows; the Triton backend passes its per-row kernel, so that a row's share
    does not depend on the rest of the batch)."""
    seq = keys.shape[-1]
    if seq == 0:
        return torch.zeros_like(dm)
    argmax = torch.cummax(keys, dim=-1).indices.contiguous()
    columns = torch.arange(seq, device=keys.device).expand_as(argmax).contiguous()
    # rows_upto[j] = the number of rows whose maximal column is <= j.
    rows_upto = torch.searchsorted(argmax, columns, right=True)
    sums = torch.cumsum(dm, dim=-1) if running_sum is None else running_sum(dm)
    prefix = torch.nn.functional.pad(sums, (1, 0))
    below = torch.gather(prefix, -1, rows_upto)
    return torch.diff(below, dim=-1, prepend=torch.zeros_like(below[..., :1]))


def normaliser_terms(m_log2: torch.Tensor, b: torch.Tensor, hdot: torch.Tensor, eps: float):
    """Per row ``[B, NH, S]``: ``r = 1 / (n + eps)``; ``beta``, the normaliser's share of
    ``dC``: ``-r (dh . h) sign(b)`` where ``n = |b|`` won the max, else 0; and ``dm = -eps r
    (dh . h)``, the stabiliser's gradient."""
    floor = torch.exp2(-m_log2)
    r = 1.0 / (torch.maximum(b.abs(), floor) + eps)
    beta = torch.where(b.abs() > floor, -r * hdot * torch.sign(b), torch.zeros_like(b))
    return r.contiguous(), beta.contiguous(), (-eps * r * hdot).contiguous()


def _reference_backward(grad_out, q, k, v, igate, logf, norm_weight, normed, norm_eps, eps,
                        residual_weight, acc):
    """The backward in plain PyTorch, materialising ``S x S`` (the module docstring's math;
    the tests hold it, like the kernels, to autograd through the reference)."""
    batch, heads, seq, dqk = q.shape
    dv_len = v.shape[-1]
    channels = heads * dv_len
    empty = q.new_empty((0,), dtype=acc)
    h, b, m = reference.cell_from_log_gates(q, k, v, igate, logf, eps)  # [B, NH, S, DV] acc
    if normed:
        dh, dweight, dbias = _layernorm_backward(grad_out, h, norm_weight, norm_eps,
                                                 residual_weight, acc)
    else:
        dh, dweight, dbias = grad_out.to(acc), empty, empty.clone()
    if seq == 0:
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                torch.zeros_like(igate), torch.zeros_like(logf), dweight, dbias)
    log_d = logf[..., :, None] - logf[..., None, :] + igate[..., None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    log_d = log_d.masked_fill(~causal, float("-inf"))
    decay = torch.exp(log_d - m[..., None])  # 0 above the diagonal
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    scores = (qa @ ka.transpose(-1, -2)) / math.sqrt(dqk)
    r, beta, dm = normaliser_terms(m * LOG2E, b, (dh * h).sum(-1), eps)
    d_c = (dh @ va.transpose(-1, -2)) * r[..., None] + beta[..., None]
    d_s = d_c * decay
    dq = (d_s @ ka) / math.sqrt(dqk)
    dk = (d_s.transpose(-1, -2) @ qa) / math.sqrt(dqk)
    dv = (scores * decay * r[..., None]).transpose(-1, -2) @ dh
    d_log_d = d_s * scores
    # The stabiliser m_i = max_j logD_ij: its gradient goes to the row's first maximal column.
    first_max = log_d.max(dim=-1).indices
    d_log_d = d_log_d.scatter_add(-1, first_max[..., None], dm[..., None])
    col = d_log_d.sum(dim=-2)
    dlogf = d_log_d.sum(dim=-1) - col
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), col.to(igate.dtype),
            dlogf.to(logf.dtype), dweight, dbias)


def _layernorm_backward(grad_out, h, weight, norm_eps, residual_weight, acc):
    """``(dh [B, NH, S, DV], dweight [NH * DV], dbias [NH * DV])`` of the multi-head
    layernorm for ``grad_out [B, S, NH * DV]`` and its input ``h`` (accumulation dtype)."""
    batch, heads, seq, dv_len = h.shape
    dy = grad_out.to(acc).reshape(batch, seq, heads, dv_len).transpose(1, 2)
    mean = h.mean(dim=-1, keepdim=True)
    centred = h - mean
    rstd = torch.rsqrt(centred.square().mean(dim=-1, keepdim=True) + norm_eps)
    y_hat = centred * rstd
    if weight is not None:
        w = weight.to(acc).reshape(heads, 1, dv_len)
        g = dy * ((1 + w) if residual_weight else w)
    else:
        g = dy
    dh = rstd * (g - g.mean(dim=-1, keepdim=True)
                 - y_hat * (g * y_hat).mean(dim=-1, keepdim=True))
    dweight = (dy * y_hat).sum(dim=(0, 2)).reshape(-1)
    dbias = dy.sum(dim=(0, 2)).reshape(-1)
    return dh, dweight, dbias
