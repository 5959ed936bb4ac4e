"""The mLSTM with states, in plain PyTorch: the recurrent (generation) form and the parallel
form with an initial state, a last state and packed documents.

The ground truth of :func:`compileops.mlstm_step` and of the chunkwise kernels' states:
readable, correct in fp64, differentiable with autograd (the states included).

State convention, per (batch, head); ``F_t = sum_{tau<=t} log sigmoid(fgate_tau)``, ``I_t``
the input-gate pre-activation, ``k`` unscaled. The state after token t is::

    m_t = max_{j<=t} (F_t - F_j + I_j)                                  (scalar)
    C_t = exp(-m_t) sum_{j<=t} exp(F_t - F_j + I_j) k_j v_j^T          [DQK, DV]
    n_t = exp(-m_t) sum_{j<=t} exp(F_t - F_j + I_j) k_j                 [DQK]

in the accumulation dtype (fp32, fp64 for fp64 inputs), i.e. the recursion::

    m_t = max(log sigmoid(f_t) + m_{t-1}, I_t)
    C_t = exp(log sigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(I_t - m_t) k_t v_t^T  (n alike)

The empty state is ``C = 0, n = 0, m = -inf`` (not ``m = 0``): from it the recursion gives
``m_1 = I_1`` and reproduces the parallel form (:func:`compileops.mlstm.reference.cell`)
exactly. A given initial state ``(C0, n0, m0)`` acts as one extra column before the first
token, with ``logD_{t,0} = F_t + m0`` and content ``C0``, ``n0``. The output of token t::

    h_t = (q_t . C_t / sqrt(DQK)) / (max(|q_t . n_t / sqrt(DQK)|, exp(-m_t)) + eps)   [DV]

Batched shapes: ``C [B, NH, DQK, DV]``, ``n [B, NH, DQK]``, ``m [B, NH]``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from compileops.mlstm import reference
from compileops.mlstm.reference import gate_dtype, masked_product
from compileops.mlstm.checks import check_cu_seqlens_layout, check_cu_seqlens_values

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def empty_state(batch: int, heads: int, dqk: int, dv: int,
                dtype: torch.dtype = torch.float32,
                device: Optional[torch.device | str] = None) -> State:
    """The empty state ``(C = 0 [B, NH, DQK, DV], n = 0 [B, NH, DQK], m = -inf [B, NH])``
    for inputs of ``dtype``: the state is in its accumulation dtype (fp32, fp64 for fp64)."""
    acc = gate_dtype(dtype)
    return (torch.zeros(batch, heads, dqk, dv, dtype=acc, device=device),
            torch.zeros(batch, heads, dqk, dtype=acc, device=device),
            torch.full((batch, heads), float("-inf"), dtype=acc, device=device))


def step_from_log_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    log_f: torch.Tensor, state: Optional[State] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, State]:
    """:func:`step_reference` from ``log_f = log sigmoid(fgate)`` ``[B, NH]``; the gates in the
    accumulation dtype."""
    acc = gate_dtype(q.dtype)
    batch, heads, dqk = q.shape
    if state is None:
        state = empty_state(batch, heads, dqk, v.shape[-1], q.dtype, q.device)
    c, n, m = state
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    m_new = torch.maximum(log_f + m, igate)
    decay = torch.exp(log_f + m - m_new)  # 0 from the empty state (m = -inf)
    gain = torch.exp(igate - m_new)
    c_new = decay[..., None, None] * c + gain[..., None, None] * ka[..., :, None] * va[..., None, :]
    n_new = decay[..., None] * n + gain[..., None] * ka
    scale = 1.0 / math.sqrt(dqk)
    numerator = (qa[..., None, :] @ c_new).squeeze(-2) * scale  # [B, NH, DV]
    row_sum = (qa * n_new).sum(dim=-1) * scale  # [B, NH]
    normaliser = torch.maximum(row_sum.abs(), torch.exp(-m_new))
    h = numerator / (normaliser + eps)[..., None]
    return h, (c_new, n_new, m_new)


def step_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, state: Optional[State] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, State]:
    """One token: ``q, k [B, NH, DQK]``, ``v [B, NH, DV]``, gate pre-activations ``igate,
    fgate [B, NH]``, ``state = (C, n, m)`` (None: the empty state) -> ``(h [B, NH, DV],
    (C, n, m))``, all in the accumulation dtype (the module docstring's math)."""
    acc = gate_dtype(q.dtype)
    return step_from_log_gates(q, k, v, reference.floor_input_gate(igate.to(acc)),
                               F.logsigmoid(fgate.to(acc)), state, eps)


def recurrent_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, initial_state: Optional[State] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, State]:
    """The token loop: ``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, ``igate, fgate [B, NH,
    S]`` -> ``(h [B, NH, S, DV], last_state)`` in the accumulation dtype."""
    batch, heads, seq, dqk = q.shape
    acc = gate_dtype(q.dtype)
    state = initial_state
    if state is None:
        state = empty_state(batch, heads, dqk, v.shape[-1], q.dtype, q.device)
    hs = []
    for t in range(seq):
        h, state = step_reference(q[:, :, t], k[:, :, t], v[:, :, t], igate[:, :, t],
                                  fgate[:, :, t], state, eps)
        hs.append(h)
    if not hs:
        return v.new_zeros(v.shape, dtype=acc), state
    return torch.stack(hs, dim=2), state


