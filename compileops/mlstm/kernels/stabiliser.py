"""The parallel forward's column terms and their running max, from which its stabiliser comes.

``term_j = (igate_j - logf_j) * log2(e)`` and ``colmax_j = max_{w <= t <= j} term_t``, ``w``
the start of j's window (the row's start, or its chunk's in the chunkwise form). The forward
reads, per query tile, its rows' stabilisers ``m_i = logf_i + colmax_i`` and the two ends of
the tile's range of ``colmax``. Computing them in the tile itself (a scan of every gate left
of it and a masked ``[BLOCK_M, BLOCK_M]`` max) cost about 0.2 ms of a 1.65 ms forward at S =
1024 on an H100: one program per SM, nothing overlaps a program's prologue. The key loop
reads the terms, one array where it read two (igate and logf: each a ``[BLOCK_N]`` vector
that every thread of the MMA layout loads its share of, per key tile).

The terms are the expression the kernels use elsewhere, and a max is exact: the stabiliser is
bitwise what a scan inside the tile gave.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from compileops.mlstm.kernels.common import LOG2E

BLOCK = 1024


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def column_terms_kernel(igate_ptr, logf_ptr, term_ptr, colmax_ptr, seq_len, window,
                        BLOCK: tl.constexpr):
    """Window ``program_id(1)`` (``window`` elements) of row ``program_id(0)`` of the
    contiguous ``[R, S]`` gates -> ``term_ptr``, ``colmax_ptr [R, S]``, block by block with a
    carry."""
    base = tl.program_id(0).to(tl.int64) * seq_len
    first = tl.program_id(1) * window
    end = tl.minimum(first + window, seq_len)
    lanes = tl.arange(0, BLOCK)
    carry = tl.full((1,), float("-inf"), dtype=colmax_ptr.dtype.element_ty)
    for start in range(first, end, BLOCK):
        idx = start + lanes
        live = idx < end
        term = (tl.load(igate_ptr + base + idx, mask=live, other=0.0)
                - tl.load(logf_ptr + base + idx, mask=live, other=0.0)) * LOG2E
        tl.store(term_ptr + base + idx, term, mask=live)
        term = tl.where(live, term, float("-inf"))
        running = tl.maximum(tl.associative_scan(term, 0, _larger), carry)
        tl.store(colmax_ptr + base + idx, running, mask=live)
        carry = tl.max(running, axis=0, keep_dims=True)


def column_terms(igate: torch.Tensor, logf: torch.Tensor,
                 chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``igate``, ``logf`` ``[B, NH, S]`` (contiguous, the accumulation dtype; ``logf``
    restarted every ``chunk`` elements when ``chunk`` > 0) -> ``(terms, colmax)``, both
    ``[B, NH, S]`` in that dtype, the running max restarted with ``logf``."""
    terms = torch.empty_like(logf)
    colmax = torch.empty_like(logf)
    seq = logf.shape[-1]
    if logf.numel() == 0:
        return terms, colmax
    window = chunk or seq
    block = min(BLOCK, max(16, triton.next_power_of_2(window)))
    column_terms_kernel[(logf.numel() // seq, triton.cdiv(seq, window))](
        igate, logf, terms, colmax, seq, window, BLOCK=block)
    return terms, colmax
