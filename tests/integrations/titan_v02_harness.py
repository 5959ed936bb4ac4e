"""Train torchtitan 0.2's Qwen3 MoE (``torchtitan.models.moe``, the layout that runs on torch
2.11), cut to a tiny size, on CPU gloo ranks with torchtitan's own ``parallelize_qwen3``
(expert parallelism, FSDP2, its per-block compile, activation checkpointing): its own experts
path, or converted by the ``"compileops_moe"`` / ``"compileops_moe_fp8"`` converters, called
as torchtitan's trainer calls them (on the model before ``parallelize_qwen3``).

The changes torchtitan 0.2 needs to run on CPU over gloo live here, never in the integration:

* ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` (torchtitan builds its meshes
  on CUDA when it sees no accelerator);
* the expert-parallel token permutation (``generate_permute_indices``) with its CPU
  implementation (``use_cpu=True``): its Triton kernel needs a GPU;
* the router's ``torch.histc`` of integer expert ids, which torch has on CUDA only, counted on
  float ids (the same counts);
* ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: gloo has no PREMUL_SUM.

The model is ``titan_harness``'s tiny Qwen3 MoE in torchtitan 0.2's terms, and
:func:`train_configs` runs that harness's training loop on it in each rank
(``tests.gloo.run_ranks``): the same weights, batches, SGD steps and results.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from tests.integrations import titan_harness
from tests.integrations.titan_harness import SIZES


def model_args(score_before_experts: bool = False, use_grouped_mm: bool = True):
    """torchtitan 0.2's arguments for ``titan_harness``'s tiny Qwen3 MoE (:data:`SIZES`)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    s = SIZES
    return Qwen3ModelArgs(
        vocab_size=s["vocab"], max_seq_len=32, head_dim=s["head_dim"], dim=s["dim"],
        n_layers=s["layers"], n_heads=s["heads"], n_kv_heads=s["kv_heads"], hidden_dim=64,
        moe_enabled=True, moe_inter_dim=s["hidden"],
        moe_args=MoEArgs(num_experts=s["experts"], num_shared_experts=0, top_k=s["top_k"],
                         score_func="softmax",
                         route_norm=True, score_before_experts=score_before_experts,
                         use_grouped_mm=use_grouped_mm))


def histc_of_float_ids(histc):
    """``histc`` for torchtitan 0.2's router, which counts integer expert ids with
    ``torch.histc``: torch has that on CUDA only, so integer ids are counted as floats (the
    same counts, returned in the ids' dtype, as on CUDA)."""
    def float_histc(t, *args, **kwargs):
        if t.is_floating_point():
            return histc(t, *args, **kwargs)
        return histc(t.float(), *args, **kwargs).to(t.dtype)

    float_histc.counts_float_ids = True
    return float_histc


def count_on_cpu() -> None:
    """:func:`histc_of_float_ids` as ``torch.histc`` in this (rank's) process."""
    if not getattr(torch.histc, "counts_float_ids", False):
        torch.histc = histc_of_float_ids(torch.histc)


def tiny_model(score_before_experts: bool = False, use_grouped_mm: bool = True):
    """The tiny model on the CPU with torchtitan's init, seeded (every call the same)."""
    from torchtitan.models.qwen3.model.model import Qwen3Model

    torch.manual_seed(0)
    model = Qwen3Model(model_args(score_before_experts, use_grouped_mm))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def initial_state() -> dict:
    """The parameters every run starts from, by name: :func:`tiny_model`'s."""
    return {k: v.detach().clone() for k, v in tiny_model().named_parameters()}


