"""The forget-gate prefix sum as ops: ``compileops::mlstm_log_forget(fgate) -> logf`` and
``compileops::mlstm_log_forget_backward(grad, fgate) -> dfgate``; and
``compileops::mlstm_column_terms(igate, logf) -> (term_hi, term_lo, colmax_hi, colmax_lo)``,
the kernels' column terms and their running max, which the forward's lowering uses.

``logf = cumsum(log sigmoid(fgate))`` ``[B, NH, S]`` in the accumulation dtype of fgate (fp32;
fp64 for fp64, which the parallel form passes: reference.FORGET_SUM_DTYPE), summed in fp64
on both backends and rounded once. On the Triton backend one program sums one row in a fixed
order, so the result is bitwise batch-invariant, which ``torch.cumsum`` on CUDA is not (it
picks its scan by the row count). Under ``torch.compile`` both stay extern calls of these
kernels.
"""
from __future__ import annotations

import torch

from compileops import backends
from compileops._library import custom_op
from compileops.mlstm.reference import FORGET_SUM_DTYPE, LOG2E, gate_dtype


def _use_triton(op: str, t: torch.Tensor) -> bool:
    return backends.select(op, t.device) == "triton"



def _chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[..., S]`` -> ``[..., NC, chunk]``, zero-padded at the end."""
    seq = t.shape[-1]
    pad = -seq % chunk
    return torch.nn.functional.pad(t, (0, pad)).reshape(*t.shape[:-1], -1, chunk)


def _sums_dtype(fgate: torch.Tensor, fp64: bool) -> torch.dtype:
    return FORGET_SUM_DTYPE if fp64 else gate_dtype(fgate.dtype)


@custom_op("mlstm_log_forget")
def log_forget_op(fgate: torch.Tensor, chunk: int = 0, fp64: bool = False) -> torch.Tensor:
    """``fgate [B, NH, S]`` -> ``cumsum(log sigmoid(fgate), -1)``, summed in fp64 and returned
    in fp64 when ``fp64`` (the parallel form's sums, reference.FORGET_SUM_DTYPE), else in
    fgate's accumulation dtype; with ``chunk`` > 0 (a power of two) the sums restart every
    ``chunk`` elements, as the chunkwise kernels read them. (``fp64`` reads fgate as it is:
    no conversion kernel ahead of this one.)"""
    acc = _sums_dtype(fgate, fp64)
    if _use_triton("mlstm_log_forget", fgate):
        from compileops.mlstm.kernels import gates

        return gates.log_forget(fgate, acc, chunk)
    terms = torch.nn.functional.logsigmoid(fgate.to(FORGET_SUM_DTYPE))
    if chunk:
        sums = torch.cumsum(_chunked(terms, chunk), dim=-1)
        sums = sums.reshape(*fgate.shape[:-1], -1)[..., :fgate.shape[-1]]
    else:
        sums = torch.cumsum(terms, dim=-1)
    return sums.to(acc).contiguous()


@log_forget_op.register_fake
def _log_forget_fake(fgate, chunk=0, fp64=False):
    return fgate.new_empty(fgate.shape, dtype=_sums_dtype(fgate, fp64))


def _setup_context(ctx, inputs, output) -> None:
    fgate, chunk, _ = inputs
    ctx.save_for_backward(fgate)
    ctx.chunk = chunk


def _backward(ctx, grad):
    (fgate,) = ctx.saved_tensors
    return log_forget_backward_op(grad, fgate, ctx.chunk), None, None


backends.register_autograd(log_forget_op, _backward, _setup_context)


@custom_op("mlstm_log_forget_backward")
def log_forget_backward_op(grad: torch.Tensor, fgate: torch.Tensor,
                           chunk: int = 0) -> torch.Tensor:
    """``sigmoid(-fgate) * revcumsum(grad)`` ``[B, NH, S]`` in fgate's dtype, summed in fp64
    (the reverse sums restarted every ``chunk`` elements when ``chunk`` > 0). ``grad`` is
    the gradient of the sums (fp64, or fgate's accumulation dtype): row sums less column
    sums of the cell's ``dlogD``, whose reverse sum cancels them down to the few pairs that
    span each step, so it is read as it comes."""
    if _use_triton("mlstm_log_forget_backward", fgate):
        from compileops.mlstm.kernels import gates

        return gates.log_forget_backward(grad, fgate, chunk)
    g = grad.to(FORGET_SUM_DTYPE)
    if chunk:
        blocks = _chunked(g, chunk)
        rev = torch.flip(torch.cumsum(torch.flip(blocks, dims=(-1,)), dim=-1), dims=(-1,))
        rev = rev.reshape(*g.shape[:-1], -1)[..., :g.shape[-1]]
    else:
        rev = torch.flip(torch.cumsum(torch.flip(g, dims=(-1,)), dim=-1), dims=(-1,))
    return (torch.sigmoid(-fgate.to(g.dtype)) * rev).to(fgate.dtype).contiguous()


@log_forget_backward_op.register_fake
def _log_forget_backward_fake(grad, fgate, chunk=0):
    return fgate.new_empty(fgate.shape)


@custom_op("mlstm_column_terms")
def column_terms_op(igate: torch.Tensor, logf: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``igate [B, NH, S]`` (the accumulation dtype) and ``logf [B, NH, S]`` (fp64, or
    igate's dtype) -> ``(term_hi, term_lo, colmax_hi, colmax_lo)``, each ``[B, NH, S]`` in
    igate's dtype: the kernels' column terms ``(igate - logf) * log2(e)`` and their running
    max along S (the row's stabiliser less ``logf``, log2 units), each computed in fp64 and
    kept as an unevaluated sum ``hi + lo`` of two numbers of igate's dtype
    (:mod:`compileops.mlstm.kernels.stabiliser` says why; ``lo`` is 0 in fp64). Internal:
    the Inductor lowering of ``mlstm_parallel`` calls it ahead of its template, as the eager
    launcher calls the kernel ahead of its own. Not differentiable (nothing differentiates
    through it: the stabiliser's gradient is the forward op's)."""
    _check_column_terms_inputs(igate, logf)
    if _use_triton("mlstm_column_terms", logf):
        from compileops.mlstm.kernels import stabiliser

        return stabiliser.column_terms(igate.contiguous(), logf.contiguous())
    return reference_column_terms(igate, logf)


def split_sum(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp64) as ``(hi, lo)`` in ``dtype``: ``hi`` the rounded value, ``lo`` the rounded
    remainder (0 where ``hi`` is infinite)."""
    hi = x.to(dtype)
    rest = torch.where(torch.isfinite(hi), x - hi.to(x.dtype), torch.zeros_like(x))
    return hi.contiguous(), rest.to(dtype).contiguous()


def reference_column_terms(igate: torch.Tensor, logf: torch.Tensor, chunk: int = 0):
    """:func:`column_terms_op` in plain PyTorch, the running max restarted every ``chunk``
    elements when ``chunk`` > 0."""
    terms = (igate.to(FORGET_SUM_DTYPE) - logf.to(FORGET_SUM_DTYPE)) * LOG2E
    if terms.shape[-1] == 0:
        colmax = terms.clone()
    elif chunk:
        colmax = torch.cummax(_chunked(terms, chunk), dim=-1).values
        colmax = colmax.reshape(*terms.shape[:-1], -1)[..., :terms.shape[-1]]
    else:
        colmax = torch.cummax(terms, dim=-1).values
    return (*split_sum(terms, igate.dtype), *split_sum(colmax, igate.dtype))


def _check_column_terms_inputs(igate, logf) -> None:
    if igate.shape != logf.shape or logf.dtype not in (igate.dtype, FORGET_SUM_DTYPE):
        raise ValueError(f"igate ({tuple(igate.shape)}, {igate.dtype}) and logf "
                         f"({tuple(logf.shape)}, {logf.dtype}) must match (logf may be "
                         f"{FORGET_SUM_DTYPE})")


@column_terms_op.register_fake
def _column_terms_fake(igate, logf):
    _check_column_terms_inputs(igate, logf)
    return tuple(igate.new_empty(igate.shape) for _ in range(4))


__all__ = ["column_terms_op", "log_forget_backward_op", "log_forget_op"]
