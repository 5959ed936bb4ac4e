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

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.mlstm.reference import LOG2E, gate_dtype, log_forget_cumsum


def _use_triton(op: str, t: torch.Tensor) -> bool:
    return backends.select(op, t.device) == "triton"



def _chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[..., S]`` -> ``[..., NC, chunk]``, zero-padded at the end."""
    seq = t.shape[-1]
    pad = -seq % chunk
    return torch.nn.functional.pad(t, (0, pad)).reshape(*t.shape[:-1], (seq + pad) // chunk,
                                                         chunk)


@custom_op("mlstm_log_forget")
def log_forget_op(fgate: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """``fgate [B, NH, S]`` -> ``cumsum(log sigmoid(fgate), -1)`` in the accumulation dtype;
    with ``chunk`` > 0 (a power of two) the sums restart every ``chunk`` elements, as the
    chunkwise kernels read them."""
    acc = gate_dtype(fgate.dtype)
    if _use_triton("mlstm_log_forget", fgate):
        from compileops.mlstm.kernels import gates

        return gates.log_forget(fgate, acc, chunk)
    if chunk:
        terms = torch.nn.functional.logsigmoid(fgate.to(acc))
        sums = torch.cumsum(_chunked(terms, chunk), dim=-1)
        return sums.flatten(-2)[..., :fgate.shape[-1]].contiguous()
    return log_forget_cumsum(fgate.to(acc)).contiguous()


@log_forget_op.register_fake
def _log_forget_fake(fgate, chunk=0):
    return fgate.new_empty(fgate.shape, dtype=gate_dtype(fgate.dtype))


def _setup_context(ctx, inputs, output) -> None:
    fgate, chunk = inputs
    ctx.save_for_backward(fgate)
    ctx.chunk = chunk


def _backward(ctx, grad):
    (fgate,) = ctx.saved_tensors
    return log_forget_backward_op(grad, fgate, ctx.chunk), None


backends.register_autograd(log_forget_op, _backward, _setup_context)


@custom_op("mlstm_log_forget_backward")
def log_forget_backward_op(grad: torch.Tensor, fgate: torch.Tensor,
                           chunk: int = 0) -> torch.Tensor:
    """``sigmoid(-fgate) * revcumsum(grad)`` ``[B, NH, S]`` in fgate's dtype (the reverse
    sums restarted every ``chunk`` elements when ``chunk`` > 0)."""
    if _use_triton("mlstm_log_forget_backward", fgate):
        from compileops.mlstm.kernels import gates

        return gates.log_forget_backward(grad.to(gate_dtype(fgate.dtype)), fgate, chunk)
    g = grad.to(gate_dtype(fgate.dtype))
    if chunk:
        blocks = _chunked(g, chunk)
        rev = torch.flip(torch.cumsum(torch.flip(blocks, dims=(-1,)), dim=-1), dims=(-1,))
        rev = rev.flatten(-2)[..., :g.shape[-1]]
    else:
        rev = torch.flip(torch.cumsum(torch.flip(g, dims=(-1,)), dim=-1), dims=(-1,))
    return (torch.sigmoid(-fgate.to(g.dtype)) * rev).to(fgate.dtype).contiguous()


@log_forget_backward_op.register_fake
def _log_forget_backward_fake(grad, fgate, chunk=0):
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
