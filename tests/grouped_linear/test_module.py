"""compileops.nn.GroupedLinear's state dicts: the grouped layout (``weight [G, N, K]``,
``bias [G, N]``) and the per-group one (``weight{i}``, ``bias{i}``, TransformerEngine's).

A per-group checkpoint loads with torch.nn.Module's semantics, key by key. The oracle is a
module that holds each group as a parameter of its own (:class:`_PerGroupParameters`), loaded
by torch itself: same missing and unexpected keys, same errors, same values afterwards."""
import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compileops
from compileops.grouped_linear.module import from_per_group_state_dict, to_per_group_state_dict
from tests import fuzzing


class _PerGroupParameters(torch.nn.Module):
    """``module``'s groups as parameters ``weight{i}`` ``[N, K]`` and ``bias{i}`` ``[N]``."""

    def __init__(self, module):
        super().__init__()
        for name in ("weight", "bias"):
            grouped = getattr(module, name)
            if grouped is not None:
                for g in range(module.num_groups):
                    self.register_parameter(f"{name}{g}",
                                            torch.nn.Parameter(grouped[g].detach().clone()))


def _load(module, state, strict):
    """What ``module.load_state_dict`` reports: ``(missing, unexpected, other errors)``, each
    a set, whether it returned them or raised them."""
    try:
        result = module.load_state_dict(state, strict=strict)
        return set(result.missing_keys), set(result.unexpected_keys), set(), False
    except RuntimeError as e:
        lines = str(e).split("\n\t")[1:]
        missing, unexpected, other = set(), set(), set()
        for line in lines:
            keys = set(re.findall(r'"([^"]+)"', line))
            if line.startswith("Missing key(s)"):
                missing = keys
            elif line.startswith("Unexpected key(s)"):
                unexpected = keys
            else:
                other.add(line.strip())
        return missing, unexpected, other, True


@settings(max_examples=60)
@given(data=st.data())
def test_per_group_keys_load_as_torch_loads_each_group(data):
    groups = data.draw(st.integers(0, 4), label="num_groups")
    n, k = data.draw(st.integers(1, 3), label="N"), data.draw(st.integers(1, 3), label="K")
    bias = data.draw(st.booleans(), label="bias")
    nested = data.draw(st.booleans(), label="nested")
    spec = data.draw(fuzzing.per_group_checkpoints(groups, {"weight": (n, k), "bias": (n,)}),
                     label="checkpoint")
    gen = torch.Generator().manual_seed(0)
    prefix = "experts." if nested else ""
    ours = compileops.nn.GroupedLinear(groups, k, n, bias=bias, dtype=torch.float64)
    oracle = _PerGroupParameters(ours)
    state = {prefix + key: torch.randn(shape, generator=gen, dtype=torch.float64)
             for key, shape in spec.items()}
    oracle_state = dict(state)
    for name in ("weight", "bias"):
        grouped = getattr(ours, name)
        if grouped is not None and not any(re.fullmatch(f"{name}(0|[1-9][0-9]*)", key) for key in spec):
            # A name without per-group keys comes in the grouped layout (so layouts mix).
            value = torch.randn(grouped.shape, generator=gen, dtype=torch.float64)
            state[prefix + name] = value
            oracle_state.update({f"{prefix}{name}{g}": value[g] for g in range(groups)})
    if nested:
        ours, oracle = torch.nn.ModuleDict({"experts": ours}), torch.nn.ModuleDict({"experts": oracle})
    for strict in (False, True):
        got_module, want_module = copy.deepcopy(ours), copy.deepcopy(oracle)
        got = _load(got_module, dict(state), strict)
        want = _load(want_module, dict(oracle_state), strict)
        assert got == want, f"strict={strict}: got {got}, torch's per-group parameters {want}"
        # What loaded (torch loads every fitting key, even when it then raises) is the same.
        want_params = dict(want_module.named_parameters())
        for name, grouped in (got_module.experts if nested else got_module).named_parameters():
            for g in range(groups):
                assert torch.equal(grouped[g], want_params[f"{prefix}{name}{g}"]), (name, g)


def test_extra_group_is_unexpected_and_strict_raises():
    module = compileops.nn.GroupedLinear(2, 3, 4)
    state = to_per_group_state_dict(module.state_dict())
    state["weight2"] = torch.randn(4, 3)
    result = compileops.nn.GroupedLinear(2, 3, 4).load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["weight2"] and result.missing_keys == []
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "weight2"'):
        compileops.nn.GroupedLinear(2, 3, 4).load_state_dict(state)


def test_misshaped_group_names_the_key_and_both_shapes():
    state = to_per_group_state_dict(compileops.nn.GroupedLinear(2, 3, 4).state_dict())
    state["weight1"] = torch.randn(5, 3)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=re.escape(
                "size mismatch for weight1: copying a param with shape torch.Size([5, 3]) from "
                "checkpoint, the shape in current model is torch.Size([4, 3]).")):
            compileops.nn.GroupedLinear(2, 3, 4).load_state_dict(state, strict=strict)


def test_missing_group_keeps_its_values_and_is_reported():
    module = compileops.nn.GroupedLinear(3, 2, 2, bias=False)
    before = module.weight.detach().clone()
    state = {"weight0": torch.zeros(2, 2), "weight2": torch.ones(2, 2)}
    result = module.load_state_dict(state, strict=False)
    assert result.missing_keys == ["weight1"] and result.unexpected_keys == []
    assert torch.equal(module.weight[0], torch.zeros(2, 2))
    assert torch.equal(module.weight[1], before[1])
    assert torch.equal(module.weight[2], torch.ones(2, 2))


@pytest.mark.parametrize("fault", ["extra", "missing", "misshaped", "both layouts"])
def test_from_per_group_state_dict_refuses_what_it_cannot_convert(fault):
    state = to_per_group_state_dict(compileops.nn.GroupedLinear(2, 3, 4).state_dict())
    error, match = KeyError, None
    if fault == "extra":
        state["bias2"] = torch.randn(4)
        match = "past its last group: \\['bias2'\\]"
    elif fault == "missing":
        del state["weight1"]
        match = "missing \\['weight1'\\]"
    elif fault == "misshaped":
        state["weight1"] = torch.randn(4, 5)
        error, match = ValueError, re.escape("weight1 has shape (4, 5), but weight0 has shape (4, 3)")
    else:
        state["weight"] = torch.randn(2, 4, 3)
        match = "both weight and per-group keys"
    with pytest.raises(error, match=match):
        from_per_group_state_dict(state, 2)
