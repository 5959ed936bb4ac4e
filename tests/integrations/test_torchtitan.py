"""compileops inside torchtitan 0.3: the converter on its Qwen3 MoE (cut to a tiny size), trained
by torchtitan's own ``parallelize_qwen3`` on 1, 2 and 4 CPU processes over gloo
(``tests/integrations/titan_harness.py`` says what it changes in torchtitan to run there).

Every mesh trains torchtitan's own experts and the converted ones from the same weights on the
same batches for 5 SGD steps; the losses and every parameter's full gradient at every step are
compared with each other and with the single-process run of the same path.

The converted ops run on compileops' reference backend (their PyTorch ground truth: the same
custom ops, autograd and compiled graphs; the kernels are tested against it in
tests/grouped_linear) in the multi-step runs: under Triton's CPU interpreter a launch costs
about 0.3 s. :func:`test_triton_kernels_in_the_loop` runs the kernels for one step.

Tolerances, with u = 2^-8 the unit roundoff of bf16 (both paths compute the experts as
torchtitan does: bf16 inputs and weights, fp32 accumulation, bf16 products):

* converted vs torchtitan, same mesh: each path rounds the experts' intermediates to bf16 at
  places the other does not (torchtitan rounds the gate and up products, the SiLU, their
  product and the down product before scaling it in fp32; compileops rounds the SwiGLU once
  from fp32, and the scaled down product), about two roundings apart in the forward and two in
  the backward: relative L2 difference of each gradient <= 4u. The loss averages these
  per-element differences over every token: relative <= 2^-12.
* one path on a mesh vs in one process: the same math, with fp32 sums in other orders (each
  rank's products have fewer rows, which a CPU BLAS may block differently; FSDP's
  reduce-scatter adds the ranks' partial gradients; compiled code fuses fp32 arithmetic
  differently; after the first update the weights differ in their last bits). Each such
  difference can move a bf16 rounding of the experts by one step, on the forward and on the
  backward: relative <= 2u at every step; losses <= 2^-12.
"""
from __future__ import annotations

import functools

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")
import compileops.integrations.torchtitan as titan  # noqa: E402  (must import: no skip)
if titan.LAYOUT != "0.3":
    pytest.skip("these tests drive torchtitan 0.3's parallelize_qwen3", allow_module_level=True)

from tests.gloo import run_ranks  # noqa: E402
from tests.integrations import titan_harness as harness  # noqa: E402
from tests.integrations.titan_harness import (  # noqa: E402
    assert_close_runs,
    relative_l2,
    run_on_ranks,
)

U = 2.0 ** -8
STEPS = harness.STEPS


def _run(world: int, configs: dict) -> dict:
    return run_on_ranks(world, configs)


@functools.lru_cache(maxsize=None)
def single_rank() -> dict:
    return _run(1, {"titan": {"record_weights": True}, "bf16": {"convert": "bf16"},
                    "fp8": {"convert": "fp8"}, "fp8-forced": {"convert": "fp8",
                                                              "forced_by": "titan"}})


@functools.lru_cache(maxsize=None)
def two_ranks() -> dict:
    return _run(2, {
        "ep2/titan": {"ep": 2}, "ep2/bf16": {"ep": 2, "convert": "bf16"},
        "fsdp2-compiled-sac/titan": {"compile": "aot_eager", "ac": "selective"},
        "fsdp2-compiled-sac/bf16": {"compile": "aot_eager", "ac": "selective",
                                    "convert": "bf16"},
    })


@functools.lru_cache(maxsize=None)
def four_ranks() -> dict:
    return _run(4, {
        "ep2xfsdp2-full-ac/titan": {"ep": 2, "ac": "full"},
        "ep2xfsdp2-full-ac/bf16": {"ep": 2, "ac": "full", "convert": "bf16"},
        "ep4-compiled/titan": {"ep": 4, "compile": "aot_eager", "seq_lens": (8,)},
        "ep4-compiled/bf16": {"ep": 4, "compile": "aot_eager", "seq_lens": (8,),
                              "convert": "bf16"},
    })


def test_single_rank_converted_matches_torchtitan():
    res = single_rank()
    assert_close_runs(res["bf16"], res["titan"], grad_rtol=4 * U, what="bf16 vs torchtitan")
    # The losses move (the runs compare training, not five copies of the first step).
    assert abs(res["titan"]["losses"][-1] - res["titan"]["losses"][0]) > 1e-3


