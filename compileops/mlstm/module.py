"""``compileops.nn.MultiHeadLayerNorm`` and ``compileops.nn.mLSTMLayer``: the xLSTM-7B mLSTM
layer on :func:`compileops.mlstm`, with the multi-head layernorm fused into the cell.

Checkpoint compatibility with NX-AI/xlstm (``xlstm/xlstm_large/model.py`` and
``components.py``, and the original cell's ``xlstm/components/ln.py``):

* :class:`MultiHeadLayerNorm` has xlstm's parameters: ``weight [NH * DH]`` (when
  ``use_weight``) and ``bias [NH * DH]`` (when ``use_bias``); both xlstm variants load as is.
  ``residual_weight=False`` (the default, xLSTM-7B's ``xlstm_large`` norm) scales by
  ``weight`` (initialised to ones); ``residual_weight=True`` (the original cell's norm) scales
  by ``1 + weight`` (initialised to zeros).
* :class:`mLSTMLayer` has xlstm's ``mLSTMLayer`` key names in both weight modes:
  ``weight_mode="single"``: ``q``, ``k``, ``v``, ``ogate_preact``, ``igate_preact``,
  ``fgate_preact``; ``weight_mode="fused"``: ``qkv_opreact`` (rows q | k | v | o) and
  ``ifgate_preact`` (rows i | f); in both ``multihead_norm`` and ``out_proj``. The mLSTM
  backend of xlstm holds no parameters, so a state dict loads with ``strict=True``.
  :func:`convert_xlstm_state_dict` converts between the two weight modes.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from compileops.mlstm import reference
from compileops.mlstm.api import mlstm

WEIGHT_MODES = ("single", "fused")


def soft_cap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(x / cap)``: smooth, odd, slope 1 at 0, bounded by ``cap``; identity for
    ``cap=None``."""
    if cap is None:
        return x
    return cap * torch.tanh(x / cap)


def layer_projections(layer: torch.nn.Module, x: torch.Tensor, num_heads: int,
                      gate_soft_cap: Optional[float], weight_mode: str):
    """The mLSTM layer's input projections of ``x [B, S, D]``: ``(q [B, NH, S, DQK], k,
    v [B, NH, S, DV], o [B, S, v_dim], i [B, NH, S], f)``, the gates soft-capped.

    ``layer`` holds the xLSTM-7B layer's Linear modules under their checkpoint names, as
    :class:`mLSTMLayer` and transformers' ``xLSTMLayer`` both do: ``q``, ``k``, ``v``,
    ``ogate_preact``, ``igate_preact``, ``fgate_preact`` (``weight_mode="single"``) or
    ``qkv_opreact`` and ``ifgate_preact`` (``"fused"``), with ``qk_dim`` and ``v_dim``."""
    if weight_mode == "single":
        q, k, v = layer.q(x), layer.k(x), layer.v(x)
        o = layer.ogate_preact(x)
        i = soft_cap(layer.igate_preact(x), gate_soft_cap)
        f = soft_cap(layer.fgate_preact(x), gate_soft_cap)
    else:  # "fused": rows q | k | v | o and i | f
        q, k, v, o = torch.split(layer.qkv_opreact(x),
                                 [layer.qk_dim, layer.qk_dim, layer.v_dim, layer.v_dim], dim=-1)
        i, f = torch.split(soft_cap(layer.ifgate_preact(x), gate_soft_cap),
                           [num_heads, num_heads], dim=-1)
    q, k, v = (t.unflatten(-1, (num_heads, -1)).transpose(1, 2) for t in (q, k, v))
    return q, k, v, o, i.transpose(1, 2), f.transpose(1, 2)


