"""The chunkwise mLSTM ops: linear in S, with states in and out.

* ``compileops::mlstm_chunkwise(q, k, v, igate, logf, norm_weight?, norm_bias?, c0?, n0?,
  m0?, chunk, normed, norm_eps, eps, residual_weight, save_h, segments?) -> (out, h,
  m_log2, b, c_states, n_states, m_states, c_last, n_last, m_last)``. As ``mlstm_parallel`` (op.py),
  except: ``logf`` is the forget-gate sum restarted every ``chunk`` rows
  (``log_forget_op(fgate, chunk)``); the optional initial state ``c0 [B, NH, DQK, DV]``,
  ``n0 [B, NH, DQK]``, ``m0 [B, NH]`` (accumulation dtype; all three or none); the
  states entering each chunk (kept for the backward, layout of ``kernels.chunkwise``) and
  the last state ``(c_last, n_last, m_last)``, with m in natural-log units. ``segments``
  (packed documents laid out by :mod:`.documents`): int32 ``[2, K + 1]``, row 0 the first
  row of each of K segments and then S, row 1 where each segment's real rows end; every
  segment starts on a chunk boundary, is entered with the empty state and is computed as
  if it were a row of its own (no initial state then).
* ``compileops::mlstm_chunkwise_backward(...)``: the gradients, the initial state's and
  the last state's included.

Gradient: the chunkwise output is the parallel form's function (the same ``logD`` under a
different summation order), so the same identities hold: ``sum_j dlogD_ij = q_i . dq_i``,
``sum_i dlogD_ij = k_j . dk_j``, and the stabiliser's gradient goes to each row's maximal
column (:func:`.kernels.segments.stabiliser_shares`; the initial state is a column before
the first).
Here every scan along the row (the forget sums' chunk offsets, the stabiliser's running
argmax and its shares, the chunk totals carried back) runs per segment, in blocks counted
from the segment's start (:mod:`.kernels.segments`).
The returned ``C = exp(-m) C~`` depends on m, so the last state's gradient adds
``dm_last - <dC_last, C_last> - <dn_last, n_last>`` to the last row's stabiliser gradient.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op, require
from compileops.mlstm import recurrent, reference
from compileops.mlstm.reference import LOG2E
from compileops.mlstm.checks import (
    check_chunk,
    check_backward_grad,
    check_inputs,
    check_kernel_head_dims,
    check_log_gates,
)
from compileops.mlstm.gates import _chunked
from compileops.mlstm.op import _dense, _out_shape



def check_state(q: torch.Tensor, v: torch.Tensor, c0, n0, m0) -> None:
    given = [t is not None for t in (c0, n0, m0)]
    if any(given) and not all(given):
        raise ValueError("initial_state must be a (C, n, m) triple: got a partial state")
    if c0 is None:
        return
    b, nh, _, dqk = q.shape
    dv = v.shape[-1]
    for name, t, shape in (("initial_state C", c0, (b, nh, dqk, dv)),
                           ("initial_state n", n0, (b, nh, dqk)),
                           ("initial_state m", m0, (b, nh))):
        require(tuple(t.shape) == shape,
                lambda: f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        require(t.dtype == reference.gate_dtype(q.dtype),
                lambda: f"{name} must be {reference.gate_dtype(q.dtype)} (the "
                        f"accumulation dtype), got {t.dtype}")
        require(t.device == q.device,
                lambda: f"{name} is on {t.device}, q on {q.device}")


def check_segments(q: torch.Tensor, segments: Optional[torch.Tensor], c0) -> None:
    if segments is None:
        return
    require(segments.dim() == 2 and segments.shape[0] == 2 and segments.shape[1] >= 2,
            lambda: f"segments must be [2, K + 1], got {list(segments.shape)}")
    require(segments.dtype == torch.int32,
            lambda: f"segments must be int32, got {segments.dtype}")
    require(segments.device == q.device,
            lambda: f"segments is on {segments.device}, q on {q.device}")
    require(c0 is None, lambda: "segments take no initial state (each starts empty)")


def global_log_forget(logf: torch.Tensor, chunk: int) -> torch.Tensor:
    """The running forget sums over the whole row, from the chunk-restarted ones."""
    blocks = _chunked(logf, chunk)
    ends = blocks[..., -1]  # a chunk's total (the last chunk's is not used)
    offsets = torch.cumsum(ends, dim=-1) - ends
    full = blocks + offsets[..., None]
    return full.flatten(-2)[..., :logf.shape[-1]]


def _reference_forward(q, k, v, igate, logf, c0, n0, m0, chunk, eps):
    """Plain PyTorch, chunk by chunk (differentiable: the reference backward's autograd).
    Causal under NaN and Inf as :func:`.reference.mlstm_parallel`."""
    acc = reference.gate_dtype(q.dtype)
    b, nh, seq, dqk = q.shape
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(dqk)
    c = c0 if c0 is not None else q.new_zeros((b, nh, dqk, dv), dtype=acc)
    n = n0 if n0 is not None else q.new_zeros((b, nh, dqk), dtype=acc)
    m = m0 if m0 is not None else q.new_full((b, nh), float("-inf"), dtype=acc)
    hs, bs, ms, cs, ns, mstates = [], [], [], [], [], []
    for start in range(0, max(seq, 1), chunk):
        cs.append(c.to(q.dtype))
        ns.append(n)
        mstates.append(m)
        if seq == 0:
            break
        sl = slice(start, min(start + chunk, seq))
        f, ig = logf[..., sl], igate[..., sl]
        qc, kc, vc = q[..., sl, :].to(acc), k[..., sl, :].to(acc), v[..., sl, :].to(acc)
        length = f.shape[-1]
        log_d = f[..., :, None] - f[..., None, :] + ig[..., None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        log_d = log_d.masked_fill(~causal, float("-inf"))
        m_row = torch.maximum(f + m[..., None], log_d.amax(dim=-1))
        # Selected, and the values through masked_product: a non-finite k_j or v_j never
        # reaches an earlier row of its chunk as NaN * 0 (reference.cell_from_log_gates).
        cmat = torch.where(causal, (qc @ kc.transpose(-1, -2)) * scale
                           * torch.exp(log_d - m_row[..., None]), 0.0)
        from_state = torch.exp(f + m[..., None] - m_row)
        num = reference.masked_product(cmat, vc) + from_state[..., None] * (qc @ c) * scale
        row_sum = cmat.sum(-1) + from_state * (qc @ n[..., None]).squeeze(-1) * scale
        nrm = torch.maximum(row_sum.abs(), torch.exp(-m_row))
        hs.append(num / (nrm + eps)[..., None])
        bs.append(row_sum)
        ms.append(m_row)
        f_end = f[..., -1]
        u = f_end[..., None] - f + ig
        m_new = torch.maximum(m + f_end, u.amax(dim=-1))
        w = torch.exp(u - m_new[..., None])
        decay = torch.exp(m + f_end - m_new)
        c = decay[..., None, None] * c + (kc * w[..., None]).transpose(-1, -2) @ vc
        n = decay[..., None] * n + (kc * w[..., None]).sum(dim=-2)
        m = m_new
    if seq == 0:
        h = v.new_zeros(v.shape, dtype=acc)
        row_sum = m_rows = logf.new_zeros(logf.shape)
    else:
        h, row_sum, m_rows = torch.cat(hs, -2), torch.cat(bs, -1), torch.cat(ms, -1)
    ns.append(n)
    mstates.append(m)
    states = (torch.stack(cs, 2).flatten(0, 1), torch.stack(ns, 2).flatten(0, 1),
              torch.stack(mstates, 2).flatten(0, 1))
    return h, row_sum, m_rows, states, (c, n, m)


@custom_op("mlstm_chunkwise")
def mlstm_chunkwise_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    c0: Optional[torch.Tensor], n0: Optional[torch.Tensor], m0: Optional[torch.Tensor],
    chunk: int, normed: bool, norm_eps: float, eps: float, residual_weight: bool,
    save_h: bool, segments: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    check_chunk(chunk)
    check_state(q, v, c0, n0, m0)
    check_segments(q, segments, c0)
    b, nh, seq = q.shape[:3]
    initial = (c0, n0, m0) if c0 is not None else None
    if segments is not None and b * nh * seq and backends.select(
            "mlstm_chunkwise", q.device) != "triton":
        return _reference_forward_segments(q, k, v, igate, logf, norm_weight, norm_bias, chunk,
                                           normed, norm_eps, eps, residual_weight, save_h,
                                           segments)
    # S = 0 (or B * NH = 0) has no rows to compute: the plain path returns the initial (or
    # empty) state as the last one, on every backend, with no kernel launch.
    if b * nh * seq and backends.select("mlstm_chunkwise", q.device) == "triton":
        check_kernel_head_dims(q, v)
        from compileops.mlstm.kernels import chunkwise, forward

        ig, lf = igate.contiguous(), logf.contiguous()
        cst, nst, mst, c_last = chunkwise.chunk_states(k, v, ig, lf, chunk, initial,
                                                       _resets(segments, seq, chunk))
        out, h, m2, row_sum = forward.mlstm_forward(
            q, k, v, ig, lf, _dense(norm_weight), _dense(norm_bias), normed, norm_eps, eps,
            residual_weight, save_h and normed, config=_forward_config(q, v, chunk),
            chunk=chunk, states=(cst, nst, mst))
        h = h if h is not None else v.new_empty((0,))
        return (out, h, m2, row_sum, cst, nst, mst, c_last,
                nst[:, -1].reshape(b, nh, q.shape[-1]).clone(),
                mst[:, -1].reshape(b, nh).clone())
    h, row_sum, m_rows, (cst, nst, mst), (c_last, n_last, m_last) = _reference_forward(
        q, k, v, igate, logf, c0, n0, m0, chunk, eps)
    if normed:
        out = reference.multihead_layernorm(h, norm_weight, norm_bias, norm_eps,
                                            residual_weight, v.dtype)
    else:
        out = h.to(v.dtype)
    kept = h.to(v.dtype) if (save_h and normed) else v.new_empty((0,))
    if seq == 0:  # the last state is the initial one: a copy (an op's output is no alias)
        c_last, n_last, m_last = (t.clone() for t in (c_last, n_last, m_last))
    return (out, kept, (m_rows * LOG2E).contiguous(), row_sum.contiguous(), cst.contiguous(),
            nst.contiguous(), mst.contiguous(), c_last.contiguous(), n_last.contiguous(),
            m_last.contiguous())


def _resets(segments: Optional[torch.Tensor], seq: int, chunk: int) -> Optional[torch.Tensor]:
    if segments is None:
        return None
    from compileops.mlstm import documents
    from compileops.mlstm.kernels.chunkwise import num_chunks

    return documents.chunk_resets(segments[0], num_chunks(seq, chunk), chunk)


def _segment_bounds(segments: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first row, end of the real rows, end)`` of each segment, read on the host."""
    starts, real_ends = segments.tolist()
    return [(a, e, b) for a, e, b in zip(starts[:-1], real_ends[:-1], starts[1:])]


def _reference_forward_segments(q, k, v, igate, logf, norm_weight, norm_bias, chunk, normed,
                                norm_eps, eps, residual_weight, save_h, segments):
    """The reference backend with segments: each segment's real rows run alone (the
    reference forward, chunk by chunk, from the empty state), exactly as that document would
    alone; pad rows read zeros. The states entering each chunk are placed at the segment's
    chunks; the last state is the empty one."""
    b, nh, seq, dqk = q.shape
    dv = v.shape[-1]
    acc = reference.gate_dtype(q.dtype)
    nc = (seq + chunk - 1) // chunk
    out = v.new_zeros(_out_shape(q, v, normed))
    kept = v.new_zeros(v.shape) if (save_h and normed) else v.new_empty((0,))
    m2 = logf.new_zeros(logf.shape)
    row_sum = logf.new_zeros(logf.shape)
    empty = recurrent.empty_state(b, nh, dqk, dv, q.dtype, q.device)
    cst = empty[0].to(q.dtype)[:, :, None].expand(b, nh, nc, dqk, dv).flatten(0, 1).clone()
    nst = empty[1][:, :, None].expand(b, nh, nc + 1, dqk).flatten(0, 1).clone()
    mst = empty[2][:, :, None].expand(b, nh, nc + 1).flatten(0, 1).clone()
    for start, real_end, _ in _segment_bounds(segments):
        if real_end == start:
            continue
        rows = slice(start, real_end)
        first = start // chunk
        parts = mlstm_chunkwise_op(
            q[:, :, rows], k[:, :, rows], v[:, :, rows], igate[..., rows], logf[..., rows],
            norm_weight, norm_bias, None, None, None, chunk, normed, norm_eps, eps,
            residual_weight, save_h)
        o, h, m, r, c_s, n_s, m_s = parts[:7]
        if normed:
            out[:, rows] = o
        else:
            out[:, :, rows] = o
        if kept.numel():
            kept[:, :, rows] = h
        m2[..., rows] = m
        row_sum[..., rows] = r
        count = c_s.shape[1]
        cst[:, first:first + count] = c_s
        nst[:, first:first + count] = n_s[:, :count]
        mst[:, first:first + count] = m_s[:, :count]
    c_last, n_last, m_last = (t.clone() for t in empty)
    return out, kept, m2, row_sum, cst, nst, mst, c_last, n_last, m_last


def _forward_config(q, v, chunk):
    from compileops.mlstm.kernels import config

    return config.choose_forward_config(q, q.shape[-1], v.shape[-1], with_state=True,
                                        max_block_m=chunk)


def _backward_config(q, v, chunk):
    from compileops.mlstm.kernels import config

    return config.choose_backward_config(q, q.shape[-1], v.shape[-1],
                                         with_state=True).capped(chunk)


@mlstm_chunkwise_op.register_fake
def _mlstm_chunkwise_fake(q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, chunk,
                          normed, norm_eps, eps, residual_weight, save_h, segments=None):
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    check_chunk(chunk)
    check_state(q, v, c0, n0, m0)
    check_segments(q, segments, c0)
    acc = reference.gate_dtype(q.dtype)
    b, nh, seq, dqk = q.shape
    dv = v.shape[-1]
    nc = (seq + chunk - 1) // chunk
    nc = torch.sym_max(nc, 1)
    out = v.new_empty(_out_shape(q, v, normed))
    h = v.new_empty(v.shape) if (save_h and normed) else v.new_empty((0,))
    rows = q.new_empty(q.shape[:3], dtype=acc)
    return (out, h, rows, torch.empty_like(rows), q.new_empty((b * nh, nc, dqk, dv)),
            q.new_empty((b * nh, nc + 1, dqk), dtype=acc),
            q.new_empty((b * nh, nc + 1), dtype=acc),
            q.new_empty((b, nh, dqk, dv), dtype=acc), q.new_empty((b, nh, dqk), dtype=acc),
            q.new_empty((b, nh), dtype=acc))


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, chunk, normed, norm_eps, eps,
     residual, _, segments) = inputs
    out, h, m2, row_sum, cst, nst, mst, c_last, n_last, _m_last = output
    ctx.mark_non_differentiable(h, m2, row_sum, cst, nst, mst)
    kept_h = h if normed else out
    ctx.save_for_backward(q, k, v, igate, logf, norm_weight, c0, n0, m0, kept_h, m2, row_sum,
                          cst, nst, mst, c_last, n_last, segments)
    ctx.chunk = chunk
    ctx.normed = normed
    ctx.norm_eps = norm_eps
    ctx.eps = eps
    ctx.residual_weight = residual
    ctx.bias_dtype = norm_bias.dtype if norm_bias is not None else None


