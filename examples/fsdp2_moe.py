"""Data-parallel training of the MoE example model (or, with ``--model hf-xlstm``, of
transformers' xLSTM on compileops' mLSTM ops) with FSDP2 (``fully_shard``) and
``torch.compile``, one process per device.

The model: ``compileops.nn.Embedding`` -> ``--layers`` pre-norm residual blocks around
``MoELayer`` from ``examples/moe_layer.py`` (router -> top-k -> sync-free permutation ->
``grouped_linear_swiglu`` -> ``grouped_linear`` with the router probability as its epilogue ->
un-permute) -> RMSNorm, LM head and cross-entropy on a synthetic, learnable target.

Sharding: ``fully_shard`` on the embedding, on every block, on the head and on the root.
FSDP2 shards each parameter on dim 0, which for the grouped weights ``[E, N, K]`` is the expert
dim: each rank stores ``E / world`` whole experts and all-gathers the others before a block's
forward (and again for its backward); gradients are reduce-scattered the same way.

Compilation (``--compile``):

* ``blocks`` (default): each sharded unit's ``forward`` is compiled with ``fullgraph=True``;
  FSDP2's all-gather / reduce-scatter hooks run eagerly around the compiled forwards
  (torchtitan's recipe). No graph break inside a block, no recompile across steps, and
  identical layers share one compiled graph;
* ``model``: ``torch.compile(model)`` on the sharded root. ``fullgraph=True`` is not possible
  there: torch 2.13 wraps every FSDP2 hook in ``torch._dynamo.disable``, so Dynamo breaks the
  graph at each sharded submodule's hooks (with ``fullgraph=True`` it raises "Attempted to call
  function marked as skipped ... skipping FSDP hooks");
* ``none``: eager.

``--model hf-xlstm`` trains transformers' ``xLSTMForCausalLM`` instead (built from a config,
``--layers`` blocks of width ``--dim``; no download) on compileops' mLSTM ops through
``compileops.integrations.transformers.apply`` (the ``hf`` extra), sharded and compiled the
same way (units: the embedding, each block, the output norm, the LM head); ``--anchor native``
runs transformers' own xLSTM code in the same model.

``--anchor grouped_mm`` swaps the two grouped products for ``torch._grouped_mm`` in the same
model (same parameters, state dict and routing; SwiGLU and the probability scaling as plain
ops), for a throughput comparison. ``--compare-single`` then trains the unsharded model on
rank 0 on the same global batches and prints the largest loss difference.
``--check-grads`` compares each rank's first step with the unsharded model on the same shard
(loss, the gradients at the units' boundaries, bitwise), and that unsharded step with itself
run again from a fresh model and compile (a run-to-run difference, not a sharding one);
``--trace-ops`` (with ``--compile none``) also fingerprints every compileops op and aten
matmul of that step in both runs and names the first op that returns different bits from
equal inputs. ``--deterministic`` runs everything under ``torch.use_deterministic_algorithms``.

Bitwise per-rank gradients under FSDP2 + compile need ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
(``--check-grads`` and ``--deterministic`` set it unless it is set). Without it, about one
sharded compiled run in three gave a rank's block-input gradient 1e-8 off the one-GPU step
(not from a compileops op: the same happens with the experts on ``torch._grouped_mm``); with
it, every run was equal. cuBLAS documents run-to-run reproducibility with concurrent streams
only under a fixed workspace configuration. 2 x H200, benchmarks/RESULTS.md.

    torchrun --nproc-per-node 2 examples/fsdp2_moe.py --device cpu     # gloo, small shapes
    torchrun --nproc-per-node 8 examples/fsdp2_moe.py                   # CUDA, nccl, bf16
    torchrun --nproc-per-node 8 examples/fsdp2_moe.py --anchor grouped_mm
    torchrun --nproc-per-node 2 examples/fsdp2_moe.py --model hf-xlstm --check-grads

It runs one process per device, so it needs ``torchrun`` (plain ``python`` says so and exits).
The default shapes depend on the device: on CUDA the model above (dim 2048, 64 experts,
sequences of 2048); on CPU the small shapes of ``--tiny`` (a model of a few kB: 20 steps in
under 2 minutes on 2 busy cores, most of it compiling, where the GPU shapes ran past 4
minutes). A size flag given explicitly wins on either.

On CUDA it prints, per step, the mean loss, each rank's step time and peak memory, and at
the end the median step time and tokens/s (the first ``--warmup`` steps, which compile, left
out). On CPU the compileops ops run their reference backend unless ``TRITON_INTERPRET=1`` is
set (then Triton's interpreter: slow, for checking the kernels).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import MoELayer  # noqa: E402  (puts the repo root on sys.path too)

import compileops  # noqa: E402
from compileops.divergence import OpFingerprints, first_divergence  # noqa: E402
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine  # noqa: E402


class GroupedMMMoELayer(MoELayer):
    """:class:`MoELayer` with its two grouped products on ``torch._grouped_mm`` (the anchor):
    the same parameters and routing; SwiGLU and the router-probability scaling as plain ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = torch.topk(torch.softmax(self.router(x).float(), dim=-1), self.top_k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        xs, order, offsets = permute_by_expert(x, ids, self.experts)
        gate, up = torch._grouped_mm(xs, self.gate_up.weight.transpose(-2, -1),
                                     offs=offsets).chunk(2, dim=-1)
        h = F.silu(gate) * up
        p_sorted = probs.reshape(-1)[order]
        y = torch._grouped_mm(h, self.down.weight.transpose(-2, -1), offs=offsets)
        y = y * p_sorted[:, None].to(y.dtype)
        return unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)


