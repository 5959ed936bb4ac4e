"""Helpers shared by the mLSTM tests: inputs, the fp64 ground truth (autograd through
``reference.mlstm_parallel -> reference.multihead_layernorm``) and the stated precision.

Shapes: ``q, k [B, NH, S, DQK]``, ``v [B, NH, S, DV]``, ``igate, fgate [B, NH, S]``,
``norm_weight, norm_bias [NH * DV]``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import compileops
from compileops.mlstm import reference
from compileops.testing import assert_close_to_reference

# Relative L2 error against the fp64 reference on the same (rounded) inputs, per dtype: the
# figures of compileops.mlstm.mlstm's docstring ("Precision"). test_kernels.py checks that the
# docstring states them; the measured worst cases are in its module docstring.
OUT_TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-3}
GRAD_TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 4e-2, torch.float16: 4e-3}

BACKENDS = ["reference", "triton"]
GRAD_NAMES = ("q", "k", "v", "igate", "fgate", "norm_weight", "norm_bias")


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    igate: torch.Tensor
    fgate: torch.Tensor
    norm_weight: Optional[torch.Tensor] = None
    norm_bias: Optional[torch.Tensor] = None

    def tensors(self) -> list[torch.Tensor]:
        """The differentiable inputs in GRAD_NAMES order (absent norm params left out)."""
        return [t for t in (self.q, self.k, self.v, self.igate, self.fgate, self.norm_weight,
                            self.norm_bias) if t is not None]

    def names(self) -> list[str]:
        return [n for n, t in zip(GRAD_NAMES, (self.q, self.k, self.v, self.igate, self.fgate,
                                               self.norm_weight, self.norm_bias))
                if t is not None]

    def map(self, fn) -> "Inputs":
        return Inputs(*[None if t is None else fn(t) for t in (
            self.q, self.k, self.v, self.igate, self.fgate, self.norm_weight, self.norm_bias)])

    def leaves(self, dtype: Optional[torch.dtype] = None) -> "Inputs":
        """Fresh leaf copies requiring grad (cast to ``dtype`` when given)."""
        return self.map(lambda t: t.detach().to(dtype or t.dtype).clone().requires_grad_(True))

    @property
    def normed(self) -> bool:
        return self.norm_weight is not None or self.norm_bias is not None


def make_inputs(B, NH, S, DQK, DV, *, dtype=torch.float64, weight=True, bias=True, seed=0,
                fgate_bias=3.0, device="cpu") -> Inputs:
    """Random inputs, drawn in fp64 on the CPU from a fixed seed, then cast and moved. The
    forget-gate pre-activations are centred at ``fgate_bias`` (mostly open gates, as in a
    trained xLSTM, so that far keys still count); the input gates at 0."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(B, NH, S, DQK), randn(B, NH, S, DQK), randn(B, NH, S, DV)
    igate, fgate = randn(B, NH, S), randn(B, NH, S) + fgate_bias
    w = randn(NH * DV) if weight else None
    b = randn(NH * DV) if bias else None
    return Inputs(q, k, v, igate, fgate, w, b).map(lambda t: t.to(device, dtype))


def reference_out(x: Inputs, *, norm_eps=1e-6, eps=1e-6, residual_weight=False):
    """The ground truth the op is held to: ``reference.mlstm_parallel`` then, when a norm
    weight or bias is given, ``reference.multihead_layernorm`` (on the unrounded h)."""
    if not x.normed:
        h, _, _ = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate, eps)
        return h
    h, _, _ = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate, eps, round_h=False)
    return reference.multihead_layernorm(h, x.norm_weight, x.norm_bias, norm_eps,
                                         residual_weight, x.v.dtype)


def op_out(x: Inputs, **kwargs):
    return compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight,
                            norm_bias=x.norm_bias, **kwargs)