def _backward(ctx, grad_out, _gh, _gm, _gb, _gc, _gn, _gms, grad_c, grad_n, grad_m):
    (q, k, v, igate, logf, norm_weight, c0, n0, m0, h, m2, row_sum, cst, nst, mst, c_last,
     n_last, segments) = ctx.saved_tensors
    if ctx.normed and h.numel() == 0 and q.numel():
        raise RuntimeError("mlstm_chunkwise was called with save_h=False but a gradient is "
                           "needed: call compileops.mlstm, which keeps h when it must")
    if grad_out is None:
        grad_out = torch.zeros(_out_shape(q, v, ctx.normed), dtype=v.dtype, device=v.device)
    acc = logf.dtype
    b, nh, _, dqk = q.shape
    dv_len = v.shape[-1]
    grad_c = grad_c if grad_c is not None else q.new_zeros((b, nh, dqk, dv_len), dtype=acc)
    grad_n = grad_n if grad_n is not None else q.new_zeros((b, nh, dqk), dtype=acc)
    grad_m = grad_m if grad_m is not None else q.new_zeros((b, nh), dtype=acc)
    grads = mlstm_chunkwise_backward_op(
        grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, norm_weight, c0, n0, m0, h,
        m2, row_sum, cst, nst, mst, c_last, n_last, ctx.chunk, ctx.normed, ctx.norm_eps,
        ctx.eps, ctx.residual_weight, segments)
    dq, dk, dv, digate, dlogf, dweight, dbias, dc0, dn0, dm0 = grads
    dweight = dweight.to(norm_weight.dtype) if norm_weight is not None else None
    dbias = dbias.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    has_state = c0 is not None
    return (dq, dk, dv, digate, dlogf, dweight, dbias, dc0 if has_state else None,
            dn0 if has_state else None, dm0 if has_state else None,
            None, None, None, None, None, None, None)


