"""torchtitan 0.2's MoE (``torchtitan.models.moe``) on compileops: the model converters
``"compileops_moe"`` / ``"compileops_moe_fp8"`` and ``apply()`` of the torchtitan
integration (``compileops/integrations/torchtitan.py``).

An ``MoE`` becomes a :class:`CompileopsMoE`: torchtitan's ``__init__`` (router, reorderer,
``GroupedExperts`` with ``w1``, ``w2``, ``w3``, shared experts, load-balancing buffers), and a
forward that runs the experts on compileops kernels, with the router scores in the down
projection's epilogue unless ``score_before_experts`` asks for them on the input. Its
``GroupedExperts`` becomes a :class:`CompileopsGroupedExperts`, which serves expert
parallelism: there torchtitan's ``ExpertParallel`` sends the routed rows to the ranks that
hold their experts through hooks on the experts module, so the MoE keeps torchtitan's own
forward around it and only the experts' products run on compileops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.protocols.model_converter import (
    _registry_model_converter_cls,
    register_model_converter,
)

from compileops.integrations._titan_experts import (
    Options,
    experts_forward,
    local_tensor,
    refuse_unservable,
)


def _mesh_names(w: torch.Tensor) -> tuple:
    mesh = getattr(w, "device_mesh", None)
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _expert_parallel(w: torch.Tensor) -> bool:
    """Whether torchtitan's expert parallelism shards this expert weight (a DTensor on a mesh
    with an ``"ep"`` dim: its ``ExpertParallel``, FSDP's sharding on top of it included)."""
    return "ep" in _mesh_names(w)


def _tensor_parallel(w: torch.Tensor) -> bool:
    """Whether tensor parallelism shards this expert weight (``"tp"`` or ``"etp"``), which the
    converted experts do not serve."""
    return any(name in _mesh_names(w) for name in ("tp", "etp"))


