"""fp8 (e4m3) quantisation for the grouped linear: the rule that fp8 kernels are held to.

Two scalings, both with one fp32 scale per group of values along the reduction dim K:

* **rowwise**: one scale per row of a ``[..., K]`` operand: per token for activations
  ``x [M, K]``, per output channel for weights ``W [G, N, K]``;
* **blockwise** (DeepSeek-V3's): ``1 x 128`` tiles along K for activations, ``128 x 128``
  blocks for weights. A ragged last tile (K or N not a multiple of 128) is a smaller tile.

The rule, per row, tile or block with largest magnitude ``amax``:

* ``scale = amax / 448`` (fp32; 448 is e4m3's largest finite value), so the largest value
  maps to +-448 and the operand is recovered as ``q * scale``;
* ``q = e4m3(x * (448 / amax))``: one fp32 quotient per group (correctly rounded, like the
  scale), one fp32 product per value, rounded to nearest (ties to even) with saturation at
  +-448;
* a group whose ``amax`` is below :data:`MIN_AMAX` ``= 448 * 2^-126`` (about 5.3e-36), an
  all-zero group among them, gets ``scale = 1``: its values, all far below e4m3's smallest
  subnormal (``2^-9``), quantise to zeros (of their signs) and come back as exact zeros, an
  error under 5.3e-36 per value. So every scale is 1 or a normal fp32 number, and ``448 /
  amax`` is at most ``2^126`` (it overflows fp32 for an amax below about 1.3e-36, which would
  turn a tiny group's values into +-448 or NaN). Every group at or above :data:`MIN_AMAX`
  keeps e4m3's full precision;
* a group holding a NaN or an infinity gets a NaN or infinite scale, so its values come back
  NaN or infinite: a non-finite input is never turned into finite numbers.

**dX from the forward's weight copy** (rowwise). ``dX = dY_g @ W_g`` reduces over N, while
the forward's copy ``W ~ diag(s_w) q_w`` has one scale per output channel n, along that very
reduction. So the scales go with dY instead: ``dY_g @ W_g ~ (dY_g * s_w[g]) @ q_w``, and
``dY_g * s_w[g]`` (fp32, one correctly rounded product per value) is quantised per row like
any activation (:func:`scale_gradient_rows`, :func:`prescaled_dx_reference`). One e4m3 copy
of the weight serves both products, transposed for dX's reduction; there is no second,
column-wise quantisation of the weight. The cost in error, measured against fp64 on
unit-normal weights and gradients (12 seeds): dX's relative error is 1.0015x (+-0.0004) that
of quantising the weight per input channel; with output channels of unequal magnitude (the
weights or gradients skewed per channel), 0.81-0.94x, because each output channel keeps its
own scale.

**dW in fp8** (rowwise, opt-in: ``fp8_weight_grad=True``). ``dW_g = dY_g^T X_g`` reduces
over the group's rows (tokens), so its scales must be constant along them: both operands are
quantised with one scale per group and column, over that group's rows
(:func:`quantize_group_columns`), written transposed (``[C, M]``: the reduction runs along
memory, as Hopper's e4m3 products read their operands). Then ``dW_g[n, k] = s_dy[g, n] *
s_x[g, k] * sum_r q_dy[n, r] q_x[k, r]`` (:func:`grouped_linear_wgrad_reference`). A column's
scale spans all of its group's rows, so one large token shrinks the resolution of the whole
column of that group: the error is that of quantising with the group's column amax, measured
in :mod:`compileops.grouped_linear.fp8_wgrad_op`.

Why e4m3 for gradients too: with a scale per row or per tile, the dynamic range a format must
cover is that of one group, which e4m3's 18 binades of normals and subnormals hold; its 3
mantissa bits halve e5m2's rounding error.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from compileops.grouped_linear.reference import grouped_linear_forward, row_groups

__all__ = ["ACTIVATION_BLOCK", "E4M3", "E4M3_MAX", "MIN_AMAX", "WEIGHT_BLOCK", "dequantize",
           "grouped_linear_dx_reference", "grouped_linear_reference",
           "grouped_linear_wgrad_reference", "prescaled_dx_reference",
           "quantize_blockwise", "quantize_group_columns", "quantize_rowwise",
           "scale_gradient_rows"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
#: Groups whose amax is below this get scale 1 and come back as zeros (module docstring):
#: the smallest amax whose scale ``amax / 448`` is a normal fp32 number (``2^-126``). Exact in
#: fp32 (``7 * 2^-120``), so every kernel compares against these bits. Why not torchao's
#: floor: torchao's float8 clamps amax from below by ``EPS = 1e-12`` before ``max / amax``
#: (pytorch/ao, ``torchao/float8/float8_utils.py``, ``amax_to_scale``), which avoids the
#: overflow too but quantises every group below 1e-12 on the floor's grid: such a group
#: loses e4m3's range below its largest value, and one under about 2.2e-18 comes back as
#: zeros. A row of gradients can be that small; this bound changes only groups whose scale
#: would not be a normal number.
MIN_AMAX = 448.0 * 2.0 ** -126
ACTIVATION_BLOCK = (1, 128)  # (rows, K) per scale
WEIGHT_BLOCK = (128, 128)  # (N, K) per scale


def _check_float(x: torch.Tensor, name: str, min_dim: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == E4M3:
        raise TypeError(f"{name} must be a floating-point tensor (not fp8), got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape "
                         f"{tuple(x.shape)}")


def _quantize(x: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32) and the groups' ``amax`` broadcast to it -> (``q`` e4m3, ``scale``)."""
    # All-zero and tiny groups (a NaN amax compares False and stays NaN): scale 1.
    flushed = amax < MIN_AMAX
    # Tensor-by-tensor divisions: correctly rounded fp32 quotients, as a kernel's
    # ``div_rn`` computes them (``448 / amax`` on a tensor is computed by torch as
    # ``448 * (1 / amax)``, rounded twice).
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    inverse = torch.where(flushed, 1.0, e4m3_max / amax)
    scale = torch.where(flushed, 1.0, amax / e4m3_max)
    # e4m3fn has no infinity: clamp first so that only NaN stays out of range.
    q = (x * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def quantize_rowwise(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> ``(q [..., K] e4m3, scale [...] fp32)``, one scale per row along
    the last dim. ``x`` is not modified."""
    _check_float(x, "x", 1)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else xf.new_zeros(
        (*x.shape[:-1], 1))
    q, scale = _quantize(xf, amax)
    return q, scale.squeeze(-1)


def _tiles(n: int, size: int) -> int:
    return -(-n // size)


def quantize_blockwise(x: torch.Tensor, block: Tuple[int, int]) -> Tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """``x [..., R, K]`` -> ``(q [..., R, K] e4m3, scale [..., ceil(R / block[0]),
    ceil(K / block[1])] fp32)``, one scale per ``block`` of the last two dims
    (:data:`ACTIVATION_BLOCK` for activations ``[M, K]``, :data:`WEIGHT_BLOCK` for weights
    ``[G, N, K]``). Ragged last blocks are smaller blocks. ``x`` is not modified."""
    _check_float(x, "x", 2)
    rows, cols = (int(b) for b in block)
    if rows < 1 or cols < 1:
        raise ValueError(f"block must be two positive sizes, got {block}")
    *lead, r, k = x.shape
    tr, tk = _tiles(r, rows), _tiles(k, cols)
    xf = x.float()
    # Pad with zeros to whole blocks: zeros never raise an amax.
    padded = torch.nn.functional.pad(xf, (0, tk * cols - k, 0, tr * rows - r))
    grouped = padded.reshape(*lead, tr, rows, tk, cols)
    amax = grouped.abs().amax(dim=(-3, -1), keepdim=True)
    q, scale = _quantize(grouped, amax)
    q = q.reshape(*lead, tr * rows, tk * cols)[..., :r, :k]
    return q, scale.reshape(*lead, tr, tk)


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               block: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """fp32 ``q * scale``: rowwise when ``block`` is None (``scale [...]`` for ``q [...,
    K]``), else per block of the last two dims as :func:`quantize_blockwise` lays it out."""
    if q.dtype != E4M3:
        raise TypeError(f"q must be {E4M3}, got {q.dtype}")
    qf = q.float()
    if block is None:
        return qf * scale.unsqueeze(-1)
    rows, cols = block
    expanded = scale.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return qf * expanded[..., :q.shape[-2], :q.shape[-1]]


def grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                             scaling: str) -> torch.Tensor:
    """The fp8 grouped linear's forward as its kernels must compute it, in plain PyTorch:
    ``x [M, K]`` and ``weight [G, N, K]`` quantised to e4m3 (``scaling``: ``"rowwise"``, per
    token and per output channel; ``"blockwise"``, :data:`ACTIVATION_BLOCK` and
    :data:`WEIGHT_BLOCK`), then ``y[r] = dq(x)[r] @ dq(weight[g(r)]).T`` in fp32, rounded once
    to x's dtype (rows of no group are 0; groups as in
    :func:`compileops.grouped_linear.reference.grouped_linear_forward`). The products of two
    e4m3 values are exact in fp32, so a kernel differs from this only in the order of its
    fp32 sums."""
    if scaling == "rowwise":
        xq, wq = (dequantize(*quantize_rowwise(t)) for t in (x, weight))
    elif scaling == "blockwise":
        xq = dequantize(*quantize_blockwise(x, ACTIVATION_BLOCK), ACTIVATION_BLOCK)
        wq = dequantize(*quantize_blockwise(weight, WEIGHT_BLOCK), WEIGHT_BLOCK)
    else:
        raise ValueError(f"scaling must be 'rowwise' or 'blockwise', got {scaling!r}")
    return grouped_linear_forward(xq, wq, offsets).to(x.dtype)


def scale_gradient_rows(grad: torch.Tensor, weight_scale: torch.Tensor,
                        offsets: torch.Tensor) -> torch.Tensor:
    """``grad [M, N]`` times the forward weight copy's scales of each row's group:
    ``grad[r] * weight_scale[g(r)]`` (``weight_scale [G, N]`` fp32), in fp32 ``[M, N]``: the
    operand that dX quantises per row (module docstring). Rows of no group take the last
    group's scales (their dX is zero whatever they hold). Plain torch ops: compiled, they
    fuse into dX's row quantisation, so the product is never written out."""
    groups = weight_scale.shape[0]
    if groups == 0:  # no group: every row's dX is zero
        return torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
    group_of_row = row_groups(offsets, grad.shape[0]).clamp(max=groups - 1)
    return grad.float() * weight_scale.index_select(0, group_of_row.long())


def prescaled_dx_reference(scaled_grad: torch.Tensor, weight_q_t: torch.Tensor,
                           offsets: torch.Tensor) -> torch.Tensor:
    """dX in fp32 ``[M, K]`` as the kernels compute it, from :func:`scale_gradient_rows`'
    ``scaled_grad [M, N]`` and the forward's e4m3 weight copy transposed, ``weight_q_t [G, K,
    N]``: ``scaled_grad`` quantised per row, then ``dq(scaled_grad)[r] @ weight_q_t[g(r)].T``
    in fp32 (the weight's scales are already in ``scaled_grad``)."""
    return grouped_linear_forward(dequantize(*quantize_rowwise(scaled_grad.float())),
                                  weight_q_t.float(), offsets)


def grouped_linear_dx_reference(grad: torch.Tensor, weight: torch.Tensor,
                                offsets: torch.Tensor, scaling: str) -> torch.Tensor:
    """The fp8 dX ``grad_g @ W_g`` (``grad [M, N]``, ``weight [G, N, K]``) as the kernels
    compute it, in fp32 ``[M, K]``: rowwise from the forward's weight copy (module
    docstring), blockwise from the one block quantisation of both products."""
    if scaling == "rowwise":
        weight_q, weight_scale = quantize_rowwise(weight.float())
        return prescaled_dx_reference(scale_gradient_rows(grad, weight_scale, offsets),
                                      weight_q.transpose(1, 2), offsets)
    if scaling == "blockwise":
        return grouped_linear_reference(grad.float(), weight.float().transpose(1, 2),
                                        offsets, scaling).float()
    raise ValueError(f"scaling must be 'rowwise' or 'blockwise', got {scaling!r}")


def quantize_group_columns(x: torch.Tensor, offsets: torch.Tensor
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [M, C]``, offsets int ``[G]`` (cumulative end row of each group) -> ``(q_t [C, M]``
    e4m3, ``scale [G, C]`` fp32): one scale per group and column, over the group's rows (the
    rule of the module docstring per ``(group, column)``), the codes written transposed. Rows
    of no group (past ``offsets[-1]``) get zero codes; an empty group's scales are 1. ``x``
    is not modified."""
    _check_float(x, "x", 2)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, C], got shape {tuple(x.shape)}")
    xf = x.float()
    groups = offsets.shape[0]
    group_of_row = row_groups(offsets, x.shape[0])  # G for rows of no group
    magnitude = xf.abs()
    # A masked amax per group (a NaN in the group stays NaN; rows elsewhere count as 0).
    amax = torch.stack([torch.where((group_of_row == g)[:, None], magnitude, 0.0).amax(0)
                        if x.shape[0] else xf.new_zeros(x.shape[1]) for g in range(groups)]
                       ) if groups else xf.new_zeros((0, x.shape[1]))
    # Each row quantised with its group's column amax; rows of no group with amax 0.
    padded = torch.cat([amax, xf.new_zeros((1, x.shape[1]))])
    q, _ = _quantize(xf, padded.index_select(0, group_of_row.long()))
    q = torch.where((group_of_row < groups)[:, None], q.float(), 0.0).to(E4M3)
    _, scale = _quantize(amax, amax)
    return q.t().contiguous(), scale


def grouped_linear_wgrad_reference(grad: torch.Tensor, x: torch.Tensor,
                                   offsets: torch.Tensor) -> torch.Tensor:
    """fp8 ``dW [G, N, K]`` in fp32 as the kernels compute it, for ``grad [M, N]`` and ``x [M,
    K]``: both quantised per group and column (:func:`quantize_group_columns`), the e4m3
    products of each group summed in fp32 (exact products; a kernel differs only in the
    order of its sums), then times ``s_dy[g, n] * s_x[g, k]``. Empty groups give zeros."""
    dy_q, dy_scale = quantize_group_columns(grad, offsets)  # [N, M], [G, N]
    x_q, x_scale = quantize_group_columns(x, offsets)  # [K, M], [G, K]
    group_of_row = row_groups(offsets, grad.shape[0])
    dyf, xf = dy_q.float(), x_q.float()
    sums = torch.stack([torch.where(group_of_row == g, dyf, 0.0) @ xf.t()
                        for g in range(offsets.shape[0])]) if offsets.shape[0] else \
        dyf.new_zeros((0, grad.shape[1], x.shape[1]))
    return sums * dy_scale[:, :, None] * x_scale[:, None, :]