backends.register_autograd(mlstm_chunkwise_op, _backward, _setup_context)


@custom_op("mlstm_chunkwise_backward")
def mlstm_chunkwise_backward_op(
    grad_out: torch.Tensor, grad_c: torch.Tensor, grad_n: torch.Tensor, grad_m: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, norm_weight: Optional[torch.Tensor], c0: Optional[torch.Tensor],
    n0: Optional[torch.Tensor], m0: Optional[torch.Tensor], h: torch.Tensor,
    m2: torch.Tensor, row_sum: torch.Tensor, cst: torch.Tensor, nst: torch.Tensor,
    mst: torch.Tensor, c_last: torch.Tensor, n_last: torch.Tensor, chunk: int, normed: bool,
    norm_eps: float, eps: float, residual_weight: bool, segments: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, digate, dlogf, dweight, dbias, dc0, dn0, dm0)`` for the output's and
    the last state's gradients (``grad_c [B, NH, DQK, DV]``, ``grad_n [B, NH, DQK]``,
    ``grad_m [B, NH]``); ``dlogf`` is for the chunk-restarted ``logf``."""
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    acc = reference.gate_dtype(q.dtype)
    b, nh, seq, dqk = q.shape
    reference_backend = backends.select("mlstm_chunkwise_backward", q.device) != "triton"
    if segments is not None and b * nh * seq and reference_backend:
        return _reference_backward_segments(grad_out, q, k, v, igate, logf, norm_weight, chunk,
                                            normed, norm_eps, eps, residual_weight, acc,
                                            segments)
    if not b * nh * seq or reference_backend:
        return _reference_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf,
                                   norm_weight, c0, n0, m0, chunk, normed, norm_eps, eps,
                                   residual_weight, acc)
    check_kernel_head_dims(q, v)
    from compileops.mlstm import kernels
    from compileops.mlstm.kernels import chunkwise
    from compileops.mlstm.kernels import segments as segment_scans

    cfg = _backward_config(q, v, chunk)
    # The initial n's gradient takes beta from the unrounded dh (norm_backward_rows in
    # kernels/norm_backward.py says why); where dh is not rounded (fp32, or no norm) the two
    # betas are one.
    beta_exact = (torch.empty_like(m2) if c0 is not None and normed and
                  q.dtype not in (torch.float32, torch.float64) else None)
    dh, r, beta, dm, parts_w, parts_b = kernels.norm_backward(
        grad_out, h, _dense(norm_weight), m2.contiguous(), row_sum.contiguous(), normed,
        norm_eps, eps, residual_weight, cfg, beta_exact=beta_exact)
    # The last state is one more reader of the row S-1: C~ = sum_j exp(F_{S-1} - F_j +
    # igate_j) k_j v_j^T puts <dC, C> + <dn, n> on F_{S-1}, its columns come through k . dk;
    # and the returned C = exp(-m) C~ depends on m, the last row's stabiliser.
    read_last = (grad_c * c_last).sum(dim=(-2, -1)) + (grad_n * n_last).sum(dim=-1)
    dm_last = grad_m - read_last
    if seq:
        dm = torch.cat([dm[..., :-1], dm[..., -1:] + dm_last[..., None]], dim=-1).contiguous()
    ig, lf = igate.contiguous(), logf.contiguous()
    starts = segments[0] if segments is not None else None
    dcs, dns, dc0, dn0_exact = chunkwise.chunk_state_grads(
        q, dh, lf, m2, r, beta, mst, chunk, (grad_c, grad_n), _resets(segments, seq, chunk),
        beta_exact=beta_exact)
    from compileops.mlstm.op import fast_gate_gradients

    dq, dk, dv, row_grad, col_grad, state_col = kernels.cell_backward(
        q, k, v, dh, ig, lf, m2, r, beta, cfg, chunk=chunk, states=(cst, nst, mst),
        state_grads=(dcs, dns), paired=not fast_gate_gradients())
    # The stabiliser's gradient: m_i = F_i + max_{j<=i} (igate_j - F_j), F the segment's
    # whole forget sums (the restarted ones plus the chunk offsets), the initial state a
    # column before the first with key m0.
    offsets = segment_scans.chunk_scan(lf, chunk, starts, reverse=False, last_only=True)
    keys = ig - (lf + _per_row(offsets, chunk, seq))
    has_state = c0 is not None
    shares, initial_share = segment_scans.stabiliser_shares(keys, dm, starts,
                                                            m0 if has_state else None)
    col_grad = col_grad + shares
    if has_state:
        dn0 = dns[:, 0].reshape(b, nh, dqk)
        # m0 scales C0 and n0 alike: its gradient pairs dC0 with the dn0 walked with the
        # same (rounded) dh, whose rounding parts cancel there.
        dm0 = (dc0 * c0).sum(dim=(-2, -1)) + (dn0 * n0).sum(dim=-1) + initial_share
        if dn0_exact is not None:
            dn0 = dn0_exact
    else:
        dn0 = q.new_zeros((b, nh, dqk), dtype=acc)
        dm0 = q.new_zeros((b, nh), dtype=acc)
    row_grad = row_grad + dm
    if state_col is not None:
        # Paired sums (16-bit; kernels.cell_backward): what crosses each chunk's end is taken
        # as it is, from the state entering the chunk and the chunk's own keys (the last
        # chunk's: the last state's readers, read_last above), not as the later chunks' row
        # sums less their column sums, whose rounding would add up along the whole row. The
        # stabiliser's pairs (dm at a row, its share at the row's maximal column) still
        # cross by their scan: both ends are the same fp32 values.
        crossing = chunkwise.chunk_boundaries((cst, nst, mst), (dcs, dns), lf, state_col, chunk,
                                              _resets(segments, seq, chunk))
        crossing = crossing + segment_scans.chunk_scan(dm - shares, chunk, starts,
                                                       reverse=True, last_only=False)
        dlogf = _with_boundaries(row_grad - col_grad, crossing, chunk)
    else:
        if seq:
            row_grad = torch.cat([row_grad[..., :-1],
                                  row_grad[..., -1:] + read_last[..., None]], -1)
        d_global = row_grad - col_grad
        later = segment_scans.chunk_scan(d_global, chunk, starts, reverse=True, last_only=False)
        dlogf = _with_later_chunks(d_global, later, chunk)
    if normed:
        dweight = parts_w.sum(dim=(0, 1)).reshape(-1)
        dbias = parts_b.sum(dim=(0, 1)).reshape(-1)
    else:
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    return dq, dk, dv, col_grad, dlogf, dweight, dbias, dc0, dn0, dm0


def _local_log_forget_grad(d_global: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`_with_later_chunks` for one segment, the later chunks' sums in plain torch (the
    reference backend)."""
    if d_global.shape[-1] == 0:
        return d_global
    totals = _chunked(d_global, chunk).sum(dim=-1)
    later = torch.flip(torch.cumsum(torch.flip(totals, (-1,)), -1), (-1,)) - totals
    return _with_later_chunks(d_global, later, chunk)


