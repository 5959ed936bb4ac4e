"""torchtitan on compileops kernels: the MoE experts (``GroupedExperts``) of its models.

``pip install "compileops[titan]"``. Two torchtitan layouts are served, whichever is installed:

* **torchtitan 0.3** (``torchtitan.models.common.moe``: ``RoutedExperts`` = a token dispatcher
  and ``GroupedExperts`` with ``w1_EFD``, ``w2_EDF``, ``w3_EFD``): a model converter in the
  model spec's ``converters``, the way torchtitan's own ``Float8GroupedExpertsConverter`` is
  turned on::

      from compileops.integrations import torchtitan as titan
      model_spec = model_registry("30B-A3B", converters=[titan.CompileopsMoEConverter.Config()])
      # fp8 rowwise with the weight cache and fast accumulation:
      #   converters=[titan.CompileopsMoEConverter.Config(fp8="rowwise")]
      # and the weight gradients in fp8 too (at fp8's error):
      #   converters=[titan.CompileopsMoEConverter.Config(fp8="rowwise", fp8_weight_grad=True)]

* **torchtitan 0.2** (``torchtitan.models.moe``: ``MoE`` with ``GroupedExperts`` ``w1``, ``w2``,
  ``w3``): model converters named ``"compileops_moe"``, ``"compileops_moe_fp8"``,
  ``"compileops_moe_fp8_dw"`` (fp8 with ``fp8_weight_grad=True``) and
  ``"compileops_moe_pair"`` (bf16, ``gate_up="pair"``), registered
  when this module is imported (``--experimental.custom_import`` with this module's dotted
  path, or a module of yours that imports it)::

      --model.converters compileops_moe        # or compileops_moe_fp8

* Either: :func:`apply` on a built model, before torchtitan's ``parallelize_fn``.

What runs: the gate and up projections as one compileops grouped GEMM with SwiGLU in its
epilogue, and the down projection as a compileops grouped GEMM with each routed row's router
score in its epilogue (``row_scale``) wherever torchtitan applies the scores after the experts;
where it applies them before (0.2's ``score_before_experts``), that is kept. As in torchtitan's
experts the products run in bf16 (inputs and weights cast to bf16, fp32 accumulation), or with
``fp8="rowwise"`` in e4m3 with per-row scales. The group offsets are the cumulative per-expert
token counts, on the device: no host sync is added, and compiled with dynamic shapes, varying
token counts do not recompile.

Unchanged: parameters (names, shapes, dtypes), state-dict keys, DCP checkpoints and torchtitan's
HF state-dict adapter; the converted modules are subclasses with torchtitan's ``__init__`` and
another ``forward``.

Parallelism. torchtitan 0.3: FSDP2, expert parallelism with its all-to-all dispatcher (the
scores travel to the experts' ranks in one more all-to-all of one float per routed row; the
combine then sums the scaled rows), per-block ``torch.compile(fullgraph=True)``, selective
and full activation checkpointing. With its other dispatchers (DeepEP, HybridEP, the padded
torchao one) the GEMMs run on compileops and the dispatcher keeps scaling the rows in its
combine. torchtitan 0.2: FSDP2, and expert parallelism through its ``ExpertParallel`` (set by
``expert_parallel_degree``), with its compile and activation checkpointing. Under expert
parallelism the tokens travel to the experts' ranks in hooks on the experts module, so the MoE
keeps torchtitan 0.2's own forward around the converted experts module: the grouped GEMMs run
on compileops, and torchtitan applies the router scores and gathers the rows (the epilogue
form needs the scores on the experts' rank, which 0.2's dispatch does not send). Tensor
parallelism (``tensor_parallel_degree`` or ``expert_tensor_parallel_degree`` > 1) is refused
with torchtitan 0.2.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch

from compileops.integrations._titan_experts import FP8_RECIPES, Options, experts_forward

__all__ = [
    "FP8_RECIPES",
    "LAYOUT",
    "SUPPORTED_TORCHTITAN",
    "CompileopsMoEConverter",
    "apply",
    "experts_forward",
]

#: The torchtitan releases served: 0.3 (tested on CPU over gloo with torch 2.13) and 0.2.2
#: (the layout that runs on torch 2.11).
SUPPORTED_TORCHTITAN = ">=0.2.2,<0.4"


def _detect_layout() -> str:
    try:
        from torchtitan.models.common import moe
    except ImportError:
        moe = None
    if moe is not None and hasattr(moe, "RoutedExperts"):
        return "0.3"
    try:
        from torchtitan.models.moe import moe as legacy  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "compileops' torchtitan integration needs torchtitan 0.2.2 or 0.3 (pip install "
            f"'compileops[titan]'); the installed torchtitan has neither MoE layout: {e}"
        ) from e
    return "0.2"


#: ``"0.3"`` (``RoutedExperts`` + token dispatchers) or ``"0.2"`` (``MoE`` + ``GroupedExperts``
#: with ``w1``/``w2``/``w3``): the layout of the installed torchtitan.
LAYOUT = _detect_layout()

if LAYOUT == "0.3":
    from compileops.integrations._titan_v03 import CompileopsMoEConverter
    from compileops.integrations._titan_v03 import apply_v03 as _apply_layout
else:
    from compileops.integrations._titan_v02 import CompileopsMoEConverter
    from compileops.integrations._titan_v02 import apply_v02 as _apply_layout
    from compileops.integrations._titan_v02 import register as _register

    _register()


def apply(model: torch.nn.Module, *, fp8: Optional[Literal["rowwise"]] = None,
          cache_fp8_weights: bool = True, fp8_fast_accum: bool = True,
          gate_up: Literal["concatenated", "pair"] = "concatenated",
          fp8_weight_grad: bool = False) -> dict:
    """Put every MoE experts module of a built torchtitan model onto compileops, in place.

    Call it before torchtitan's ``parallelize_fn`` (which captures each module's forward),
    on the meta-device model or a materialised one. ``fp8="rowwise"``: e4m3 products with
    per-row scales; with it, ``cache_fp8_weights`` reuses each weight's e4m3 copy until the
    next optimizer step (``compileops/grouped_linear/fp8_cache.py``) and ``fp8_fast_accum``
    accumulates in the MMA's own precision; ``fp8_weight_grad=True`` computes the experts'
    weight gradients in e4m3 too, at fp8's error (:func:`compileops.grouped_linear`). Without
    fp8 the first two are ignored and the last refused. ``gate_up`` (bf16):
    ``"concatenated"`` runs the gate and up products as one fused kernel on a ``[E, 2F, D]``
    copy of w1 and w3 made per call; ``"pair"`` runs the same kernel on w1 and w3 where they
    are (no copy, no split of the gradient; the same bits), experimental: not yet timed in
    torchtitan's trainer.

    Raises ``NotImplementedError`` listing every experts module it cannot serve (another
    experts class, experts converted by another converter, a module already parallelized: with
    torchtitan 0.2, convert before its expert parallelism, as its converters run), before
    changing anything.

    Returns ``{"experts": [names], "scores": {moe name: "epilogue" | "before experts" |
    "combine"}, "fp8": fp8, "layout": "0.3" | "0.2"}``; ``"scores"`` says where each MoE's
    router scores are applied: in the down projection's kernel, on the experts' input
    (torchtitan 0.2's ``score_before_experts``), or by torchtitan's dispatcher in its combine.
    With torchtitan 0.2, expert parallelism applied afterwards moves ``"epilogue"`` scores to
    torchtitan's own ``MoE.forward``, after the experts (the module docstring's
    Parallelism).
    With torchtitan 0.2 it also holds ``"compute": {experts name: "bf16" | "the parameters'
    dtype (torchtitan's use_grouped_mm=False)"}``: the products run in bf16 as torchtitan's
    grouped-GEMM experts do, or in the parameters' dtype where its experts run their for-loop
    (torchtitan sets ``use_grouped_mm=False`` itself for some models on GPUs before Hopper).
    """
    options = Options(fp8, cache_fp8_weights, fp8_fast_accum, gate_up, fp8_weight_grad)
    report = _apply_layout(model, options)
    report.update(fp8=fp8, layout=LAYOUT)
    return report
