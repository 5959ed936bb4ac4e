"""torchtitan 0.3's MoE (``torchtitan.models.common.moe``) on compileops: the converter and
``apply()`` of the torchtitan integration (``compileops/integrations/torchtitan.py``).

A ``RoutedExperts`` (token dispatcher + ``GroupedExperts``) becomes a
:class:`CompileopsRoutedExperts` and its ``GroupedExperts`` a :class:`CompileopsGroupedExperts`:
subclasses with torchtitan's ``__init__`` (same parameters, same names) and another forward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch.distributed._functional_collectives import (
    all_to_all_single_autograd,
    wait_tensor,
)
from torchtitan.distributed.spmd_types import maybe_set_sparse_mesh
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllDispatchMetadata,
    AllToAllTokenDispatcher,
    LocalDispatchMetadata,
    LocalTokenDispatcher,
    TorchAOTokenDispatcher,
)
from torchtitan.protocols.model import ModelConfigConverter

from compileops.integrations._titan_experts import Options, experts_forward, refuse_unservable


class CompileopsGroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` (``w1_EFD``, ``w2_EDF``, ``w3_EFD``) computing on
    compileops grouped GEMMs; ``forward`` takes the router score of each routed row
    (``row_scale_R``) for the down projection's epilogue."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        fp8: Optional[str] = None
        cache_fp8_weights: bool = True
        fp8_fast_accum: bool = True
        gate_up: str = "concatenated"
        fp8_weight_grad: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.compileops_options = Options(config.fp8, config.cache_fp8_weights,
                                          config.fp8_fast_accum, config.gate_up,
                                          config.fp8_weight_grad)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor,
                row_scale_R: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x_RD ``[R, D]`` grouped by local expert, num_tokens_per_expert_E ``[E]``,
        row_scale_R ``[R]`` or None -> ``[R, D]``."""
        return experts_forward(x_RD, self.w1_EFD, self.w2_EDF, self.w3_EFD,
                               num_tokens_per_expert_E, row_scale_R,
                               self.compileops_options)


def _is_all_to_all(dispatcher) -> bool:
    """torchtitan's all-to-all dispatcher, whose metadata says where each routed row went
    (the padded torchao variant moves rows to other places, and is left to its combine)."""
    return (isinstance(dispatcher, AllToAllTokenDispatcher)
            and not isinstance(dispatcher, TorchAOTokenDispatcher))


def scores_placement(dispatcher) -> str:
    """Where the router scores are applied with this dispatcher: ``"epilogue"`` (the down
    projection's kernel) or ``"combine"`` (torchtitan's dispatcher scales the rows)."""
    if type(dispatcher) is LocalTokenDispatcher or _is_all_to_all(dispatcher):
        return "epilogue"
    return "combine"


def _scores_to_experts(dispatcher, metadata):
    """``(row_scale_R or None, metadata for the combine)``: the router score of each row the
    experts get, in their order, and the metadata with unit scores (the rows come back
    scaled). None, and the metadata as it was, for dispatchers that keep their own scoring."""
    if scores_placement(dispatcher) != "epilogue":
        return None, metadata
    scores_N = metadata.topk_scores_experts_sorted_N
    if type(metadata) is LocalDispatchMetadata:  # EP = 1: the rows stayed in this order
        scores_R = scores_N
    elif type(metadata) is AllToAllDispatchMetadata:
        # The rows went to their experts' ranks in one all-to-all, then were reordered
        # expert-major (``permuted_indices``): send the scores the same way, differentiably
        # (the router's gradient comes back through it).
        sent = all_to_all_single_autograd(scores_N, metadata.output_splits,
                                          metadata.input_splits, dispatcher.ep_mesh)
        scores_R = wait_tensor(sent)[metadata.permuted_indices]
    else:
        return None, metadata
    # Multiplying by one is exact: the combine then adds the scaled rows as they are.
    return scores_R, dataclasses.replace(metadata,
                                         topk_scores_experts_sorted_N=torch.ones_like(scores_N))


class CompileopsRoutedExperts(RoutedExperts):
    """torchtitan's ``RoutedExperts`` (dispatch, experts, combine) with the router scores in
    the experts' down projection where the dispatcher allows it (:func:`scores_placement`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The same arguments (and names: torchtitan's ``local_map`` binds them by name) and
        result ``[B, L, D]`` as ``RoutedExperts.forward``."""
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.size(-1)
        x_TD = x_BLD.view(B * L, D)
        routed_input_RD, tokens_per_local_expert_e, metadata = self.token_dispatcher.dispatch(
            x_TD, topk_scores_BLK.view(B * L, K), topk_expert_ids_BLK.view(B * L, K),
            num_local_tokens_per_expert_E)
        row_scale_R, metadata = _scores_to_experts(self.token_dispatcher, metadata)
        with maybe_set_sparse_mesh():
            if row_scale_R is None:
                routed_output_RD = self.inner_experts(routed_input_RD,
                                                      tokens_per_local_expert_e)
            else:
                routed_output_RD = self.inner_experts(routed_input_RD,
                                                      tokens_per_local_expert_e, row_scale_R)
        out_TD = self.token_dispatcher.combine(routed_output_RD, metadata, x_TD)
        return out_TD.view(B, -1, D)