def _per_row(per_chunk: torch.Tensor, chunk: int, seq: int) -> torch.Tensor:
    """``[..., NC]`` -> ``[..., S]``: each row gets its chunk's value."""
    return per_chunk.repeat_interleave(chunk, dim=-1)[..., :seq]


def _with_later_chunks(d_global: torch.Tensor, later: torch.Tensor, chunk: int) -> torch.Tensor:
    """The gradient of the chunk-restarted forget sums from that of the segment's whole
    ones ``d_global [..., S]``: a chunk's last sum also carries into every later row of its
    segment, whose gradients ``later [..., NC]`` sums (:func:`.kernels.segments.chunk_scan`).
    A partial last chunk has no later rows: its padded last slot is dropped."""
    seq = d_global.shape[-1]
    if seq == 0:
        return d_global
    blocks = _chunked(d_global, chunk)
    last = torch.zeros_like(blocks)
    last[..., -1] = later
    return (blocks + last).flatten(-2)[..., :seq].contiguous()


def _with_boundaries(d_local: torch.Tensor, crossing: torch.Tensor, chunk: int) -> torch.Tensor:
    """The gradient of the chunk-restarted forget sums from each row's ``d_local [..., S]``
    (its row sum less its column sum of ``dlogD``) and each chunk's ``crossing [..., NC]``
    (the pairs across its end): ``crossing`` joins each chunk's last row (the row's last
    chunk: row S - 1, also when partial), and the reverse sums within each chunk
    (``log_forget_backward``) do the rest."""
    seq = d_local.shape[-1]
    if seq == 0:
        return d_local
    blocks = _chunked(d_local, chunk)
    ends = torch.zeros_like(blocks)
    ends[..., :-1, -1] = crossing[..., :-1]
    ends[..., -1, (seq - 1) % chunk] = crossing[..., -1]
    return (blocks + ends).flatten(-2)[..., :seq].contiguous()


