"""The embedding forward: a row gather with 64-bit row offsets (tables past 2**31 elements
work), upcasting only the gathered rows."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import _launch
from ..._launch import cdiv
from .. import checks
from .cast import cast_as_torch
from .config import ForwardConfig, device_options


@triton.jit
def gather_rows_tile(
    ids_ptr, weight_ptr, out_ptr,
    n_tokens, num_embeddings, dim,
    stride_w_row, stride_w_col,
    pid_tok, pid_col,
    BLOCK_TOK: tl.constexpr, BLOCK_COL: tl.constexpr,
):
    """Copy rows ``weight[ids[t]]`` of tokens ``[pid_tok * BLOCK_TOK, +BLOCK_TOK)``,
    columns ``[pid_col * BLOCK_COL, +BLOCK_COL)``, into ``out``.

    * ``ids_ptr``: ids ``[n_tokens]`` int32 or int64, contiguous.
    * ``weight_ptr``: table ``[num_embeddings, dim]``, row stride ``stride_w_row``, column
      stride ``stride_w_col`` (any strides; offsets in int64).
    * ``out_ptr``: ``[n_tokens, dim]`` contiguous, in its own dtype (the rows are cast).
    """
    toks = pid_tok * BLOCK_TOK + tl.arange(0, BLOCK_TOK)
    cols = pid_col * BLOCK_COL + tl.arange(0, BLOCK_COL)
    tok_ok = toks < n_tokens
    col_ok = cols < dim
    ids = tl.load(ids_ptr + toks, mask=tok_ok, other=0).to(tl.int64)  # [BLOCK_TOK]
    # Active only when compiled with debug=True (the launcher does so on GPUs). The message
    # must be a literal: Triton kernels cannot read non-constexpr globals.
    tl.device_assert(
        (ids >= 0) & (ids < num_embeddings),
        "compileops.embedding: id out of range [0, num_embeddings)",
        mask=tok_ok,
    )
    mask = tok_ok[:, None] & col_ok[None, :]
    src = weight_ptr + ids[:, None] * stride_w_row + cols[None, :].to(tl.int64) * stride_w_col
    rows = tl.load(src, mask=mask)  # [BLOCK_TOK, BLOCK_COL]
    dst = out_ptr + toks[:, None].to(tl.int64) * dim + cols[None, :]
    tl.store(dst, cast_as_torch(rows, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def embedding_forward_kernel(
    ids_ptr, weight_ptr, out_ptr,
    n_tokens, num_embeddings, dim,
    stride_w_row, stride_w_col,
    BLOCK_TOK: tl.constexpr, BLOCK_COL: tl.constexpr,
):
    """``out [n_tokens, dim] = weight [num_embeddings, dim] [ids [n_tokens]]``; program
    (t, c) copies the ``[BLOCK_TOK, BLOCK_COL]`` tile (t, c) (see ``gather_rows_tile``)."""
    gather_rows_tile(
        ids_ptr, weight_ptr, out_ptr, n_tokens, num_embeddings, dim,
        stride_w_row, stride_w_col, tl.program_id(0), tl.program_id(1),
        BLOCK_TOK, BLOCK_COL,
    )


def embedding_forward(
    ids: torch.Tensor, weight: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
    *, config: Optional[ForwardConfig] = None,
) -> torch.Tensor:
    """ids ``[*]`` int32/int64, weight ``[V, D]`` -> ``[*, D]`` in ``out_dtype or weight.dtype``.

    ``config``: the tile shape (default :meth:`ForwardConfig.default`)."""
    num_embeddings, dim = weight.shape
    out_dtype = out_dtype or weight.dtype
    flat_ids = checks.flatten_ids(ids)
    n_tokens = flat_ids.numel()
    # Allocated in its final shape (the kernel writes it as the contiguous [n_tokens, dim]
    # it is): a reshape of a [n_tokens, dim] buffer would be a view, and autograd refuses
    # in-place ops on a view that a custom op returns.
    out = torch.empty((*ids.shape, dim), dtype=out_dtype, device=weight.device)
    if n_tokens and dim and _launch.interpreter_casts_wrongly(weight.dtype, out_dtype):
        # an fp64 table read as bf16, under the interpreter: gathered in fp64, rounded by torch
        return out.copy_(embedding_forward(ids, weight, config=config))
    if n_tokens and dim:
        config = config or ForwardConfig.default(dim, weight.element_size())
        grid = (cdiv(n_tokens, config.block_tok), cdiv(dim, config.block_col))
        _launch.launch(
            embedding_forward_kernel, grid,
            (flat_ids, weight, out, n_tokens, num_embeddings, dim,
             weight.stride(0), weight.stride(1)),
            dict(BLOCK_TOK=config.block_tok, BLOCK_COL=config.block_col),
            dict(num_warps=config.num_warps, **device_options(weight.device)),
        )
    return out
