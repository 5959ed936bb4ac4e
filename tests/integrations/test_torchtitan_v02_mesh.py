"""compileops inside torchtitan 0.2 (the layout that runs on torch 2.11): the converters on its
Qwen3 MoE (cut to a tiny size), trained by torchtitan 0.2's own ``parallelize_qwen3`` on 1, 2
and 4 CPU processes over gloo, with expert parallelism (EP 2 and 4), FSDP2, its compile and
activation checkpointing (``tests/integrations/titan_v02_harness.py`` says what it changes in
torchtitan to run there).

Every mesh trains torchtitan's own experts and the converted ones from the same weights on
the same batches for 5 SGD steps, as ``test_torchtitan.py`` does for torchtitan 0.3, with the
same tolerances and for the same reasons (its docstring): converted vs torchtitan on one mesh,
each gradient within 4u relative L2 (u = 2^-8) and the losses within 2^-12; a path on a mesh
vs the same path in one process, 2u and 2^-12. The converted ops run on compileops' reference
backend (their PyTorch ground truth, the same custom ops, autograd and graphs).
"""
from __future__ import annotations

import functools

import pytest

pytest.importorskip("torchtitan")
import compileops.integrations.torchtitan as titan  # noqa: E402  (must import: no skip)
if titan.LAYOUT != "0.2":
    pytest.skip("these tests drive torchtitan 0.2's parallelize_qwen3", allow_module_level=True)

from tests.gloo import run_ranks  # noqa: E402
from tests.integrations import titan_v02_harness as harness  # noqa: E402
from tests.integrations.titan_harness import assert_close_runs, run_on_ranks  # noqa: E402

U = 2.0 ** -8


def _run(world: int, configs: dict) -> dict:
    return run_on_ranks(world, configs, harness.train_configs)


@functools.lru_cache(maxsize=None)
def single_rank() -> dict:
    return _run(1, {"titan": {}, "bf16": {"convert": "bf16"}})


@functools.lru_cache(maxsize=None)
def two_ranks() -> dict:
    return _run(2, {
        "ep2/titan": {"ep": 2}, "ep2/bf16": {"ep": 2, "convert": "bf16"},
        "ep2/fp8": {"ep": 2, "convert": "fp8"},
        "ep2-compiled-sac/titan": {"ep": 2, "compile": "aot_eager", "ac": "selective"},
        "ep2-compiled-sac/bf16": {"ep": 2, "compile": "aot_eager", "ac": "selective",
                                  "convert": "bf16"},
    })


@functools.lru_cache(maxsize=None)
def four_ranks() -> dict:
    return _run(4, {
        "ep2xfsdp4-full-ac/titan": {"ep": 2, "ac": "full"},
        "ep2xfsdp4-full-ac/bf16": {"ep": 2, "ac": "full", "convert": "bf16"},
        "ep4-compiled/titan": {"ep": 4, "compile": "aot_eager", "seq_lens": (8,)},
        "ep4-compiled/bf16": {"ep": 4, "compile": "aot_eager", "seq_lens": (8,),
                              "convert": "bf16"},
    })


@pytest.mark.parametrize("name, ranks", [
    ("ep2", 2), ("ep2-compiled-sac", 2), ("ep2xfsdp4-full-ac", 4), ("ep4-compiled", 4),
])
def test_expert_parallel_mesh_matches_torchtitan_and_single_rank(name, ranks):
    res = (two_ranks if ranks == 2 else four_ranks)()
    titan_run, mine = res[f"{name}/titan"], res[f"{name}/bf16"]
    # The converted experts ran, behind torchtitan's dispatch: once per MoE layer (2) per
    # step, and again in the backward of each checkpointed layer (full: both; torchtitan
    # 0.2's default selective checkpointing: every second layer).
    per_step = {"ep2": 2, "ep2-compiled-sac": 3, "ep2xfsdp4-full-ac": 4, "ep4-compiled": 2}
    assert mine["experts_calls"] == per_step[name] * harness.titan_harness.STEPS
    assert titan_run["experts_calls"] == 0
    if "compiled" not in name:  # and they computed on compileops' grouped GEMMs
        assert mine["down_projections"] == mine["experts_calls"]
        assert titan_run["down_projections"] == 0
    assert_close_runs(mine, titan_run, grad_rtol=4 * U, what=f"{name}: bf16 vs torchtitan")
    if name == "ep4-compiled":  # one sequence length: compare with runs of the same batches
        return
    single = single_rank()
    for path, run in (("titan", titan_run), ("bf16", mine)):
        assert_close_runs(run, single[path], grad_rtol=2 * U,
                           what=f"{name}/{path} vs one process")


def test_expert_parallel_fp8_trains_like_torchtitan():
    # fp8 rowwise: about 3.7e-2 relative error per e4m3 product (fp8_op's docstring), at
    # most three of them on a gradient's path.
    res = two_ranks()
    assert_close_runs(res["ep2/fp8"], res["ep2/titan"], grad_rtol=3 * 4e-2,
                       loss_rtol=4e-2 / 8, what="ep2 fp8 vs torchtitan")
    assert res["ep2/fp8"]["experts_calls"] == 2 * harness.titan_harness.STEPS


@pytest.mark.parametrize("name, ranks", [("ep2-compiled-sac", 2), ("ep4-compiled", 4)])
def test_compiled_expert_parallel_does_not_recompile(name, ranks):
    res = (two_ranks if ranks == 2 else four_ranks)()
    for path in ("titan", "bf16"):
        graphs = res[f"{name}/{path}"]["graphs"]
        assert graphs[0] >= 1, graphs  # something compiled
        # The rows each rank's experts receive change at every step; the sequence length
        # changes at the third step of the 2-rank run (one dynamic-shape recompile of the
        # blocks), never after it.
        warm = 3 if ranks == 2 else 1
        assert len(set(graphs[warm - 1:])) == 1, (path, graphs)


def test_apply_refuses_a_model_parallelized_already_before_changing_anything():
    results, codes = run_ranks(harness.refusals, 2, timeout_s=600, group_timeout_s=300)
    assert codes == [0, 0], results
    for rank in (0, 1):
        out = results[rank]
        assert "error" not in out, out
        for case, (error, experts_class, moe_class, fp8) in out.items():
            assert error is not None and "parallelism is applied already" in error, (case, error)
        # Nothing changed: FSDP's experts classes and the converted options stay.
        assert out["unconverted"][1:3] == ("FSDPGroupedExperts", "MoE"), out
        assert out["converted"][1:] == ("FSDPCompileopsGroupedExperts", "CompileopsMoE", None), out