@mlstm_chunkwise_backward_op.register_fake
def _mlstm_chunkwise_backward_fake(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf,
                                   norm_weight, c0, n0, m0, h, m2, row_sum, cst, nst, mst,
                                   c_last, n_last, chunk, normed, norm_eps, eps,
                                   residual_weight, segments=None):
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    acc = reference.gate_dtype(q.dtype)
    b, nh, _, dqk = q.shape
    dv = v.shape[-1]
    channels = nh * dv if normed else 0
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            igate.new_empty(igate.shape), logf.new_empty(logf.shape),
            q.new_empty((channels,), dtype=acc), q.new_empty((channels,), dtype=acc),
            q.new_empty((b, nh, dqk, dv), dtype=acc), q.new_empty((b, nh, dqk), dtype=acc),
            q.new_empty((b, nh), dtype=acc))


def _reference_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, norm_weight,
                        c0, n0, m0, chunk, normed, norm_eps, eps, residual_weight, acc):
    """Without states the chunkwise output is the parallel form's function of the whole-row
    forget sums: the parallel reference backward (op.py), then the chunk-restarted sums'
    gradient. With an initial state, or a gradient for the last state, (and at S = 0):
    autograd through the chunk-by-chunk forward (:func:`_state_backward`)."""
    from compileops.mlstm.op import _reference_backward as parallel_backward

    with_states = c0 is not None or bool(
        (grad_c != 0).any() | (grad_n != 0).any() | (grad_m != 0).any())
    if with_states or q.shape[:3].numel() == 0:
        return _state_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf,
                               norm_weight, c0, n0, m0, chunk, normed, norm_eps, eps,
                               residual_weight, acc)
    dq, dk, dv, dig, dlf, dweight, dbias = parallel_backward(
        grad_out, q, k, v, igate, global_log_forget(logf, chunk), norm_weight, normed,
        norm_eps, eps, residual_weight, acc)
    b, nh, _, dqk = q.shape
    dv_len = v.shape[-1]
    return (dq, dk, dv, dig, _local_log_forget_grad(dlf, chunk), dweight, dbias,
            q.new_zeros((b, nh, dqk, dv_len), dtype=acc), q.new_zeros((b, nh, dqk), dtype=acc),
            q.new_zeros((b, nh), dtype=acc))


