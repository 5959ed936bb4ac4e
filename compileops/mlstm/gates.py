"""The forget-gate prefix sum as ops: ``compileops::mlstm_log_forget(fgate) -> logf`` and
``compileops::mlstm_log_forget_backward(grad, fgate) -> dfgate``; and
``compileops::mlstm_column_terms(igate, logf) -> (terms, colmax)``, the forward's column terms
and their running max, which the forward's lowering uses.

``logf = cumsum(log sigmoid(fgate))`` ``[B, NH, S]`` in the accumulation dtype (fp32, fp64 for
fp64). On the Triton backend one program sums one row in a fixed order, so the result is
bitwise batch-invariant, which ``torch.cumsum`` on CUDA is not (it picks its scan by the row
count). Under ``torch.compile`` both stay extern calls of these kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.mlstm.checks import check_cu_seqlens, check_cu_seqlens_eagerly
from compileops.mlstm.reference import LOG2E, gate_dtype, log_forget_cumsum


def _use_triton(op: str, t: torch.Tensor) -> bool:
    return backends.select(op, t.device) == "triton"



def _chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[..., S]`` -> ``[..., NC, chunk]``, zero-padded at the end."""
    seq = t.shape[-1]
    pad = -seq % chunk
    # The chunk count spelled out: -1 is ambiguous for an empty batch (B = 0).
    return torch.nn.functional.pad(t, (0, pad)).reshape(*t.shape[:-1], (seq + pad) // chunk,
                                                        chunk)


