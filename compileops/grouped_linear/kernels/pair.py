"""Eager launchers of the gate/up pair kept as two weights: the M-jagged kernel
(:mod:`.mjagged`) with its ``SECOND_WEIGHT`` (the SwiGLU forward reading the up tile from the
second weight; dX running a second K loop over it)."""
from __future__ import annotations

import torch

from compileops.grouped_linear.kernels.mjagged import mjagged_gemm


def _pair_strides(w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate/up pair with one set of strides (the kernels address both through the
    gate's): each as it is when they match, else both made contiguous."""
    if w_gate.stride() == w_up.stride():
        return w_gate, w_up
    return w_gate.contiguous(), w_up.contiguous()


def grouped_linear_swiglu_pair_forward(x, w_gate, w_up, offsets, *, batch_invariant=False,
                                       use_tma=None, preact=None):
    """x ``[M, K]``, w_gate and w_up ``[G, H, K]`` -> ``silu(x W_gate^T) * (x W_up^T)``
    ``[M, H]``, reading the two weights where they are (no concatenated copy); ``preact [M,
    2H]``, if given, receives the gate then the up pre-activations in its dtype. The same
    tiles and sums as :func:`grouped_linear_swiglu_forward` on ``cat([w_gate, w_up], 1)``."""
    w_gate, w_up = _pair_strides(w_gate, w_up)
    h = w_gate.shape[1]
    return mjagged_gemm(x, w_gate, (w_gate.stride(0), w_gate.stride(2), w_gate.stride(1)),
                        offsets, h, swiglu=True, out_dtype=x.dtype,
                        batch_invariant=batch_invariant, use_tma=use_tma, preact=preact,
                        second_weight=w_up)


def grouped_linear_dx_pair(grad, w_gate, w_up, offsets, *, batch_invariant=False, use_tma=None):
    """grad ``[M, 2H]`` (gate columns, then up), w_gate and w_up ``[G, H, K]`` -> ``dX [M, K]
    = grad_g[:, :H] @ W_gate_g + grad_g[:, H:] @ W_up_g``, one fp32 accumulator per tile
    (bitwise :func:`grouped_linear_dx` on the concatenated weight when the config's
    ``BLOCK_K`` divides H)."""
    w_gate, w_up = _pair_strides(w_gate, w_up)
    k = w_gate.shape[2]
    return mjagged_gemm(grad, w_gate, (w_gate.stride(0), w_gate.stride(1), w_gate.stride(2)),
                        offsets, k, out_dtype=grad.dtype, batch_invariant=batch_invariant,
                        b_kn=True, use_tma=use_tma, second_weight=w_up)