def test_single_rank_fp8_trains_like_torchtitan():
    """fp8 rowwise: each e4m3 product has a relative error of about 3.7e-2 (fp8_op's
    docstring); a gradient passes through at most three of them. That bounds a step's
    gradients from the same weights: every step starts from torchtitan's weights at that
    step ("fp8-forced"). Trained on its own, the fp8 model's weights drift from
    torchtitan's by fp8's error, and a token whose top-k choice is near a tie can switch
    experts, which changes the router's and those experts' gradients by far more than a
    product's error (measured: 0.31 at step 4 in one layer, where the forced step's
    worst is 0.06): the free run is held to its losses."""
    res = single_rank()
    assert_close_runs(res["fp8-forced"], res["titan"], grad_rtol=3 * 4e-2,
                      loss_rtol=4e-2 / 8, what="fp8 (forced) vs torchtitan")
    torch.testing.assert_close(torch.tensor(res["fp8"]["losses"]),
                               torch.tensor(res["titan"]["losses"]), rtol=4e-2 / 8, atol=0)
    # The forced run did follow torchtitan's weights: its step-0 gradients are the free run's.
    for name, grads in res["fp8"]["grads"].items():
        assert torch.equal(grads[0], res["fp8-forced"]["grads"][name][0]), name


@pytest.mark.parametrize("name, ranks", [
    ("ep2", 2), ("fsdp2-compiled-sac", 2), ("ep2xfsdp2-full-ac", 4), ("ep4-compiled", 4),
])
def test_mesh_matches_torchtitan_and_single_rank(name, ranks):
    res = (two_ranks if ranks == 2 else four_ranks)()
    titan_run, mine = res[f"{name}/titan"], res[f"{name}/bf16"]
    assert_close_runs(mine, titan_run, grad_rtol=4 * U, what=f"{name}: bf16 vs torchtitan")
    if name == "ep4-compiled":  # one sequence length: compare with runs of the same batches
        return
    single = single_rank()
    for path, run in (("titan", titan_run), ("bf16", mine)):
        assert_close_runs(run, single[path], grad_rtol=2 * U,
                           what=f"{name}/{path} vs one process")


@pytest.mark.parametrize("name, ranks", [("fsdp2-compiled-sac", 2), ("ep4-compiled", 4)])
def test_compiled_blocks_do_not_recompile(name, ranks):
    res = (two_ranks if ranks == 2 else four_ranks)()
    for path in ("titan", "bf16"):
        graphs = res[f"{name}/{path}"]["graphs"]
        assert graphs[0] >= 1, graphs  # the blocks did compile (fullgraph: one graph each)
        # The token counts per expert change at every step; the sequence length changes at
        # the third step of the SAC run (one dynamic-shape recompile), never after it.
        warm = 3 if name == "fsdp2-compiled-sac" else 1
        assert len(set(graphs[warm - 1:])) == 1, (path, graphs)
    assert res[f"{name}/bf16"]["graphs"] == res[f"{name}/titan"]["graphs"]


def test_triton_kernels_in_the_loop():
    """One step with the Triton kernels (under the interpreter) instead of the reference
    backend. Both accumulate in fp32 and round each product to bf16, summing in another
    order: any of those roundings can land one step apart, and a weight's gradient passes
    through four of them (pre-activations, the SwiGLU output and the down product forward,
    the down projection's dX backward): relative <= 4u, as between the two paths."""
    results, codes = run_ranks(functools.partial(
        harness.train_configs, configs={"kernels": {"convert": "bf16", "backend": None,
                                                    "steps": 1}}), 1, timeout_s=900)
    assert codes == [0], results
    got = results[0]["kernels"]
    want = single_rank()["bf16"]
    assert abs(got["losses"][0] - want["losses"][0]) <= 2.0 ** -12 * abs(want["losses"][0])
    for name, grads in want["grads"].items():
        rel = relative_l2(got["grads"][name][0], grads[0])
        assert rel <= 4 * U, (name, rel)


# ---------------------------------------------------------------------------------------
# One process, no mesh: what the converter changes and what it keeps


def _models():
    """``(converted, torchtitan's)`` tiny models, each initialised by torchtitan."""
    torch.manual_seed(0)
    mine = harness.tiny_config("bf16").build()
    theirs = harness.tiny_config().build()
    mine.init_weights()
    theirs.init_weights()
    return mine, theirs