class MultiHeadLayerNorm(torch.nn.Module):
    """Layernorm per head: ``[B, NH, S, DH]`` -> ``[B, S, NH * DH]``.

    Per (batch, head, position): mean and biased variance over DH in fp32 (fp64 for fp64
    input), ``(h - mean) / sqrt(var + eps)``, then per channel of ``NH * DH`` times
    ``weight`` (``1 + weight`` when ``residual_weight``) plus ``bias``. The result has the
    input's dtype.

    Parameters (xlstm's names and shapes): ``weight [NH * DH]`` if ``use_weight`` (ones, or
    zeros when ``residual_weight``), ``bias [NH * DH]`` if ``use_bias`` (zeros).

    Inside :class:`mLSTMLayer` this module only holds the parameters: the layer passes them to
    :func:`compileops.mlstm` (see :meth:`mlstm_kwargs`), whose kernel applies the norm. Its
    own :meth:`forward` is the standalone, unfused path (``reference.multihead_layernorm``).

    Differences from xlstm's classes, none of which changes the state dict:

    * input layout ``[B, NH, S, DH]``, the mLSTM cell's output (xlstm_large's
      ``MultiHeadLayerNorm`` takes ``[B, S, NH, DH]``; the original cell's takes ``[B, NH, S,
      DH]`` but returns that layout too). The output ``[B, S, NH * DH]`` is xlstm_large's;
    * the affine step is done in fp32 and rounded once (xlstm_large rounds the normalised
      value to the input dtype, then multiplies): results differ by one rounding in bf16;
    * statistics are always at least fp32: ``force_float32_reductions=False`` is accepted (for
      configs that carry it) and changes nothing.
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6, use_weight: bool = True,
                 use_bias: bool = False, force_float32_reductions: bool = True,
                 residual_weight: bool = False, device=None, dtype=None):
        super().__init__()
        if num_heads <= 0 or head_dim <= 0:
            raise ValueError(f"num_heads and head_dim must be positive, got {num_heads}, "
                             f"{head_dim}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_features = num_heads * head_dim
        self.eps = float(eps)
        self.residual_weight = bool(residual_weight) and use_weight
        self.force_float32_reductions = force_float32_reductions
        factory = {"device": device, "dtype": dtype}
        self.weight = (torch.nn.Parameter(torch.empty(self.num_features, **factory))
                       if use_weight else None)
        self.bias = (torch.nn.Parameter(torch.empty(self.num_features, **factory))
                     if use_bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.weight is not None:
                self.weight.fill_(0.0 if self.residual_weight else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def mlstm_kwargs(self, like: torch.Tensor) -> dict:
        """The keyword arguments that make :func:`compileops.mlstm` apply this norm:
        ``norm_weight``, ``norm_bias``, ``norm_eps``, ``residual_weight``. Without weight and
        bias, a ones weight (from ``like``) asks the op for the plain normalisation."""
        weight, bias = self.weight, self.bias
        if weight is None and bias is None:
            weight = like.new_ones((self.num_features,))
        return {"norm_weight": weight, "norm_bias": bias, "norm_eps": self.eps,
                "residual_weight": self.residual_weight}

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [B, NH, S, DH]`` -> ``[B, S, NH * DH]`` in h's dtype."""
        if h.dim() != 4 or h.shape[1] != self.num_heads or h.shape[3] != self.head_dim:
            raise ValueError(f"MultiHeadLayerNorm expects [B, NH={self.num_heads}, S, "
                             f"DH={self.head_dim}], got {tuple(h.shape)}")
        return reference.multihead_layernorm(h, self.weight, self.bias, self.eps,
                                             self.residual_weight, h.dtype)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, eps={self.eps}, "
                f"weight={self.weight is not None}, bias={self.bias is not None}, "
                f"residual_weight={self.residual_weight}")