@custom_op("mlstm_log_forget")
def log_forget_op(fgate: torch.Tensor, chunk: int = 0,
                  cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fgate [B, NH, S]`` -> ``cumsum(log sigmoid(fgate), -1)`` in the accumulation dtype;
    with ``chunk`` > 0 (a power of two) the sums restart every ``chunk`` elements of each
    document (``cu_seqlens [N + 1]``, B = 1: the packed documents' cumulative ends; None:
    the row is one document), as the chunkwise kernels read them."""
    _check_log_forget_args(fgate, chunk, cu_seqlens)
    check_cu_seqlens_eagerly(cu_seqlens, fgate.shape[-1])
    acc = gate_dtype(fgate.dtype)
    if _use_triton("mlstm_log_forget", fgate):
        from compileops.mlstm.kernels import gates

        if chunk:
            from compileops.mlstm.kernels import chunk_gates

            return chunk_gates.log_forget(fgate, acc, chunk, _tables(fgate, chunk, cu_seqlens))
        return gates.log_forget(fgate, acc)
    if chunk:
        return _per_document(fgate, chunk, cu_seqlens, _chunk_log_forget, fgate.to(acc))
    return log_forget_cumsum(fgate.to(acc)).contiguous()


def _check_log_forget_args(fgate, chunk, cu_seqlens) -> None:
    torch._check(cu_seqlens is None or chunk > 0, lambda: "mlstm_log_forget: cu_seqlens "
                 "needs the chunkwise form's chunk > 0")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, fgate, "fgate")


def _tables(t: torch.Tensor, chunk: int, cu_seqlens: Optional[torch.Tensor]):
    from compileops.mlstm.kernels.documents import document_tables

    return document_tables(cu_seqlens, t.shape[-1], chunk, t.device)


def _chunk_log_forget(f: torch.Tensor, chunk: int) -> torch.Tensor:
    """The reference: the running sums of ``log sigmoid(f) [..., L]`` restarted every
    ``chunk`` elements."""
    sums = torch.cumsum(_chunked(torch.nn.functional.logsigmoid(f), chunk), dim=-1)
    return sums.flatten(-2)[..., :f.shape[-1]]


def _chunk_log_forget_backward(g: torch.Tensor, f: torch.Tensor, chunk: int) -> torch.Tensor:
    """The reference: ``sigmoid(-f)`` times the reverse running sums of ``g [..., L]``
    restarted every ``chunk`` elements (in g's dtype)."""
    blocks = _chunked(g, chunk)
    rev = torch.flip(torch.cumsum(torch.flip(blocks, dims=(-1,)), dim=-1), dims=(-1,))
    rev = rev.flatten(-2)[..., :g.shape[-1]]
    return torch.sigmoid(-f.to(g.dtype)) * rev


def _per_document(like: torch.Tensor, chunk: int, cu_seqlens: Optional[torch.Tensor], fn,
                  *rows: torch.Tensor) -> torch.Tensor:
    """The reference backend's ``fn(*rows, chunk)`` on each document's contiguous copy of
    ``rows`` (reads ``cu_seqlens`` on the host), joined along S. Even the elementwise work
    runs per document: on CPU a vectorised loop and its scalar tail round transcendental
    functions differently, so a document must sit where it sits when alone."""
    from compileops.mlstm.documents import host_bounds

    bounds = host_bounds(cu_seqlens, like.shape[-1])
    parts = [fn(*(r[..., a:b].contiguous() for r in rows), chunk)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts, -1).contiguous()


@log_forget_op.register_fake
def _log_forget_fake(fgate, chunk=0, cu_seqlens=None):
    _check_log_forget_args(fgate, chunk, cu_seqlens)
    return fgate.new_empty(fgate.shape, dtype=gate_dtype(fgate.dtype))


def _setup_context(ctx, inputs, output) -> None:
    fgate, chunk, cu_seqlens = inputs
    ctx.save_for_backward(fgate, cu_seqlens)
    ctx.chunk = chunk


def _backward(ctx, grad):
    fgate, cu_seqlens = ctx.saved_tensors
    return log_forget_backward_op(grad, fgate, ctx.chunk, cu_seqlens), None, None


backends.register_autograd(log_forget_op, _backward, _setup_context)


@custom_op("mlstm_log_forget_backward")
def log_forget_backward_op(grad: torch.Tensor, fgate: torch.Tensor, chunk: int = 0,
                           cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sigmoid(-fgate) * revcumsum(grad)`` ``[B, NH, S]`` in fgate's dtype (the reverse
    sums restarted every ``chunk`` elements of each document when ``chunk`` > 0)."""
    _check_log_forget_args(fgate, chunk, cu_seqlens)
    if _use_triton("mlstm_log_forget_backward", fgate):
        from compileops.mlstm.kernels import gates

        g = grad.to(gate_dtype(fgate.dtype))
        if chunk:
            from compileops.mlstm.kernels import chunk_gates

            return chunk_gates.log_forget_backward(g, fgate, chunk,
                                                   _tables(fgate, chunk, cu_seqlens))
        return gates.log_forget_backward(g, fgate)
    g = grad.to(gate_dtype(fgate.dtype))
    if chunk:
        return _per_document(g, chunk, cu_seqlens, _chunk_log_forget_backward, g,
                             fgate).to(fgate.dtype)
    rev = torch.flip(torch.cumsum(torch.flip(g, dims=(-1,)), dim=-1), dims=(-1,))
    return (torch.sigmoid(-fgate.to(g.dtype)) * rev).to(fgate.dtype).contiguous()


@log_forget_backward_op.register_fake
def _log_forget_backward_fake(grad, fgate, chunk=0, cu_seqlens=None):
    _check_log_forget_args(fgate, chunk, cu_seqlens)
    return fgate.new_empty(fgate.shape)


@custom_op("mlstm_column_terms")
def column_terms_op(igate: torch.Tensor, logf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``igate``, ``logf`` ``[B, NH, S]`` (the accumulation dtype) -> ``(terms, colmax)``, both
    ``[B, NH, S]``: the parallel forward's column terms ``(igate - logf) * log2(e)`` and their
    running max along S (its stabiliser less ``logf``, log2 units). Internal: the Inductor
    lowering of ``mlstm_parallel`` calls it ahead of its template, as the eager launcher calls
    the kernel ahead of its own. Not differentiable (nothing differentiates through it: the
    stabiliser's gradient is the forward op's)."""
    _check_column_terms_inputs(igate, logf)
    if _use_triton("mlstm_column_terms", logf):
        from compileops.mlstm.kernels import stabiliser

        return stabiliser.column_terms(igate.contiguous(), logf.contiguous())
    terms = ((igate - logf) * LOG2E).contiguous()
    if terms.shape[-1] == 0:
        return terms, terms.clone()
    return terms, torch.cummax(terms, dim=-1).values.contiguous()


def _check_column_terms_inputs(igate, logf) -> None:
    if igate.shape != logf.shape or igate.dtype != logf.dtype:
        raise ValueError(f"igate ({tuple(igate.shape)}, {igate.dtype}) and logf "
                         f"({tuple(logf.shape)}, {logf.dtype}) must match")


@column_terms_op.register_fake
def _column_terms_fake(igate, logf):
    _check_column_terms_inputs(igate, logf)
    return logf.new_empty(logf.shape), logf.new_empty(logf.shape)


__all__ = ["column_terms_op", "log_forget_backward_op", "log_forget_op"]
