"""Hugging Face transformers on compileops kernels: MoE experts, input embeddings and xLSTM.

Two entry points, both importing this module (``pip install "compileops[hf]"``):

* **The experts backend ``"compileops"``**, registered in transformers' experts interface
  (``transformers.integrations.moe.ExpertsInterface``, transformers >= 5.7) when this module is
  imported::

      import compileops.integrations.transformers  # registers "compileops"
      model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="compileops")
      # or, on a loaded model: model.set_experts_implementation("compileops")

  Every experts module that transformers dispatches through the interface (its class carries
  ``@use_experts_implementation``: Qwen3-MoE, Mixtral, DeepSeek-V2/V3, GPT-OSS, ... ) then runs
  :func:`experts_forward`: the sync-free routing helpers (:func:`permute_by_expert`,
  :func:`unpermute_and_combine`) around compileops grouped GEMMs, with SwiGLU fused into the
  gate/up GEMM where the model's gate is the default ``act_fn(gate) * up`` with SiLU. The
  checkpoint's weights are used as they are: ``gate_up_proj [E, 2H, D]`` directly, and the
  transposed layouts (``is_transposed``: ``[E, D, 2H]``) through a ``transpose(1, 2)`` view,
  which the grouped-linear ops take as a strided weight (no copy, forward or backward).
  A model or module the backend cannot serve raises, naming the reason; it never silently runs
  another implementation (see :func:`unservable_reason`).

* :func:`apply` ``(model, embedding=True, experts=True)`` for models (or transformers versions)
  whose experts do not go through the interface. It walks the model's modules and patches them
  by type, the same code for every architecture: the input embedding becomes a
  :class:`compileops.nn.Embedding` sharing the same ``Parameter`` (state dict and tied weights
  untouched), and each experts module it knows gets a compileops-backed ``forward`` (interface
  experts: :func:`experts_forward`; Llama-4's dense expert-sorted experts:
  :func:`dense_experts_forward`). transformers' xLSTM (``xLSTMForCausalLM``) runs its mLSTM
  layers on :func:`compileops.mlstm` and :func:`compileops.mlstm_step`
  (:mod:`compileops.integrations.xlstm`). Modules it does not know how to serve make it raise
  before anything is changed. The patched model pickles: ``torch.save(model)`` /
  ``torch.load(path, weights_only=False)`` and ``copy.deepcopy`` keep the compileops forwards
  (:mod:`compileops.integrations._forward`).

Numerics: in fp32 the result matches transformers' eager experts to fp32 rounding (the sums run
in another order); in bf16 the routed rows are combined as ``sum_j w_j * y_j`` with the products
rounded to the activation dtype, like the eager loop.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import transformers

from compileops.embedding.module import Embedding
from compileops.grouped_linear.api import grouped_linear, grouped_linear_swiglu
from compileops.grouped_linear.routing import permute_by_expert, unpermute_and_combine
from compileops.integrations import xlstm as _xlstm
from compileops.integrations._forward import bind

__all__ = [
    "BACKEND",
    "MIN_TRANSFORMERS",
    "apply",
    "dense_experts_forward",
    "experts_forward",
    "register",
    "unservable_reason",
]

BACKEND = "compileops"
#: The first transformers release whose ``from_pretrained`` / ``set_experts_implementation``
#: accept an experts backend registered by a library (5.0-5.6 hard-code their own names).
MIN_TRANSFORMERS = "5.7.0"

_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

try:  # transformers >= 5.0
    from transformers.integrations import moe as _hf_moe
except ImportError:  # pragma: no cover - depends on the installed transformers
    _hf_moe = None


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def has_experts_interface() -> bool:
    """Whether the installed transformers accepts a registered experts backend by name."""
    return (_hf_moe is not None and hasattr(_hf_moe, "ExpertsInterface")
            and _version_tuple(transformers.__version__) >= _version_tuple(MIN_TRANSFORMERS))


# ---------------------------------------------------------------------------------------
# The experts forward


def _flag(module, name: str, default: bool) -> bool:
    # The attributes @use_experts_implementation sets on each experts module; older 5.x
    # releases set fewer of them, and their defaults are the decorator's.
    return bool(getattr(module, name, default))


def _projection_weights(module):
    """``(up, up_bias, down, down_bias)`` as the module stores them (``up`` is
    ``gate_up_proj`` for gated experts, ``up_proj`` otherwise)."""
    gated = _flag(module, "has_gate", True)
    up_name = "gate_up_proj" if gated else "up_proj"
    up = getattr(module, up_name, None)
    down = getattr(module, "down_proj", None)
    up_bias = down_bias = None
    if _flag(module, "has_bias", False):
        up_bias = getattr(module, f"{up_name}_bias", None)
        down_bias = getattr(module, "down_proj_bias", None)
    return up_name, up, up_bias, down, down_bias


def unservable_reason(module: torch.nn.Module) -> Optional[str]:
    """Why :func:`experts_forward` cannot run ``module`` (an experts module of transformers'
    experts interface), or None when it can."""
    if _flag(module, "_is_expert_parallel", False):
        return ("expert parallelism is on (routing ids carry sentinel experts owned by other "
                "ranks); the compileops backend serves experts that are all local")
    up_name, up, up_bias, down, down_bias = _projection_weights(module)
    for name, w in ((up_name, up), ("down_proj", down)):
        if not isinstance(w, torch.Tensor):
            return f"it has no {name} weight tensor (got {type(w).__name__})"
        if type(w).__name__ == "DTensor" or (
                isinstance(w, torch.nn.Parameter) and type(w.data).__name__ == "DTensor"):
            return f"{name} is a DTensor (tensor parallelism); shard-local weights are not served"
        if w.dim() != 3:
            return f"{name} is not a 3-D [experts, out, in] tensor: shape {tuple(w.shape)}"
        if w.dtype not in _WEIGHT_DTYPES:
            return (f"{name} is {w.dtype} (a quantized checkpoint?); the grouped-linear ops take "
                    "bf16, fp16, fp32 and fp64 weights")
    if up.dtype != down.dtype:
        return f"{up_name} is {up.dtype} but down_proj is {down.dtype}"
    if up.shape[0] != down.shape[0]:
        return (f"{up_name} has {up.shape[0]} experts but down_proj has {down.shape[0]} "
                "(extra 'zero' or identity experts are not served)")
    if _flag(module, "has_bias", False) and (up_bias is None or down_bias is None):
        return "has_bias is set but the projection biases are missing"
    if _flag(module, "has_post_expert_norm", False) and not hasattr(module, "post_expert_norm"):
        return "has_post_expert_norm is set but the module has no post_expert_norm"
    return None


def _raise_unservable(module: torch.nn.Module, reason: str):
    raise NotImplementedError(
        f"compileops experts backend cannot serve {type(module).__name__}: {reason}. "
        "Load it with another experts_implementation (e.g. 'grouped_mm')."
    )


def _is_silu(act) -> bool:
    if isinstance(act, torch.nn.SiLU):
        return True
    activations = getattr(transformers, "activations", None)
    silu_cls = getattr(activations, "SiLUActivation", None) if activations else None
    return silu_cls is not None and isinstance(act, silu_cls)


def _fused_swiglu(module) -> bool:
    """Whether the gate is ``silu(gate) * up`` over the concatenated halves ``[gate; up]``, so
    the gate/up GEMM can apply it in its kernel; otherwise the module's own ``_apply_gate``
    runs on the GEMM's output."""
    if not _flag(module, "has_gate", True) or not _flag(module, "is_concatenated", True):
        return False
    default_gate = getattr(_hf_moe, "_default_apply_gate", None)
    gate = getattr(type(module), "_apply_gate", default_gate)
    return gate is default_gate and _is_silu(getattr(module, "act_fn", None))


