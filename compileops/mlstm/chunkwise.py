"""The chunkwise mLSTM ops: linear in S, with states in and out, and packed documents.

* ``compileops::mlstm_chunkwise(q, k, v, igate, logf, norm_weight?, norm_bias?, c0?, n0?,
  m0?, cu_seqlens?, chunk, normed, norm_eps, eps, residual_weight, save_h) -> (out, h,
  m_log2, b, c_states, n_states, m_states, c_last, n_last, m_last)``. As ``mlstm_parallel``
  (op.py), except: ``logf`` is the forget-gate sum restarted every ``chunk`` rows of each
  document (``log_forget_op(fgate, chunk, cu_seqlens)``); the optional initial state ``c0
  [B, NH, DQK, DV]``, ``n0 [B, NH, DQK]``, ``m0 [B, NH]`` (accumulation dtype; all three or
  none); the states entering each chunk (kept for the backward, layout of
  ``kernels.chunkwise``) and the last state ``(c_last, n_last, m_last)``, with m in
  natural-log units.
* ``compileops::mlstm_chunkwise_backward(...)``: the gradients, the initial state's and
  the last state's included.

Packed documents: ``cu_seqlens [N + 1]`` (int32 or int64, on q's device, B = 1; no initial
state) holds the cumulative ends of N documents packed in the row. Each document is cut
into its own chunks from its own start (``compileops.mlstm.documents``), and every kernel
reads its document's rows only: a document's outputs and gradients are bitwise those of the
document run alone, whatever the other documents hold. The last state is then the last
document's, and carries no gradient. ``cu_seqlens`` is checked for its shape, dtype and
device eagerly and while tracing; its values (from 0, non-decreasing, up to S) by
:func:`checks.check_cu_seqlens_eagerly`: on the host for CPU tensors (eagerly and in
compiled code), on CUDA with ``compileops.strict_offset_checks()`` only (one host sync).
Unchecked, invalid values never take a kernel out of bounds: the Triton forward writes NaN.

Gradient: the chunkwise output is the parallel form's function (the same ``logD`` under a
different summation order), so the same identities hold: ``sum_j dlogD_ij = q_i . dq_i``,
``sum_i dlogD_ij = k_j . dk_j``, and the stabiliser's gradient goes to each row's maximal
column (``kernels.chunk_gates``; the initial state is a column before the first).
The returned ``C = exp(-m) C~`` depends on m, so the last state's gradient adds
``dm_last - <dC_last, C_last> - <dn_last, n_last>`` to the last row's stabiliser gradient.
The reference backend's backward is autograd through its plain-PyTorch forward, states
included.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.mlstm import documents, reference
from compileops.mlstm.reference import LOG2E
from compileops.mlstm.checks import (
    check_backward_grad,
    check_cu_seqlens,
    check_cu_seqlens_eagerly,
    check_inputs,
    check_kernel_head_dims,
    check_log_gates,
)
from compileops.mlstm.gates import _chunked
from compileops.mlstm.op import _dense, _out_shape


def check_chunk(chunk: int) -> None:
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk}")


def check_state(q: torch.Tensor, v: torch.Tensor, c0, n0, m0, cu_seqlens=None) -> None:
    given = [t is not None for t in (c0, n0, m0)]
    if any(given) and not all(given):
        raise ValueError("initial_state must be a (C, n, m) triple: got a partial state")
    if c0 is None:
        return
    torch._check(cu_seqlens is None, lambda: "cu_seqlens takes no initial_state (each "
                 "document starts empty)")
    b, nh, _, dqk = q.shape
    dv = v.shape[-1]
    for name, t, shape in (("initial_state C", c0, (b, nh, dqk, dv)),
                           ("initial_state n", n0, (b, nh, dqk)),
                           ("initial_state m", m0, (b, nh))):
        torch._check(tuple(t.shape) == shape,
                     lambda: f"{name} must have shape {list(shape)}, got {list(t.shape)}")
        torch._check(t.dtype == reference.gate_dtype(q.dtype),
                     lambda: f"{name} must be {reference.gate_dtype(q.dtype)} (the "
                             f"accumulation dtype), got {t.dtype}")
        torch._check(t.device == q.device,
                     lambda: f"{name} is on {t.device}, q on {q.device}")


def _reference_forward(q, k, v, igate, logf, c0, n0, m0, chunk, eps):
    """Plain PyTorch, chunk by chunk, one document (differentiable: the tests hold the
    kernels and the reference backward to its autograd)."""
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
        cmat = (qc @ kc.transpose(-1, -2)) * scale * torch.exp(log_d - m_row[..., None])
        from_state = torch.exp(f + m[..., None] - m_row)
        num = cmat @ vc + from_state[..., None] * (qc @ c) * scale
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
    states = (torch.stack(cs, 2).reshape(b * nh, len(cs), dqk, dv),
              torch.stack(ns, 2).reshape(b * nh, len(ns), dqk),
              torch.stack(mstates, 2).reshape(b * nh, len(mstates)))
    return h, row_sum, m_rows, states, (c, n, m)


def _reference_documents(q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0,
                         cu_seqlens, chunk, normed, norm_eps, eps, residual_weight):
    """The reference forward, document by document (each on its own contiguous copy, so a
    document's results are those of the document alone): ``(out, h, m_rows, row_sum,
    (c_states, n_states, m_states), (c_last, n_last, m_last))`` in the layouts of the op,
    ``out`` in v's dtype, the rest in the accumulation dtype. Reads ``cu_seqlens`` on the
    host."""
    batch, heads, seq, dqk = q.shape
    dv = v.shape[-1]
    bounds = documents.host_bounds(cu_seqlens, seq)
    first = documents.host_slot_first(bounds, chunk)
    slots = documents.chunk_slots(seq, chunk, len(bounds) - 1)
    acc = reference.gate_dtype(q.dtype)
    cst = q.new_zeros((batch * heads, slots, dqk, dv))
    nst = q.new_zeros((batch * heads, slots + len(bounds) - 1, dqk), dtype=acc)
    mst = q.new_zeros((batch * heads, slots + len(bounds) - 1), dtype=acc)
    outs, hs, ms, bs = [], [], [], []
    for d, (start, end) in enumerate(zip(bounds, bounds[1:])):
        def rows(t):
            return t[:, :, start:end].contiguous()
        h, row_sum, m_rows, (cs, ns, mstates), last = _reference_forward(
            rows(q), rows(k), rows(v), rows(igate), rows(logf), c0, n0, m0, chunk, eps)
        if normed:
            outs.append(reference.multihead_layernorm(h, norm_weight, norm_bias, norm_eps,
                                                      residual_weight, v.dtype))
        else:
            outs.append(h.to(v.dtype))
        hs.append(h)
        ms.append(m_rows)
        bs.append(row_sum)
        cst[:, first[d]:first[d + 1]] = cs
        nst[:, first[d] + d:first[d + 1] + d + 1] = ns
        mst[:, first[d] + d:first[d + 1] + d + 1] = mstates
    # A state given in and returned unchanged (S = 0) must not alias the input.
    last = tuple(t.clone() if t is g else t for t, g in zip(last, (c0, n0, m0)))
    return (torch.cat(outs, 1 if normed else 2), torch.cat(hs, 2), torch.cat(ms, 2),
            torch.cat(bs, 2), (cst, nst, mst), last)


@custom_op("mlstm_chunkwise")
def mlstm_chunkwise_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    logf: torch.Tensor, norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
    c0: Optional[torch.Tensor], n0: Optional[torch.Tensor], m0: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], chunk: int, normed: bool, norm_eps: float, eps: float,
    residual_weight: bool, save_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    _check_forward(q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, cu_seqlens,
                   chunk, norm_eps, eps)
    check_cu_seqlens_eagerly(cu_seqlens, q.shape[2])
    b, nh, seq, dqk = q.shape
    initial = (c0, n0, m0) if c0 is not None else None
    if backends.select("mlstm_chunkwise", q.device) == "triton":
        check_kernel_head_dims(q, v)
        from compileops.mlstm.kernels import chunk_tiles, chunkwise
        from compileops.mlstm.kernels.documents import document_tables

        tables = document_tables(cu_seqlens, seq, chunk, q.device)
        ig, lf = igate.contiguous(), logf.contiguous()
        cst, nst, mst, c_last = chunkwise.chunk_states(k, v, ig, lf, chunk, tables, initial)
        out, h, m2, row_sum = chunk_tiles.chunk_forward(
            q, k, v, ig, lf, _dense(norm_weight), _dense(norm_bias), normed, norm_eps, eps,
            residual_weight, save_h and normed, chunk, (cst, nst, mst), tables,
            config=_forward_config(q, v, chunk))
        h = h if h is not None else v.new_empty((0,))
        # The last document's last state: its n/m slot follows its chunks' (slot_first[N]
        # counts every document's chunks, plus one slot each before it).
        last_slot = tables.slot_first[-1:].long() + (tables.docs - 1)
        n_last = nst.index_select(1, last_slot).reshape(b, nh, dqk)
        m_last = mst.index_select(1, last_slot).reshape(b, nh)
        c_last = c_last.reshape(b, nh, tables.docs, dqk, v.shape[-1])[:, :, -1].contiguous()
        return out, h, m2, row_sum, cst, nst, mst, c_last, n_last, m_last
    out, h, m_rows, row_sum, (cst, nst, mst), (c_last, n_last, m_last) = _reference_documents(
        q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, cu_seqlens, chunk, normed,
        norm_eps, eps, residual_weight)
    kept = h.to(v.dtype) if (save_h and normed) else v.new_empty((0,))
    return (out, kept, (m_rows * LOG2E).contiguous(), row_sum.contiguous(), cst.contiguous(),
            nst.contiguous(), mst.contiguous(), c_last.contiguous(), n_last.contiguous(),
            m_last.contiguous())


def _check_forward(q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, cu_seqlens,
                   chunk, norm_eps, eps) -> None:
    check_inputs(q, k, v, igate, logf, norm_weight, norm_bias, norm_eps, eps)
    check_log_gates(q, igate, logf)
    check_chunk(chunk)
    check_state(q, v, c0, n0, m0, cu_seqlens)
    check_cu_seqlens(cu_seqlens, q)


def _forward_config(q, v, chunk):
    from compileops.mlstm.kernels import config

    return config.choose_forward_config(q, q.shape[-1], v.shape[-1], with_state=True,
                                        max_block_m=chunk)


def _backward_config(q, v, chunk):
    from compileops.mlstm.kernels import config

    return config.choose_backward_config(q, q.shape[-1], v.shape[-1]).capped(chunk)


def _documents(cu_seqlens: Optional[torch.Tensor]):
    return 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1


@mlstm_chunkwise_op.register_fake
def _mlstm_chunkwise_fake(q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0,
                          cu_seqlens, chunk, normed, norm_eps, eps, residual_weight, save_h):
    _check_forward(q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, cu_seqlens,
                   chunk, norm_eps, eps)
    acc = reference.gate_dtype(q.dtype)
    b, nh, seq, dqk = q.shape
    dv = v.shape[-1]
    docs = _documents(cu_seqlens)
    slots = documents.chunk_slots(seq, chunk, docs)
    out = v.new_empty(_out_shape(q, v, normed))
    h = v.new_empty(v.shape) if (save_h and normed) else v.new_empty((0,))
    rows = q.new_empty(q.shape[:3], dtype=acc)
    return (out, h, rows, torch.empty_like(rows), q.new_empty((b * nh, slots, dqk, dv)),
            q.new_empty((b * nh, slots + docs, dqk), dtype=acc),
            q.new_empty((b * nh, slots + docs), dtype=acc),
            q.new_empty((b, nh, dqk, dv), dtype=acc), q.new_empty((b, nh, dqk), dtype=acc),
            q.new_empty((b, nh), dtype=acc))


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, igate, logf, norm_weight, norm_bias, c0, n0, m0, cu_seqlens, chunk, normed,
     norm_eps, eps, residual, _) = inputs
    out, h, m2, row_sum, cst, nst, mst, c_last, n_last, m_last = output
    ctx.mark_non_differentiable(h, m2, row_sum, cst, nst, mst)
    if cu_seqlens is not None:  # the last document's state: no gradient
        ctx.mark_non_differentiable(c_last, n_last, m_last)
    # An output the loss does not use gets no gradient (None, not zeros): the backward then
    # skips the last state's terms (which, as zeros, would still turn an Inf into NaN).
    ctx.set_materialize_grads(False)
    kept_h = h if normed else out
    ctx.save_for_backward(q, k, v, igate, logf, norm_weight, c0, n0, m0, cu_seqlens, kept_h,
                          m2, row_sum, cst, nst, mst, c_last, n_last)
    ctx.chunk = chunk
    ctx.normed = normed
    ctx.norm_eps = norm_eps
    ctx.eps = eps
    ctx.residual_weight = residual
    ctx.bias_dtype = norm_bias.dtype if norm_bias is not None else None


def _backward(ctx, grad_out, _gh, _gm, _gb, _gc, _gn, _gms, grad_c, grad_n, grad_m):
    (q, k, v, igate, logf, norm_weight, c0, n0, m0, cu_seqlens, h, m2, row_sum, cst, nst,
     mst, c_last, n_last) = ctx.saved_tensors
    if ctx.normed and h.numel() == 0 and q.numel():
        raise RuntimeError("mlstm_chunkwise was called with save_h=False but a gradient is "
                           "needed: call compileops.mlstm, which keeps h when it must")
    if grad_out is None:
        grad_out = torch.zeros(_out_shape(q, v, ctx.normed), dtype=v.dtype, device=v.device)
    acc = logf.dtype
    b, nh, _, dqk = q.shape
    dv_len = v.shape[-1]
    if cu_seqlens is not None or (grad_c is None and grad_n is None and grad_m is None):
        grad_c = grad_n = grad_m = None
    else:
        grad_c = grad_c if grad_c is not None else q.new_zeros((b, nh, dqk, dv_len), dtype=acc)
        grad_n = grad_n if grad_n is not None else q.new_zeros((b, nh, dqk), dtype=acc)
        grad_m = grad_m if grad_m is not None else q.new_zeros((b, nh), dtype=acc)
    grads = mlstm_chunkwise_backward_op(
        grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, norm_weight, c0, n0, m0,
        cu_seqlens, h, m2, row_sum, cst, nst, mst, c_last, n_last, ctx.chunk, ctx.normed,
        ctx.norm_eps, ctx.eps, ctx.residual_weight)
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
    grad_out: torch.Tensor, grad_c: Optional[torch.Tensor], grad_n: Optional[torch.Tensor],
    grad_m: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    igate: torch.Tensor, logf: torch.Tensor, norm_weight: Optional[torch.Tensor],
    c0: Optional[torch.Tensor], n0: Optional[torch.Tensor], m0: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], h: torch.Tensor, m2: torch.Tensor,
    row_sum: torch.Tensor, cst: torch.Tensor, nst: torch.Tensor, mst: torch.Tensor,
    c_last: torch.Tensor, n_last: torch.Tensor, chunk: int, normed: bool, norm_eps: float,
    eps: float, residual_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, digate, dlogf, dweight, dbias, dc0, dn0, dm0)`` for the output's and
    the last state's gradients (``grad_c [B, NH, DQK, DV]``, ``grad_n [B, NH, DQK]``,
    ``grad_m [B, NH]``: all three or none; none with ``cu_seqlens``); ``dlogf`` is for the
    chunk-restarted ``logf``."""
    _check_backward(grad_out, grad_c, grad_n, grad_m, q, v, cu_seqlens, normed)
    acc = reference.gate_dtype(q.dtype)
    if backends.select("mlstm_chunkwise_backward", q.device) != "triton":
        return _reference_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf,
                                   norm_weight, c0, n0, m0, cu_seqlens, chunk, normed,
                                   norm_eps, eps, residual_weight, acc)
    check_kernel_head_dims(q, v)
    from compileops.mlstm import kernels
    from compileops.mlstm.kernels import chunk_gates, chunk_tiles, chunkwise
    from compileops.mlstm.kernels.documents import document_tables

    b, nh, seq, dqk = q.shape
    tables = document_tables(cu_seqlens, seq, chunk, q.device)
    cfg = _backward_config(q, v, chunk)
    dh, r, beta, dm, parts_w, parts_b = kernels.norm_backward(
        grad_out, h, _dense(norm_weight), m2.contiguous(), row_sum.contiguous(), normed,
        norm_eps, eps, residual_weight, cfg)
    ig, lf = igate.contiguous(), logf.contiguous()
    has_last = grad_c is not None
    if has_last:
        # The last state is one more reader of the row S-1: C~ = sum_j exp(F_{S-1} - F_j +
        # igate_j) k_j v_j^T puts <dC, C> + <dn, n> on F_{S-1}, its columns come through
        # k . dk; and the returned C = exp(-m) C~ depends on m, the last row's stabiliser.
        read_last = (grad_c * c_last).sum(dim=(-2, -1)) + (grad_n * n_last).sum(dim=-1)
        dm_last = grad_m - read_last
        if seq:
            dm = torch.cat([dm[..., :-1], dm[..., -1:] + dm_last[..., None]], -1).contiguous()
    dcs, dns, dc0 = chunkwise.chunk_state_grads(q, dh, lf, m2, r, beta, mst, chunk, tables,
                                                (grad_c, grad_n) if has_last else None)
    dq, dk, dv, row_grad, col_grad = chunk_tiles.chunk_cell_backward(
        q, k, v, dh, ig, lf, m2, r, beta, chunk, (cst, nst, mst), (dcs, dns), tables, cfg)
    if has_last and seq:
        row_grad = torch.cat([row_grad[..., :-1], row_grad[..., -1:] + read_last[..., None]],
                             -1).contiguous()
    has_state = c0 is not None
    digate, dlogf, share0 = chunk_gates.gate_grads(
        ig, lf, dm, row_grad, col_grad, chunk, tables,
        m0.contiguous() if has_state else None)
    if has_state:  # the initial state: a column before the first, with logD = F_i + m0
        if has_last and not seq:  # nothing between: the last state is the initial one
            share0 = share0 + dm_last.reshape(-1)
        dc0 = dc0.reshape(c0.shape)
        dn0 = dns[:, 0].reshape(n0.shape).contiguous()
        dm0 = ((dc0 * c0).sum(dim=(-2, -1)) + (dn0 * n0).sum(dim=-1)
               + share0.reshape(m0.shape))
    else:
        dc0 = q.new_zeros((b, nh, dqk, v.shape[-1]), dtype=acc)
        dn0 = q.new_zeros((b, nh, dqk), dtype=acc)
        dm0 = q.new_zeros((b, nh), dtype=acc)
    if normed:
        dweight = parts_w.sum(dim=(0, 1)).reshape(-1)
        dbias = parts_b.sum(dim=(0, 1)).reshape(-1)
    else:
        dweight, dbias = q.new_empty((0,), dtype=acc), q.new_empty((0,), dtype=acc)
    return dq, dk, dv, digate, dlogf, dweight, dbias, dc0, dn0, dm0


