"""Hugging Face transformers' xLSTM (``xLSTMForCausalLM`` / ``xLSTMModel``, the classes of
NX-AI/xLSTM-7b) on compileops' mLSTM ops. Entry point:
:func:`compileops.integrations.transformers.apply`, which calls :func:`plan` and :func:`patch`.

What changes, per instance (``forward`` attributes, kept by ``torch.save`` / ``torch.load``
and ``copy.deepcopy``; parameters, buffers, state dict and checkpoints untouched):

* every ``xLSTMLayer``: :func:`layer_forward`. The projections are the layer's own ``Linear``
  modules (both weight modes), the gates are soft-capped as transformers does
  (``gate_soft_cap * tanh(x / gate_soft_cap)``), then one :func:`compileops.mlstm` call runs the
  cell with the multi-head layernorm fused (``kernel="auto"``: the parallel form for short
  training rows without states, the chunkwise form for longer ones and when a state goes in
  or out), or
  :func:`compileops.mlstm_step` for one token with a state (generation). The output gate
  ``sigmoid(o) * h`` follows in the ``[B, S, NH * DV]`` layout the op writes, so under
  ``torch.compile`` it fuses into the op's epilogue; then ``out_proj``.
* every ``xLSTMModel``: :func:`model_forward`, transformers' loop over the blocks with the
  cache handled so that it works (see "transformers' own bugs" below): the states in
  ``xLSTMCache.rnn_state`` are the ops' own tensors (fp32, fp64 for fp64 models), replaced,
  never copied into place.
* every ``xLSTMRMSNorm``: :func:`rms_norm_forward`, transformers' math with the statistics in
  at least fp32 (transformers rounds an fp64 model's activations to fp32 there).

The block (RMSNorm, residuals, feed-forward), the LM head with its output soft cap and the
generation loop stay transformers' own.

States: ``xLSTMCache.rnn_state[layer] = (C [B, NH, DQK, DV], n [B, NH, DQK], m [B, NH, 1])``,
transformers' layout and stabilisation (``compileops.mlstm.recurrent``'s convention, ``m``
with a trailing 1). A fresh cache (one no forward has used) starts from the empty state
(``m = -inf``: nothing seen); a used one continues from its states, whatever wrote them.
docs/xlstm-transformers.md gives the conventions and how they differ from transformers'.

transformers' own bugs worked around (transformers 5.24; docs/xlstm-transformers.md):
the cache's head dims rounded up to 64 (``xLSTMCache`` uses ``config.qk_dim``, the layer
``int(hidden * qk_dim_factor)``); the cache's states rounded to the activation dtype (bf16) by
``copy_`` into its tensors; ``use_cache=True`` (the default) breaking the backward (that
``copy_`` overwrites tensors autograd saved), so in training mode ``use_cache`` defaults to
False here; ``return_last_states=False`` / ``mode`` (read by transformers' backend only, ignored
here); norms and states forced to fp32 for fp64 models; ``weight_mode="fused"`` crashing in
``_init_weights`` (:func:`fused_init`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from compileops.integrations._forward import bind, bound_function
from compileops.mlstm.api import mlstm
from compileops.mlstm.module import layer_projections
from compileops.mlstm.reference import gate_dtype
from compileops.mlstm.step import mlstm_step

__all__ = ["EMPTY_STATE", "fused_init", "layer_forward", "model_forward", "new_cache", "patch",
           "plan", "rms_norm_forward"]

MODELING = "transformers.models.xlstm.modeling_xlstm"
_LAYER = f"{MODELING}.xLSTMLayer"
_MODEL = f"{MODELING}.xLSTMModel"
_RMS_NORM = f"{MODELING}.xLSTMRMSNorm"


class _EmptyState:
    """The state argument that asks :func:`layer_forward` to start from the empty state and
    return the last one (``None`` starts empty and returns none)."""

    def __repr__(self) -> str:
        return "EMPTY_STATE"


EMPTY_STATE = _EmptyState()


# ---------------------------------------------------------------------------------------
# The layer


def _projections(layer, x: torch.Tensor):
    """``(q, k [B, NH, S, DQK], v [B, NH, S, DV], o [B, S, NH * DV], i, f [B, NH, S])`` from
    transformers' ``xLSTMLayer``'s own Linear modules, which carry mLSTMLayer's names."""
    config = layer.config
    return layer_projections(layer, x, config.num_heads, config.gate_soft_cap,
                             config.weight_mode)


