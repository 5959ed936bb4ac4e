"""The forget-gate prefix sum ``F = cumsum(log sigmoid(f))`` and its backward, and the plain
running sum the stabiliser's gradient takes, one program per (batch, head) row.

A row's result depends on that row only and is summed in a fixed order, so it is bitwise the
same whatever else is in the batch. (``torch.cumsum`` on CUDA picks its scan by the number of
rows, which broke the mLSTM's batch invariance on the H100.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _log_sigmoid(x):
    """``log sigmoid(x) = min(x, 0) - log(1 + exp(-|x|))`` (no libdevice: the interpreter)."""
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def running_sum_kernel(x_ptr, out_ptr, seq_len, LOG_SIGMOID: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of ``x_ptr [R, S]`` (contiguous, the accumulation dtype) ->
    ``out_ptr [R, S]``: the running sum of ``x`` (``LOG_SIGMOID``: of ``log sigmoid(x)``),
    block by block."""
    base = tl.program_id(0).to(tl.int64) * seq_len
    lanes = tl.arange(0, BLOCK)
    carry = tl.zeros((1,), dtype=out_ptr.dtype.element_ty)
    for start in range(0, seq_len, BLOCK):
        live = start + lanes < seq_len
        x = tl.load(x_ptr + base + start + lanes, mask=live, other=0.0)
        if LOG_SIGMOID:
            x = _log_sigmoid(x)
        terms = tl.where(live, x, 0.0)
        running = tl.cumsum(terms, axis=0) + carry
        tl.store(out_ptr + base + start + lanes, running, mask=live)
        carry = tl.sum(tl.where(lanes == BLOCK - 1, running, 0.0), axis=0, keep_dims=True)


@triton.jit
def log_forget_backward_kernel(grad_ptr, f_ptr, out_ptr, seq_len, BLOCK: tl.constexpr):
    """Row ``program_id(0)``: ``out = sigmoid(-f) * revcumsum(grad)``, blocks from the end."""
    base = tl.program_id(0).to(tl.int64) * seq_len
    lanes = tl.arange(0, BLOCK)
    carry = tl.zeros((1,), dtype=grad_ptr.dtype.element_ty)
    num_blocks = tl.cdiv(seq_len, BLOCK)
    for i in range(0, num_blocks):
        start = (num_blocks - 1 - i) * BLOCK
        live = start + lanes < seq_len
        g = tl.load(grad_ptr + base + start + lanes, mask=live, other=0.0)
        running = tl.cumsum(g, axis=0, reverse=True) + carry
        x = tl.load(f_ptr + base + start + lanes, mask=live, other=0.0).to(g.dtype)
        tl.store(out_ptr + base + start + lanes,
                 (running / (1.0 + tl.exp(x))).to(out_ptr.dtype.element_ty), mask=live)
        carry = tl.sum(tl.where(lanes == 0, running, 0.0), axis=0, keep_dims=True)


@triton.jit
def log_forget_chunks_kernel(f_ptr, out_ptr, seq_len, CHUNK: tl.constexpr):
    """Chunk ``program_id(1)`` of row ``program_id(0)``: the running sum of ``log
    sigmoid(f)`` restarted at the chunk's first element."""
    base = tl.program_id(0).to(tl.int64) * seq_len
    idx = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    live = idx < seq_len
    x = tl.load(f_ptr + base + idx, mask=live, other=0.0)
    tl.store(out_ptr + base + idx, tl.cumsum(tl.where(live, _log_sigmoid(x), 0.0), axis=0),
             mask=live)


@triton.jit
def log_forget_chunks_backward_kernel(grad_ptr, f_ptr, out_ptr, seq_len, CHUNK: tl.constexpr):
    """``sigmoid(-f)`` times the reverse running sum of ``grad`` within each chunk."""
    base = tl.program_id(0).to(tl.int64) * seq_len
    idx = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    live = idx < seq_len
    g = tl.load(grad_ptr + base + idx, mask=live, other=0.0)
    x = tl.load(f_ptr + base + idx, mask=live, other=0.0).to(g.dtype)
    running = tl.cumsum(g, axis=0, reverse=True)
    tl.store(out_ptr + base + idx, (running / (1.0 + tl.exp(x))).to(out_ptr.dtype.element_ty),
             mask=live)


def _block(seq: int) -> int:
    return min(BLOCK, max(16, triton.next_power_of_2(max(seq, 1))))


def log_forget(fgate: torch.Tensor, acc: torch.dtype, chunk: int = 0) -> torch.Tensor:
    """``[B, NH, S]`` -> ``cumsum(log sigmoid(fgate))`` in ``acc``, contiguous; restarted
    every ``chunk`` elements when ``chunk`` (a power of two) is given."""
    f = fgate.to(acc).contiguous()
    out = torch.empty_like(f)
    seq = f.shape[-1]
    rows = f.numel() // max(seq, 1)
    if f.numel() and chunk:
        log_forget_chunks_kernel[(rows, triton.cdiv(seq, chunk))](f, out, seq, CHUNK=chunk)
    elif f.numel():
        running_sum_kernel[(rows,)](f, out, seq, LOG_SIGMOID=True, BLOCK=_block(seq))
    return out


def running_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., S]`` -> ``cumsum(x, -1)`` in x's dtype, contiguous, each row summed in a fixed
    order: batch-invariant, where ``torch.cumsum`` on CUDA is not."""
    x = x.contiguous()
    out = torch.empty_like(x)
    seq = x.shape[-1]
    if x.numel():
        running_sum_kernel[(x.numel() // seq,)](x, out, seq, LOG_SIGMOID=False,
                                                BLOCK=_block(seq))
    return out


def log_forget_backward(grad: torch.Tensor, fgate: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """``sigmoid(-fgate) * revcumsum(grad)`` in fgate's dtype (computed in grad's), the
    reverse sums restarted every ``chunk`` elements when ``chunk`` is given."""
    g = grad.contiguous()
    f = fgate.contiguous()
    out = torch.empty(f.shape, dtype=fgate.dtype, device=f.device)
    seq = f.shape[-1]
    rows = f.numel() // max(seq, 1)
    if f.numel() and chunk:
        log_forget_chunks_backward_kernel[(rows, triton.cdiv(seq, chunk))](
            g, f, out, seq, CHUNK=chunk)
    elif f.numel():
        log_forget_backward_kernel[(rows,)](g, f, out, seq, BLOCK=_block(seq))
    return out
