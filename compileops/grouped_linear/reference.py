"""Ground truth for the grouped linear family, in plain PyTorch.

What the tests compare against and what the ``reference`` backend runs. Groups are
contiguous row ranges: group ``g`` owns rows ``[offsets[g-1], offsets[g])`` (``offsets[-1]
= 0``); rows past ``offsets[G-1]`` belong to no group and their output is exactly zero.

Sync-free: the group id of each row comes from ``searchsorted`` on the device, and each
group is a masked dense product (a Python loop over the static ``G``), so no group size is
ever read on the host. It costs ``G`` dense GEMMs: fine for a reference and small CPU runs.
Low-precision inputs are computed in fp32 and cast once; fp64 inputs stay fp64. Only the
math lives here: argument checks shared by both backends are in ``checks.py``.
"""
from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the grouped-linear math: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_groups(offsets: torch.Tensor, m: int) -> torch.Tensor:
    """``[M]`` int64 group id per row; ``G`` for rows past the last offset."""
    rows = torch.arange(m, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets.contiguous(), rows, right=True)


def _rows_by_group(product, offsets, rows: int, groups: int, width: int, dtype, device):
    """``[rows, width]``: row r takes row r of ``product(g(r))``; rows of no group stay 0.

    ``product(g)`` is the full ``[rows, width]`` product with group g's weight: wasteful but
    obviously correct, which is what a reference is for.
    """
    gid = row_groups(offsets, rows)
    out = torch.zeros((rows, width), dtype=dtype, device=device)
    for g in range(groups):
        out = torch.where((gid == g)[:, None], product(g), out)
    return out


def grouped_linear_forward(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x ``[M, K]``, weight ``[G, N, K]``, offsets int ``[G]``, bias ``[G, N]`` -> ``[M, N]``:
    ``y[r] = x[r] @ weight[g(r)].T + bias[g(r)]``; rows of no group are 0."""
    cdt = compute_dtype(x.dtype)
    xc = x.to(cdt)

    def product(g: int) -> torch.Tensor:
        yg = xc @ weight[g].to(cdt).t()
        return yg if bias is None else yg + bias[g].to(cdt)

    return _rows_by_group(product, offsets, x.shape[0], weight.shape[0], weight.shape[1], cdt,
                          x.device).to(x.dtype)


def grouped_linear_row_scaled(x, weight, offsets, row_scale) -> torch.Tensor:
    """``grouped_linear_forward(x, weight, offsets) * row_scale[:, None]``: the product rounded
    to x's dtype, then each row times its scale (``row_scale [M]`` in x's dtype), rounded
    again; the bits of writing the two steps out."""
    return grouped_linear_forward(x, weight, offsets) * row_scale.unsqueeze(-1)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``[..., 2H] -> [..., H]``: ``silu(h[..., :H]) * h[..., H:]`` (gate first, then up)."""
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def grouped_linear_swiglu_forward(x, weight, offsets, bias=None) -> torch.Tensor:
    """weight ``[G, 2H, K]`` -> ``swiglu(x W_g^T + b_g)`` ``[M, H]``, computed in fp32, cast once."""
    return grouped_linear_swiglu_with_preact(x, weight, offsets, bias)[0]


def grouped_linear_swiglu_with_preact(x, weight, offsets, bias=None):
    """``(swiglu(h) [M, H], h [M, 2H])`` with ``h = x W_g^T + b_g`` computed in fp32, each cast
    once to x's dtype (the training form: the backward reads ``h``)."""
    cdt = compute_dtype(x.dtype)
    h = grouped_linear_forward(x.to(cdt), weight.to(cdt), offsets,
                               None if bias is None else bias.to(cdt))
    return swiglu(h).to(x.dtype), h.to(x.dtype)


def grouped_linear_dx(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad ``[M, N]`` -> ``dX [M, K]``, ``dX[r] = grad[r] @ weight[g(r)]``; rows of no group 0."""
    cdt = compute_dtype(grad.dtype)
    gc = grad.to(cdt)
    return _rows_by_group(lambda g: gc @ weight[g].to(cdt), offsets, grad.shape[0],
                          weight.shape[0], weight.shape[2], cdt, grad.device).to(grad.dtype)


def grouped_linear_wgrad(grad, x, offsets, weight_dtype, bias_dtype, with_db=True):
    """``(dW [G, N, K], db [G, N])``: ``dW_g = grad_g^T x_g``, ``db_g = sum of grad_g rows``.
    An empty group gives exact zeros. ``with_db=False``: ``(dW, None)``."""
    m, n, k = grad.shape[0], grad.shape[1], x.shape[1]
    groups = offsets.shape[0]
    cdt = compute_dtype(grad.dtype)
    gid = row_groups(offsets, m)
    gc, xc = grad.to(cdt), x.to(cdt)
    dws, dbs = [], []
    for g in range(groups):
        in_g = (gid == g)[:, None]
        gg = torch.where(in_g, gc, torch.zeros((), dtype=cdt, device=grad.device))
        xg = torch.where(in_g, xc, torch.zeros((), dtype=cdt, device=grad.device))
        dws.append(gg.t() @ xg)
        if with_db:
            dbs.append(gg.sum(0))
    if groups == 0:
        return (torch.zeros((0, n, k), dtype=weight_dtype, device=grad.device),
                torch.zeros((0, n), dtype=bias_dtype, device=grad.device) if with_db else None)
    dw = torch.stack(dws).to(weight_dtype)
    return dw, torch.stack(dbs).to(bias_dtype) if with_db else None