def test_converter_keeps_parameters_and_state_dict():
    from compileops.integrations._titan_v03 import (
        CompileopsGroupedExperts,
        CompileopsRoutedExperts,
    )

    mine, theirs = _models()
    layer = mine.layers["0"].moe.routed_experts
    assert type(layer) is CompileopsRoutedExperts
    assert type(layer.inner_experts) is CompileopsGroupedExperts
    assert [(n, p.shape, p.dtype) for n, p in mine.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in theirs.named_parameters()]
    assert list(mine.state_dict()) == list(theirs.state_dict())
    assert [(n, b.shape) for n, b in mine.named_buffers()] == \
        [(n, b.shape) for n, b in theirs.named_buffers()]


def test_hf_state_dict_adapter_unchanged():
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    mine, theirs = _models()
    theirs.load_state_dict(mine.state_dict())
    hf_mine = Qwen3StateDictAdapter(harness.tiny_config("bf16"), None).to_hf(mine.state_dict())
    hf_theirs = Qwen3StateDictAdapter(harness.tiny_config(), None).to_hf(theirs.state_dict())
    assert hf_mine.keys() == hf_theirs.keys()
    for k in hf_mine:
        assert torch.equal(hf_mine[k], hf_theirs[k]), k
    back_mine = Qwen3StateDictAdapter(harness.tiny_config("bf16"), None).from_hf(hf_mine)
    back_theirs = Qwen3StateDictAdapter(harness.tiny_config(), None).from_hf(hf_theirs)
    assert back_mine.keys() == back_theirs.keys()
    for k in back_mine:
        assert torch.equal(back_mine[k], mine.state_dict()[k]), k


@pytest.mark.parametrize("direction", ["torchtitan->compileops", "compileops->torchtitan"])
def test_dcp_checkpoint_loads_bitwise_across_conversion(tmp_path, direction):
    import torch.distributed.checkpoint as dcp

    mine, theirs = _models()
    src, dst = (theirs, mine) if direction.startswith("torchtitan") else (mine, theirs)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_()
        for p in dst.parameters():
            p.zero_()
    saved = {k: v.clone() for k, v in src.state_dict().items()}
    dcp.save(src.state_dict(), checkpoint_id=str(tmp_path))
    target = dst.state_dict()
    dcp.load(target, checkpoint_id=str(tmp_path))
    dst.load_state_dict(target)
    assert dst.state_dict().keys() == saved.keys()
    for k, v in dst.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_apply_on_a_built_model_reports_and_matches_the_converter():
    mine, theirs = _models()
    report = titan.apply(theirs)
    assert report["layout"] == "0.3" and report["fp8"] is None
    assert report["experts"] == [f"layers.{i}.moe.routed_experts.inner_experts"
                                 for i in range(harness.SIZES["layers"])]
    # the local dispatcher (no expert parallelism): scores in the down projection's epilogue
    assert set(report["scores"].values()) == {"epilogue"}
    assert type(theirs.layers["0"].moe.routed_experts) is type(mine.layers["0"].moe.routed_experts)
    theirs.load_state_dict(mine.state_dict())
    tokens = torch.randint(0, harness.SIZES["vocab"], (2, 8))
    seen = []  # the experts get each routed row's score (the third argument)
    theirs.layers["0"].moe.routed_experts.inner_experts.register_forward_pre_hook(
        lambda module, args: seen.append(len(args)))
    import compileops

    with compileops.backends.use_backend("reference"):
        torch.testing.assert_close(theirs(tokens), mine(tokens), rtol=0, atol=0)
    assert seen == [3]
    assert titan.apply(theirs)["experts"] == report["experts"]  # idempotent