def _check_backward(grad_out, grad_c, grad_n, grad_m, q, v, cu_seqlens, normed) -> None:
    check_backward_grad(grad_out, _out_shape(q, v, normed), "grad_out")
    given = [g is not None for g in (grad_c, grad_n, grad_m)]
    torch._check(all(given) or not any(given), lambda: "mlstm_chunkwise_backward: the last "
                 "state's gradient is (grad_c, grad_n, grad_m), all three or none")
    torch._check(cu_seqlens is None or not any(given), lambda: "mlstm_chunkwise_backward: "
                 "with cu_seqlens the last state has no gradient")


@mlstm_chunkwise_backward_op.register_fake
def _mlstm_chunkwise_backward_fake(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf,
                                   norm_weight, c0, n0, m0, cu_seqlens, h, m2, row_sum, cst,
                                   nst, mst, c_last, n_last, chunk, normed, norm_eps, eps,
                                   residual_weight):
    _check_backward(grad_out, grad_c, grad_n, grad_m, q, v, cu_seqlens, normed)
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
                        c0, n0, m0, cu_seqlens, chunk, normed, norm_eps, eps, residual_weight,
                        acc):
    """The gradient in plain PyTorch, document by document (each on its own contiguous copy,
    as the reference forward runs them): :func:`_document_backward`."""
    b, nh, seq, dqk = q.shape
    dv_len = v.shape[-1]
    grads = [torch.zeros_like(t) for t in (q, k, v, igate, logf)]
    dweight = q.new_zeros((nh * dv_len if normed else 0,), dtype=acc)
    dbias = torch.zeros_like(dweight)
    has_last = grad_c is not None
    state_grads = [q.new_zeros((b, nh, dqk, dv_len), dtype=acc),
                   q.new_zeros((b, nh, dqk), dtype=acc), q.new_zeros((b, nh), dtype=acc)]
    if c0 is not None and has_last and seq == 0:  # the last state is the initial state
        state_grads = [g.to(acc).clone() for g in (grad_c, grad_n, grad_m)]
    bounds = documents.host_bounds(cu_seqlens, seq)
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        if normed:
            cotangent = grad_out[:, start:end].contiguous()
        else:
            cotangent = grad_out[:, :, start:end].contiguous()
        got = _document_backward(
            cotangent, grad_c, grad_n, grad_m,
            *(t[:, :, start:end].contiguous() for t in (q, k, v, igate, logf)), norm_weight,
            c0, n0, m0, chunk, normed, norm_eps, eps, residual_weight, acc)
        for i in range(5):
            grads[i][:, :, start:end] = got[i]
        dweight = dweight + got[5]
        dbias = dbias + got[6]
        if c0 is not None:
            state_grads = list(got[7:])
    return (*grads, dweight, dbias, *state_grads)


