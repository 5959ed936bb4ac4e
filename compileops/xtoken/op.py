"""The cross-tokenizer custom ops.

* ``compileops::xtoken_project`` / ``compileops::xtoken_project_backward``: ``p @ M`` for a
  frozen sparse ``M [V_s, V_t]`` held as plain CSR buffers, and ``grad @ M^T``. Both always
  compute in fp32 and return fp32; each has its own fp32 autocast rule (``register_autocast``
  covers only the op it is registered on), so a bf16 autocast region changes nothing.
* ``compileops::xtoken_chunk_sums`` / ``compileops::xtoken_chunk_sums_backward``: per-chunk
  row sums and sizes, and the gather of the sums' gradient back to the tokens.

All four are functional, with fake functions that check every precondition, and shapes that
never depend on tensor data. The checks and the index preprocessing both backends share live
in :mod:`compileops.xtoken.checks`; :mod:`compileops.xtoken.reference` is the math only.
"""
from __future__ import annotations

from typing import Optional

import torch

from compileops._library import as_rows

from compileops import backends
from compileops._library import custom_op
from compileops.xtoken import reference
from compileops.xtoken.checks import (
    COL_CSR,
    ROW_CSR,
    check_chunk_args,
    check_chunk_backward_args,
    check_column_values,
    check_csr_values_eagerly,
    check_project_args,
    check_project_backward_args,
    chunk_segments,
)


# ---------------------------------------------------------------------------------------
# Projection



@custom_op("xtoken_project")
def project_op(
    p: torch.Tensor,
    col_indptr: torch.Tensor,
    col_student_ids: torch.Tensor,
    col_weights: torch.Tensor,
    row_indptr: torch.Tensor,
    row_teacher_ids: torch.Tensor,
    row_weights: torch.Tensor,
    columns: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``p [*, V_s]`` -> fp32 ``p @ M`` ``[*, V_t]``, or ``[*, K]`` for ``columns [*, K]``.

    The row CSR is not read here; it is an input so the backward can use it. A column outside
    ``[0, V_t)`` raises ``IndexError`` on CPU; on CUDA it is masked (0 output, no gradient).
    On CPU the column CSR's values are checked too (``indptr`` a valid CSR pointer, student ids
    in ``[0, V_s)``); the kernels trust them.
    """
    check_project_args(p, col_indptr, col_student_ids, col_weights,
                       row_indptr, row_teacher_ids, row_weights, columns)
    check_column_values(columns, col_indptr.shape[0] - 1)
    check_csr_values_eagerly(col_indptr, col_student_ids, p.shape[-1], "column CSR", COL_CSR,
                             "p's last dim (the student vocab)")
    if backends.select("xtoken_project", p.device) == "triton":
        from compileops.xtoken import kernels

        flat = as_rows(p)
        segs = None if columns is None else as_rows(columns)
        out = kernels.csr_gather_sum(flat, col_indptr, col_student_ids, col_weights, segs)
        return out.reshape(*p.shape[:-1], out.shape[-1])
    # contiguous, as the fake declares: the reference result takes the layout of its index
    # inputs (a transposed ``columns`` gives a transposed output)
    return reference.project_forward(p, col_indptr, col_student_ids, col_weights,
                                     columns).contiguous()


@project_op.register_fake
def _project_fake(p, col_indptr, col_student_ids, col_weights,
                  row_indptr, row_teacher_ids, row_weights, columns=None):
    check_project_args(p, col_indptr, col_student_ids, col_weights,
                       row_indptr, row_teacher_ids, row_weights, columns)
    n_out = col_indptr.shape[0] - 1 if columns is None else columns.shape[-1]
    return p.new_empty((*p.shape[:-1], n_out), dtype=torch.float32)


def _project_setup_context(ctx, inputs, output) -> None:
    p, col_indptr, _cs, _cw, row_indptr, row_teacher_ids, row_weights, columns = inputs
    ctx.save_for_backward(row_indptr, row_teacher_ids, row_weights, columns)
    ctx.num_teacher = col_indptr.shape[0] - 1
    ctx.p_dtype = p.dtype


def _project_autograd(ctx, grad):
    row_indptr, row_teacher_ids, row_weights, columns = ctx.saved_tensors
    grad_p = project_backward_op(
        grad, row_indptr, row_teacher_ids, row_weights, ctx.num_teacher, columns
    )
    if grad_p.dtype != ctx.p_dtype:
        grad_p = grad_p.to(ctx.p_dtype)
    return grad_p, None, None, None, None, None, None, None


backends.register_autograd(project_op, _project_autograd, _project_setup_context)


@custom_op("xtoken_project_backward")
def project_backward_op(
    grad: torch.Tensor,
    row_indptr: torch.Tensor,
    row_teacher_ids: torch.Tensor,
    row_weights: torch.Tensor,
    num_teacher: int,
    columns: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``grad [*, V_t]`` (or ``[*, K]`` with ``columns``) -> fp32 ``grad @ M^T`` ``[*, V_s]``.

    A gather over the row CSR in a fixed order: deterministic, bitwise batch-invariant.
    """
    check_project_backward_args(grad, row_indptr, row_teacher_ids, row_weights,
                                num_teacher, columns)
    check_column_values(columns, num_teacher)
    check_csr_values_eagerly(row_indptr, row_teacher_ids, num_teacher, "row CSR", ROW_CSR,
                             "num_teacher")
    if backends.select("xtoken_project_backward", grad.device) == "triton":
        from compileops.xtoken import kernels

        flat = as_rows(grad)
        if columns is None:
            out = kernels.csr_gather_sum(flat, row_indptr, row_teacher_ids, row_weights)
        else:
            cols = as_rows(columns)
            out = kernels.csr_match_sum(flat, cols, row_indptr, row_teacher_ids, row_weights,
                                        num_teacher)
        return out.reshape(*grad.shape[:-1], out.shape[-1])
    return reference.project_backward(grad, row_indptr, row_teacher_ids, row_weights,
                                      num_teacher, columns).contiguous()