def _as_n_by_k(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The grouped-linear weight ``[E, N, K]``: the checkpoint tensor itself, or for a model
    storing ``[E, K, N]`` its transpose view (the ops read strided weights; no copy)."""
    return w.transpose(1, 2) if transposed else w


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"compileops"`` experts implementation (the signature of transformers' experts
    interface): hidden_states ``[T, D]``, top_k_index ``[T, k]`` (expert ids), top_k_weights
    ``[T, k]`` -> ``[T, D]`` ``= sum_j w_j * expert_{id_j}(x)``.

    Route (stable sort by expert, int32 offsets, all on the device: no host sync, CUDA-graph
    capturable), gate/up grouped GEMM (SwiGLU fused in its kernel when the gate is the default
    one), down grouped GEMM, un-permute and combine with the router weights (differentiable:
    the router gets its gradient). One sort per call: the un-permutation is the sort's
    inverse, a scatter (``order_is_permutation=True``), as in transformers' ``grouped_mm``
    backend.
    """
    reason = unservable_reason(self)
    if reason is not None:
        _raise_unservable(self, reason)
    _, up, up_bias, down, down_bias = _projection_weights(self)
    transposed = _flag(self, "is_transposed", False)
    up, down = _as_n_by_k(up, transposed), _as_n_by_k(down, transposed)
    shape = hidden_states.shape
    # As transformers' grouped_mm backend: the GEMMs run in the weights' dtype (autocast).
    x = hidden_states.reshape(-1, shape[-1]).to(up.dtype)
    # [T, k] by k, not by -1: with no tokens (T = 0, an empty batch) -1 is ambiguous.
    top_k = top_k_index.shape[-1]
    xs, order, offsets = permute_by_expert(x, top_k_index.reshape(x.shape[0], top_k),
                                           up.shape[0])
    if _fused_swiglu(self):
        h = grouped_linear_swiglu(xs, up, offsets, up_bias)
    else:
        h = grouped_linear(xs, up, offsets, up_bias)
        h = self._apply_gate(h) if _flag(self, "has_gate", True) else self.act_fn(h)
    y = grouped_linear(h.to(down.dtype), down, offsets, down_bias)
    if _flag(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    out = unpermute_and_combine(y, order, top_k_weights.reshape(x.shape[0], top_k),
                                order_is_permutation=True)
    return out.to(hidden_states.dtype).reshape(shape)


# ---------------------------------------------------------------------------------------
# Registration in transformers' experts interface


def _guard_models_without_interface() -> None:
    """Make ``experts_implementation="compileops"`` raise for a model whose experts do not go
    through the interface (transformers would accept the name and silently keep the model's
    own experts): the same check transformers runs for an explicit ``"grouped_mm"``."""
    cls = transformers.PreTrainedModel
    original = getattr(cls, "get_correct_experts_implementation", None)
    if original is None or getattr(original, "_compileops_guard", False):
        return

    @functools.wraps(original)
    def get_correct_experts_implementation(self, requested_experts, *args, **kwargs):
        applicable = original(self, requested_experts, *args, **kwargs)
        if applicable == BACKEND and not type(self)._can_set_experts_implementation():
            raise ValueError(
                f"experts_implementation={BACKEND!r}: {type(self).__name__} does not route its "
                "experts through transformers' experts interface (no @use_experts_implementation "
                f"class in {type(self).__module__}), so the backend would never run. Use "
                "compileops.integrations.transformers.apply(model) instead, which patches "
                "experts modules by type (or tells why it cannot)."
            )
        return applicable

    get_correct_experts_implementation._compileops_guard = True
    cls.get_correct_experts_implementation = get_correct_experts_implementation


def register(name: str = BACKEND) -> None:
    """Register :func:`experts_forward` as experts implementation ``name`` (idempotent; done
    with the default name when this module is imported, if transformers has the interface)."""
    if not has_experts_interface():
        raise ImportError(
            f"transformers {transformers.__version__} has no experts interface that accepts a "
            f"library's backend (needs transformers >= {MIN_TRANSFORMERS}: "
            "pip install 'compileops[hf]'). compileops.integrations.transformers.apply(model, "
            "experts=False) still swaps the input embedding."
        )
    _hf_moe.ExpertsInterface.register(name, experts_forward)
    if name == BACKEND:
        _guard_models_without_interface()


if has_experts_interface():
    register()


# ---------------------------------------------------------------------------------------
# apply(): patch by module type


def dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Experts that get every token for every expert, rows already grouped by expert
    (Llama-4's ``Llama4TextExperts``): hidden_states ``[E * T, D]`` -> ``[E * T, D]``, with
    ``gate_up_proj [E, D, 2H]`` and ``down_proj [E, H, D]`` read through transpose views.
    The groups are E equal row blocks, so the offsets are ``T * (1..E)``, made on the device."""
    up = _as_n_by_k(self.gate_up_proj, True)
    down = _as_n_by_k(self.down_proj, True)
    experts = up.shape[0]
    x = hidden_states.reshape(-1, up.shape[2]).to(up.dtype)
    rows = x.shape[0] // experts
    offsets = torch.arange(1, experts + 1, device=x.device, dtype=torch.int32) * rows
    if _is_silu(getattr(self, "act_fn", None)):
        h = grouped_linear_swiglu(x, up, offsets)
    else:
        gate, up_half = grouped_linear(x, up, offsets).chunk(2, dim=-1)
        h = self.act_fn(gate) * up_half
    return grouped_linear(h, down, offsets).to(hidden_states.dtype)


def _dense_unservable_reason(module) -> Optional[str]:
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(module, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            return f"{name} is not a 3-D tensor"
        if w.dtype not in _WEIGHT_DTYPES:
            return f"{name} is {w.dtype}; the grouped-linear ops take bf16, fp16, fp32 and fp64"
    return None


# Experts classes that keep their own forward signature (not the interface's), by qualified
# name so that nothing is imported to match them: class -> (forward, reason-or-None check).
_DENSE_EXPERTS = {
    "transformers.models.llama4.modeling_llama4.Llama4TextExperts": (
        dense_experts_forward, _dense_unservable_reason),
}

_EXPERT_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_interface_experts(module) -> bool:
    """An instance of a ``@use_experts_implementation`` class: the decorator sets these."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_bias") and any(
        isinstance(getattr(module, n, None), torch.Tensor) for n in _EXPERT_WEIGHT_NAMES)


def _experts_plan(model: torch.nn.Module):
    """``(patches, problems)``: ``(name, module, forward)`` per experts module to patch, and a
    message per experts-like module that cannot be served."""
    patches, problems = [], []
    for name, module in model.named_modules():
        where = name or "<model>"
        dense = next((v for k, v in _DENSE_EXPERTS.items()
                      if any(_qualname(c) == k for c in type(module).__mro__)), None)
        if dense is not None:
            forward, check = dense
            reason = check(module)
            if reason:
                problems.append(f"{where} ({type(module).__name__}): {reason}")
            else:
                patches.append((where, module, forward))
        elif _is_interface_experts(module):
            reason = unservable_reason(module)
            if reason:
                problems.append(f"{where} ({type(module).__name__}): {reason}")
            else:
                patches.append((where, module, experts_forward))
        elif isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts":
            problems.append(
                f"{where}: experts stored as a ModuleList of per-expert modules (the layout of "
                "transformers < 5); a grouped GEMM needs the experts' weights in one [E, N, K] "
                "tensor, which here would be a copy of every weight on every step. Use "
                f"transformers >= {MIN_TRANSFORMERS} (fused expert weights), or apply(model, "
                "experts=False)")
        elif any(isinstance(p, torch.Tensor) and p.dim() == 3
                 for n, p in module.named_parameters(recurse=False) if n in _EXPERT_WEIGHT_NAMES):
            problems.append(
                f"{where} ({type(module).__name__}): 3-D expert weights, but neither an "
                "experts-interface class nor one whose forward compileops knows; not patched")
    return patches, problems


# The module hooks the new embedding takes over from the old one: each is called with the
# module it runs on, so it works the same on the new one (the output is bitwise the same).
# The hook dicts themselves move, not copies, so the handles that registered the hooks
# (transformers' ``_require_grads_hooks`` from gradient checkpointing, PEFT's) still remove
# them.
_MOVED_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                "_backward_pre_hooks", "_backward_hooks")
# State-dict hooks may hold the old module itself (``_WrappedHook``): not moved, refused.
_REFUSED_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                  "_load_state_dict_post_hooks")