@dataclasses.dataclass
class mLSTMLayerConfig:  # noqa: N801  (xlstm's name)
    """The :class:`mLSTMLayer` settings; the field names are xlstm's ``mLSTMLayerConfig``'s
    (the cell's ``eps`` sits in xlstm's backend config; ``kernel`` is ours)."""

    embedding_dim: int
    num_heads: int
    #: Bias in the q/k/v/o and output projections and in the norm (the gates always have one).
    use_bias: bool = False
    #: The multi-head layernorm's eps.
    norm_eps: float = 1e-6
    #: Accepted for xlstm configs; the norm statistics are always at least fp32.
    norm_reduction_force_float32: bool = True
    #: q and k width ``int(embedding_dim * qk_dim_factor)``, split over the heads.
    qk_dim_factor: float = 0.5
    #: v (and output gate) width ``int(embedding_dim * v_dim_factor)``, split over the heads.
    v_dim_factor: float = 1.0
    #: Gate pre-activations are soft-capped: ``cap * tanh(x / cap)`` (None: no cap).
    gate_soft_cap: Optional[float] = 15.0
    #: The cell's eps: ``h = C v / (n + eps)``.
    eps: float = 1e-6
    #: "single" (separate q, k, v, o, i, f projections) or "fused" (qkv_opreact, ifgate_preact).
    weight_mode: str = "single"
    #: Passed to :func:`compileops.mlstm` (``"auto"``, ``"parallel"`` or ``"chunkwise"``).
    kernel: str = "auto"

    @property
    def qk_dim(self) -> int:
        return int(self.embedding_dim * self.qk_dim_factor)

    @property
    def v_dim(self) -> int:
        return int(self.embedding_dim * self.v_dim_factor)

    def validate(self) -> None:
        if self.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode must be one of {WEIGHT_MODES}, got "
                             f"{self.weight_mode!r}")
        for name, width in (("qk_dim", self.qk_dim), ("v_dim", self.v_dim)):
            if width <= 0 or width % self.num_heads:
                raise ValueError(f"{name} = {width} (embedding_dim {self.embedding_dim} times "
                                 f"its factor) must be a positive multiple of num_heads "
                                 f"{self.num_heads}")