def record_alignment(model: torch.nn.Module, prefix: str):
    """A forward pre-hook for a block: while ``model.capture`` is a dict, it records each of
    the block's parameters' address modulo 256 as the forward sees it (FSDP2's all-gathered
    views, or the unsharded model's own tensors), under ``"alignment"`` and
    ``prefix.<name>``."""
    def hook(module, _inputs):
        if model.capture is not None:
            seen = model.capture.setdefault("alignment", {})
            for name, p in module.named_parameters():
                seen.setdefault(f"{prefix}.{name}", p.data_ptr() % 256)
    return hook


class Block(torch.nn.Module):
    """``x + moe(rmsnorm(x))`` on ``x [T, D]``; with ``--xlstm``, first ``x +
    mLSTMLayer(rmsnorm(x))`` over the ``[B, S, D]`` view of the same tokens."""

    def __init__(self, args, dtype):
        super().__init__()
        self.seq = args.seq
        self.mlstm = None
        if args.xlstm:
            self.mlstm_norm = torch.nn.RMSNorm(args.dim, dtype=dtype)
            self.mlstm = compileops.nn.mLSTMLayer(compileops.nn.mLSTMLayerConfig(
                embedding_dim=args.dim, num_heads=args.xlstm_heads)).to(dtype)
        self.norm = torch.nn.RMSNorm(args.dim, dtype=dtype)
        layer = GroupedMMMoELayer if args.anchor == "grouped_mm" else MoELayer
        self.moe = layer(args.dim, args.hidden, args.experts, args.top_k, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlstm is not None:
            seqs = x.view(-1, self.seq, x.shape[-1])
            x = (seqs + self.mlstm(self.mlstm_norm(seqs))).view(-1, x.shape[-1])
        return x + self.moe(self.norm(x))


class Head(torch.nn.Module):
    """Final norm, LM head and the mean cross-entropy (in fp32)."""

    def __init__(self, args, dtype):
        super().__init__()
        self.norm = torch.nn.RMSNorm(args.dim, dtype=dtype)
        self.proj = torch.nn.Linear(args.dim, args.vocab, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.proj(self.norm(x)).float(), labels.reshape(-1))


class MoEModel(torch.nn.Module):
    """ids, labels ``[B, S]`` -> the mean loss."""

    def __init__(self, args, dtype):
        super().__init__()
        self.embed = compileops.nn.Embedding(args.vocab, args.dim, dtype=dtype)
        self.layers = torch.nn.ModuleList(Block(args, dtype) for _ in range(args.layers))
        self.head = Head(args, dtype)
        #: ``--check-grads``: a dict that receives the gradients of the blocks' input (the
        #: embedding's output: every block's backward, the compileops ops' included), of
        #: each later block's input (``d_block{i}_in``: the backward of blocks ``i..``), and
        #: of their output (the head's backward alone) on this rank's data; and, under
        #: ``"alignment"``, each block parameter's address modulo 256 as the block's forward
        #: saw it (FSDP2's all-gathered views, or the unsharded model's own tensors).
        self.capture = None
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(record_alignment(self, f"layers.{i}"))

    def units(self) -> list[torch.nn.Module]:
        """The modules that are sharded (and compiled) one by one."""
        return [self.embed, *self.layers, self.head]

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids.reshape(-1))
        if self.capture is not None and x.requires_grad:
            x.register_hook(lambda g: self.capture.setdefault("d_embedding_out",
                                                              g.detach().clone()))
        for i, layer in enumerate(self.layers):
            if i and self.capture is not None and x.requires_grad:
                x.register_hook(lambda g, name=f"d_block{i}_in": self.capture.setdefault(
                    name, g.detach().clone()))
            x = layer(x)
        if self.capture is not None and x.requires_grad:
            # Upstream of every block: the head's (cuBLAS, Inductor) gradient alone.
            x.register_hook(lambda g: self.capture.setdefault("d_head_in", g.detach().clone()))
        return self.head(x, labels)