def test_gate_up_pair_reaches_the_experts_and_gives_the_same_bits():
    """``gate_up="pair"`` through the converter's config and through ``apply()``: every
    converted experts module computes with it. The model's output is the concatenated form's,
    bitwise (the Triton kernels, under the interpreter on CPU). Its gradients are too up to
    dX of the gate/up product: the tiny model's F = 16 is half the interpreter's K step, so
    the pair sums dX's two halves apart (the kernels' docstring); a bf16 rounding of dX can
    then move one step, relative <= 2u."""
    from compileops.integrations.torchtitan import CompileopsMoEConverter

    config = CompileopsMoEConverter.Config(gate_up="pair").build().convert(harness.tiny_config())
    torch.manual_seed(0)
    pair = config.build()
    pair.init_weights()
    _, concatenated = _models()
    titan.apply(concatenated)
    concatenated.load_state_dict(pair.state_dict())
    applied = harness.tiny_config().build()
    titan.apply(applied, gate_up="pair")
    for model, form in ((pair, "pair"), (applied, "pair"), (concatenated, "concatenated")):
        experts = [m for m in model.modules() if hasattr(m, "compileops_options")]
        assert experts and {m.compileops_options.gate_up for m in experts} == {form}
    tokens = torch.randint(0, harness.SIZES["vocab"], (2, 8))
    outs = []
    for model in (pair, concatenated):
        model.zero_grad()
        out = model(tokens)
        out.float().sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0])
    for name, grad in outs[0][1].items():
        assert relative_l2(grad.float(), outs[1][1][name].float()) <= 2 * U, name


def test_apply_refuses_a_parallelized_model():
    _, theirs = _models()
    theirs.layers["1"].moe.routed_experts._parallelized = True
    before = type(theirs.layers["0"].moe.routed_experts)
    with pytest.raises(NotImplementedError, match="layers.1.moe.routed_experts: already "
                                                  "parallelized"):
        titan.apply(theirs)
    assert type(theirs.layers["0"].moe.routed_experts) is before  # nothing changed


def test_converter_refuses_other_experts_and_models_without_moe():
    from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls
    from torchtitan.models.common.moe import GroupedExperts

    config = harness.tiny_config()
    other = _get_float8_grouped_experts_cls(GroupedExperts).Config
    experts = config.layers[1].moe.routed_experts
    experts.inner_experts = other(**{f: getattr(experts.inner_experts, f)
                                     for f in ("dim", "hidden_dim", "num_experts",
                                               "param_init")})
    converter = titan.CompileopsMoEConverter.Config().build()
    with pytest.raises(ValueError, match=r"layers\.1\.moe\.routed_experts\.inner_experts is "
                                         r"Float8GroupedExperts"):
        converter.convert(config)
    assert type(config.layers[0].moe.routed_experts.inner_experts) is GroupedExperts.Config
    with pytest.raises(ValueError, match="no RoutedExperts"):
        converter.convert(config.layers[0].attention)


def test_converter_refuses_an_unknown_fp8_recipe():
    with pytest.raises(ValueError, match="fp8 must be one of"):
        titan.CompileopsMoEConverter.Config(fp8="blockwise").build()
    with pytest.raises(ValueError, match="fp8 must be one of"):
        titan.apply(_models()[1], fp8="e5m2")


def test_scores_go_to_the_epilogue_with_the_local_and_all_to_all_dispatchers():
    from torchtitan.models.common.token_dispatcher import (
        AllToAllTokenDispatcher,
        LocalTokenDispatcher,
        TorchAOTokenDispatcher,
    )

    from compileops.integrations._titan_v03 import scores_placement

    local = LocalTokenDispatcher.Config(num_experts=8, top_k=2).build()
    a2a = AllToAllTokenDispatcher.Config(num_experts=8, top_k=2).build()
    padded = TorchAOTokenDispatcher.Config(num_experts=8, top_k=2, pad_multiple=16).build()
    assert [scores_placement(d) for d in (local, a2a, padded)] == \
        ["epilogue", "epilogue", "combine"]



def test_fp8_weight_grad_reaches_the_experts_and_needs_fp8():
    """``fp8_weight_grad`` through the converter's config and through ``apply()``: every
    converted experts module computes with it; without fp8 both refuse it."""
    from compileops.integrations.torchtitan import CompileopsMoEConverter

    config = CompileopsMoEConverter.Config(fp8="rowwise", fp8_weight_grad=True).build().convert(
        harness.tiny_config())
    applied = harness.tiny_config().build()
    titan.apply(applied, fp8="rowwise", fp8_weight_grad=True)
    for model in (config.build(), applied):
        experts = [m for m in model.modules() if hasattr(m, "compileops_options")]
        assert experts and all(m.compileops_options.fp8_weight_grad for m in experts)
    with pytest.raises(ValueError, match="fp8_weight_grad=True computes"):
        CompileopsMoEConverter.Config(fp8_weight_grad=True).build()
    with pytest.raises(ValueError, match="fp8_weight_grad=True computes"):
        titan.apply(harness.tiny_config().build(), fp8_weight_grad=True)
