"""Inductor lowering of ``compileops::mlstm_parallel``: a Triton template with the norm inside.

The template (``templates/mlstm.py.jinja``) calls the eager kernel's ``@triton.jit`` tile body
(``compileops/mlstm/kernels/forward.py``), so no kernel math is written twice. The main output
(``[B, S, NH * DV]`` normed, else ``[B, NH, S, DV]``) goes through ``store_output``: pointwise
consumers, the xLSTM block's output gate ``sigmoid(o) * h`` and casts, fuse as its epilogue.
The norm is a reduction over DV, so it cannot be an epilogue: it runs inside the template,
where a program holds whole rows. The raw h (when the backward needs it), the stabiliser and
the row sum are extra outputs, allocated here and passed as mutated inputs. The column terms
and their running max (``compileops::mlstm_column_terms``) are an extern call just before it.

Sizes: the head dims are static (they are constexpr tile widths); the sequence length and the
batch stay symbolic under ``dynamic=True`` (the kernel masks ragged tiles). The one guard:
S % 16 == 0 when S's first value is a multiple of 16, which keeps the per-row gate accesses
aligned (see :func:`lower_mlstm_parallel`). One heuristic config (the eager launcher's), no
compile-time benchmarking.
Without Triton codegen for the device, or for fp64 (the contract tests' dtype, run by the
eager kernels), or head dims past the kernels' limit: an extern call of the op. The choice and
its reason are logged on ``compileops.mlstm`` (``COMPILEOPS_LOG``), the guards on
``compileops.guards``.

``compileops::mlstm_parallel_backward`` is not lowered: it stays an extern call of our eager
dQ and dK/dV kernels (its outputs feed the projections' GEMMs, with no pointwise neighbour
worth fusing); the gate-gradient scan and sigmoid around it are plain torch ops that Inductor
fuses itself.
"""
from __future__ import annotations

import functools
import logging
import math
import os

import torch

from compileops import _log
from compileops.lowerings import _compat

logger = _log.get_logger("mlstm")

_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "templates", "mlstm.py.jinja")


def _grid(batch, heads, seq, _dqk, meta, *, cdiv):
    # Flat and head-major, as the eager launcher's (kernels.common.head_major_tile).
    return (batch * heads * cdiv(seq, meta["BLOCK_M"]), 1, 1)


@functools.lru_cache(maxsize=None)
def template():
    with open(_TEMPLATE_PATH) as f:
        source = f.read()
    return _compat.triton_template("compileops_mlstm", _compat.symbolic_grid_fn(_grid), source)