def _norm_kwargs(norm, like: torch.Tensor) -> dict:
    """transformers' ``xLSTMMultiHeadLayerNorm`` as :func:`compileops.mlstm` arguments (scale
    by ``weight``, then add ``bias``; statistics in at least fp32)."""
    weight, bias = norm.weight, norm.bias
    if weight is None and bias is None:
        weight = like.new_ones((norm.num_features,))
    return {"norm_weight": weight, "norm_bias": bias, "norm_eps": norm.eps}


def _check_state(state, q: torch.Tensor, v: torch.Tensor):
    """transformers' ``(C, n, m [B, NH, 1])`` -> the ops' ``(C, n, m [B, NH])`` in the
    accumulation dtype, shapes checked (a clear error, not a kernel's)."""
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise TypeError("an xLSTM layer state must be a (C, n, m) triple, as xLSTMCache.rnn_state "
                        f"holds them, got {type(state).__name__}")
    c, n, m = state
    batch, heads, _, dqk = q.shape
    dv = v.shape[-1]
    if m.dim() == 3:
        m = m.squeeze(-1)
    for name, t, shape in (("C", c, (batch, heads, dqk, dv)), ("n", n, (batch, heads, dqk)),
                           ("m", m, (batch, heads))):
        if tuple(t.shape) != shape:
            raise ValueError(
                f"xLSTM state {name} has shape {tuple(t.shape)}, the layer needs {shape} "
                "([B, NH, DQK, DV], [B, NH, DQK], [B, NH, 1]): a cache of another batch size or "
                "model? (transformers' own xLSTMCache rounds DQK and DV up; compileops builds the "
                "cache itself when none is passed)")
    acc = gate_dtype(q.dtype)
    return c.to(acc), n.to(acc), m.to(acc)


def layer_forward(self, x: torch.Tensor, state=None):
    """``xLSTMLayer.forward`` on compileops: ``x [B, S, D]``, ``state`` -> ``(y [B, S, D],
    state)``.

    ``state``: ``None`` (start empty, return no state: training; ``kernel="auto"``),
    :data:`EMPTY_STATE` (start empty, return the last state) or a ``(C, n, m)`` triple
    (continue from it, return the next). With a state wanted and one token, the step
    (:func:`compileops.mlstm_step`); otherwise :func:`compileops.mlstm`.
    """
    if x.dim() != 3:
        raise ValueError(f"xLSTMLayer expects x [B, S, D], got shape {tuple(x.shape)}")
    q, k, v, o, i, f = _projections(self, x)
    kwargs = dict(_norm_kwargs(self.multihead_norm, v), eps=self.config.eps)
    if state is None:
        h = mlstm(q, k, v, i, f, kernel="auto", **kwargs)  # [B, S, NH * DV], normed
        new_state = None
    else:
        initial = None if state is EMPTY_STATE else _check_state(state, q, v)
        if x.shape[1] == 1:
            h, new_state = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[..., 0], f[..., 0],
                                      initial, **kwargs)
            h = h[:, None]
        else:
            h, new_state = mlstm(q, k, v, i, f, kernel="auto", initial_state=initial,
                                 return_last_state=True, **kwargs)
        c, n, m = new_state
        new_state = (c, n, m[..., None])
    return self.out_proj(torch.sigmoid(o) * h), new_state


# ---------------------------------------------------------------------------------------
# The RMSNorm


def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``xLSTMRMSNorm.forward`` with ``force_float32_reductions`` read as "at least fp32":
    the same operations as transformers' for bf16, fp16 and fp32 (bitwise), and fp64 kept in
    fp64 (transformers rounds it to fp32)."""
    in_dtype = x.dtype
    if self.force_float32_reductions:
        x = x.to(torch.promote_types(in_dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    x = x.to(in_dtype)
    if self.weight is not None:
        x = x * self.weight
    if self.bias is not None:
        x = x + self.bias
    return x


# ---------------------------------------------------------------------------------------
# The model and its cache


def new_cache(config, dtype: torch.dtype, device):
    """An empty ``xLSTMCache`` (transformers' class, so generation and user code see the type
    they expect) whose ``rnn_state`` the forward fills with the ops' states. Its own zero
    tensors are not allocated at full size (transformers sizes them wrongly)."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    cache = xLSTMCache(config, 0, dtype=dtype, device=device)
    cache.rnn_state = {}
    return cache


def _layer_state(cache, index: int):
    """The state a block starts from: the cache's, or :data:`EMPTY_STATE` for a fresh cache
    (never through a forward: transformers marks used ones ``rnn_state_initial = False``)."""
    if cache is None:
        return None
    if getattr(cache, "rnn_state_initial", True) or index not in cache.rnn_state:
        return EMPTY_STATE
    return cache.rnn_state[index]