class HFxLSTMModel(torch.nn.Module):
    """``--model hf-xlstm``: transformers' ``xLSTMForCausalLM`` (from a config: ``--layers``
    blocks of width ``--dim`` with ``--xlstm-heads`` heads, vocabulary ``--vocab``; no
    download) on compileops' mLSTM ops through :func:`compileops.integrations.transformers.apply`
    (``--anchor native``: transformers' own xLSTM code). ids, labels ``[B, S]`` -> the mean
    loss, with :class:`MoEModel`'s ``units()`` (the embedding, each block, the output norm and
    the LM head) and ``capture``."""

    def __init__(self, args, dtype):
        super().__init__()
        from transformers import xLSTMConfig, xLSTMForCausalLM

        config = xLSTMConfig(vocab_size=args.vocab, hidden_size=args.dim,
                             num_hidden_layers=args.layers, num_heads=args.xlstm_heads,
                             use_cache=False)
        self.lm = xLSTMForCausalLM(config).to(dtype)
        if args.anchor != "native":
            import compileops.integrations.transformers as cit

            cit.apply(self.lm)
        backbone = self.lm.backbone
        self.capture = None
        backbone.embeddings.register_forward_hook(self._capture_output("d_embedding_out"))
        for i, block in enumerate(backbone.blocks):
            if i:
                block.register_forward_pre_hook(self._capture_input(f"d_block{i}_in"))
            block.register_forward_pre_hook(record_alignment(self, f"blocks.{i}"))
        # Upstream of every block: the output norm's and the head's gradient alone.
        backbone.out_norm.register_forward_pre_hook(self._capture_input("d_head_in"))

    def _capture_output(self, name: str):
        def hook(_module, _inputs, output):
            if self.capture is not None and output.requires_grad:
                output.register_hook(lambda g: self.capture.setdefault(name, g.detach().clone()))
        return hook

    def _capture_input(self, name: str):
        def hook(_module, inputs):
            x = inputs[0]
            if self.capture is not None and x.requires_grad:
                x.register_hook(lambda g: self.capture.setdefault(name, g.detach().clone()))
        return hook

    def units(self) -> list[torch.nn.Module]:
        """The modules that are sharded (and compiled) one by one."""
        backbone = self.lm.backbone
        return [backbone.embeddings, *backbone.blocks, backbone.out_norm, self.lm.lm_head]

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.reshape(-1))


#: ``--model``: the model each rank trains.
MODELS = {"moe": MoEModel, "hf-xlstm": HFxLSTMModel}


def build(args, device, dtype) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # every rank and the single-device run start alike
    return MODELS[args.model](args, dtype).to(device)


def compile_model(model: torch.nn.Module, mode: str):
    if mode == "blocks":
        for unit in model.units():
            unit.forward = torch.compile(unit.forward, fullgraph=True)
        return model
    if mode == "model":
        return torch.compile(model)
    return model