def _check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> None:
    check_cu_seqlens_layout(cu_seqlens, batch, cu_seqlens.device)
    check_cu_seqlens_values(cu_seqlens, seq)


def parallel_reference_with_state(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, igate: torch.Tensor,
    fgate: torch.Tensor, initial_state: Optional[State] = None,
    cu_seqlens: Optional[torch.Tensor] = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, State]:
    """The parallel form with states: ``(h [B, NH, S, DV], b [B, NH, S], m [B, NH, S],
    last_state)`` in the accumulation dtype, materialising ``S x S`` (as
    :func:`compileops.mlstm.reference.cell_from_log_gates`).

    ``b`` is the signed row sum (the normaliser is ``max(|b|, exp(-m))``), ``m`` the
    stabiliser, both with the initial state's column: for row t, ``m_t = max(F_t + m0,
    max_{j<=t} logD_tj)``, ``b_t = sum_j C_tj + exp(F_t + m0 - m_t) q_t . n0 / sqrt(DQK)``,
    ``h_t = (sum_j C_tj v_j + exp(F_t + m0 - m_t) q_t . C0 / sqrt(DQK)) / (max(|b_t|,
    exp(-m_t)) + eps)``. ``m_t`` is the recursion's ``m_t``; the last state is the last row's
    ``(sum_j exp(logD_Sj - m_S) k_j v_j^T + exp(F_S + m0 - m_S) C0, ..., m_S)``.

    ``initial_state``: ``(C0 [B, NH, DQK, DV], n0 [B, NH, DQK], m0 [B, NH])`` or None (the
    empty state). ``cu_seqlens``: int ``[N + 1]``, the cumulative ends of N documents packed
    in one row (B must be 1). Documents never see each other (block-diagonal mask); each
    starts from the empty state, or from ``initial_state[d]`` (its leading dimension then N),
    and the last state is per document, ``[N, NH, ...]`` (an empty document's is its initial
    state). Differentiable, w.r.t. the initial state too. Causal under NaN and Inf as
    :func:`compileops.mlstm.reference.mlstm_parallel`: a non-finite input reaches the later
    rows of its document and its document's last state, nothing else.
    """
    acc = gate_dtype(q.dtype)
    batch, heads, seq, dqk = q.shape
    dv = v.shape[-1]
    device = q.device
    if cu_seqlens is None:
        starts = torch.zeros(1, dtype=torch.long, device=device)
        ends = torch.full((1,), seq, dtype=torch.long, device=device)
        doc = torch.zeros(seq, dtype=torch.long, device=device)  # document of each position
        states = batch  # one state per row
    else:
        _check_cu_seqlens(cu_seqlens, batch, seq)
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        starts, ends = cu[:-1], cu[1:]
        doc = torch.searchsorted(ends, torch.arange(seq, device=device), right=True)
        states = cu.shape[0] - 1  # one state per document
    if initial_state is None:
        c0, n0, m0 = empty_state(states, heads, dqk, dv, q.dtype, device)
    else:
        c0, n0, m0 = initial_state
        if c0.shape[0] != states:
            raise ValueError(f"initial_state must have a leading dimension of {states} ("
                             f"{'N, one per document' if cu_seqlens is not None else 'B'}), "
                             f"got C of shape {tuple(c0.shape)}")
    scale = 1.0 / math.sqrt(dqk)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)

    # Forget-gate sums from each document's start: each document's own cumsum.
    terms = F.logsigmoid(fgate.to(acc))  # [B, NH, S]
    bounds = [0, seq] if cu_seqlens is None else cu_seqlens.tolist()
    log_f = torch.cat([torch.cumsum(terms[..., a:b], dim=-1)
                       for a, b in zip(bounds, bounds[1:])], dim=-1)
    pos = torch.arange(seq, device=device)
    live = (pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None])  # [S, S]
    log_d = (log_f[..., :, None] - log_f[..., None, :]
             + reference.floor_input_gate(igate.to(acc))[..., None, :])
    log_d = log_d.masked_fill(~live, float("-inf"))  # [B, NH, S, S]

    # The initial state's column, and what it contributes to each row: q . C0, q . n0.
    if cu_seqlens is None:
        state_col = log_f + m0[..., None]  # [B, NH, S]
        q_c0 = qa @ c0  # [B, NH, S, DV]
        q_n0 = (qa @ n0[..., None]).squeeze(-1)  # [B, NH, S]
    else:
        state_col = log_f + m0.transpose(0, 1)[None, :, doc]
        q_c0 = torch.einsum("hsd,nhde->hsne", qa[0], c0)[:, pos, doc][None]
        q_n0 = torch.einsum("hsd,nhd->hsn", qa[0], n0)[:, pos, doc][None]

    full = torch.cat([state_col[..., None], log_d], dim=-1)  # column 0: the state
    m = full.max(dim=-1).values  # [B, NH, S]; its gradient goes to the first max
    weights = torch.exp(full - m[..., None])
    w0, decay = weights[..., 0], weights[..., 1:]
    # Selected, and the values through masked_product: a non-finite k_j or v_j reaches the
    # rows that see j (later rows of its document) only, never as NaN * 0 an earlier row or
    # another document.
    c = torch.where(live, (qa @ ka.transpose(-1, -2)) * scale * decay, 0.0)
    b = c.sum(dim=-1) + w0 * q_n0 * scale
    n = torch.maximum(b.abs(), torch.exp(-m))
    h = (masked_product(c, va, live) + w0[..., None] * q_c0 * scale) / (n + eps)[..., None]

    # The last state: the last row of each document (or row), its own stabiliser.
    if seq == 0:
        return h, b, m, (c0, n0, m0)
    last = (ends - 1).clamp(min=0)  # [docs]
    if cu_seqlens is None:
        row_decay = decay[..., seq - 1, :]  # [B, NH, S]
        row_w0, row_m = w0[..., seq - 1], m[..., seq - 1]  # [B, NH]
        c_last = torch.einsum("bhs,bhsd,bhse->bhde", row_decay, ka, va)
        n_last = torch.einsum("bhs,bhsd->bhd", row_decay, ka)
    else:
        row_decay = decay[0][:, last].transpose(0, 1)  # [N, NH, S]
        row_w0, row_m = w0[0][:, last].t(), m[0][:, last].t()  # [N, NH]
        # Each document's own columns: the others' decay is 0, but 0 * NaN is not.
        spans = list(zip(bounds, bounds[1:]))
        c_last = torch.stack([torch.einsum("hs,hsd,hse->hde", row_decay[i, :, a:e],
                                           ka[0, :, a:e], va[0, :, a:e])
                              for i, (a, e) in enumerate(spans)])
        n_last = torch.stack([torch.einsum("hs,hsd->hd", row_decay[i, :, a:e], ka[0, :, a:e])
                              for i, (a, e) in enumerate(spans)])
    c_last = c_last + row_w0[..., None, None] * c0
    n_last = n_last + row_w0[..., None] * n0
    if cu_seqlens is not None:  # an empty document keeps its initial state
        empty = (ends == starts)[:, None]
        c_last = torch.where(empty[..., None, None], c0, c_last)
        n_last = torch.where(empty[..., None], n0, n_last)
        row_m = torch.where(empty, m0, row_m)
    return h, b, m, (c_last, n_last, row_m)


__all__ = ["State", "empty_state", "parallel_reference_with_state", "recurrent_reference",
           "step_from_log_gates", "step_reference"]