def _hidden_state_selection(config, output_hidden_states) -> Optional[set[int]]:
    """The hidden-state indices ``output_hidden_states`` selects, as transformers reads it:
    None for a flag (every one); an int or a list of ints selects those, negative ones
    counted from the end of the ``num_hidden_layers + 1`` states, out of range ones
    dropped."""
    if isinstance(output_hidden_states, bool) or output_hidden_states is None:
        return None
    if isinstance(output_hidden_states, int):
        output_hidden_states = [output_hidden_states]
    count = config.num_hidden_layers + 1
    return {i % count for i in output_hidden_states if -count <= i < count}


def _record(all_hidden: Optional[list], keep: Optional[set[int]], hidden: torch.Tensor):
    """Append ``hidden`` to the hidden states, or None where the selection leaves it out."""
    if all_hidden is not None:
        all_hidden.append(hidden if keep is None or len(all_hidden) in keep else None)


def _run_blocks(model, hidden: torch.Tensor, cache, all_hidden: Optional[list],
                keep: Optional[set[int]] = None):
    for index, block in enumerate(model.blocks):
        hidden, state = block(hidden, _layer_state(cache, index))
        if cache is not None:
            cache.rnn_state[index] = state
        _record(all_hidden, keep, hidden)
    if cache is not None:
        cache.rnn_state_initial = False
    return hidden


def model_forward(self, input_ids: Optional[torch.LongTensor] = None,
                  inputs_embeds: Optional[torch.Tensor] = None, cache=None,
                  use_cache: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                  return_dict: Optional[bool] = None, **kwargs):
    """``xLSTMModel.forward`` on compileops: transformers' arguments and output
    (``xLSTMOutput(last_hidden_state, cache, hidden_states)``).

    ``output_hidden_states``: True returns the ``num_hidden_layers + 1`` hidden states (the
    embeddings, then each block's output, the last one after ``out_norm``); an int or a list
    of ints (negative ones from the end) returns the same tuple with None in the slots not
    asked for, as transformers does.

    ``use_cache`` defaults to the config's in eval mode and to False in training mode
    (transformers' default True breaks its own backward, and a training step needs no state:
    the mLSTM then takes its parallel form up to 512 tokens in 16-bit, 128 in fp32, and its
    chunkwise form above). A ``cache`` passed in is used
    and updated whatever ``use_cache`` says. Sequences longer than
    ``config.max_inference_chunksize`` in eval mode run in pieces of that length, the states
    carried (transformers' memory cap; outputs equal the one-piece run to rounding).
    """
    cache = kwargs.pop("cache_params", cache)  # transformers' deprecated name
    config = self.config
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = self.embeddings(input_ids)
    if output_hidden_states is None:
        output_hidden_states = getattr(config, "output_hidden_states", False)
    if return_dict is None:
        return_dict = bool(getattr(config, "return_dict", True))
    if use_cache is None:
        use_cache = bool(config.use_cache) and not self.training
    seq = inputs_embeds.shape[1]
    if cache is None and use_cache:
        cache = new_cache(config, inputs_embeds.dtype, inputs_embeds.device)
    # transformers' convention: output_hidden_states may be a flag or the indices to return
    # (an int or a list); a falsy value (False, 0, []) returns none.
    all_hidden = [] if output_hidden_states else None
    keep = _hidden_state_selection(config, output_hidden_states) if all_hidden is not None else None
    _record(all_hidden, keep, inputs_embeds)

    piece = config.max_inference_chunksize
    if not self.training and piece < seq and not output_hidden_states:
        if cache is None:  # the pieces pass their states on through a cache
            cache = new_cache(config, inputs_embeds.dtype, inputs_embeds.device)
        with torch.no_grad():
            hidden = torch.cat([_run_blocks(self, inputs_embeds[:, start:start + piece], cache,
                                            None) for start in range(0, seq, piece)], dim=1)
    else:
        hidden = _run_blocks(self, inputs_embeds, cache, all_hidden, keep)
    if cache is not None:
        cache.seqlen_offset = cache.seqlen_offset + seq
    hidden = self.out_norm(hidden)
    if all_hidden is not None and all_hidden[-1] is not None:
        all_hidden[-1] = hidden  # transformers records the last block's output after out_norm

    from transformers.models.xlstm.modeling_xlstm import xLSTMOutput

    # transformers renamed the output's cache field from cache_params to cache (5.2x).
    cache_field = "cache" if "cache" in xLSTMOutput.__dataclass_fields__ else "cache_params"
    out = xLSTMOutput(last_hidden_state=hidden, **{cache_field: cache},
                      hidden_states=tuple(all_hidden) if all_hidden is not None else None)
    return out if return_dict else out.to_tuple()


