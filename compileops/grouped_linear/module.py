"""``compileops.nn.GroupedLinear``: G linear layers applied to contiguous row groups.

One grouped parameter ``weight [G, N, K]`` (and ``bias [G, N]``). Checkpoints in the
TransformerEngine per-group layout (``weight0..weight{G-1}`` of ``[N, K]``, ``bias{i}`` of
``[N]``) load directly; :func:`to_per_group_state_dict` / :func:`from_per_group_state_dict`
convert both ways.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from compileops.grouped_linear.op import grouped_linear, grouped_linear_splits


def from_per_group_state_dict(state: Mapping[str, torch.Tensor], num_groups: int,
                              prefix: str = "") -> dict[str, torch.Tensor]:
    """``{prefix}weight{i}`` ``[N, K]`` / ``{prefix}bias{i}`` ``[N]`` -> ``weight [G, N, K]`` /
    ``bias [G, N]`` (other keys are kept)."""
    out = {k: v for k, v in state.items()
           if not (k.startswith(prefix) and k[len(prefix):].rstrip("0123456789") in ("weight", "bias")
                   and k[len(prefix):] not in ("weight", "bias"))}
    for name in ("weight", "bias"):
        keys = [f"{prefix}{name}{i}" for i in range(num_groups)]
        present = [k in state for k in keys]
        if all(present):
            out[f"{prefix}{name}"] = torch.stack([state[k] for k in keys])
        elif any(present):
            missing = [k for k, p in zip(keys, present) if not p]
            raise KeyError(f"per-group state dict is missing {missing}")
    return out


def to_per_group_state_dict(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Inverse of :func:`from_per_group_state_dict`: split the grouped tensors per group."""
    out = {k: v for k, v in state.items() if k not in (f"{prefix}weight", f"{prefix}bias")}
    for name in ("weight", "bias"):
        key = f"{prefix}{name}"
        if key in state:
            for i, t in enumerate(state[key].unbind(0)):
                out[f"{prefix}{name}{i}"] = t.clone()
    return out


class GroupedLinear(torch.nn.Module):
    """``y[rows of g] = x[rows of g] @ weight[g].T + bias[g]``.

    x ``[M, in_features]``; groups given per call as counts (``m_splits [G]``, the default,
    TransformerEngine's convention) or cumulative int32 end rows (``offsets=True``).
    Returns ``[M, out_features]``; rows past the last group are zero.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(num_groups, out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Per group, as torch.nn.Linear does.
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0
        with torch.no_grad():
            for w in self.weight:
                torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, m_splits_or_offsets: torch.Tensor, *,
                offsets: bool = False) -> torch.Tensor:
        if offsets:
            return grouped_linear(x, self.weight, m_splits_or_offsets.to(x.device), self.bias)
        return grouped_linear_splits(x, self.weight, m_splits_or_offsets, self.bias)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if f"{prefix}weight0" in state_dict and f"{prefix}weight" not in state_dict:
            converted = from_per_group_state_dict(
                {k: v for k, v in state_dict.items() if k.startswith(prefix)}, self.num_groups, prefix)
            for k in [k for k in state_dict if k.startswith(prefix)]:
                del state_dict[k]
            state_dict.update(converted)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