def build(world: int, *, ep: int = 1, convert: Optional[str] = None,
          compile: Optional[str] = None, ac: Optional[str] = None):
    """``(model, parallel dims)``: the model parallelized by torchtitan 0.2's
    ``parallelize_qwen3`` on ``world`` gloo ranks (FSDP2 over every rank; with ``ep`` > 1
    expert parallelism), weights loaded. ``convert``: None, ``"bf16"`` or ``"fp8"`` (the
    registered converter, before parallelizing, as torchtitan's trainer runs converters);
    ``compile``: None or torchtitan's compile backend; ``ac``: None, ``"selective"`` or
    ``"full"`` activation checkpointing."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.models.moe.kernels as moe_kernels
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.model.model import Qwen3Model

    parallel_dims_module.device_type = "cpu"  # torchtitan assumes CUDA without an accelerator
    moe_utils.generate_permute_indices = functools.partial(
        moe_kernels.generate_permute_indices, use_cpu=True)
    count_on_cpu()
    job = JobConfig()
    job.parallelism.expert_parallel_degree = ep
    job.compile.enable = compile is not None
    job.compile.components = ["model"]
    job.compile.backend = compile or "inductor"
    job.training.mixed_precision_param = "float32"
    job.activation_checkpoint.mode = ac or "none"
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep, etp=1,
                        world_size=world)
    dims.build_mesh()
    with torch.device("meta"):
        model = Qwen3Model(model_args())
    if convert is not None:
        import compileops.integrations.torchtitan  # noqa: F401  (registers the converters)
        from torchtitan.protocols.model_converter import _registry_model_converter_cls

        name = {"bf16": "compileops_moe", "fp8": "compileops_moe_fp8"}[convert]
        _registry_model_converter_cls[name](job, dims).convert(model)
    model = parallelize_qwen3(model, dims, job)
    titan_harness.materialize(model, initial_state())
    return model, dims


def train_configs(rank: int, world: int, configs: dict) -> dict:
    """``titan_harness.train`` (the same loop, batches and results) for each ``{name: kwargs}``
    of ``configs`` on torchtitan 0.2 models (:func:`build`), in one process group. Each
    result also counts, on this rank, the calls of the converted experts module's forward
    (``experts_calls``: the expert-parallel path's, which torchtitan's ``MoE.forward`` makes
    through the dispatch hooks) and, in runs not compiled, of compileops' down projection
    (``down_projections``: the experts computed on compileops' grouped GEMMs)."""
    from compileops.integrations import _titan_experts, _titan_v02

    calls = {"experts": 0, "down": 0}
    forward, down = _titan_v02.CompileopsGroupedExperts.forward, _titan_experts.grouped_linear

    def counted_forward(self, *args, **kwargs):
        calls["experts"] += 1
        return forward(self, *args, **kwargs)

    def counted_down(*args, **kwargs):
        calls["down"] += 1
        return down(*args, **kwargs)

    _titan_v02.CompileopsGroupedExperts.forward = counted_forward
    results = {}
    try:
        for name, kwargs in configs.items():
            calls.update(experts=0, down=0)
            # Compiled runs trace the experts once: only eager calls count.
            _titan_experts.grouped_linear = down if kwargs.get("compile") else counted_down
            results[name] = titan_harness.train(rank, world, builder=build, **kwargs)
            results[name]["experts_calls"] = calls["experts"]
            results[name]["down_projections"] = calls["down"]
    finally:
        _titan_v02.CompileopsGroupedExperts.forward = forward
        _titan_experts.grouped_linear = down
    return results


def refusals(rank: int, world: int) -> dict:
    """``apply()`` on a model that torchtitan parallelized with expert parallelism 2 (``world``
    ranks), converted before or not: ``{case: (error message or None, the experts' class
    name and the MoE's class name after the call)}``."""
    import compileops.integrations.torchtitan as titan

    out = {}
    for case, convert in (("unconverted", None), ("converted", "bf16")):
        model, _ = build(world, ep=2, convert=convert)
        try:
            titan.apply(model, fp8="rowwise")
            error = None
        except NotImplementedError as e:
            error = str(e)
        moe = model.layers["0"].moe
        out[case] = (error, type(moe.experts).__name__, type(moe).__name__,
                     moe.experts.compileops_options.fp8 if convert else None)
    return out