# ---------------------------------------------------------------------------------------
# apply(): find and patch


def _qualnames(module) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}


_FORWARDS = {_LAYER: layer_forward, _MODEL: model_forward, _RMS_NORM: rms_norm_forward}


def plan(model: torch.nn.Module):
    """``(patches, problems)``: ``(name, module, forward)`` per xLSTM module to patch (layers,
    models, RMSNorms; empty for a model with no xLSTM in it), and why a model cannot be
    served."""
    patches, problems = [], []
    models = []
    for name, module in model.named_modules():
        names = _qualnames(module)
        for qualname, forward in _FORWARDS.items():
            if qualname in names:
                patches.append((name or "<model>", module, forward))
                if qualname == _MODEL:
                    models.append((name or "<model>", module))
    for name, module in models:
        layers = [m for m in module.modules() if _LAYER in _qualnames(m)]
        if len(layers) != len(module.blocks):
            import transformers.models.xlstm.modeling_xlstm as modeling

            why = ("transformers runs these blocks through the external 'xlstm' package "
                   "(installed here); compileops serves transformers' own xLSTM code"
                   if getattr(modeling, "external_xlstm", False) else
                   f"{len(module.blocks)} blocks but {len(layers)} xLSTMLayer modules")
            problems.append(f"{name} (xLSTMModel): {why}")
    return patches, problems


def patch(patches) -> list[str]:
    """Set each ``forward`` (idempotent; one that ``torch.save`` and ``copy.deepcopy`` carry,
    :func:`compileops.integrations._forward.bind`); returns the patched layers' names."""
    names = []
    for name, module, forward in patches:
        if bound_function(module) is not forward:
            bind(module, forward)
        if forward is layer_forward:
            names.append(name)
    return names


# ---------------------------------------------------------------------------------------
# weight_mode="fused": transformers' _init_weights crashes


_init_lock = threading.Lock()


def _fused_init_weights(original):
    """transformers' ``_init_weights``, except for the two fused projections it cannot
    initialise (transformers 5.24: a shape error for ``ifgate_preact``, a None bias indexed for
    ``proj_up_gate_z``): those get what the single weight mode gives their parts,
    concatenated."""
    from transformers import initialization as init

    def _init_weights(self, module):
        config = self.config
        if config.weight_mode != "fused" or not isinstance(module, torch.nn.Linear):
            return original(self, module)
        name = self._module_name_map(module)
        if not name.endswith(("ifgate_preact", "proj_up_gate_z")):
            return original(self, module)
        weight = torch.empty_like(module.weight)
        weight.normal_(0.0, (2 / (5 * config.hidden_size)) ** 0.5)  # small_init_method's std
        heads = config.num_heads
        if name.endswith("ifgate_preact"):  # rows i | f; single mode zeroes "gate" weights
            weight.zero_()
            init.copy_(module.bias, torch.cat([torch.full((heads,), -10.0),
                                               torch.linspace(3.0, 6.0, heads)]).to(module.bias))
        else:  # proj_up_gate_z, rows gate | z: single mode zeroes proj_up_gate, not proj_up
            weight[: weight.shape[0] // 2] = 0.0
            if module.bias is not None:
                init.zeros_(module.bias)
        init.copy_(module.weight, weight)

    return _init_weights


@contextlib.contextmanager
def fused_init():
    """Build or load an ``weight_mode="fused"`` xLSTM inside this context: transformers
    5.24's ``_init_weights`` raises a shape error for the fused gate projections (from a config
    and in ``from_pretrained`` alike). Inside, those projections are initialised as the single
    weight mode initialises their parts (gate weights zero, input-gate bias -10, forget-gate
    bias ``linspace(3, 6)``); loaded weights are not touched, as transformers' own init skips
    them. Patches ``xLSTMPreTrainedModel._init_weights`` for the duration (a lock keeps two
    threads from nesting it)."""
    from transformers.models.xlstm import modeling_xlstm as modeling

    cls = modeling.xLSTMPreTrainedModel
    with _init_lock:
        original = cls._init_weights
        cls._init_weights = _fused_init_weights(original)
        try:
            yield
        finally:
            cls._init_weights = original