@project_backward_op.register_fake
def _project_backward_fake(grad, row_indptr, row_teacher_ids, row_weights, num_teacher,
                           columns=None):
    check_project_backward_args(grad, row_indptr, row_teacher_ids, row_weights,
                                num_teacher, columns)
    return grad.new_empty((*grad.shape[:-1], row_indptr.shape[0] - 1), dtype=torch.float32)


# fp32 inside autocast, forward and backward: each op carries its own rule.
for _op in (project_op, project_backward_op):
    for _device_type in ("cpu", "cuda"):
        torch.library.register_autocast(_op, _device_type, torch.float32)


# ---------------------------------------------------------------------------------------
# Chunk sums


@custom_op("xtoken_chunk_sums")
def chunk_sums_op(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs [B, T, V]``, ``chunk_id [B, T]`` -> ``sums [B, C, V]``, ``sizes [B, C]`` (fp32).

    Rows of one chunk are added in token order in fp32; ids outside ``[0, C)`` are ignored.
    """
    check_chunk_args(log_probs, chunk_id, max_chunks)
    if backends.select("xtoken_chunk_sums", log_probs.device) == "triton":
        from compileops.xtoken import kernels

        order, starts, ends = chunk_segments(chunk_id, max_chunks)
        sums = kernels.chunk_sums(log_probs, order, starts, ends)
        return sums, (ends - starts).float()
    sums, sizes = reference.chunk_sums(log_probs, chunk_id, max_chunks)
    return sums.contiguous(), sizes.contiguous()


@chunk_sums_op.register_fake
def _chunk_sums_fake(log_probs, chunk_id, max_chunks):
    check_chunk_args(log_probs, chunk_id, max_chunks)
    B, _, V = log_probs.shape
    return (log_probs.new_empty((B, max_chunks, V), dtype=torch.float32),
            log_probs.new_empty((B, max_chunks), dtype=torch.float32))


def _chunk_sums_setup_context(ctx, inputs, output) -> None:
    log_probs, chunk_id, _max_chunks = inputs
    ctx.save_for_backward(chunk_id)
    ctx.lp_dtype = log_probs.dtype
    ctx.mark_non_differentiable(output[1])


def _chunk_sums_autograd(ctx, grad_sums, _grad_sizes):
    (chunk_id,) = ctx.saved_tensors
    return chunk_sums_backward_op(grad_sums, chunk_id, ctx.lp_dtype), None, None


backends.register_autograd(chunk_sums_op, _chunk_sums_autograd, _chunk_sums_setup_context)


@custom_op("xtoken_chunk_sums_backward")
def chunk_sums_backward_op(
    grad_sums: torch.Tensor, chunk_id: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``grad_sums [B, C, V]``, ``chunk_id [B, T]`` -> ``[B, T, V]`` in ``dtype``: a gather."""
    check_chunk_backward_args(grad_sums, chunk_id, dtype)
    if backends.select("xtoken_chunk_sums_backward", grad_sums.device) == "triton":
        from compileops.xtoken import kernels

        return kernels.chunk_sums_backward(grad_sums, chunk_id, dtype)
    return reference.chunk_sums_backward(grad_sums, chunk_id, dtype).contiguous()  # (as above)


@chunk_sums_backward_op.register_fake
def _chunk_sums_backward_fake(grad_sums, chunk_id, dtype):
    check_chunk_backward_args(grad_sums, chunk_id, dtype)
    B, _, V = grad_sums.shape
    return grad_sums.new_empty((B, chunk_id.shape[1], V), dtype=dtype)