def _reference_backward_segments(grad_out, q, k, v, igate, logf, norm_weight, chunk, normed,
                                 norm_eps, eps, residual_weight, acc, segments):
    """The reference backend's backward with segments: each segment's real rows alone (as
    :func:`_reference_forward_segments`), pad rows a zero gradient; the norm's affine
    gradients summed over the segments in order."""
    b, nh, _, dqk = q.shape
    dv_len = v.shape[-1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dig, dlf = torch.zeros_like(igate), torch.zeros_like(logf)
    channels = nh * dv_len if normed else 0
    dweight = q.new_zeros((channels,), dtype=acc)
    dbias = q.new_zeros((channels,), dtype=acc)
    for start, real_end, _ in _segment_bounds(segments):
        if real_end == start:
            continue
        rows = slice(start, real_end)
        g = grad_out[:, rows] if normed else grad_out[:, :, rows]
        parts = _reference_backward(
            g, q.new_zeros((b, nh, dqk, dv_len), dtype=acc),
            q.new_zeros((b, nh, dqk), dtype=acc), q.new_zeros((b, nh), dtype=acc),
            q[:, :, rows], k[:, :, rows], v[:, :, rows], igate[..., rows], logf[..., rows],
            norm_weight, None, None, None, chunk, normed, norm_eps, eps, residual_weight, acc)
        dq[:, :, rows], dk[:, :, rows], dv[:, :, rows] = parts[:3]
        dig[..., rows], dlf[..., rows] = parts[3], parts[4]
        if normed:
            dweight = dweight + parts[5]
            dbias = dbias + parts[6]
    zeros = (q.new_zeros((b, nh, dqk, dv_len), dtype=acc), q.new_zeros((b, nh, dqk), dtype=acc),
             q.new_zeros((b, nh), dtype=acc))
    return (dq, dk, dv, dig, dlf, dweight, dbias, *zeros)


def _state_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, norm_weight,
                    c0, n0, m0, chunk, normed, norm_eps, eps, residual_weight, acc):
    """The reference backend's gradient through the states: the vector-Jacobian product
    (``torch.func.vjp``; plain autograd does not record inside an op's implementation) of
    :func:`_reference_forward`, the plain recursion chunk by chunk, and the norm, for the
    output's gradient and the last state's ``(grad_c, grad_n, grad_m)``. The norm's bias
    enters as zeros: its gradient does not depend on its value, nor does any other."""
    b, nh, _, dqk = q.shape
    dv_len = v.shape[-1]
    has_state = c0 is not None
    weight = norm_weight if norm_weight is not None else torch.ones(
        (nh * dv_len,), dtype=acc, device=q.device)
    bias = torch.zeros((nh * dv_len,), dtype=acc, device=q.device)
    state = (c0, n0, m0) if has_state else recurrent.empty_state(b, nh, dqk, dv_len, q.dtype,
                                                                  q.device)

    def forward(q, k, v, igate, logf, weight, bias, c0, n0, m0):
        h, _, _, _, last = _reference_forward(q, k, v, igate, logf, c0, n0, m0, chunk, eps)
        if normed:
            out = reference.multihead_layernorm(
                h, weight if norm_weight is not None else None, bias, norm_eps,
                residual_weight, v.dtype)
        else:
            out = h.to(v.dtype)
        return (out, *last)

    outputs, vjp = torch.func.vjp(forward, q, k, v, igate, logf, weight, bias, *state)
    cotangents = tuple(g.to(t.dtype) for t, g in zip(outputs, (grad_out, grad_c, grad_n,
                                                                 grad_m)))
    dq, dk, dv, dig, dlf, dweight, dbias, dc0, dn0, dm0 = vjp(cotangents)
    if normed:
        dweight, dbias = dweight.to(acc), dbias.to(acc)
    else:
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    if not has_state:  # the empty state is a constant: no gradient to return
        dc0, dn0, dm0 = (torch.zeros_like(t) for t in state)
    # A gradient that passes through unchanged (the last state of S = 0 is the initial
    # one) would alias the cotangent: an op's outputs must not alias its inputs.
    return tuple(g.clone() if any(g is x for x in (grad_out, grad_c, grad_n, grad_m))
                 else g for g in (dq, dk, dv, dig, dlf, dweight, dbias, dc0, dn0, dm0))