def _embedding_plan(model: torch.nn.Module):
    """``(old, problem)``: the input embedding to swap (None if nothing to do)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if emb is None or isinstance(emb, Embedding):
        return None, None
    if type(emb) is not torch.nn.Embedding:
        return None, (f"input embedding {type(emb).__name__} is not a plain torch.nn.Embedding "
                      "(a subclass may scale or otherwise change the lookup); not swapped")
    if "forward" in vars(emb):
        return None, ("input embedding has an instance forward (e.g. a device-map dispatch); "
                      "call apply() before attaching it")
    if any(getattr(emb, name, None) for name in _REFUSED_HOOKS):
        return None, ("input embedding has state-dict hooks, which may hold the module itself "
                      "and so cannot move to the new one; call apply() before registering them")
    unsupported = [n for n, used in (("max_norm", emb.max_norm is not None),
                                     ("scale_grad_by_freq", emb.scale_grad_by_freq),
                                     ("sparse", emb.sparse)) if used]
    if unsupported:
        return None, f"input embedding uses {', '.join(unsupported)}, which compileops refuses"
    return emb, None


def _swap_embedding(model: torch.nn.Module, old: torch.nn.Embedding) -> Embedding:
    new = Embedding(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx,
                    norm_type=old.norm_type, _weight=old.weight,
                    _freeze=not old.weight.requires_grad)
    new.weight = old.weight  # the same Parameter object: tied heads and optimizers see it
    for key, value in vars(old).items():  # transformers' per-module flags, if any
        if key not in vars(new):
            setattr(new, key, value)
    for key in _MOVED_HOOKS:  # e.g. gradient checkpointing's input-require-grads hook
        vars(new)[key] = vars(old)[key]
    vars(new)["_is_full_backward_hook"] = old._is_full_backward_hook
    new.train(old.training)
    setter = getattr(model, "set_input_embeddings", None)
    try:
        setter(new)
    except (TypeError, NotImplementedError, AttributeError):
        setter = None
    if setter is None or model.get_input_embeddings() is not new:
        name = next(n for n, m in model.named_modules() if m is old)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], new)
    return new


def apply(model: torch.nn.Module, embedding: bool = True, experts: bool = True,
          xlstm: bool = True) -> dict:
    """Patch ``model`` in place to run on compileops kernels, by module type.

    * ``embedding``: the input embedding (``model.get_input_embeddings()``), a plain
      ``torch.nn.Embedding``, becomes :class:`compileops.nn.Embedding` holding the **same**
      ``Parameter``: state dict keys, tied output embeddings and optimizer state are untouched,
      and its output is bitwise the same. Its forward and backward hooks move with it (the
      same hook dicts, so their handles still remove them): the input-require-grads hook
      that gradient checkpointing (``gradient_checkpointing_enable()``, or a config with
      ``gradient_checkpointing=True``) and PEFT put there keeps working.
    * ``experts``: every experts module of transformers' experts interface gets
      :func:`experts_forward` as its forward (whatever ``config._experts_implementation``
      says), and known experts classes with their own signature get theirs
      (Llama-4: :func:`dense_experts_forward`). Weights are used in place.

    * ``xlstm``: transformers' xLSTM (``xLSTMForCausalLM``, ``xLSTMModel``): each
      ``xLSTMLayer`` runs its mLSTM cell, multi-head layernorm and output gate through
      :func:`compileops.mlstm` (training and prefill) and :func:`compileops.mlstm_step`
      (generation), and each ``xLSTMModel`` keeps its cache in the ops' states, working around
      transformers' own cache bugs (:mod:`compileops.integrations.xlstm`,
      docs/xlstm-transformers.md). Same parameters, state dict and checkpoints.

    Each patched module keeps its class; its ``forward`` is a ``functools.partial`` of a
    module-level function, so the model survives ``torch.save`` / ``torch.load`` and
    ``copy.deepcopy``, and ``torch.compile(fullgraph=True)`` traces it with no graph break.

    Raises ``NotImplementedError`` listing every module it cannot serve (experts stored per
    expert as in transformers < 5, unknown experts classes, quantized, tensor- or expert-parallel
    weights, a non-plain embedding or one with state-dict hooks or an instance forward, xLSTM
    blocks from the external ``xlstm`` package), before changing anything. Returns what was
    patched:
    ``{"embedding": [name], "experts": [names], "xlstm": [layer names]}``.
    """
    report = {"embedding": [], "experts": [], "xlstm": []}
    problems = []
    old_emb = None
    if embedding:
        old_emb, problem = _embedding_plan(model)
        if problem:
            problems.append(f"embedding: {problem}")
    patches = []
    if experts:
        patches, experts_problems = _experts_plan(model)
        problems += experts_problems
    xlstm_patches = []
    if xlstm:
        xlstm_patches, xlstm_problems = _xlstm.plan(model)
        problems += xlstm_problems
    if problems:
        raise NotImplementedError(
            f"compileops.integrations.transformers.apply cannot serve {type(model).__name__}:\n  "
            + "\n  ".join(problems))
    if old_emb is not None:
        name = next(n for n, m in model.named_modules() if m is old_emb)
        _swap_embedding(model, old_emb)
        report["embedding"].append(name)
    for name, module, forward in patches:
        bind(module, forward)
        report["experts"].append(name)
    report["xlstm"] = _xlstm.patch(xlstm_patches)
    return report
