"""``compileops.nn.GroupedLinear``: G linear layers applied to contiguous row groups.

One grouped parameter ``weight [G, N, K]`` (and ``bias [G, N]``). Checkpoints in the
TransformerEngine per-group layout (``weight0..weight{G-1}`` of ``[N, K]``, ``bias{i}`` of
``[N]``) load directly; :func:`to_per_group_state_dict` / :func:`from_per_group_state_dict`
convert both ways. Loading per-group keys follows ``torch.nn.Module.load_state_dict``: a
missing group is a missing key, a group past ``num_groups`` an unexpected one (an error under
``strict=True``), and a group of the wrong shape a size mismatch naming the key and both
shapes.
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Optional

import torch

from compileops.grouped_linear.api import (
    check_fp8_options,
    grouped_linear,
    grouped_linear_splits,
)


# A per-group key's name after the prefix: "weight" or "bias" and a group number written as
# Python writes an int (no sign, no leading zero), so "weight01" is not group 1's key.
_PER_GROUP_KEY = re.compile(r"(weight|bias)(0|[1-9][0-9]*)")


def per_group_keys(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, dict[int, str]]:
    """``{"weight": {group: key}, "bias": {group: key}}``: the per-group keys under ``prefix``
    in ``state`` (``{prefix}weight{i}``, ``{prefix}bias{i}``), whatever their group numbers."""
    found: dict[str, dict[int, str]] = {"weight": {}, "bias": {}}
    for key in state:
        if key.startswith(prefix):
            match = _PER_GROUP_KEY.fullmatch(key[len(prefix):])
            if match:
                found[match.group(1)][int(match.group(2))] = key
    return found


def from_per_group_state_dict(state: Mapping[str, torch.Tensor], num_groups: int,
                              prefix: str = "") -> dict[str, torch.Tensor]:
    """``{prefix}weight{i}`` ``[N, K]`` / ``{prefix}bias{i}`` ``[N]`` -> ``weight [G, N, K]`` /
    ``bias [G, N]`` (other keys are kept).

    Every group ``0..num_groups-1`` of a name must be there, and no other: a missing group
    or one past ``num_groups`` raises ``KeyError`` naming the keys; groups of different shapes
    raise ``ValueError`` naming the key and both shapes. A name without per-group keys is
    left as it is."""
    out = dict(state)
    for name, groups in per_group_keys(state, prefix).items():
        if not groups:
            continue
        missing = [f"{prefix}{name}{g}" for g in range(num_groups) if g not in groups]
        extra = [key for g, key in sorted(groups.items()) if g >= num_groups]
        if missing or extra:
            raise KeyError(
                f"per-group state dict of {num_groups} groups"
                + (f" is missing {missing}" if missing else "")
                + (" and" if missing and extra else "")
                + (f" has keys past its last group: {extra}" if extra else ""))
        first = f"{prefix}{name}0"
        for g in range(1, num_groups):
            key = groups[g]
            if state[key].shape != state[first].shape:
                raise ValueError(
                    f"per-group state dict: {key} has shape {tuple(state[key].shape)}, but "
                    f"{first} has shape {tuple(state[first].shape)}; every group's {name} "
                    "must have one shape")
        if f"{prefix}{name}" in state:
            raise KeyError(f"state dict holds both {prefix}{name} and per-group keys "
                           f"{prefix}{name}0..; keep one layout")
        for key in groups.values():
            del out[key]
        if num_groups:
            out[f"{prefix}{name}"] = torch.stack([state[groups[g]] for g in range(num_groups)])
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

    ``fp8="rowwise"`` or ``"blockwise"`` (experimental, ``bias=False`` only): the forward
    and dX products in e4m3 (:func:`compileops.grouped_linear`'s ``fp8``); the parameters
    stay in ``dtype``. ``cache_fp8_weights=True``: the weight's e4m3 copies are made once per
    optimizer step (per version of the weight) and reused by every micro-batch, at one byte
    per weight element per layout (:mod:`compileops.grouped_linear.fp8_cache`).
    ``fp8_fast_accum=True`` (with ``"rowwise"``): the products accumulate in the MMA's
    reduced-precision sum over all of K; faster, slightly less exact
    (:func:`compileops.grouped_linear`). ``fp8_weight_grad=True`` (with ``"rowwise"``): the
    weight gradient in e4m3 too, at a relative error of about 3.7e-2 where bf16's is 1.7e-3
    (:func:`compileops.grouped_linear`).
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, fp8: Optional[str] = None,
                 cache_fp8_weights: bool = False, fp8_fast_accum: bool = False,
                 fp8_weight_grad: bool = False):
        super().__init__()
        from compileops.grouped_linear.fp8_op import check_recipe

        check_recipe(fp8, bias=True if bias else None, fast_accum=fp8_fast_accum,
                     weight_grad=fp8_weight_grad)
        if fp8 is None:
            check_fp8_options(cache_fp8_weights, fp8_fast_accum, fp8_weight_grad)
        self.fp8, self.cache_fp8_weights = fp8, bool(cache_fp8_weights)
        self.fp8_fast_accum = bool(fp8_fast_accum)
        self.fp8_weight_grad = bool(fp8_weight_grad)
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
        """``x [M, K]`` -> ``[M, N]``: the rows of group ``g`` times ``weight[g]^T`` (plus
        ``bias[g]``); rows past the last group are zeros.

        ``m_splits_or_offsets [G]``: the groups' row counts (integers, TransformerEngine's
        ``m_splits``), or with ``offsets=True`` their cumulative end rows (int32, as
        :func:`compileops.grouped_linear` takes them). On a GPU give it as a device tensor:
        its values are read on the device, so nothing waits for the host (and nothing is
        checked there: :func:`compileops.strict_offset_checks` checks them, at a sync). A
        Python list works too, but each new list recompiles under ``torch.compile``.

        Same dtype for ``x`` and the weight (bf16, fp16 or fp32; fp64 on the reference
        backend). Deterministic; see :func:`compileops.grouped_linear` for the numerics.
        """
        if offsets:
            return grouped_linear(x, self.weight, m_splits_or_offsets.to(x.device), self.bias,
                                  fp8=self.fp8, cache_fp8_weights=self.cache_fp8_weights,
                                  fp8_fast_accum=self.fp8_fast_accum,
                                  fp8_weight_grad=self.fp8_weight_grad)
        return grouped_linear_splits(x, self.weight, m_splits_or_offsets, self.bias,
                                     fp8=self.fp8, cache_fp8_weights=self.cache_fp8_weights,
                                     fp8_fast_accum=self.fp8_fast_accum,
                                     fp8_weight_grad=self.fp8_weight_grad)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Per-group keys (weight{i} [N, K], bias{i} [N]) load with torch.nn.Module's
        # semantics, key by key: a group past num_groups is an unexpected key, a group not
        # given a missing one (its slice keeps its value), a group of the wrong shape a size
        # mismatch naming the key and both shapes; load_state_dict then reports them in its
        # result, or raises under strict=True, as torch does for any key.
        loaded_by_group = []
        for name, groups in per_group_keys(state_dict, prefix).items():
            param = getattr(self, name)
            if not groups or param is None or f"{prefix}{name}" in state_dict:
                continue  # left to torch: unexpected keys (no such parameter, or both layouts)
            present = self._take_groups(state_dict, name, groups, strict, unexpected_keys,
                                        error_msgs)
            if strict:  # (as torch.nn.Module reports missing keys)
                missing_keys.extend(f"{prefix}{name}{g}" for g in range(self.num_groups)
                                    if g not in groups)
            if self.num_groups and len(present) == self.num_groups:
                # All there: one grouped key, which torch loads (assign=True included).
                state_dict[f"{prefix}{name}"] = torch.stack(
                    [present[g][1] for g in range(self.num_groups)])
            else:
                loaded_by_group.append(f"{prefix}{name}")
                for g, (key, value) in present.items():
                    self._copy_group(param, g, key, value, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # Those were loaded (or reported) group by group, not as one grouped key.
        missing_keys[:] = [k for k in missing_keys if k not in loaded_by_group]

    def _take_groups(self, state_dict, name, groups, strict, unexpected_keys, error_msgs):
        """Pop ``name``'s per-group keys from ``state_dict``; return ``{group: (key, tensor)}``
        of the ones that fit, after reporting the others as torch would."""
        param = getattr(self, name)
        expected = param.shape[1:]
        present = {}
        for g, key in sorted(groups.items()):
            value = state_dict.pop(key)
            if g >= self.num_groups:
                if strict:  # (what torch.nn.Module does with keys it does not know)
                    unexpected_keys.append(key)
            elif not torch.overrides.is_tensor_like(value):
                error_msgs.append(f'While copying the parameter named "{key}", expected '
                                  f"torch.Tensor or Tensor-like object from checkpoint but "
                                  f"received {type(value)}")
            elif value.shape != expected:  # (torch's words for any parameter)
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from "
                    f"checkpoint, the shape in current model is {expected}.")
            else:
                present[g] = (key, value)
        return present

    @staticmethod
    def _copy_group(param, g, key, value, error_msgs) -> None:
        """``param[g] = value`` (``key`` is group g's), reporting a failure as torch reports
        one of a whole parameter."""
        try:
            with torch.no_grad():
                param[g].copy_(value)
        except Exception as ex:  # noqa: BLE001 (reported, as torch.nn.Module does)
            error_msgs.append(
                f'While copying the parameter named "{key}", whose dimensions in the model are '
                f"{param.shape[1:]} and whose dimensions in the checkpoint are {value.size()}, "
                f"an exception occurred : {ex.args}.")

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}"
                + (f", fp8={self.fp8!r}" if self.fp8 is not None else "")
                + (", cache_fp8_weights=True" if self.cache_fp8_weights else "")
                + (", fp8_fast_accum=True" if self.fp8_fast_accum else "")
                + (", fp8_weight_grad=True" if self.fp8_weight_grad else ""))
