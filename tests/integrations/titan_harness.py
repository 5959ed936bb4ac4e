"""Train torchtitan 0.3's Qwen3 MoE, cut to a tiny size, on CPU gloo ranks with torchtitan's
own ``parallelize_qwen3`` (EP, FSDP2, per-block compile, activation checkpointing): its own
experts path, or converted by :class:`compileops.integrations.torchtitan.CompileopsMoEConverter`.

The changes torchtitan needs to run on CPU over gloo live here, never in the integration:

* ``ParallelismConfig(spmd_backend="partial_dtensor")`` (and ``set_spmd_backend``, as
  torchtitan's trainer calls it): the default ``spmd_types`` backend's list all-to-all
  refuses uneven splits on gloo, and torch 2.13's ``fully_shard`` wants DTensors;
* ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` (torchtitan builds its meshes
  on CUDA when it sees no accelerator);
* attention: torchtitan's ``ScaledDotProductAttention`` (causal SDPA) as the inner attention,
  in the model config, instead of FlexAttention, whose backward does not run on CPU (every
  sequence here is one document, so the causal mask is the one FlexAttention would build);
* ``set_force_sum_reduction_for_comms(True)`` on every FSDP module: gloo has no PREMUL_SUM.

:func:`train` runs in each rank (``tests.gloo.run_ranks``); every rank starts from the same
weights (made on the CPU from a seed, then sharded as each parameter is), takes its slice of
one fixed global batch per step, and trains with SGD, the loss normalised as torchtitan's
trainer does it (over the global token count; FSDP's averaging off). It returns the loss of
each step (over the global batch) and, on rank 0, the full gradient of every parameter at
every step (all-gathered from DTensor shards), in fp32, by name.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.distributed as dist

#: The tiny Qwen3 MoE: 2 layers, width 32, 8 experts of hidden 16, top-2, vocabulary 64.
SIZES = dict(layers=2, dim=32, heads=2, kv_heads=1, head_dim=16, hidden=16, experts=8,
             top_k=2, vocab=64)
BATCH, STEPS, LR = 4, 5, 0.5
#: Sequence length of each step: the routed token counts vary from step to step (and, after
#: the first steps, the lengths too).
SEQ_LENS = (8, 8, 12, 8, 12)


def tiny_config(convert: Optional[str] = None):
    """The Qwen3 MoE model config (``torchtitan.models.qwen3``'s builders at :data:`SIZES`),
    with causal SDPA attention; ``convert``: None (torchtitan's experts), ``"bf16"`` or
    ``"fp8"`` (through the compileops converter, as a user would)."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model

    s = SIZES
    config = Qwen3Model.Config(
        vocab_size=s["vocab"], dim=s["dim"], norm=qwen3._qwen3_norm(s["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"],
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"],
                              param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=s["layers"], dim=s["dim"], n_heads=s["heads"],
            n_kv_heads=s["kv_heads"], head_dim=s["head_dim"], moe_hidden_dim=s["hidden"],
            num_experts=s["experts"], top_k=s["top_k"], attn_backend="flex",
            rope=CosSinRoPE.Config(dim=s["head_dim"], max_seq_len=64, theta=1e6),
            moe_comm_backend="standard"))
    for layer in config.layers:  # FlexAttention's backward does not run on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if convert is not None:
        from compileops.integrations.torchtitan import CompileopsMoEConverter

        fp8 = {"bf16": None, "fp8": "rowwise"}[convert]
        config = CompileopsMoEConverter.Config(fp8=fp8).build().convert(config)
    return config


def initial_state() -> dict:
    """The parameters every run starts from, by name: torchtitan's init of the unconverted
    model, seeded."""
    torch.manual_seed(0)
    model = tiny_config().build()
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def clean_name(name: str) -> str:
    """A parameter's name without the parts that wrappers add: activation checkpointing's
    and ``torch.compile``'s (torchtitan 0.2 compiles submodules in place)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def load_parameters(model, state: dict) -> None:
    """Copy full tensors into the (possibly DTensor-sharded) parameters: each rank keeps its
    shard (``distribute_tensor`` with the parameter's own mesh and placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            full = state[clean_name(name)]
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements)
            p.copy_(full)


def batches(steps: int = STEPS, seq_lens=SEQ_LENS):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        seq = seq_lens[step % len(seq_lens)]
        yield (torch.randint(0, SIZES["vocab"], (BATCH, seq), generator=g),
               torch.randint(0, SIZES["vocab"], (BATCH, seq), generator=g))


def build(world: int, *, ep: int = 1, convert: Optional[str] = None,
          compile: Optional[str] = None, ac: Optional[str] = None):
    """The model, parallelized by torchtitan's ``parallelize_qwen3`` on ``world`` gloo ranks
    (FSDP2 over every rank; with ``ep`` > 1 expert parallelism), weights loaded."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.qwen3 import parallelize_qwen3

    parallel_dims_module.device_type = "cpu"  # torchtitan assumes CUDA without an accelerator
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=ep,
                                    data_parallel_shard_degree=-1)
    set_spmd_backend(parallelism.spmd_backend)  # as torchtitan's trainer does
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    config = tiny_config(convert)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    ac_config = {None: None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[ac]
    model = parallelize_qwen3(
        model, parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=compile is not None, components=["model"],
                                     backend=compile or "inductor"),
        ac_config=ac_config, dump_folder="/tmp")
    materialize(model, initial_state())
    return model, dims


def materialize(model, state: dict) -> None:
    """A model parallelized on the meta device, made real on the CPU with ``state``'s weights
    (each rank its shards), its FSDP modules reducing by sums (gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    load_parameters(model, state)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def train(rank: int, world: int, *, ep: int = 1, convert: Optional[str] = None,
          compile: Optional[str] = None, ac: Optional[str] = None,
          backend: Optional[str] = "reference", steps: int = STEPS,
          seq_lens=SEQ_LENS, builder=None, record_weights: bool = False,
          forced_weights: Optional[list] = None) -> dict:
    """``steps`` SGD steps of one model; returns the loss of each step and, on rank 0, the
    full gradients (``{name: [one tensor per step]}``) and Dynamo's count of compiled graphs
    after each step.

    ``compile``: None, or the backend of torchtitan's per-block ``torch.compile``
    (``"inductor"``, ``"aot_eager"``). ``backend``: the compileops backend of the converted
    ops (``"reference"``: their PyTorch ground truth, the same ops, autograd and graphs;
    None: the default, the Triton kernels under the interpreter). ``builder``: the function
    that builds the parallelized model, :func:`build`'s signature (None: :func:`build`).
    ``record_weights`` (one process): the result's ``"weights"`` holds the full parameters
    before each step; ``forced_weights``: such a list, loaded before each step, so that every
    step's gradients come from the same weights as the recording run's (teacher forcing: a
    step's error, free of the earlier steps' differences).
    """
    if (record_weights or forced_weights is not None) and world != 1:
        raise ValueError("record_weights and forced_weights run in one process")
    import compileops

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._inductor.config.compile_threads = 1  # the ranks share the machine's cores
    model, _ = (builder or build)(world, ep=ep, convert=convert, compile=compile, ac=ac)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    out = {"losses": [], "grads": {}, "graphs": [], "weights": []}
    for step, (tokens, labels) in enumerate(batches(steps, seq_lens)):
        if forced_weights is not None:
            load_parameters(model, forced_weights[step])
        if record_weights:
            out["weights"].append({clean_name(n): _full(p) for n, p in model.named_parameters()})
        with compileops.backends.use_backend(backend) if backend else _nothing():
            logits = model(tokens[mine])
            # As torchtitan's trainer: the sum over this rank's tokens divided by the global
            # token count (torchtitan turns off FSDP's averaging of the gradients).
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), labels[mine].flatten(),
                reduction="sum") / labels.numel()
            loss.backward()
        for name, p in model.named_parameters():
            g = _full(p.grad)  # a collective for DTensors: every rank calls it
            if rank == 0:
                out["grads"].setdefault(clean_name(name), []).append(g)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item())
        out["graphs"].append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return out


