"""compileops inside torchtitan 0.2 (``torchtitan.models.moe``, the layout that runs on torch
2.11): the ``"compileops_moe"`` converters and ``apply()`` on a tiny Qwen3 MoE, in one CPU
process (its parallelisms on gloo ranks: test_torchtitan_v02_mesh.py).

torchtitan 0.2's router counts tokens with ``torch.histc`` on integer expert ids, which torch
has on CUDA only: the tests count them on float ids (the same counts, in the ids' dtype;
``titan_v02_harness.histc_of_float_ids``), on the harness's tiny model.

Tolerances as in test_torchtitan.py: the two paths round the experts' intermediates to bf16
(u = 2^-8) at different places, a gradient's relative L2 difference <= 4u.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan")
import compileops.integrations.torchtitan as titan  # noqa: E402  (must import: no skip)
if titan.LAYOUT != "0.2":
    pytest.skip("torchtitan 0.2's MoE layout (torchtitan.models.moe)", allow_module_level=True)

import compileops  # noqa: E402
from tests.integrations import titan_v02_harness as harness  # noqa: E402

U = 2.0 ** -8


@pytest.fixture(autouse=True)
def _histc_on_cpu(monkeypatch):
    monkeypatch.setattr(torch, "histc", harness.histc_of_float_ids(torch.histc))


_model = harness.tiny_model


def _step(model, tokens):
    with compileops.backends.use_backend("reference"):
        out = model(tokens)
        out.float().square().mean().backward()
    return out


@pytest.mark.parametrize("score_before_experts", [False, True])
def test_apply_matches_torchtitan(score_before_experts):
    theirs = _model(score_before_experts)
    mine = copy.deepcopy(theirs)
    report = titan.apply(mine)
    where = "before experts" if score_before_experts else "epilogue"
    assert report == {"experts": ["layers.0.moe.experts", "layers.1.moe.experts"],
                      "scores": {"layers.0.moe": where, "layers.1.moe": where},
                      "compute": {"layers.0.moe.experts": "bf16",
                                  "layers.1.moe.experts": "bf16"},
                      "fp8": None, "layout": "0.2"}
    assert list(mine.state_dict()) == list(theirs.state_dict())
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    want, got = _step(theirs, tokens), _step(mine, tokens)
    assert ((got - want).norm() / want.norm()).item() <= U
    for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel <= 4 * U, (name, rel)
    # the load-balancing counts are kept as torchtitan keeps them
    for a, b in zip(mine.layers.values(), theirs.layers.values()):
        assert torch.equal(a.moe.tokens_per_expert, b.moe.tokens_per_expert)


def test_compiled_body_does_not_recompile_as_token_counts_change():
    from compileops.integrations._titan_v02 import apply_v02
    from compileops.integrations._titan_experts import Options

    theirs = _model()
    mine = copy.deepcopy(theirs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests of this process compiled too
    apply_v02(mine, Options(), compile_backend="aot_eager")  # as the converter does
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 8), generator=gen)
        want, got = _step(theirs, tokens), _step(mine, tokens)
        assert ((got - want).norm() / want.norm()).item() <= U
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_converters_are_registered_and_refuse_tensor_parallelism():
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    assert _registry_model_converter_cls["compileops_moe"].fp8 is None
    fp8 = _registry_model_converter_cls["compileops_moe_fp8"]
    assert fp8.fp8 == "rowwise"
    fp8_dw = _registry_model_converter_cls["compileops_moe_fp8_dw"]
    assert fp8_dw.fp8 == "rowwise" and fp8_dw.fp8_weight_grad and not fp8.fp8_weight_grad
    pair = _registry_model_converter_cls["compileops_moe_pair"]
    assert pair.fp8 is None and pair.gate_up == "pair"

    class Job:
        class compile:  # noqa: N801 - the job config's section
            enable, components, backend = False, [], "inductor"

    for tp, etp in ((2, 1), (2, 2)):
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, etp=etp,
                            world_size=2)
        with pytest.raises(ValueError, match="not tensor parallelism"):
            fp8(Job, dims)
    # expert parallelism is served (tests/integrations/test_torchtitan_v02_mesh.py)
    fp8(Job, ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1,
                          world_size=2))
    single = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                          world_size=1)
    model = _model()
    fp8(Job, single).convert(model)
    assert model.layers["0"].moe.compileops_options.fp8 == "rowwise"


def test_apply_refuses_experts_with_hooks_before_changing_anything():
    model = _model()
    model.layers["1"].moe.experts.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(NotImplementedError, match=r"layers\.1\.moe\.experts has forward hooks"):
        titan.apply(model)
    assert type(model.layers["0"].moe).__name__ == "MoE"


def test_for_loop_experts_keep_the_parameters_dtype():
    """torchtitan's experts with ``use_grouped_mm=False`` (which it sets itself for some
    models before Hopper) compute in the parameters' dtype, fp32 here: so do the converted
    ones, within fp32 rounding of torchtitan's (bf16 would be about 1e-2 off)."""
    theirs = _model(use_grouped_mm=False)
    mine = copy.deepcopy(theirs)
    report = titan.apply(mine)
    assert set(report["compute"].values()) == {
        "the parameters' dtype (torchtitan's use_grouped_mm=False)"}
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    want, got = _step(theirs, tokens), _step(mine, tokens)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel <= 1e-5, (name, rel)


def test_a_layer_converted_for_a_compiled_job_saves_and_loads(tmp_path):
    """The converter of a job that compiles keeps the backend's name on each MoE, not the
    compiled function, so that the module pickles; loaded, it computes as before."""
    from compileops.integrations._titan_experts import Options
    from compileops.integrations._titan_v02 import apply_v02

    model = _model()
    apply_v02(model, Options(), compile_backend="aot_eager")
    moe = model.layers["0"].moe
    torch.save(moe, tmp_path / "moe.pt")
    loaded = torch.load(tmp_path / "moe.pt", weights_only=False)
    assert loaded.compileops_compile_backend == "aot_eager"
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    with compileops.backends.use_backend("reference"), torch.no_grad():
        assert torch.equal(loaded(x), moe(x))