class mLSTMLayer(torch.nn.Module):  # noqa: N801  (xlstm's name)
    """The xLSTM-7B mLSTM layer: ``x [B, S, D]`` -> ``[B, S, D]``.

    With ``NH`` heads, ``DQK = qk_dim / NH``, ``DV = v_dim / NH``:

    1. ``q, k = Linear(x)`` to ``qk_dim`` -> ``[B, NH, S, DQK]``; ``v = Linear(x)`` to
       ``v_dim`` -> ``[B, NH, S, DV]``; ``o = Linear(x)`` to ``v_dim`` (the output gate's
       pre-activation, ``[B, S, v_dim]``);
    2. ``i, f = soft_cap(Linear(x), gate_soft_cap)`` to NH each, with bias -> ``[B, NH, S]``;
    3. ``h = compileops.mlstm(q, k, v, i, f, norm_weight=..., norm_bias=...)``: the cell with
       the multi-head layernorm (``self.multihead_norm``'s parameters) fused in, written
       ``[B, S, v_dim]``; the norm is never run separately;
    4. ``out_proj(sigmoid(o) * h)`` -> ``[B, S, D]`` (the block adds the residual).

    Construct from a :class:`mLSTMLayerConfig`, or from its fields as keywords
    (``mLSTMLayer(embedding_dim=512, num_heads=4)``), or both (keywords override).

    State dict: xlstm's ``mLSTMLayer`` keys in either weight mode (module docstring); load a
    checkpoint of the other mode through :func:`convert_xlstm_state_dict`. Unlike xlstm's
    layer, ``forward`` returns only ``y`` (no recurrent state: the parallel cell starts from a
    zero state), and runs in the input's dtype (xlstm's backend autocasts to bf16).

    Under ``torch.compile(dynamic=True)`` Dynamo makes the layer's float settings (the eps
    values) symbolic and restarts its trace once to specialise them, as it does for
    ``torch.nn.LayerNorm``'s eps; no recompile follows across sizes.

    Head dims on the Triton kernels: DQK up to 256, DV of any width (above 256 in slices of
    256 value columns, the norm after them; see :func:`compileops.mlstm`).

    Initialisation: ``torch.nn.Linear``'s default, then the original xLSTM cell's gate biases
    (forget gate ``linspace(3, 6)`` over heads, input gate ``N(0, 0.1)``), so that a freshly
    built layer remembers over tens of steps.
    """

    def __init__(self, config: Optional[mLSTMLayerConfig] = None, /, *, device=None, dtype=None,
                 **fields):
        super().__init__()
        if config is None:
            config = mLSTMLayerConfig(**fields)
        elif fields:
            config = dataclasses.replace(config, **fields)
        config.validate()
        self.config = config
        # What forward reads, copied out of the config.
        self.num_heads, self.weight_mode, self.kernel = (config.num_heads, config.weight_mode,
                                                         config.kernel)
        self.gate_soft_cap, self.eps = config.gate_soft_cap, config.eps
        d, nh = config.embedding_dim, config.num_heads
        self.qk_dim, self.v_dim = config.qk_dim, config.v_dim
        factory = {"device": device, "dtype": dtype}

        def linear(out_features: int, bias: bool) -> torch.nn.Linear:
            return torch.nn.Linear(d, out_features, bias=bias, **factory)

        if config.weight_mode == "single":
            self.q = linear(self.qk_dim, config.use_bias)
            self.k = linear(self.qk_dim, config.use_bias)
            self.v = linear(self.v_dim, config.use_bias)
            self.ogate_preact = linear(self.v_dim, config.use_bias)
            self.igate_preact = linear(nh, True)
            self.fgate_preact = linear(nh, True)
        else:
            self.qkv_opreact = linear(2 * self.qk_dim + 2 * self.v_dim, config.use_bias)
            self.ifgate_preact = linear(2 * nh, True)
        self.multihead_norm = MultiHeadLayerNorm(
            nh, self.v_dim // nh, eps=config.norm_eps, use_weight=True,
            use_bias=config.use_bias,
            force_float32_reductions=config.norm_reduction_force_float32, **factory)
        self.out_proj = torch.nn.Linear(self.v_dim, d, bias=config.use_bias, **factory)
        self.reset_gate_biases()

    def reset_gate_biases(self) -> None:
        """Forget-gate bias ``linspace(3, 6)`` over the heads, input-gate bias ``N(0, 0.1)``."""
        nh = self.config.num_heads
        with torch.no_grad():
            if self.config.weight_mode == "single":
                ibias, fbias = self.igate_preact.bias, self.fgate_preact.bias
            else:
                ibias, fbias = self.ifgate_preact.bias[:nh], self.ifgate_preact.bias[nh:]
            fbias.copy_(torch.linspace(3.0, 6.0, nh))
            ibias.normal_(0.0, 0.1)

    def projections(self, x: torch.Tensor):
        """``(q [B, NH, S, DQK], k, v [B, NH, S, DV], o [B, S, v_dim], i [B, NH, S], f)``:
        the cell's inputs and the output gate's pre-activation, gates soft-capped."""
        return layer_projections(self, x, self.num_heads, self.gate_soft_cap, self.weight_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, S, D]`` -> ``[B, S, D]``."""
        if x.dim() != 3:
            raise ValueError(f"mLSTMLayer expects x [B, S, D], got shape {tuple(x.shape)}")
        q, k, v, o, i, f = self.projections(x)
        h = mlstm(q, k, v, i, f, eps=self.eps, kernel=self.kernel,
                  **self.multihead_norm.mlstm_kwargs(v))  # [B, S, v_dim], normed
        return self.out_proj(torch.sigmoid(o) * h)

    def prefill(self, x: torch.Tensor):
        """``x [B, S, D]`` -> ``(y [B, S, D], state)``: :meth:`forward` (always the chunkwise
        form) also returning the cell's last state ``(C, n, m)`` for :meth:`step`."""
        q, k, v, o, i, f = self.projections(x)
        h, state = mlstm(q, k, v, i, f, eps=self.eps, kernel="chunkwise",
                         return_last_state=True, **self.multihead_norm.mlstm_kwargs(v))
        return self.out_proj(torch.sigmoid(o) * h), state

    def step(self, x: torch.Tensor, state=None):
        """One token for generation: ``x [B, D]`` and the state from :meth:`prefill` or the
        previous step (None: empty) -> ``(y [B, D], state)``, via
        :func:`compileops.mlstm_step`; equals :meth:`forward` on the whole sequence."""
        from compileops.mlstm.step import mlstm_step

        q, k, v, o, i, f = self.projections(x[:, None])
        h, state = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[..., 0], f[..., 0], state,
                              eps=self.eps, **self.multihead_norm.mlstm_kwargs(v))
        return self.out_proj(torch.sigmoid(o[:, 0]) * h), state

    def extra_repr(self) -> str:
        c = self.config
        return (f"embedding_dim={c.embedding_dim}, num_heads={c.num_heads}, "
                f"qk_dim={self.qk_dim}, v_dim={self.v_dim}, weight_mode={c.weight_mode!r}, "
                f"gate_soft_cap={c.gate_soft_cap}, eps={c.eps}")


