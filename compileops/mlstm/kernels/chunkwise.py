"""The chunkwise mLSTM's recurrent part: the states between chunks, forward and backward.

The sequence is cut into chunks of ``chunk`` rows. Within a chunk the parallel kernels run
as they are (their key loops start at the chunk, ``logf`` restarts its sums there); the
rows before the chunk reach it through the state entering it, one ``[DQK, DV]`` matrix per
(batch, head, chunk), so the cost is linear in S.

State convention (``compileops.mlstm.recurrent``): ``(C [DQK, DV], n [DQK], m)`` with
``C = exp(-m) sum_j exp(F - F_j + igate_j) k_j v_j^T`` over the rows so far (k unscaled),
``n`` the same with ``k_j``, ``m`` the running max of the exponent, in natural-log units.
An empty state is ``(0, 0, -inf)``. Leaving chunk c (``f`` its restarted forget sums,
``f_end`` the last): ``m' = max(m + f_end, max_j (f_end - f_j + igate_j))``, ``C' =
exp(m + f_end - m') C + sum_j exp(f_end - f_j + igate_j - m') k_j v_j^T``.

One program per (batch * head, DV tile) walks the chunks in order (forward) or in reverse
(backward), carrying its state tile in fp32 registers; ``n`` and ``m`` are computed by every
program alike and stored by the first. Fixed order, no atomics: bitwise reproducible and
batch-invariant.

Storage: the states entering chunks ``0 .. NC-1`` as ``C [B * NH, NC, DQK, DV]`` in the
inputs' dtype (the MMA operand the chunk kernels read), plus the last state in fp32;
``n [B * NH, NC + 1, DQK]`` and ``m [B * NH, NC + 1]`` in fp32 (slot ``NC``: the last).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from compileops.mlstm.kernels.common import (
    LOG2E,
    accumulation_dtype,
    head_major_tile,
    head_scale,
    input_precision,
    load_tile,
    mma,
    upcast_dots,
)
from compileops.mlstm.kernels.config import StateConfig, choose_state_config, head_tile


# num_chunks is not specialised: a packed document and the same document alone (a different
# chunk count, maybe 1) must run the same compiled walk, so that they round alike.
@triton.jit(do_not_specialize=["num_chunks"])
def chunk_states_kernel(
    k_ptr, v_ptr, igate_ptr, logf_ptr, c0_ptr, n0_ptr, m0_ptr, resets_ptr,
    c_ptr, n_ptr, m_ptr, c_last_ptr, seq_len, num_heads, num_chunks,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, HAS_INITIAL: tl.constexpr,
    HAS_RESETS: tl.constexpr, ACC: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(B * NH * cdiv(DV, BLOCK_V),)``, head-major. ``igate_ptr``, ``logf_ptr [B *
    NH, S]`` (``logf`` restarted at each chunk), ``ACC``, contiguous; ``c0_ptr [B * NH, DQK,
    DV]``, ``n0_ptr [B * NH, DQK]``, ``m0_ptr [B * NH]`` (``ACC``): the initial state when
    ``HAS_INITIAL``. ``resets_ptr [NC]`` (int8, ``HAS_RESETS``): a chunk flagged 1 is
    entered with the empty state, whatever came before (selected, never scaled to zero: an
    Inf or NaN before it stays there). Writes the layout of the module docstring."""
    bh, pv = head_major_tile(tl.cdiv(DV, BLOCK_V))
    batch64 = (bh // num_heads).to(tl.int64)
    head64 = (bh % num_heads).to(tl.int64)
    gate_off = bh.to(tl.int64) * seq_len
    dqk = tl.arange(0, BLOCK_DQK)
    dv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    tile_mask = (dqk[:, None] < DQK) & (dv[None, :] < DV)
    tile = dqk[:, None] * DV + dv[None, :]
    if HAS_INITIAL:
        state = tl.load(c0_ptr + bh.to(tl.int64) * DQK * DV + tile, mask=tile_mask,
                        other=0.0).to(ACC)
        norm = tl.load(n0_ptr + bh.to(tl.int64) * DQK + dqk, mask=dqk < DQK, other=0.0).to(ACC)
        m = tl.load(m0_ptr + bh).to(ACC)
    else:
        state = tl.zeros((BLOCK_DQK, BLOCK_V), dtype=ACC)
        norm = tl.zeros((BLOCK_DQK,), dtype=ACC)
        m = tl.full((), float("-inf"), dtype=ACC)
    k_base = k_ptr + batch64 * stride_kb + head64 * stride_kh
    v_base = v_ptr + batch64 * stride_vb + head64 * stride_vh
    lanes = tl.arange(0, CHUNK)
    for c in range(0, num_chunks):
        if HAS_RESETS:
            if tl.load(resets_ptr + c) != 0:
                state = tl.zeros((BLOCK_DQK, BLOCK_V), dtype=ACC)
                norm = tl.zeros((BLOCK_DQK,), dtype=ACC)
                m = tl.full((), float("-inf"), dtype=ACC)
        slot = bh.to(tl.int64) * (num_chunks + 1) + c
        tl.store(c_ptr + (bh.to(tl.int64) * num_chunks + c) * DQK * DV + tile,
                 state.to(c_ptr.dtype.element_ty), mask=tile_mask)
        if pv == 0:
            tl.store(n_ptr + slot * DQK + dqk, norm, mask=dqk < DQK)
            tl.store(m_ptr + slot, m)
        rows = c * CHUNK + lanes
        row_ok = rows < seq_len
        last = tl.minimum(c * CHUNK + CHUNK, seq_len) - 1
        f_end = tl.load(logf_ptr + gate_off + last)
        f = tl.load(logf_ptr + gate_off + rows, mask=row_ok, other=0.0)
        ig = tl.load(igate_ptr + gate_off + rows, mask=row_ok, other=0.0)
        u = tl.where(row_ok, f_end - f + ig, float("-inf"))
        m_new = tl.maximum(m + f_end, tl.max(u, axis=0))
        decay = tl.exp(m + f_end - m_new)
        state = state * decay
        norm = norm * decay
        # Rows in sub-blocks: long chunks would not fit their k and v tiles in shared memory.
        for sub in range(0, CHUNK, SUB):
            part = c * CHUNK + sub + tl.arange(0, SUB)
            part_ok = part < seq_len
            u_part = tl.where(part_ok, f_end - tl.load(logf_ptr + gate_off + part, mask=part_ok,
                                                        other=0.0)
                              + tl.load(igate_ptr + gate_off + part, mask=part_ok, other=0.0),
                              float("-inf"))
            weight = tl.exp(u_part - m_new)
            k = load_tile(k_base, part, stride_ks, dqk, stride_kd, seq_len, DQK, BLOCK_DQK, True)
            v = load_tile(v_base, part, stride_vs, dv, stride_vd, seq_len, DV, BLOCK_V, True)
            kw = k.to(ACC) * weight[:, None]
            state = mma(tl.trans(kw.to(k.dtype)), v, state, INPUT_PRECISION, UPCAST)
            norm = norm + tl.sum(kw, axis=0)
        m = m_new
    slot = bh.to(tl.int64) * (num_chunks + 1) + num_chunks
    tl.store(c_last_ptr + bh.to(tl.int64) * DQK * DV + tile, state, mask=tile_mask)
    if pv == 0:
        tl.store(n_ptr + slot * DQK + dqk, norm, mask=dqk < DQK)
        tl.store(m_ptr + slot, m)


@triton.jit(do_not_specialize=["num_chunks"])
def chunk_state_grads_kernel(
    q_ptr, dh_ptr, logf_ptr, m2_ptr, r_ptr, beta_ptr, m_ptr, dc_last_ptr, dn_last_ptr,
    resets_ptr, beta0_ptr, dc_ptr, dn_ptr, dc0_ptr, dn0_ptr, seq_len, num_heads, num_chunks,
    scale, stride_qb, stride_qh, stride_qs, stride_qd,
    stride_hb, stride_hh, stride_hs, stride_hd,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, HAS_LAST_GRAD: tl.constexpr,
    HAS_RESETS: tl.constexpr, EXACT_INITIAL: tl.constexpr, ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(B * NH * cdiv(DV, BLOCK_V),)``, head-major, chunks in reverse. The gradient of
    the state leaving chunk c: the later chunks' rows read it as ``a_i q_i C / sqrt(DQK)``
    with ``a_i = exp(logf_i + m - m_i)`` (``m_i`` the row's stabiliser ``m2_ptr``, log2 units),
    so ``dC += sum_i a_i r_i q_i dh_i^T / sqrt(DQK)`` and ``dn += sum_i a_i beta_i q_i /
    sqrt(DQK)`` (``r``, ``beta``: the norm preprocess's per-row terms), carried back
    through ``exp(m + f_end - m')``. Writes ``dc_ptr [B * NH, NC, DQK, DV]`` (q's dtype;
    slot c: leaving chunk c), ``dn_ptr [B * NH, NC + 1, DQK]`` (slot c + 1: leaving chunk
    c; slot 0: the initial state's) and ``dc0_ptr [B * NH, DQK, DV]`` (``ACC``: the initial
    state's). ``HAS_LAST_GRAD``: start from ``dc_last_ptr``/``dn_last_ptr`` (the returned
    last state's gradient, ``ACC``). ``resets_ptr`` (``HAS_RESETS``): as the forward's; the
    state leaving a chunk before a reset has no reader, so its gradient is zero (selected:
    nothing from the later segment reaches it). ``EXACT_INITIAL``: a second normaliser
    gradient walks along, taking ``beta0_ptr [B * NH, S]`` for ``beta`` (the norm backward's
    beta from the unrounded dh), and is written to ``dn0_ptr [B * NH, DQK]`` (``ACC``): the
    initial n's gradient. The slots of ``dn_ptr`` keep ``beta``'s, which the cell's other
    gradients pair with. Its cost, only with ``EXACT_INITIAL``: a second ``[SUB, DQK]``
    product per sub-block (sm90, TFLA's head: 4.5 KB of spills a thread against 3.0; not
    timed)."""
    scale = head_scale(scale, DQK, ACC)
    bh, pv = head_major_tile(tl.cdiv(DV, BLOCK_V))
    batch64 = (bh // num_heads).to(tl.int64)
    head64 = (bh % num_heads).to(tl.int64)
    gate_off = bh.to(tl.int64) * seq_len
    dqk = tl.arange(0, BLOCK_DQK)
    dv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    tile_mask = (dqk[:, None] < DQK) & (dv[None, :] < DV)
    tile = dqk[:, None] * DV + dv[None, :]
    if HAS_LAST_GRAD:
        grad = tl.load(dc_last_ptr + bh.to(tl.int64) * DQK * DV + tile, mask=tile_mask,
                       other=0.0).to(ACC)
        grad_n = tl.load(dn_last_ptr + bh.to(tl.int64) * DQK + dqk, mask=dqk < DQK,
                         other=0.0).to(ACC)
    else:
        grad = tl.zeros((BLOCK_DQK, BLOCK_V), dtype=ACC)
        grad_n = tl.zeros((BLOCK_DQK,), dtype=ACC)
    grad_n0 = grad_n
    q_base = q_ptr + batch64 * stride_qb + head64 * stride_qh
    h_base = dh_ptr + batch64 * stride_hb + head64 * stride_hh
    for i in range(0, num_chunks):
        c = num_chunks - 1 - i
        if HAS_RESETS:
            # Nothing reads the state leaving chunk c when chunk c + 1 starts a segment. (The
            # slot the forward keeps for it holds the reset state's m, so its decay below is
            # no number either: selected away too.)
            read = (i == 0) | (tl.load(resets_ptr + tl.minimum(c + 1, num_chunks - 1)) == 0)
            grad = tl.where(read, grad, 0.0)
            grad_n = tl.where(read, grad_n, 0.0)
            if EXACT_INITIAL:
                grad_n0 = tl.where(read, grad_n0, 0.0)
        slot = bh.to(tl.int64) * (num_chunks + 1) + c
        tl.store(dc_ptr + (bh.to(tl.int64) * num_chunks + c) * DQK * DV + tile,
                 grad.to(dc_ptr.dtype.element_ty), mask=tile_mask)
        if pv == 0:
            tl.store(dn_ptr + (slot + 1) * DQK + dqk, grad_n, mask=dqk < DQK)
        last = tl.minimum(c * CHUNK + CHUNK, seq_len) - 1
        f_end = tl.load(logf_ptr + gate_off + last)
        m = tl.load(m_ptr + slot)
        m_next = tl.load(m_ptr + slot + 1)
        decay = tl.exp(m + f_end - m_next)
        if HAS_RESETS:
            decay = tl.where(read, decay, 0.0)
        grad = grad * decay
        grad_n = grad_n * decay
        if EXACT_INITIAL:
            grad_n0 = grad_n0 * decay
        for sub in range(0, CHUNK, SUB):
            rows = c * CHUNK + sub + tl.arange(0, SUB)
            row_ok = rows < seq_len
            f = tl.load(logf_ptr + gate_off + rows, mask=row_ok, other=0.0)
            m2 = tl.load(m2_ptr + gate_off + rows, mask=row_ok, other=0.0)
            r = tl.load(r_ptr + gate_off + rows, mask=row_ok, other=0.0)
            beta = tl.load(beta_ptr + gate_off + rows, mask=row_ok, other=0.0)
            # The forward tile's expression for the state's row factor, bitwise.
            a = tl.where(row_ok, tl.exp2(f * LOG2E + m * LOG2E - m2), 0.0) * scale
            q = load_tile(q_base, rows, stride_qs, dqk, stride_qd, seq_len, DQK, BLOCK_DQK, True)
            dh = load_tile(h_base, rows, stride_hs, dv, stride_hd, seq_len, DV, BLOCK_V, True)
            weighted = (dh.to(ACC) * (a * r)[:, None]).to(q.dtype)
            grad = mma(tl.trans(q), weighted, grad, INPUT_PRECISION, UPCAST)
            grad_n = grad_n + tl.sum(q.to(ACC) * (a * beta)[:, None], axis=0)
            if EXACT_INITIAL:
                beta0 = tl.load(beta0_ptr + gate_off + rows, mask=row_ok, other=0.0)
                grad_n0 = grad_n0 + tl.sum(q.to(ACC) * (a * beta0)[:, None], axis=0)
    tl.store(dc0_ptr + bh.to(tl.int64) * DQK * DV + tile, grad, mask=tile_mask)
    if EXACT_INITIAL:
        if pv == 0:
            tl.store(dn0_ptr + bh.to(tl.int64) * DQK + dqk, grad_n0, mask=dqk < DQK)
    if pv == 0:
        tl.store(dn_ptr + bh.to(tl.int64) * (num_chunks + 1) * DQK + dqk, grad_n,
                 mask=dqk < DQK)


# Not specialised on the row's length or chunk count: a packed document and the document
# alone run the same compiled sums (see kernels.segments).
@triton.jit(do_not_specialize=["seq_len", "num_chunks"])
def chunk_boundaries_kernel(
    c_ptr, n_ptr, m_ptr, dc_ptr, dn_ptr, logf_ptr, resets_ptr, state_col_ptr, out_ptr,
    seq_len, num_chunks,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, HAS_RESETS: tl.constexpr, ACC: tl.constexpr,
):
    """Program (row, chunk c) of a grid ``(B * NH, NC)``: ``out_ptr [B * NH, NC]`` gets the
    share of the forget-gate gradient that crosses chunk c's end, ``sum dlogD_ij`` over the
    rows ``i`` after the chunk (the last chunk: the last state's readers) and the keys ``j``
    up to its end, in two parts, neither a difference of larger sums:

    * the keys before the chunk, through the state entering it: ``<G, C> + <g, n>``, with
      ``(C, n)`` that state (the forward's ``c_ptr``, ``n_ptr``, ``m_ptr``; the layout of
      the module docstring) and ``(G, g)`` the gradient reaching it from the later chunks:
      the gradient of the state leaving the chunk (``dc_ptr``, ``dn_ptr``, as
      :func:`chunk_state_grads_kernel` writes them) times the walk's decay
      ``exp(m + f_end - m')`` (zero where nothing reads the leaving state: ``resets_ptr``);
    * the chunk's own keys: the sum of ``state_col_ptr [B * NH, S]``, the later chunks'
      share of each key's column sum (:func:`.backward.mlstm_dkv_kernel`).

    Fixed tiles (``BLOCK_D`` rows of the state at a time) and a fixed order, whatever the
    batch: bitwise batch-invariant and reproducible."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    slot = row * (num_chunks + 1) + c
    last = tl.minimum(c * CHUNK + CHUNK, seq_len) - 1
    f_end = tl.load(logf_ptr + row * seq_len + last)
    decay = tl.exp(tl.load(m_ptr + slot) + f_end - tl.load(m_ptr + slot + 1))
    if HAS_RESETS:
        read = (c == num_chunks - 1) | (tl.load(resets_ptr + tl.minimum(c + 1, num_chunks - 1))
                                        == 0)
        decay = tl.where(read, decay, 0.0)
    rows = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    base = (row * num_chunks + c) * DQK * DV
    acc = tl.zeros((BLOCK_D, BLOCK_DV), dtype=ACC)
    for d0 in range(0, DQK, BLOCK_D):
        d = d0 + rows
        mask = (d[:, None] < DQK) & (dv[None, :] < DV)
        offs = base + d[:, None] * DV + dv[None, :]
        grad = tl.load(dc_ptr + offs, mask=mask, other=0.0).to(ACC)
        state = tl.load(c_ptr + offs, mask=mask, other=0.0).to(ACC)
        acc += grad * state
    dqk = tl.arange(0, BLOCK_DQK)
    grad_n = tl.load(dn_ptr + (slot + 1) * DQK + dqk, mask=dqk < DQK, other=0.0)
    n = tl.load(n_ptr + slot * DQK + dqk, mask=dqk < DQK, other=0.0)
    entering = decay * (tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(grad_n * n, axis=0))
    idx = c * CHUNK + tl.arange(0, CHUNK)
    own = tl.load(state_col_ptr + row * seq_len + idx, mask=idx < seq_len, other=0.0)
    tl.store(out_ptr + row * num_chunks + c, entering + tl.sum(own, axis=0))


def _launch_opts(q: torch.Tensor, chunk: int, dqk: int, dv: int,
                 config: Optional[StateConfig], backward: bool) -> tuple[dict, int]:
    cfg = (config or choose_state_config(q, chunk, dqk, dv, backward=backward)).capped(chunk)
    return dict(
        DQK=dqk, DV=dv, BLOCK_DQK=head_tile(dqk), BLOCK_V=cfg.block_v, CHUNK=chunk,
        SUB=cfg.sub, ACC=accumulation_dtype(q.dtype), INPUT_PRECISION=input_precision(q.dtype),
        UPCAST=upcast_dots(q), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ), cfg.block_v


def num_chunks(seq: int, chunk: int) -> int:
    """Chunks of a row of ``seq``: at least one (an empty row keeps its state slots)."""
    return max(1, -(-seq // chunk))


def chunk_states(
    k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor, logf: torch.Tensor, chunk: int,
    initial: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    resets: Optional[torch.Tensor] = None, config: Optional[StateConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(C, n, m, C_last)`` (module docstring) for ``k [B, NH, S, DQK]``, ``v [B, NH, S,
    DV]`` (any strides), ``igate``/``logf [B, NH, S]`` contiguous in the accumulation dtype
    (``logf`` restarted every ``chunk`` rows), and an optional initial ``(C0 [B, NH, DQK,
    DV], n0 [B, NH, DQK], m0 [B, NH])`` in the accumulation dtype. ``resets [NC]`` (int8):
    the chunks entered with the empty state (packed documents). ``config``: the walk's tiles
    (default: :func:`.config.choose_state_config`)."""
    batch, heads, seq, dqk = k.shape
    dv = v.shape[-1]
    nc = num_chunks(seq, chunk)
    acc = logf.dtype
    dev = k.device
    c = torch.empty((batch * heads, nc, dqk, dv), dtype=k.dtype, device=dev)
    n = torch.empty((batch * heads, nc + 1, dqk), dtype=acc, device=dev)
    m = torch.empty((batch * heads, nc + 1), dtype=acc, device=dev)
    c_last = torch.empty((batch, heads, dqk, dv), dtype=acc, device=dev)
    if batch * heads == 0:
        return c, n, m, c_last
    c0, n0, m0 = (t.contiguous() for t in initial) if initial is not None else (m, m, m)
    opts, block_v = _launch_opts(k, chunk, dqk, dv, config, backward=False)
    chunk_states_kernel[(batch * heads * triton.cdiv(dv, block_v),)](
        k, v, igate, logf, c0, n0, m0, resets if resets is not None else m, c, n, m, c_last,
        seq, heads, nc, *k.stride(), *v.stride(),
        HAS_INITIAL=initial is not None, HAS_RESETS=resets is not None, **opts)
    return c, n, m, c_last


def chunk_state_grads(
    q: torch.Tensor, dh: torch.Tensor, logf: torch.Tensor, m_log2: torch.Tensor,
    r: torch.Tensor, beta: torch.Tensor, m_states: torch.Tensor, chunk: int,
    last_grad: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    resets: Optional[torch.Tensor] = None, config: Optional[StateConfig] = None,
    beta_exact: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(dC [B * NH, NC, DQK, DV], dn [B * NH, NC + 1, DQK], dC0 [B, NH, DQK, DV], dn0)``:
    the gradients of the states leaving each chunk and of the initial state (its ``dn`` in
    slot 0), for the raw h's gradient ``dh [B, NH, S, DV]`` (any strides), the per-row
    ``logf``, ``m_log2``, ``r``, ``beta`` ``[B, NH, S]`` and the forward's ``m_states``.
    ``last_grad``: ``(dC_last [B, NH, DQK, DV], dn_last [B, NH, DQK])``; ``resets``: as
    :func:`chunk_states`; ``config``: as :func:`chunk_states`. ``beta_exact`` (``[B, NH,
    S]``, the norm backward's beta from the unrounded dh): ``dn0 [B, NH, DQK]`` is the
    initial n's gradient walked with it (None without)."""
    batch, heads, seq, dqk = q.shape
    dv = dh.shape[-1]
    nc = num_chunks(seq, chunk)
    acc = logf.dtype
    dev = q.device
    dc = torch.empty((batch * heads, nc, dqk, dv), dtype=q.dtype, device=dev)
    dn = torch.empty((batch * heads, nc + 1, dqk), dtype=acc, device=dev)
    dc0 = torch.empty((batch, heads, dqk, dv), dtype=acc, device=dev)
    dn0 = (torch.empty((batch, heads, dqk), dtype=acc, device=dev) if beta_exact is not None
           else None)
    if batch * heads == 0:
        return dc, dn, dc0, dn0
    dc_last, dn_last = ((t.contiguous() for t in last_grad) if last_grad is not None
                        else (dn, dn))
    opts, block_v = _launch_opts(q, chunk, dqk, dv, config, backward=True)
    chunk_state_grads_kernel[(batch * heads * triton.cdiv(dv, block_v),)](
        q, dh, logf, m_log2, r, beta, m_states, dc_last, dn_last,
        resets if resets is not None else dn, beta_exact if beta_exact is not None else dn,
        dc, dn, dc0, dn0 if dn0 is not None else dn, seq, heads, nc,
        1.0 / math.sqrt(dqk), *q.stride(), *dh.stride(),
        HAS_LAST_GRAD=last_grad is not None, HAS_RESETS=resets is not None,
        EXACT_INITIAL=beta_exact is not None, **opts)
    return dc, dn, dc0, dn0


def chunk_boundaries(states: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     state_grads: tuple[torch.Tensor, torch.Tensor], logf: torch.Tensor,
                     state_col: torch.Tensor, chunk: int,
                     resets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, NH, NC]``: for each chunk, the share of the forget-gate gradient that crosses its
    end (:func:`chunk_boundaries_kernel`), from the forward's ``states`` ``(C, n, m)``
    (:func:`chunk_states`), the gradients ``(dC, dn)`` of the states leaving each chunk
    (:func:`chunk_state_grads`), ``logf [B, NH, S]`` (restarted at each chunk), and the later
    chunks' share of each key's column sum ``state_col [B, NH, S]``
    (:func:`.backward.cell_backward`); ``resets`` as :func:`chunk_states`.

    Its cost: one pass reading the entering states and the leaving states' gradients (each
    ``[DQK, DV]`` a chunk in the inputs' dtype) and ``state_col``."""
    c_states, n_states, m_states = states
    dc, dn = state_grads
    batch, heads, seq = logf.shape
    rows, nc, dqk, dv = c_states.shape
    out = torch.empty((batch, heads, nc), dtype=logf.dtype, device=logf.device)
    if rows and seq:
        chunk_boundaries_kernel[(rows, nc)](
            c_states, n_states, m_states, dc, dn, logf,
            resets if resets is not None else m_states, state_col.contiguous(), out, seq, nc,
            DQK=dqk, DV=dv, BLOCK_DQK=head_tile(dqk), BLOCK_D=16, BLOCK_DV=head_tile(dv),
            CHUNK=chunk,
            HAS_RESETS=resets is not None, ACC=accumulation_dtype(c_states.dtype))
    elif rows:
        out.zero_()
    return out
