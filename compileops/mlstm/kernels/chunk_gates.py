"""The chunkwise form's per-row gate work, per document: the forget-gate sums restarted at
each chunk (and their backward), the forward's column terms, and the backward's gate
gradients (the stabiliser's share, the chunk-restarted sums' gradient).

Every kernel finds its document and chunk on the device (:mod:`.documents`) and works on
the document's rows only, from its own first row, as it does for the document alone: a
document's results are bitwise those of the document alone, whatever the others hold. All
rows ``[B * NH, S]`` contiguous, in the accumulation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compileops.mlstm.documents import DocumentTables
from compileops.mlstm.kernels.documents import document_rows, locate_slot
from compileops.mlstm.kernels.gates import _log_sigmoid
from compileops.mlstm.kernels.stabiliser import BLOCK as TERMS_BLOCK
from compileops.mlstm.kernels.stabiliser import column_terms_span

#: Rows per step of the per-document gate-gradient walks (the stabiliser's share builds a
#: ``[SUB, SUB]`` match of rows to columns).
SUB = 64


@triton.jit
def log_forget_chunks_kernel(f_ptr, out_ptr, bounds_ptr, slot_first_ptr, slot_doc_ptr,
                             seq_len, num_docs, num_slots, CHUNK: tl.constexpr):
    """Grid ``(R * U,)``: chunk slot ``pid % U`` of row ``pid // U`` -> the running sum of
    ``log sigmoid(f)`` over the chunk's rows, from the chunk's first row."""
    pid = tl.program_id(0)
    row = pid // num_slots
    doc, chunk, start, length = locate_slot(pid % num_slots, bounds_ptr, slot_first_ptr,
                                            slot_doc_ptr, num_docs)
    base = row.to(tl.int64) * seq_len + start
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    live = idx < length
    x = tl.load(f_ptr + base + idx, mask=live, other=0.0)
    tl.store(out_ptr + base + idx, tl.cumsum(tl.where(live, _log_sigmoid(x), 0.0), axis=0),
             mask=live)


@triton.jit
def log_forget_chunks_backward_kernel(grad_ptr, f_ptr, out_ptr, bounds_ptr, slot_first_ptr,
                                      slot_doc_ptr, seq_len, num_docs, num_slots,
                                      CHUNK: tl.constexpr):
    """Grid as :func:`log_forget_chunks_kernel`: ``sigmoid(-f)`` times the reverse running
    sum of ``grad`` within the chunk (``out`` in f's dtype)."""
    pid = tl.program_id(0)
    row = pid // num_slots
    doc, chunk, start, length = locate_slot(pid % num_slots, bounds_ptr, slot_first_ptr,
                                            slot_doc_ptr, num_docs)
    base = row.to(tl.int64) * seq_len + start
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    live = idx < length
    g = tl.load(grad_ptr + base + idx, mask=live, other=0.0)
    x = tl.load(f_ptr + base + idx, mask=live, other=0.0).to(g.dtype)
    running = tl.cumsum(g, axis=0, reverse=True)
    tl.store(out_ptr + base + idx, (running / (1.0 + tl.exp(x))).to(out_ptr.dtype.element_ty),
             mask=live)


@triton.jit
def column_terms_chunks_kernel(igate_ptr, logf_ptr, term_ptr, colmax_ptr, bounds_ptr,
                               slot_first_ptr, slot_doc_ptr, seq_len, num_docs, num_slots,
                               CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Grid as :func:`log_forget_chunks_kernel`: the forward's column terms and their running
    max over one chunk (:func:`.stabiliser.column_terms_span`)."""
    pid = tl.program_id(0)
    row = pid // num_slots
    doc, chunk, start, length = locate_slot(pid % num_slots, bounds_ptr, slot_first_ptr,
                                            slot_doc_ptr, num_docs)
    first = chunk * CHUNK
    column_terms_span(igate_ptr, logf_ptr, term_ptr, colmax_ptr,
                      row.to(tl.int64) * seq_len + start, first,
                      tl.minimum(first + CHUNK, length), BLOCK)


@triton.jit
def _later_max(value_a, index_a, value_b, index_b):
    """A running argmax's step: ``b`` (the later) wins ties; index -1 is no column."""
    take = (value_b > value_a) | ((value_b == value_a) & (index_b > index_a))
    return tl.where(take, value_b, value_a), tl.where(take, index_b, index_a)


@triton.jit
def stabiliser_shares_kernel(igate_ptr, logf_ptr, dm_ptr, col_ptr, m0_ptr, out_ptr,
                             share0_ptr, bounds_ptr, seq_len, num_docs,
                             CHUNK: tl.constexpr, SUB: tl.constexpr,
                             HAS_INITIAL: tl.constexpr):
    """Grid ``(B * NH * N,)``: document ``pid % N`` of row ``pid // N``, in order.

    The stabiliser ``m_i = F_i + max(m0, max_{j<=i} (igate_j - F_j))`` (``F`` the forget
    sums from the document's start, ``logf`` plus the earlier chunks' totals) takes its
    gradient ``dm_i`` from its maximal column (on exact ties the latest; the initial state,
    ``m0_ptr [B * NH * N]`` with ``HAS_INITIAL``, is a column before the first). The
    maximal column never moves back, so the rows sharing a column are a run: walked in
    order, each column's share is written once, when its run ends. Writes ``out = col +
    share`` (``col_ptr``: the cell's column sums ``sum_i dlogD_ij``) and ``share0_ptr [B *
    NH * N]``, the initial state's share."""
    pid = tl.program_id(0)
    start, length = document_rows(bounds_ptr, pid % num_docs, num_docs)
    base = (pid // num_docs).to(tl.int64) * seq_len + start
    lanes = tl.arange(0, SUB)
    zero = tl.zeros((), dtype=dm_ptr.dtype.element_ty)
    if HAS_INITIAL:
        best = tl.load(m0_ptr + pid) + zero
    else:
        best = zero + float("-inf")
    best_idx = tl.full((), -1, tl.int32)
    run = zero  # the dm of the rows whose maximal column is best_idx, so far
    share0 = zero
    offset = zero  # the forget sums of the earlier chunks
    for c in range(0, tl.cdiv(length, CHUNK)):
        for sub in range(0, tl.minimum(CHUNK, length - c * CHUNK), SUB):
            rows = c * CHUNK + sub + lanes
            ok = rows < length
            ig = tl.load(igate_ptr + base + rows, mask=ok, other=0.0)
            lf = tl.load(logf_ptr + base + rows, mask=ok, other=0.0)
            key = tl.where(ok, ig - (lf + offset), float("-inf"))
            value, arg = tl.associative_scan((key, tl.where(ok, rows, -1)), 0, _later_max)
            carried = ~((value > best) | ((value == best) & (arg > best_idx)))
            value = tl.where(carried, best, value)
            arg = tl.where(carried, best_idx, arg)
            dm = tl.load(dm_ptr + base + rows, mask=ok, other=0.0)
            # Each column's share from these rows: [rows, columns] matches, summed over rows.
            match = (arg[:, None] == rows[None, :]) & ok[:, None]
            share = tl.sum(tl.where(match, dm[:, None], 0.0), axis=0)
            to_carried = tl.sum(tl.where(ok & (arg == best_idx), dm, 0.0), axis=0)
            last = rows == tl.minimum(c * CHUNK + sub + SUB, length) - 1
            new_idx = tl.sum(tl.where(last, arg, 0), axis=0)
            new_best = tl.sum(tl.where(last, value, 0.0), axis=0)
            ended = new_idx != best_idx
            # The carried column's run ends here: its share is complete.
            write = ended & (best_idx >= 0)
            tl.store(out_ptr + base + best_idx,
                     tl.load(col_ptr + base + best_idx, mask=write, other=0.0)
                     + (run + to_carried), mask=write)
            share0 += tl.where(ended & (best_idx < 0), run + to_carried, 0.0)
            run = tl.where(ended, tl.sum(tl.where(rows == new_idx, share, 0.0), axis=0),
                           run + to_carried)
            # These rows' columns, but the one whose run goes on.
            col = tl.load(col_ptr + base + rows, mask=ok, other=0.0)
            tl.store(out_ptr + base + rows, col + share, mask=ok & (rows != new_idx))
            best = new_best
            best_idx = new_idx
        offset += tl.load(logf_ptr + base + tl.minimum(c * CHUNK + CHUNK, length) - 1)
    write = best_idx >= 0
    tl.store(out_ptr + base + best_idx,
             tl.load(col_ptr + base + best_idx, mask=write, other=0.0) + run, mask=write)
    share0 += tl.where(write, 0.0, run)
    tl.store(share0_ptr + pid, share0)


@triton.jit
def local_forget_grad_kernel(row_ptr, dm_ptr, digate_ptr, out_ptr, bounds_ptr, seq_len,
                             num_docs, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Grid ``(B * NH * N,)``: document ``pid % N`` of row ``pid // N``, chunks in reverse.
    With ``d = row + dm - digate``, the gradient of the whole-document forget sums
    (``logD_ij = F_i - F_j + igate_j``: rows minus columns, the stabiliser's row share
    ``dm`` included), the chunk-restarted sums' gradient: ``d``, plus at each chunk's last
    row the total of the document's later chunks (that sum enters every later row)."""
    pid = tl.program_id(0)
    start, length = document_rows(bounds_ptr, pid % num_docs, num_docs)
    base = (pid // num_docs).to(tl.int64) * seq_len + start
    lanes = tl.arange(0, SUB)
    later = tl.zeros((), dtype=out_ptr.dtype.element_ty)
    chunks = tl.cdiv(length, CHUNK)
    for i in range(0, chunks):
        c = chunks - 1 - i
        total = tl.zeros((), dtype=out_ptr.dtype.element_ty)
        for sub in range(0, CHUNK, SUB):
            rows = c * CHUNK + sub + lanes
            ok = rows < length
            d = tl.where(ok, (tl.load(row_ptr + base + rows, mask=ok, other=0.0)
                              + tl.load(dm_ptr + base + rows, mask=ok, other=0.0))
                         - tl.load(digate_ptr + base + rows, mask=ok, other=0.0), 0.0)
            tl.store(out_ptr + base + rows,
                     d + tl.where(rows == c * CHUNK + CHUNK - 1, later, 0.0), mask=ok)
            total += tl.sum(d, axis=0)
        later += total


def _grid_args(tables: DocumentTables) -> tuple:
    return tables.bounds, tables.slot_first, tables.slot_doc


def log_forget(fgate: torch.Tensor, acc: torch.dtype, chunk: int,
               tables: DocumentTables) -> torch.Tensor:
    """``fgate [B, NH, S]`` -> ``cumsum(log sigmoid(fgate))`` in ``acc``, restarted at each
    chunk of each document, contiguous."""
    f = fgate.to(acc).contiguous()
    out = torch.empty_like(f)
    seq = f.shape[-1]
    rows = f.numel() // max(seq, 1)
    if f.numel():
        log_forget_chunks_kernel[(rows * tables.slots,)](
            f, out, *_grid_args(tables), seq, tables.docs, tables.slots, CHUNK=chunk)
    return out


def log_forget_backward(grad: torch.Tensor, fgate: torch.Tensor, chunk: int,
                        tables: DocumentTables) -> torch.Tensor:
    """``sigmoid(-fgate)`` times the reverse sums of ``grad`` within each chunk, in fgate's
    dtype (computed in grad's)."""
    g = grad.contiguous()
    f = fgate.contiguous()
    out = torch.empty(f.shape, dtype=fgate.dtype, device=f.device)
    seq = f.shape[-1]
    rows = f.numel() // max(seq, 1)
    if f.numel():
        log_forget_chunks_backward_kernel[(rows * tables.slots,)](
            g, f, out, *_grid_args(tables), seq, tables.docs, tables.slots, CHUNK=chunk)
    return out


def column_terms(igate: torch.Tensor, logf: torch.Tensor, chunk: int,
                 tables: DocumentTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``(terms, colmax)`` ``[B, NH, S]`` of :func:`.stabiliser.column_terms`, the running
    max restarted at each chunk of each document (``igate``, ``logf`` contiguous)."""
    terms = torch.empty_like(logf)
    colmax = torch.empty_like(logf)
    seq = logf.shape[-1]
    if logf.numel():
        column_terms_chunks_kernel[(logf.numel() // seq * tables.slots,)](
            igate, logf, terms, colmax, *_grid_args(tables), seq, tables.docs, tables.slots,
            CHUNK=chunk, BLOCK=min(TERMS_BLOCK, chunk))
    return terms, colmax


def gate_grads(igate: torch.Tensor, logf: torch.Tensor, dm: torch.Tensor,
               row_grad: torch.Tensor, col_grad: torch.Tensor, chunk: int,
               tables: DocumentTables, m0=None) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """``(digate, dlogf, share0)`` from the cell's row and column sums of ``dlogD``
    (``[B, NH, S]``) and the stabiliser's gradient ``dm``: the input gate's gradient (the
    column sums plus the stabiliser's share), the chunk-restarted forget sums' gradient,
    and the initial state's share of ``dm`` per (row, document) ``[B * NH * N]`` (``m0 [B *
    NH * N]``: the initial stabiliser, when there is an initial state)."""
    digate = torch.empty_like(col_grad)
    dlogf = torch.empty_like(col_grad)
    rows = col_grad.shape[:-1].numel()  # B * NH, also when S = 0
    share0 = torch.empty((rows * tables.docs,), dtype=dm.dtype, device=dm.device)
    if rows * tables.docs == 0:
        return digate, dlogf, share0
    seq = col_grad.shape[-1]
    sub = min(SUB, chunk)
    grid = (rows * tables.docs,)
    stabiliser_shares_kernel[grid](
        igate, logf, dm, col_grad, m0 if m0 is not None else dm, digate, share0,
        tables.bounds, seq, tables.docs, CHUNK=chunk, SUB=sub, HAS_INITIAL=m0 is not None)
    local_forget_grad_kernel[grid](row_grad, dm, digate, dlogf, tables.bounds, seq,
                                   tables.docs, CHUNK=chunk, SUB=sub)
    return digate, dlogf, share0