def batches(args, world: int, device):
    """The global batch of each step, ``[world * batch, seq]``; every rank draws the same.
    Target: a fixed permutation of the input token, which the model can learn."""
    g = torch.Generator().manual_seed(args.seed + 1)
    target = torch.randperm(args.vocab, generator=g)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (world * args.batch, args.seq), generator=g)
        yield ids.to(device), target[ids].to(device)


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def train_sharded(args, device, dtype, rank: int, world: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    model = build(args, device, dtype)
    for unit in model.units():
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == 0 and args.model == "moe":
        w = model.layers[0].moe.gate_up.weight
        print(f"layers.0.moe.gate_up.weight [E, 2H, D]: {type(w).__name__} {list(w.shape)} "
              f"{list(w.placements)} -> local {list(w.to_local().shape)} on rank 0 "
              "(whole experts)", flush=True)
    run = compile_model(model, args.compile)
    opt = make_optimizer(model, args)
    cuda = device.type == "cuda"
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    losses, times = [], []
    step0 = None
    model.capture = {} if args.check_grads else None
    for step, (ids, labels) in enumerate(batches(args, world, device)):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with op_trace(args.trace_ops and step == 0) as trace:
            loss = run(ids[mine], labels[mine])
            loss.backward()
        if model.capture is not None:
            step0 = (loss.detach().clone(), dict(model.capture), trace)
            model.capture = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        line = f"step {step:3d}  loss {losses[-1]:.5f}"
        if cuda:
            stats = [None] * world
            dist.all_gather_object(stats, (elapsed * 1e3, torch.cuda.max_memory_allocated(device)))
            times.append(max(s[0] for s in stats))
            line += "  time ms " + " ".join(f"r{r}={s[0]:.1f}" for r, s in enumerate(stats))
            line += "  peak GiB " + " ".join(f"r{r}={s[1] / 2**30:.2f}"
                                              for r, s in enumerate(stats))
        if rank == 0:
            print(line, flush=True)
    if rank == 0:
        counters = torch._dynamo.utils.counters
        print(f"compile={args.compile}: {counters['stats']['unique_graphs']} graphs compiled, "
              f"{sum(counters['graph_break'].values())} graph breaks", flush=True)
        steady = times[args.warmup:]
        if steady:
            ms = statistics.median(steady)
            tokens = world * args.batch * args.seq
            print(f"anchor={args.anchor}: median step {ms:.2f} ms over {len(steady)} steps "
                  f"(slowest rank), {tokens / ms * 1e3:,.0f} tokens/s", flush=True)
    return losses, step0


def single_step(args, device, dtype, rank: int, world: int, trace_ops: bool):
    """Step 0 of the unsharded model on this one GPU and this rank's shard of the batch:
    ``(loss, captured gradients and alignment, op trace or None)``."""
    model = build(args, device, dtype)
    run = compile_model(model, args.compile)
    model.capture = {}
    ids, labels = next(iter(batches(args, world, device)))
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    with op_trace(trace_ops) as trace:
        loss = run(ids[mine], labels[mine])
        loss.backward()
    return loss.detach(), model.capture, trace


def compare_captures(ours: dict, theirs: dict) -> dict:
    """name -> (bitwise equal, max |diff|) for every captured gradient."""
    return {name: (torch.equal(g, theirs[name]),
                   (g.float() - theirs[name].float()).abs().max().item())
            for name, g in ours.items() if name != "alignment"}


def check_against_single(args, device, dtype, rank: int, world: int, step0) -> None:
    """``--check-grads``: this rank's step-0 loss and the gradient of the embedding's output
    (the result of every block's backward, the compileops ops' included) under FSDP2,
    against the same unsharded model on this one GPU and the same shard of data: bitwise.
    Then the unsharded step once more (a fresh model and compile): whether two unsharded
    runs agree tells a sharding difference from a run-to-run one."""
    loss, single, trace = single_step(args, device, dtype, rank, world, args.trace_ops)
    again_loss, again, _ = single_step(args, device, dtype, rank, world, False)
    sharded_loss, sharded, sharded_trace = step0
    single_alignment = single.pop("alignment", {})
    sharded_alignment = sharded.pop("alignment", {})
    grads = compare_captures(single, sharded)
    repeat = compare_captures(again, single)
    # Parameters whose address differs modulo 256 between the two runs (kernels such as
    # cuBLAS's may choose by alignment): name -> (sharded, single).
    moved = {name: (sharded_alignment[name], single_alignment.get(name))
             for name in sorted(sharded_alignment)
             if sharded_alignment[name] != single_alignment.get(name)}
    ops = (first_divergence(sharded_trace.calls, trace.calls).summary()
           if args.trace_ops else None)
    results = [None] * world
    dist.all_gather_object(results, (rank, torch.equal(loss, sharded_loss), grads, moved, ops,
                                     torch.equal(again_loss, loss), repeat))
    if rank == 0:
        for r, same_loss, per_point, moved_r, ops_r, same_again, per_point_again in results:
            print(f"rank {r} against one GPU on its shard, step 0: loss bitwise equal: "
                  f"{same_loss}; {_points(per_point)}", flush=True)
            print(f"rank {r} the one-GPU step again (a fresh model and compile): loss "
                  f"bitwise equal: {same_again}; {_points(per_point_again)}", flush=True)
            where = ", ".join(f"{n} {a}/{b}" for n, (a, b) in moved_r.items()) or "none"
            print(f"rank {r} block parameters at another address mod 256 (sharded/single): "
                  f"{where}", flush=True)
            if ops_r is not None:
                print(f"rank {r} op trace, sharded against single: {ops_r}", flush=True)


def _points(per_point: dict) -> str:
    return "; ".join(f"{name} bitwise equal: {same} (max |diff| {diff:.3e})"
                     for name, (same, diff) in sorted(per_point.items()))


@contextlib.contextmanager
def op_trace(enabled: bool):
    """``--trace-ops``: fingerprints of every compileops op and aten matmul (eager only)."""
    if not enabled:
        yield None
        return
    with OpFingerprints() as trace:
        yield trace


def train_single(args, device, dtype) -> list[float]:
    model = build(args, device, dtype)
    run = compile_model(model, args.compile)
    opt = make_optimizer(model, args)
    losses = []
    for ids, labels in batches(args, dist.get_world_size(), device):
        loss = run(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


#: The size flags' defaults: the model of the module docstring on CUDA, a few kB on CPU (and
#: with ``--tiny`` anywhere). Flags given explicitly keep their values.
GPU_SHAPES = dict(vocab=32768, dim=2048, hidden=768, experts=64, top_k=8, layers=2, batch=2,
                  seq=2048, lr=3e-4, xlstm_heads=8)
SMALL_SHAPES = dict(vocab=64, dim=32, hidden=32, experts=4, top_k=2, layers=2, batch=2,
                    seq=8, lr=1e-2, xlstm_heads=2)

_EPILOG = """\
The size flags (--vocab to --lr, and --xlstm-heads) default to the GPU shapes on CUDA and to
the small shapes of --tiny on CPU (there 20 steps took under 2 minutes on 2 busy cores, most
of it compiling; the GPU shapes ran past 4 minutes). Launch with torchrun, one process per
device:

    torchrun --nproc-per-node 2 examples/fsdp2_moe.py --device cpu"""


def build_parser() -> argparse.ArgumentParser:
    # Raw: the epilog's command stays on one line (argparse would break it at a hyphen).
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--tiny", action="store_true",
                   help="the small shapes (a model of a few kB) on CUDA too; the default on CPU")
    p.add_argument("--compile", choices=["blocks", "model", "none"], default="blocks")
    p.add_argument("--model", choices=list(MODELS), default="moe",
                   help="moe: the MoE model above; hf-xlstm: transformers' xLSTMForCausalLM "
                   "on compileops' mLSTM ops (the hf extra)")
    p.add_argument("--anchor", choices=["compileops", "grouped_mm", "native"],
                   default="compileops",
                   help="grouped_mm (moe): the experts on torch._grouped_mm instead; native "
                   "(hf-xlstm): transformers' own xLSTM code")
    p.add_argument("--compare-single", action="store_true",
                   help="also train the unsharded model on rank 0 and compare the losses")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameters and activations (default: bf16 on CUDA and for the "
                   "grouped_mm anchor, which takes bf16 only; fp32 otherwise)")

    def size(flag, kind, what=""):
        key = flag[2:].replace("-", "_")
        p.add_argument(flag, type=kind, default=None,
                       help=f"{what}{'; ' if what else ''}default {GPU_SHAPES[key]} on CUDA, "
                       f"{SMALL_SHAPES[key]} on CPU")

    size("--vocab", int)
    size("--dim", int)
    size("--hidden", int, "expert hidden size")
    size("--experts", int)
    size("--top-k", int)
    size("--layers", int)
    size("--batch", int, "sequences per rank")
    size("--seq", int)
    size("--lr", float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--xlstm", action="store_true",
                   help="each block also runs an mLSTM layer (compileops.nn.mLSTMLayer)")
    size("--xlstm-heads", int, "mLSTM heads (query head dim / 2 / heads: <= 256)")
    p.add_argument("--check-grads", action="store_true",
                   help="compare each rank's step-0 loss and gradients with one GPU, bitwise")
    p.add_argument("--trace-ops", action="store_true",
                   help="with --check-grads and --compile none: fingerprint every compileops "
                   "op and aten matmul of step 0 in both runs and name the first op that "
                   "returns different results on equal inputs")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True), with "
                   "CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set: an op without a deterministic "
                   "implementation raises, and Inductor generates no atomic scatter")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    anchors = {"moe": ("compileops", "grouped_mm"), "hf-xlstm": ("compileops", "native")}
    if args.anchor not in anchors[args.model]:
        p.error(f"--anchor {args.anchor} applies to another --model than {args.model} "
                f"(its anchors: {', '.join(anchors[args.model])})")
    if args.trace_ops and (not args.check_grads or args.compile != "none"):
        p.error("--trace-ops needs --check-grads and --compile none (dispatch modes see eager "
                "ops only)")
    shapes = SMALL_SHAPES if args.tiny or args.device == "cpu" else GPU_SHAPES
    for name, value in shapes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