def train_configs(rank: int, world: int, configs: dict, builder=None) -> dict:
    """:func:`train` for each ``{name: kwargs}`` of ``configs``, one after the other in the
    same process group: ``{name: result}``. A config with ``"forced_by": other`` starts each
    step from the weights that the earlier config ``other`` (run with ``record_weights``)
    had at that step."""
    results = {}
    for name, kwargs in configs.items():
        kwargs = dict(kwargs)
        leader = kwargs.pop("forced_by", None)
        if leader is not None:
            kwargs["forced_weights"] = results[leader]["weights"]
        results[name] = train(rank, world, builder=builder, **kwargs)
    return results


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_on_ranks(world: int, configs: dict, train_configs_fn=None) -> dict:
    """``train_configs_fn`` (default :func:`train_configs`) on ``world`` gloo ranks: rank 0's
    results, after checking that no rank failed and that every rank saw the same losses."""
    import functools

    from tests.gloo import run_ranks

    results, codes = run_ranks(
        functools.partial(train_configs_fn or train_configs, configs=configs), world,
        timeout_s=1500, group_timeout_s=600)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert codes == [0] * world, codes
    for name in configs:  # every rank saw the same global losses
        for rank in range(1, world):
            assert results[rank][name]["losses"] == results[0][name]["losses"], name
    return results[0]


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close_runs(got: dict, want: dict, *, grad_rtol, loss_rtol=2.0 ** -12, what=""):
    """Two :func:`train` results: the losses of every step within ``loss_rtol``, every
    parameter's gradient at every step within ``grad_rtol`` relative L2."""
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=loss_rtol, atol=0, msg=lambda m: f"{what} losses: {m}")
    assert got["grads"].keys() == want["grads"].keys()
    for name in want["grads"]:
        for step in range(STEPS):
            rel = relative_l2(got["grads"][name][step], want["grads"][name][step])
            assert rel <= grad_rtol, \
                f"{what}: {name} step {step}: relative L2 {rel:.3g} > {grad_rtol:.3g}"