def fw_bw(fn, x: Inputs, grad_out: Optional[torch.Tensor] = None, loss=None, **kwargs):
    """``(out, grads)`` of ``fn(leaves, **kwargs)`` for fresh leaves of ``x``: the gradients
    of ``loss(out)`` when given, else of ``out`` for the cotangent ``grad_out``."""
    leaves = x.leaves()
    out = fn(leaves, **kwargs)
    if loss is not None:
        grads = torch.autograd.grad(loss(out), leaves.tensors())
    else:
        grads = torch.autograd.grad(out, leaves.tensors(), grad_out)
    return out.detach(), list(grads)


def cotangent(shape, dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)


def out_shape(x: Inputs):
    b, nh, s, _ = x.q.shape
    dv = x.v.shape[-1]
    return (b, s, nh * dv) if x.normed else (b, nh, s, dv)


def check_precision(x: Inputs, dtype, *, backend="triton", seed=1, out_tol=None, grad_tol=None,
                    kernel="auto", **kwargs) -> list[float]:
    """``x`` (fp64) rounded to ``dtype``: our op in ``dtype`` against fp64 autograd through the
    reference on the rounded values, output and every gradient within ``OUT_TOL`` /
    ``GRAD_TOL`` (relative L2; or ``out_tol`` / ``grad_tol``). Returns the relative errors,
    the output's first, then GRAD_NAMES order."""
    out_tol = OUT_TOL[dtype] if out_tol is None else out_tol
    grad_tol = GRAD_TOL[dtype] if grad_tol is None else grad_tol
    rounded = x.map(lambda t: t.to(dtype).to(torch.float64))
    grad = cotangent(out_shape(x), dtype, seed=seed, device=x.q.device)
    want_out, want = fw_bw(reference_out, rounded, grad.double(), **kwargs)
    with compileops.use_backend(backend):
        got_out, got = fw_bw(op_out, rounded.map(lambda t: t.to(dtype)), grad, kernel=kernel,
                             **kwargs)
    assert got_out.dtype == dtype
    errors = [assert_close_to_reference(got_out, want_out, max_relative_error=out_tol,
                                        what=f"{dtype} output").relative_error]
    for name, g, w in zip(x.names(), got, want):
        assert g.dtype == dtype, name
        errors.append(assert_close_to_reference(
            g, w, max_relative_error=grad_tol, what=f"{dtype} d{name}").relative_error)
    return errors


def check_contract(backend, x: Inputs, *, eps, norm_eps=1e-6, residual_weight=False,
                   offset_seed=7, atol=1e-5, rtol=1e-5, relative=None):
    """The seed's contract: loss ``((out + offset) ** 2).sum()`` with ``offset = 3 * randn``;
    the op's output and gradients (inputs in ``x``'s dtype) against fp64 autograd through
    the reference, ``torch.testing.assert_close`` at ``atol``/``rtol`` (1e-5); or, with
    ``relative``, each within that relative L2 error (fp32: elementwise 1e-5 is an fp64
    bar, cancelling gradient entries lose more than that in fp32 arithmetic)."""
    gen = torch.Generator().manual_seed(offset_seed)
    offset = 3.0 * torch.randn(out_shape(x), generator=gen, dtype=torch.float64)
    offset = offset.to(x.q.device)

    def loss(out):
        return ((out + offset) ** 2).sum()

    kwargs = dict(eps=eps, norm_eps=norm_eps, residual_weight=residual_weight)
    want_out, want = fw_bw(reference_out, x.map(lambda t: t.to(torch.float64)), loss=loss,
                           **kwargs)
    with compileops.use_backend(backend):
        got_out, got = fw_bw(op_out, x, loss=loss, **kwargs)
    assert got_out.shape == want_out.shape and got_out.dtype == x.q.dtype
    for name, g, w in [("out", got_out, want_out), *zip(x.names(), got, want)]:
        assert g.shape == w.shape, name
        if relative is not None:
            assert_close_to_reference(g, w, max_relative_error=relative, what=name)
        else:
            torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol,
                                       msg=lambda m: f"{name}: {m}")