#: What torchrun sets for each process, and ``init_process_group``'s env:// init reads.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launched_by_torchrun() -> None:
    """Exit with one line saying how to launch the example when torchrun did not (plain
    ``python`` otherwise dies in ``init_process_group`` with a "RANK expected" traceback)."""
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
    if missing:
        raise SystemExit(
            "examples/fsdp2_moe.py runs one process per device: launch it with torchrun, e.g. "
            "torchrun --nproc-per-node 2 examples/fsdp2_moe.py --device cpu "
            f"({', '.join(missing)} not set)")


def main(argv=None) -> None:
    args = parse_args(argv)
    check_launched_by_torchrun()
    if args.deterministic or args.check_grads:
        # Before the first cuBLAS handle: with FSDP2's collectives on concurrent streams,
        # cuBLAS reproduces its results run to run only with a fixed workspace (module
        # docstring), and --check-grads compares bits.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    if args.device == "cpu":
        torch._inductor.config.compile_threads = 1  # the ranks share the cores
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" or args.anchor == "grouped_mm" else torch.float32)
    if args.anchor == "grouped_mm" and dtype != torch.bfloat16:
        raise SystemExit("--anchor grouped_mm needs --dtype bfloat16: torch._grouped_mm (its meta "
                         "function, which torch.compile runs) takes bf16 only")
    try:
        if rank == 0:
            print(f"world {world} on {device.type} ({dist.get_backend()}), {dtype}, "
                  f"model={args.model}, anchor={args.anchor}, compile={args.compile}",
                  flush=True)
        losses, step0 = train_sharded(args, device, dtype, rank, world)
        if args.check_grads:
            torch._dynamo.reset()
            check_against_single(args, device, dtype, rank, world, step0)
        if args.compare_single:
            if rank == 0:
                torch._dynamo.reset()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                single = train_single(args, device, dtype)
                diffs = [abs(a - b) for a, b in zip(losses, single)]
                for step, (a, b) in enumerate(zip(losses, single)):
                    print(f"step {step:3d}  sharded {a:.6f}  single {b:.6f}  diff {abs(a - b):.2e}")
                print(f"max |sharded - single| loss difference: {max(diffs):.3e}", flush=True)
        # Every rank reaches the teardown together: a rank that tears gloo down while the
        # other still has work in flight can abort in gloo's threads at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