def _config_name(config) -> str:
    """``Owner.Config`` (torchtitan makes converted classes inside functions: their
    ``__qualname__`` names the function)."""
    owner = getattr(type(config), "_owner", None)
    return f"{owner.__name__}.Config" if owner is not None else type(config).__qualname__


def _unservable_config(fqn: str, config) -> Optional[str]:
    inner = config.inner_experts
    if isinstance(inner, CompileopsGroupedExperts.Config):
        return None  # converted already: converting again changes nothing
    if type(inner) is not GroupedExperts.Config:
        return (f"{fqn}.inner_experts is {_config_name(inner)}, not torchtitan's "
                "GroupedExperts (another converter, e.g. float8/mxfp8, or a model with its own "
                "experts math, e.g. gpt-oss): not converted")
    if type(config) not in (RoutedExperts.Config, CompileopsRoutedExperts.Config):
        return (f"{fqn} is {_config_name(config)}, not torchtitan's RoutedExperts: "
                "its forward is not known")
    return None


def _converted_config(config, options: Options):
    inner = config.inner_experts
    if not isinstance(inner, CompileopsGroupedExperts.Config):
        inner = CompileopsGroupedExperts.Config(
            **{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)},
            fp8=options.fp8, cache_fp8_weights=options.cache_fp8_weights,
            fp8_fast_accum=options.fp8_fast_accum, gate_up=options.gate_up,
            fp8_weight_grad=options.fp8_weight_grad)
    return CompileopsRoutedExperts.Config(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
           if f.name != "inner_experts"},
        inner_experts=inner)


class CompileopsMoEConverter(ModelConfigConverter):
    """Model converter (torchtitan 0.3): every ``RoutedExperts`` with torchtitan's
    ``GroupedExperts`` runs its experts on compileops kernels.

    In a model spec: ``model_registry(flavor, converters=[CompileopsMoEConverter.Config()])``
    (bf16), or ``CompileopsMoEConverter.Config(fp8="rowwise")`` (e4m3 products with per-row
    scales; ``cache_fp8_weights`` and ``fp8_fast_accum`` on by default). Raises ``ValueError``
    naming every experts config it cannot serve, or when the model has no MoE layer.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        fp8: Optional[Literal["rowwise"]] = None
        """None: bf16 products, as torchtitan's experts. "rowwise": e4m3 products with one
        scale per row of each operand."""
        cache_fp8_weights: bool = True
        """With fp8: keep each weight's e4m3 copy until the next optimizer step."""
        fp8_fast_accum: bool = True
        """With fp8: accumulate each product in the MMA's own precision over all of K."""
        fp8_weight_grad: bool = False
        """With fp8: the weight gradients in e4m3 too (one scale per expert and column of
        each operand), at fp8's error instead of bf16's."""
        gate_up: Literal["concatenated", "pair"] = "concatenated"
        """Without fp8: how the gate and up products read w1 and w3. "concatenated": one
        fused kernel on a [E, 2F, D] copy made per call. "pair": the same kernel reading both
        where they are, no copy (experimental: not yet timed in the trainer)."""

    def __init__(self, config: Config):
        self.config = config
        self.options = Options(config.fp8, config.cache_fp8_weights, config.fp8_fast_accum,
                               config.gate_up, config.fp8_weight_grad)

    def convert(self, model_config):
        found = list(model_config.traverse(RoutedExperts.Config))
        if not found:
            raise ValueError(f"CompileopsMoEConverter: {type(model_config).__qualname__} has "
                             "no RoutedExperts (no MoE layer) to convert")
        problems = [p for p in (_unservable_config(fqn, c) for fqn, c, _, _ in found) if p]
        if problems:
            raise ValueError("CompileopsMoEConverter cannot serve:\n  " + "\n  ".join(problems))
        for _fqn, config, parent, attr in found:
            new = _converted_config(config, self.options)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        return model_config


def _module_problem(name: str, module) -> Optional[str]:
    inner = getattr(module, "inner_experts", None)
    if isinstance(module, CompileopsRoutedExperts):
        return None
    if type(module) is not RoutedExperts:
        return f"{name} ({type(module).__name__}): not torchtitan's RoutedExperts"
    if type(inner) is not GroupedExperts:
        return (f"{name}.inner_experts ({type(inner).__name__}): not torchtitan's "
                "GroupedExperts (converted by another converter?)")
    for m in (module, inner):
        if m._parallelized or "forward" in vars(m):
            return (f"{name}: already parallelized (its forward was wrapped by "
                    "parallelize_fn); call apply() before parallelizing the model")
    return None


def apply_v03(model: torch.nn.Module, options: Options) -> dict:
    """The torchtitan integration's ``apply()`` for torchtitan 0.3 models."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]
    refuse_unservable(model, [p for p in (_module_problem(n, m) for n, m in found) if p])
    report = {"experts": [], "scores": {}}
    for name, module in found:
        if not isinstance(module, CompileopsRoutedExperts):
            module.__class__ = CompileopsRoutedExperts
            module.inner_experts.__class__ = CompileopsGroupedExperts
        module.inner_experts.compileops_options = options
        report["experts"].append(f"{name}.inner_experts")
        report["scores"][name] = scores_placement(module.token_dispatcher)
    return report