def lower_mlstm_parallel(q, k, v, igate, logf, norm_weight, norm_bias, normed, norm_eps, eps,
                         residual_weight, save_h):
    from compileops.mlstm import kernels
    from compileops.mlstm.checks import MAX_KERNEL_HEAD_DIM
    from compileops.mlstm.kernels.common import input_precision

    op = torch.ops.compileops.mlstm_parallel.default
    args = (q, k, v, igate, logf, norm_weight, norm_bias, normed, norm_eps, eps,
            residual_weight, save_h)
    device = q.get_device()
    dtype = q.get_dtype()
    dqk, dv = q.get_size()[3], v.get_size()[3]
    no_template = _why_no_template(device, dtype)
    if no_template is not None:
        return _extern_call(op, args, no_template)
    # Head dims are tile widths (constexpr): static, a model constant.
    dqk = _compat.specialize(dqk, what="the mLSTM head dim DQK")
    dv = _compat.specialize(dv, what="the mLSTM head dim DV")
    if max(dqk, dv) > MAX_KERNEL_HEAD_DIM:
        return _extern_call(op, args, f"head dim {max(dqk, dv)} above the kernels' maximum "
                                      f"{MAX_KERNEL_HEAD_DIM}")
    batch, heads, seq, _ = q.get_size()
    # Under dynamic=True the sequence length is a kernel argument, and the per-row gate loads
    # and stabiliser / row-sum stores sit at offsets bh * S. When S's first value is a
    # multiple of 16 a guard keeps it so and the template shows Triton the factor, so
    # those accesses stay aligned and vectorised: without it an H100 ran the dynamic forward
    # 6-12% slower than the static one (narrower loads, register spills). A later S that is
    # not a multiple recompiles once rather than run that form; a first S that is not one
    # keeps the unaligned form for every length (no guard, no recompile).
    seq_aligned = (not _compat.is_static(seq)
                   and _compat.multiple_of(seq, 16, what="the mLSTM sequence length"))
    # The kernel indexes the per-row gates and the norm's affine densely.
    igate, logf = _compat.require_contiguous(igate), _compat.require_contiguous(logf)
    # The column terms and their running max, ahead of the template as the eager launcher
    # computes them ahead of its kernel (an extern call of compileops::mlstm_column_terms).
    terms, colmax = _compat.fallback(torch.ops.compileops.mlstm_column_terms.default)(
        igate, logf)
    affine = [_compat.require_contiguous(p) for p in (norm_weight, norm_bias) if p is not None]
    nodes = _compat.realize_inputs(q, k, v, igate, logf, terms, colmax, *affine)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    save_h = bool(save_h and normed)
    extras = ([_compat.empty_buffer(device, dtype, [batch, heads, seq, dv])] if save_h else [])
    m_log2 = _compat.empty_buffer(device, acc, [batch, heads, seq])
    row_sum = _compat.empty_buffer(device, acc, [batch, heads, seq])
    extras += [m_log2, row_sum]
    if normed:
        layout = _compat.fixed_layout(device, dtype, [batch, seq, heads * dv],
                                      [seq * heads * dv, heads * dv, 1])
    else:
        layout = _compat.fixed_layout(device, dtype, [batch, heads, seq, dv],
                                      [heads * seq * dv, seq * dv, dv, 1])
    # The eager launcher's config: a representative tensor stands in for q.
    probe = torch.empty(0, dtype=dtype, device=device)
    cfg = kernels.choose_forward_config(probe, dqk, dv)
    choices: list = []
    error = template().maybe_append_choice(
        choices, input_nodes=[*nodes, *extras], layout=layout, mutated_inputs=extras,
        call_sizes=q.get_size(), num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DQK=dqk, DV=dv,
        BLOCK_DQK=kernels.head_tile(dqk), BLOCK_DV=kernels.head_tile(dv),
        HAS_NORM=bool(normed), HAS_WEIGHT=norm_weight is not None,
        HAS_BIAS=norm_bias is not None, RESIDUAL_WEIGHT=bool(residual_weight), SAVE_H=save_h,
        SCALE=1.0 / math.sqrt(dqk), EPS=float(eps), NORM_EPS=float(norm_eps),
        ACC_FP64=acc == torch.float64, TF32=input_precision(dtype) == "tf32",
        UPCAST=device.type == "cpu" and dtype in (torch.bfloat16, torch.float16),
        SEQ_ALIGNED=seq_aligned,
    )
    if not choices:  # the template could not be built: the op itself, as an extern call
        return _extern_call(op, args, f"the template could not be built ({error})")
    if logger.isEnabledFor(logging.INFO):
        flags = _log.settings(HAS_NORM=bool(normed), SAVE_H=save_h, SEQ_ALIGNED=seq_aligned)
        logger.info("mlstm_parallel: template %s (%s) for %s: %s; %s", template().name,
                    _describe_config(cfg, dqk, dv), _describe_inputs(q, v),
                    _why_config(device), flags)
    out = _compat.autotune_select_algorithm("compileops_mlstm", choices, [*nodes, *extras],
                                            layout)
    h = extras[0] if save_h else _compat.empty_buffer(device, dtype, [0])
    return out, h, m_log2, row_sum


# ---------------------------------------------------------------------------------------
# The log lines ("compileops.mlstm"): what the lowering chose, and why


def _why_no_template(device, dtype) -> str | None:
    """None when the template applies (by device and dtype), else why the op stays an extern
    call."""
    if not _compat.emits_triton_for(device):
        return _compat.why_no_triton(device)
    if dtype == torch.float64:
        return "fp64 (the contract tests' dtype, run by the eager kernels) has no template"
    return None


def _extern_call(op, args, why: str):
    """The op itself as an extern call (its eager kernels), logged with the reason."""
    q, v = args[0], args[2]
    logger.info("mlstm_parallel: extern call of the eager op for %s: %s",
                _describe_inputs(q, v), why)
    return _compat.fallback(op)(*args)


def _describe_inputs(q, v) -> str:
    return (f"q {_log.shape(q.get_size())} {_log.dtype(q.get_dtype())}, "
            f"v {_log.shape(v.get_size())}")


def _describe_config(cfg, dqk: int, dv: int) -> str:
    from compileops.mlstm import kernels

    return _log.settings(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                         BLOCK_DQK=kernels.head_tile(dqk), BLOCK_DV=kernels.head_tile(dv),
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _why_config(device) -> str:
    if device.type == "cpu":
        return "the eager launcher's config: the interpreter's small tiles (CPU)"
    return "the eager launcher's config for these head dims and dtype, no benchmarking"


def register() -> None:
    import compileops.mlstm.gates  # noqa: F401  (the ops must exist before lowering)
    import compileops.mlstm.op  # noqa: F401

    _compat.register_lowering(torch.ops.compileops.mlstm_parallel.default, lower_mlstm_parallel)
