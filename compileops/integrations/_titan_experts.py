"""torchtitan's ``GroupedExperts`` math on compileops grouped GEMMs (both torchtitan layouts).

Nothing here imports torchtitan: the layout modules (:mod:`._titan_v03`, :mod:`._titan_v02`)
call :func:`experts_forward` with the weights they read from torchtitan's modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from compileops.grouped_linear import grouped_linear, grouped_linear_swiglu

#: The ``fp8`` values the integration takes (None: bf16 products, as torchtitan's experts).
FP8_RECIPES = (None, "rowwise")
#: How the 16-bit gate and up products read torchtitan's two weights ``w1`` and ``w3``
#: (:func:`_swiglu`): ``"concatenated"`` (a ``[E, 2F, D]`` copy per call, one fused kernel) or
#: ``"pair"`` (the same kernel reading both where they are; experimental).
GATE_UP_FORMS = ("concatenated", "pair")


@dataclass(frozen=True)
class Options:
    """How the converted experts compute: ``fp8`` (None or ``"rowwise"``); with fp8,
    ``cache_fp8_weights``, ``fp8_fast_accum`` and ``fp8_weight_grad`` (dW in e4m3 too, off
    by default: its error is fp8's, see :func:`compileops.grouped_linear`) as in
    :func:`compileops.grouped_linear`; without, ``gate_up`` (one of :data:`GATE_UP_FORMS`,
    :func:`_swiglu`)."""

    fp8: Optional[str] = None
    cache_fp8_weights: bool = True
    fp8_fast_accum: bool = True
    gate_up: str = "concatenated"
    fp8_weight_grad: bool = False

    def __post_init__(self):
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {FP8_RECIPES}, got {self.fp8!r}")
        if self.gate_up not in GATE_UP_FORMS:
            raise ValueError(f"gate_up must be one of {GATE_UP_FORMS}, got {self.gate_up!r}")
        if self.fp8_weight_grad and self.fp8 is None:
            raise ValueError("fp8_weight_grad=True computes the experts' weight gradients in "
                             "fp8: it needs fp8='rowwise'")

    def kwargs(self, cacheable: bool = True) -> dict:
        """The keyword arguments of the grouped-linear calls (the fp8-only options are
        passed only with fp8: the ops refuse them otherwise). ``cacheable``: whether the
        weights the products get are the same tensors from call to call."""
        if self.fp8 is None:
            return {}
        return dict(fp8=self.fp8,
                    cache_fp8_weights=bool(self.cache_fp8_weights) and cacheable,
                    fp8_fast_accum=bool(self.fp8_fast_accum),
                    fp8_weight_grad=bool(self.fp8_weight_grad))


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, offsets: torch.Tensor, *,
            fp8: Optional[str] = None, cache_fp8_weights: bool = False,
            fp8_fast_accum: bool = False, fp8_weight_grad: bool = False,
            gate_up: str = "concatenated") -> torch.Tensor:
    """``silu(x W1_g^T) * (x W3_g^T)``: x ``[M, D]``, w1 and w3 ``[E, F, D]`` (torchtitan keeps
    them as two parameters), offsets int32 ``[E]`` -> ``[M, F]``.

    The one place where the gate/up form is chosen. Now: one fused kernel
    (:func:`compileops.grouped_linear_swiglu`) on the concatenated weight ``[E, 2F, D]``, a
    copy of w1 and w3 per call (compiled, one kernel together with the cast to bf16 that
    torchtitan's experts make anyway); its backward is a split of dW. Compiled
    (benchmarks/titan_swiglu_graph.py, AOTAutograd's graphs), this form has 1 grouped GEMM in
    the forward and 2 in the backward, against 2 and 4 for two separate products; the
    separate form has the smaller backward graph (10 nodes against 21: the fused op's SwiGLU
    derivative is written as pointwise ops, which Inductor fuses into one kernel), so the
    fused form launches fewer GEMMs for a larger pointwise graph. Measured in torchtitan
    0.2.2's trainer on an H200 at Qwen3-30B-A3B's experts (benchmarks/RESULTS.md), this form
    trains at 1.31x torchtitan's own experts with fp32 master weights, where the copy is
    the cast. With bf16 weights (FSDP2's mixed precision) the copy is traffic of its own: by
    arithmetic, not measured, one read and one write of w1 and w3 forward and the same for
    their gradients' split, about 3.2 GB a layer a step at that shape, 0.75 ms at the H200's
    copy bandwidth.
    ``gate_up="pair"`` (16-bit only): the same kernel reading w1 and w3 where they are
    (:func:`compileops.grouped_linear_swiglu`'s ``up_weight``), so neither the copy nor the
    split exists, with the same bits (dX: when its tile's K step divides F). In torchtitan
    0.2.2's trainer on an H200 with fp32 master weights it trained at the concatenated
    form's speed (1.297x torchtitan's experts, both) and held 0.75 GiB more reserved memory,
    so it is not the default; it is meant for bf16 weights, where it saves the copy above.
    With ``cache_fp8_weights`` the two products stay apart: the fp8 cache keys on the
    weight's storage, and a concatenated copy is a new storage at every call, so it would
    never hit.
    """
    if fp8 is not None and cache_fp8_weights:
        opts = dict(fp8=fp8, cache_fp8_weights=True, fp8_fast_accum=fp8_fast_accum,
                    fp8_weight_grad=fp8_weight_grad)
        gate = grouped_linear(x, w1, offsets, **opts)
        return F.silu(gate) * grouped_linear(x, w3, offsets, **opts)
    if fp8 is None and gate_up == "pair":
        return grouped_linear_swiglu(x, w1, offsets, up_weight=w3)
    opts = (dict(fp8=fp8, fp8_fast_accum=fp8_fast_accum, fp8_weight_grad=fp8_weight_grad)
            if fp8 is not None else {})
    return grouped_linear_swiglu(x, torch.cat([w1, w3], dim=1), offsets, **opts)


def refuse_unservable(model: torch.nn.Module, problems: list) -> None:
    """``apply()``'s refusal, before anything changes: a ``NotImplementedError`` listing
    every module it cannot serve (``problems``; none: nothing raised)."""
    if problems:
        raise NotImplementedError(
            f"compileops' torchtitan apply() cannot serve {type(model).__name__}:"
            "\n  " + "\n  ".join(problems))


def local_tensor(w: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor weight (expert parallelism shards the expert dim, and the
    token dispatcher sent this rank the rows of its own experts), else ``w``."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def experts_forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor,
                    row_scale: Optional[torch.Tensor] = None,
                    options: Options = Options(),
                    compute_dtype: Optional[torch.dtype] = torch.bfloat16) -> torch.Tensor:
    """torchtitan's ``GroupedExperts`` on compileops: x ``[R, D]`` (rows grouped by expert),
    w1 and w3 ``[E, F, D]``, w2 ``[E, D, F]``, num_tokens_per_expert ``[E]`` (integers, on
    the device), row_scale ``[R]`` or None -> ``[R, D]`` in x's dtype, per expert
    ``row_scale * (silu(x W1^T) * (x W3^T)) W2^T``.

    As torchtitan's grouped-GEMM experts: inputs and weights cast to ``compute_dtype`` (bf16),
    fp32 accumulation, each product rounded to it (``options.fp8="rowwise"``: e4m3 operands
    whatever ``compute_dtype``; the weight cache is used only for weights that are bf16
    already). ``compute_dtype=None``: the weights' dtype, as torchtitan 0.2's for-loop
    experts (``use_grouped_mm=False``) compute. The row scale multiplies the down projection's
    rounded rows in its epilogue. Rows past the last group (padding) come
    out as zeros. The offsets are the counts' cumsum on the device: no host sync.
    """
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    weights = [local_tensor(w) for w in (w1, w2, w3)]
    if compute_dtype is None:
        compute_dtype = weights[0].dtype
    if options.fp8 is not None:
        compute_dtype = torch.bfloat16  # the fp8 products quantise from bf16
    xb = x.to(compute_dtype)
    # The fp8 weight cache keys on the weight's storage: it can only hit when the weights are
    # bf16 already (FSDP's bf16 unsharded parameters, bf16 training). A bf16 copy made here
    # at every call (fp32 parameters under autocast) is a new storage each time.
    opts = options.kwargs(cacheable=all(w.dtype == torch.bfloat16 for w in weights))
    w1, w2, w3 = (w.to(compute_dtype) for w in weights)
    h = _swiglu(xb, w1, w3, offsets, **opts, gate_up=options.gate_up)
    return grouped_linear(h, w2, offsets, row_scale=row_scale, **opts).to(x.dtype)