def _document_backward(grad_out, grad_c, grad_n, grad_m, q, k, v, igate, logf, norm_weight,
                       c0, n0, m0, chunk, normed, norm_eps, eps, residual_weight, acc):
    """The gradient of one document (``S >= 1`` rows) by hand, in the parallel form with the
    initial state as a column before the first (``logD_t0 = F_t + m0``, content ``q_t C0``,
    ``q_t . n0``), materialising ``S x S``: ``(dq, dk, dv, digate, dlogf, dweight, dbias,
    dc0, dn0, dm0)``. The chain: the norm; ``r``, ``beta`` and the stabiliser's gradient
    ``dm`` per row (:func:`.op.normaliser_terms`); ``dC = r (dh . v) + beta``, ``dS = dC
    D``, ``dlogD = dS S``; the last state ``C = sum_j D_Lj k_j v_j^T + w0_L C0`` (its
    stabiliser is the last row's: ``dm_L += grad_m - <grad_c, C> - <grad_n, n>``); ``dm``
    to each row's maximal column (:func:`.op.stabiliser_column_grad`); then the forget sums
    ``F`` (rows minus columns) back to the chunk-restarted ``logf``."""
    from compileops.mlstm.op import _layernorm_backward, normaliser_terms, \
        stabiliser_column_grad

    seq, dqk = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(dqk)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    has_state, has_last = c0 is not None, grad_c is not None
    forget = _global_log_forget(logf, chunk)
    log_d = forget[..., :, None] - forget[..., None, :] + igate[..., None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    log_d = log_d.masked_fill(~causal, float("-inf"))
    state_col = forget + m0[..., None] if has_state else torch.full_like(forget, float("-inf"))
    m = torch.maximum(state_col, log_d.amax(dim=-1))
    decay = torch.exp(log_d - m[..., None])
    w0 = torch.exp(state_col - m)
    scores = (qa @ ka.transpose(-1, -2)) * scale
    cmat = scores * decay
    row_sum = cmat.sum(-1)
    num = cmat @ va
    if has_state:
        q_c0 = (qa @ c0) * scale  # [.., S, DV]
        q_n0 = (qa @ n0[..., None]).squeeze(-1) * scale
        row_sum = row_sum + w0 * q_n0
        num = num + w0[..., None] * q_c0
    normaliser = torch.maximum(row_sum.abs(), torch.exp(-m))
    h = num / (normaliser + eps)[..., None]
    if normed:
        dh, dweight, dbias = _layernorm_backward(grad_out, h, norm_weight, norm_eps,
                                                 residual_weight, acc)
    else:
        dh = grad_out.to(acc)
        dweight, dbias = q.new_zeros((0,), dtype=acc), q.new_zeros((0,), dtype=acc)
    r, beta, dm = normaliser_terms(m * LOG2E, row_sum, (dh * h).sum(-1), eps)
    r_dh = dh * r[..., None]
    d_s = (r_dh @ va.transpose(-1, -2) + beta[..., None]) * decay
    dq = (d_s @ ka) * scale
    dk = (d_s.transpose(-1, -2) @ qa) * scale
    dv = (cmat * r[..., None]).transpose(-1, -2) @ dh
    d_log_d = d_s * scores
    if has_state:
        dq = dq + w0[..., None] * scale * (r_dh @ c0.transpose(-1, -2)
                                           + beta[..., None] * n0[..., None, :])
        dc0 = scale * (qa * w0[..., None]).transpose(-1, -2) @ r_dh
        dn0 = scale * ((w0 * beta)[..., None] * qa).sum(-2)
        d_col0 = w0 * ((r_dh * q_c0).sum(-1) + beta * q_n0)
    if has_last:
        gc, gn, gm = grad_c.to(acc), grad_n.to(acc), grad_m.to(acc)
        last_d, last_w0 = decay[..., -1, :], w0[..., -1]  # [.., S], [..]
        c_last = torch.einsum("...s,...sd,...se->...de", last_d, ka, va)
        n_last = torch.einsum("...s,...sd->...d", last_d, ka)
        if has_state:
            c_last = c_last + last_w0[..., None, None] * c0
            n_last = n_last + last_w0[..., None] * n0
        read = (gc * c_last).sum((-2, -1)) + (gn * n_last).sum(-1)
        k_gc = ka @ gc  # [.., S, DV]
        dk = dk + last_d[..., None] * (va @ gc.transpose(-1, -2) + gn[..., None, :])
        dv = dv + last_d[..., None] * k_gc
        d_log_d[..., -1, :] += last_d * ((k_gc * va).sum(-1) + (ka * gn[..., None, :]).sum(-1))
        dm = dm.clone()
        dm[..., -1] += gm - read
        if has_state:
            dc0 = dc0 + last_w0[..., None, None] * gc
            dn0 = dn0 + last_w0[..., None] * gn
            d_col0 = d_col0.clone()
            d_col0[..., -1] += last_w0 * ((gc * c0).sum((-2, -1)) + (gn * n0).sum(-1))
    keys = igate - forget
    if has_state:
        shares = stabiliser_column_grad(torch.cat([m0[..., None], keys], -1),
                                        torch.cat([torch.zeros_like(dm[..., :1]), dm], -1))
        col = d_log_d.sum(-2) + shares[..., 1:]
        row = d_log_d.sum(-1) + dm + d_col0
        dm0 = d_col0.sum(-1) + shares[..., 0]
    else:
        col = d_log_d.sum(-2) + stabiliser_column_grad(keys, dm)
        row = d_log_d.sum(-1) + dm
    dlogf = _local_log_forget_grad(row - col, chunk)
    state = (dc0, dn0, dm0) if has_state else ()
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), col.to(igate.dtype),
            dlogf.to(logf.dtype), dweight, dbias, *state)


def _global_log_forget(logf: torch.Tensor, chunk: int) -> torch.Tensor:
    """The running forget sums over the whole document, from the chunk-restarted ones."""
    blocks = _chunked(logf, chunk)
    ends = blocks[..., -1]  # a chunk's total (the last chunk's is not used)
    offsets = torch.cumsum(ends, dim=-1) - ends
    full = blocks + offsets[..., None]
    return full.flatten(-2)[..., :logf.shape[-1]]


def _local_log_forget_grad(d_global: torch.Tensor, chunk: int) -> torch.Tensor:
    """From the gradient of the whole-document forget sums to the chunk-restarted ones: a
    chunk's last sum also carries into every later row."""
    seq = d_global.shape[-1]
    blocks = _chunked(d_global, chunk)
    totals = blocks.sum(dim=-1)
    later = torch.flip(torch.cumsum(torch.flip(totals, (-1,)), -1), (-1,)) - totals
    last = torch.zeros_like(blocks)
    last[..., -1] = later
    out = (blocks + last).flatten(-2)
    # A partial last chunk has no later rows: its (padded) last slot carries 0.
    return out[..., :seq].contiguous()