_SINGLE_QKVO = ("q", "k", "v", "ogate_preact")
_SINGLE_IF = ("igate_preact", "fgate_preact")


def convert_xlstm_state_dict(state_dict: Mapping[str, torch.Tensor], weight_mode: str = "single",
                             *, v_dim: Optional[int] = None) -> dict[str, torch.Tensor]:
    """An xlstm state dict with every mLSTM layer in ``weight_mode`` (a new dict; other keys
    are kept unchanged).

    Works on a layer's own state dict or a whole model's (``backbone.blocks.3.mlstm_layer.``
    and other prefixes are found by the key endings). Per layer:

    * to ``"single"``: ``qkv_opreact.{weight,bias}`` (rows ``q | k | v | o``) is split into
      ``q``, ``k``, ``v``, ``ogate_preact``; ``ifgate_preact.{weight,bias}`` (rows ``i | f``)
      into ``igate_preact``, ``fgate_preact``. The split needs ``v_dim``: read from the layer's
      ``out_proj.weight [D, v_dim]``, or given;
    * to ``"fused"``: the inverse concatenation (xlstm's
      ``convert_single_weights_to_fused_weights`` for the mLSTM layer; its feed-forward
      weights are left alone).

    ``multihead_norm.{weight,bias}`` and ``out_proj.*`` need no change in either mode, and
    neither does a layer already in ``weight_mode``.
    """
    if weight_mode not in WEIGHT_MODES:
        raise ValueError(f"weight_mode must be one of {WEIGHT_MODES}, got {weight_mode!r}")
    out = dict(state_dict)
    if weight_mode == "single":
        for key in [k for k in state_dict if k.endswith("qkv_opreact.weight")]:
            prefix = key[: -len("qkv_opreact.weight")]
            fused = state_dict[key]
            width = v_dim
            if width is None:
                proj = state_dict.get(f"{prefix}out_proj.weight")
                if proj is None:
                    raise KeyError(f"{prefix}qkv_opreact.weight cannot be split without "
                                   f"{prefix}out_proj.weight; pass v_dim=")
                width = proj.shape[1]
            rest = fused.shape[0] - 2 * width
            if rest <= 0 or rest % 2:
                raise ValueError(f"{key} has {fused.shape[0]} rows, which is not "
                                 f"2 * qk_dim + 2 * v_dim with v_dim {width}")
            sizes = [rest // 2, rest // 2, width, width]
            for kind in ("weight", "bias"):
                name = f"{prefix}qkv_opreact.{kind}"
                if name in out:
                    for part, t in zip(_SINGLE_QKVO, torch.split(out.pop(name), sizes)):
                        out[f"{prefix}{part}.{kind}"] = t.clone()
            for kind in ("weight", "bias"):
                name = f"{prefix}ifgate_preact.{kind}"
                if name in out:
                    t = out.pop(name)
                    for part, half in zip(_SINGLE_IF, torch.chunk(t, 2)):
                        out[f"{prefix}{part}.{kind}"] = half.clone()
    else:
        for key in [k for k in state_dict if k.endswith("ogate_preact.weight")]:
            prefix = key[: -len("ogate_preact.weight")]
            for group, fused in ((_SINGLE_QKVO, "qkv_opreact"), (_SINGLE_IF, "ifgate_preact")):
                for kind in ("weight", "bias"):
                    names = [f"{prefix}{part}.{kind}" for part in group]
                    present = [n in out for n in names]
                    if all(present):
                        out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
                    elif any(present):
                        missing = [n for n, p in zip(names, present) if not p]
                        raise KeyError(f"cannot fuse {prefix}{fused}.{kind}: missing {missing}")
    return out


__all__ = ["MultiHeadLayerNorm", "convert_xlstm_state_dict", "mLSTMLayer", "mLSTMLayerConfig",
           "soft_cap"]