def moe_body(x: torch.Tensor, scores_sorted: torch.Tensor, token_indices_sorted: torch.Tensor,
             num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
             w3: torch.Tensor, top_k: int, score_before_experts: bool,
             options: Options,
             compute_dtype: Optional[torch.dtype] = torch.bfloat16) -> torch.Tensor:
    """The routed part of torchtitan 0.2's ``MoE.forward`` after its router and reorderer:
    x ``[T, D]``, the reorderer's expert-sorted scores and token slots ``[T*k]`` and counts
    ``[E]`` -> the experts' combined output ``[T, D]``.

    The router scores multiply the down projection's rows in its epilogue, or (with
    ``score_before_experts``) the experts' input rows, in fp32, as torchtitan does.
    ``compute_dtype``: as :func:`.experts_forward` (None: the parameters' dtype, as
    torchtitan's experts with ``use_grouped_mm=False``).
    """
    routed_input = x[token_indices_sorted // top_k]
    row_scale = scores_sorted
    if score_before_experts:
        routed_input = (routed_input.to(torch.float32)
                        * scores_sorted.reshape(-1, 1)).to(x.dtype)
        row_scale = None
    routed_output = experts_forward(routed_input, w1, w2, w3, num_tokens_per_expert,
                                    row_scale, options, compute_dtype)
    # Back to token order (each routed row has its own slot: an assignment, no adds), then
    # the sum over each token's top-k slots.
    unsorted = routed_output.new_zeros((x.shape[0] * top_k, x.shape[1]))
    unsorted[token_indices_sorted] = routed_output
    return unsorted.reshape(-1, top_k, x.shape[1]).sum(dim=1)


class CompileopsMoE(MoE):
    """torchtitan 0.2's ``MoE`` with its experts on compileops grouped GEMMs (same module
    tree and parameters).

    torchtitan 0.2 compiles an MoE layer's children (router, reorderer, shared experts) and
    its experts function, not ``MoE.forward``; the converter compiles :func:`moe_body` the same
    way when the job compiles the model (``compileops_compile_backend``: the backend's name,
    None: not compiled). The module keeps the name, not the compiled function, so that it
    pickles (``torch.save``) and deep-copies; layers with the same backend share one
    compiled function (:func:`compiled`).

    The products run in bf16 as torchtitan's grouped-GEMM experts do, or, where its experts
    run their for-loop (``use_grouped_mm=False``, which torchtitan sets itself for some
    models on GPUs older than Hopper, and on the CPU), in the parameters' dtype as that loop
    does (with ``fp8``: e4m3 either way).
    """

    compileops_options = Options()
    compileops_compile_backend: Optional[str] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, L, D]`` -> ``[B, L, D]``, as ``MoE.forward``."""
        weights = (self.experts.w1, self.experts.w2, self.experts.w3)
        if any(_tensor_parallel(w) for w in weights):
            raise NotImplementedError(
                "compileops' torchtitan 0.2 MoE does not serve tensor parallelism "
                "(tensor_parallel_degree or expert_tensor_parallel_degree > 1); expert "
                "parallelism and FSDP are served")
        if any(_expert_parallel(w) for w in weights):
            # The routed rows travel between ranks in hooks on the experts module, which
            # torchtitan's forward calls: keep it; the experts compute on compileops.
            return MoE.forward(self, x)
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, expert_ids, num_tokens_per_expert = self.router(x, self.expert_bias)
        with torch.no_grad():  # the load-balancing statistics, as torchtitan keeps them
            self.tokens_per_expert.add_(num_tokens_per_expert)
        scores_sorted, token_indices_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, expert_ids)
        experts = self.experts
        out_experts = compiled(moe_body, self.compileops_compile_backend)(
            x, scores_sorted, token_indices_sorted, num_tokens_per_expert, experts.w1,
            experts.w2, experts.w3, self.router.top_k, bool(self.score_before_experts),
            self.compileops_options, experts_compute_dtype(experts))
        if self.shared_experts is not None:
            out_experts = self.shared_experts(x) + out_experts
        return out_experts.reshape(bs, slen, dim)


_compiled: dict = {}


def compiled(fn, backend: Optional[str]):
    """``fn`` (:func:`moe_body` or :func:`.experts_forward`) compiled ``fullgraph=True`` with
    ``backend``, one compiled function per function and backend, shared by every layer (the
    same graph for each); ``fn`` itself for None."""
    if backend is None:
        return fn
    if (fn, backend) not in _compiled:
        _compiled[fn, backend] = torch.compile(fn, backend=backend, fullgraph=True)
    return _compiled[fn, backend]


class CompileopsGroupedExperts(GroupedExperts):
    """torchtitan 0.2's ``GroupedExperts`` (same parameters) computing on compileops grouped
    GEMMs: x ``[R, D]`` grouped by local expert, num_tokens_per_expert ``[E_local]`` -> ``[R,
    D]``.

    Called where expert parallelism is applied (:meth:`CompileopsMoE.forward`): torchtitan's
    ``ExpertParallel`` hooks hand it the rows this rank's experts received, padded per expert
    to torchtitan's alignment with zero rows, and take its output back to the tokens' ranks;
    the router scores are applied by torchtitan's ``MoE.forward``, before or after the
    experts as ``score_before_experts`` says. As torchtitan compiles its experts function
    under expert parallelism, the compiled products see the row count as dynamic (it changes
    at every step), so they compile once."""

    compileops_options = Options()
    compileops_compile_backend: Optional[str] = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        backend = self.compileops_compile_backend
        if backend is not None:
            torch._dynamo.mark_dynamic(x, 0)
        return compiled(experts_forward, backend)(
            x, w1, w2, w3, num_tokens_per_expert, None, self.compileops_options,
            experts_compute_dtype(self))


def experts_compute_dtype(experts) -> Optional[torch.dtype]:
    """bf16 for torchtitan's grouped-GEMM experts; None (the parameters' dtype) where they run
    their for-loop (``use_grouped_mm=False``)."""
    return torch.bfloat16 if getattr(experts, "use_grouped_mm", True) else None


def _problem(name: str, module) -> Optional[str]:
    """Why ``apply()`` cannot serve this MoE, or None. A converted one (``apply()`` again, to
    change the options) is served unless it was parallelized since."""
    converted = isinstance(module, CompileopsMoE)
    if not converted and type(module) is not MoE:
        return (f"{name} ({type(module).__name__}): not torchtitan's MoE (DeepEP and other "
                "MoE variants have their own dispatch)")
    experts = module.experts
    weights = [getattr(experts, w, None) for w in ("w1", "w2", "w3")]
    # Parallelism first: torchtitan 0.2 wraps expert-parallel experts in FSDP, whose class
    # (FSDPGroupedExperts) would otherwise be reported as another experts class.
    if any(isinstance(w, torch.Tensor) and (_expert_parallel(w) or _tensor_parallel(w))
           for w in weights):
        return (f"{name}.experts: expert or tensor parallelism is applied already; "
                "convert before parallelizing (the converter does)")
    if getattr(experts, "_forward_pre_hooks", None) or getattr(experts, "_forward_hooks", None):
        return (f"{name}.experts has forward hooks (expert parallelism's dispatch, FSDP?): "
                "convert before parallelizing")
    if converted:
        return None
    if type(experts).__name__ != "GroupedExperts" or weights[0] is None:
        return f"{name}.experts ({type(experts).__name__}): not torchtitan's GroupedExperts"
    if any(not isinstance(w, torch.Tensor) or w.dim() != 3 for w in weights):
        return f"{name}.experts: w1/w2/w3 are not 3-D tensors (converted by another converter?)"
    return None


def apply_v02(model: torch.nn.Module, options: Options,
              compile_backend: Optional[str] = None) -> dict:
    """The torchtitan integration's ``apply()`` for torchtitan 0.2 models
    (``compile_backend``: every MoE's :func:`moe_body` compiled with it, or None)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
    refuse_unservable(model, [p for p in (_problem(n, m) for n, m in found) if p])
    report = {"experts": [], "scores": {}, "compute": {}}
    for name, module in found:
        module.__class__ = CompileopsMoE
        if not isinstance(module.experts, CompileopsGroupedExperts):
            module.experts.__class__ = CompileopsGroupedExperts
        for converted in (module, module.experts):
            converted.compileops_options = options
            if compile_backend is not None:
                converted.compileops_compile_backend = compile_backend
        report["experts"].append(f"{name}.experts")
        report["scores"][name] = "before experts" if module.score_before_experts else "epilogue"
        dtype = experts_compute_dtype(module.experts)
        report["compute"][f"{name}.experts"] = (
            "bf16" if dtype is not None else
            "the parameters' dtype (torchtitan's use_grouped_mm=False)")
    return report


class CompileopsMoEConverter:
    """torchtitan 0.2 model converter (``model.converters``: ``"compileops_moe"`` for bf16,
    ``"compileops_moe_fp8"`` for fp8 rowwise with the weight cache and fast accumulation)."""

    fp8: Optional[str] = None
    gate_up: str = "concatenated"
    fp8_weight_grad: bool = False

    def __init__(self, job_config, parallel_dims):
        if getattr(parallel_dims, "etp", 1) > 1 or getattr(parallel_dims, "tp", 1) > 1:
            raise ValueError(
                "compileops' torchtitan 0.2 converter serves FSDP and expert parallelism, "
                "not tensor parallelism (tensor_parallel_degree="
                f"{getattr(parallel_dims, 'tp', '?')}, expert_tensor_parallel_degree="
                f"{getattr(parallel_dims, 'etp', '?')})")
        self.options = Options(self.fp8, gate_up=self.gate_up,
                               fp8_weight_grad=self.fp8_weight_grad)
        compile_config = job_config.compile
        # As torchtitan 0.2 compiles its experts function (compiled).
        self.compile_backend = (compile_config.backend if compile_config.enable
                                and "model" in compile_config.components else None)

    def convert(self, model: torch.nn.Module) -> None:
        apply_v02(model, self.options, self.compile_backend)

    def post_optimizer_hook(self, model) -> None:
        pass


class CompileopsFP8MoEConverter(CompileopsMoEConverter):
    """``"compileops_moe_fp8"``: fp8 rowwise, weight cache, fast accumulation."""

    fp8 = "rowwise"


class CompileopsFP8WeightGradMoEConverter(CompileopsFP8MoEConverter):
    """``"compileops_moe_fp8_dw"``: as ``"compileops_moe_fp8"``, with the experts' weight
    gradients in fp8 too (``fp8_weight_grad=True``, at fp8's error)."""

    fp8_weight_grad = True


class CompileopsPairMoEConverter(CompileopsMoEConverter):
    """``"compileops_moe_pair"``: bf16, the gate and up products reading w1 and w3 where they
    are (``gate_up="pair"``, experimental)."""

    gate_up = "pair"


def register() -> None:
    """Register the converters under ``"compileops_moe"``, ``"compileops_moe_fp8"``,
    ``"compileops_moe_fp8_dw"`` and ``"compileops_moe_pair"`` (idempotent: torchtitan
    refuses a name registered twice)."""
    for name, cls in (("compileops_moe", CompileopsMoEConverter),
                      ("compileops_moe_fp8", CompileopsFP8MoEConverter),
                      ("compileops_moe_fp8_dw", CompileopsFP8WeightGradMoEConverter),
                      ("compileops_moe_pair", CompileopsPairMoEConverter)):
        if name not in _registry_model_converter_cls:
            register_model_converter(cls, name)
