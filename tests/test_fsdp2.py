"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over ``GroupedLinear`` and ``Embedding``,
compiled, in 2 CPU processes over gloo.

What is checked, per rank:

* ``fully_shard`` shards every parameter on dim 0, which for a ``GroupedLinear`` weight
  ``[G, N, K]`` (and its bias ``[G, N]``) is the expert dim: each rank holds ``G / 2`` whole
  experts; the embedding table is split by vocabulary rows;
* before each forward of a sharded block the all-gathered weights are plain tensors of the full
  shape, equal to the unsharded model's (a forward pre-hook registered after FSDP's own, which
  runs just before the compiled forward reads them);
* gradients come back sharded the same way and, all-gathered, equal the unsharded model's;
* three SGD steps give the loss of the unsharded model, eager (rank 0 trains it on the whole
  batch; each rank trains the sharded, compiled one on its half, and the loss is the mean over
  the ranks).

Compilation: each sharded block's ``forward`` is compiled with ``fullgraph=True`` (the
per-block recipe of torchtitan): FSDP2's hooks run eagerly around the compiled forwards.
``torch.compile(model, fullgraph=True)`` on the sharded root is not possible: torch 2.13 wraps
every FSDP2 hook in ``torch._dynamo.disable``, so Dynamo stops at the first one ("Attempted to
call function marked as skipped ... skipping FSDP hooks"); without ``fullgraph`` the whole
model compiles with a graph break at each hook.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from tests.gloo import run_ranks

VOCAB, DIM, HIDDEN, EXPERTS, TOP_K = 64, 32, 32, 4, 2
BATCH, SEQ, STEPS, LR, WORLD = 4, 8, 3, 0.5, 2


class MoEBlock(torch.nn.Module):
    """Residual SwiGLU MoE: ``x [T, D]`` -> ``x + sum_j p_j expert_j(x)``."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.gate_up = compileops.nn.GroupedLinear(EXPERTS, DIM, 2 * HIDDEN, bias=False)
        self.down = compileops.nn.GroupedLinear(EXPERTS, HIDDEN, DIM, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, ids = torch.topk(torch.softmax(self.router(x), dim=-1), TOP_K, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        xs, order, offsets = permute_by_expert(x, ids, EXPERTS)
        h = compileops.grouped_linear_swiglu(xs, self.gate_up.weight, offsets)
        y = self.down(h, offsets, offsets=True)
        return x + unpermute_and_combine(y, order, probs)


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.proj(x), labels.reshape(-1))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = compileops.nn.Embedding(VOCAB, DIM)
        self.moe = MoEBlock()
        self.head = Head()

    def blocks(self):
        return (self.embed, self.moe, self.head)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(ids.reshape(-1))), labels)


#: The parameters whose sharding and gradients are checked: name -> full shape.
CHECKED = {
    "embed.weight": (VOCAB, DIM),
    "moe.gate_up.weight": (EXPERTS, 2 * HIDDEN, DIM),
    "moe.down.weight": (EXPERTS, DIM, HIDDEN),
    "moe.down.bias": (EXPERTS, DIM),
}


def _batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
               torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _placements(t) -> list:
    """A DTensor's placements as ``[("Shard", dim), ...]`` (plain values for the parent)."""
    return [(type(pl).__name__, getattr(pl, "dim", None)) for pl in t.placements]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _train(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch._inductor.config.compile_threads = 1  # two ranks share the CI's two cores
    torch.manual_seed(0)
    net = Net()
    ref = Net() if rank == 0 else None
    if ref is not None:
        ref.load_state_dict(net.state_dict())
    mesh = init_device_mesh("cpu", (WORLD,))  # also on a machine with a GPU
    for block in net.blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    out = {"placements": {}, "unsharded": [], "grads": [], "losses": [], "ref_losses": []}
    params = dict(net.named_parameters())
    for name in CHECKED:
        p = params[name]
        out["placements"][name] = (type(p).__name__, _placements(p),
                                   tuple(p.to_local().shape), tuple(p.shape))

    def check_unsharded(prefix, names):
        def hook(module, args):
            seen = {}
            for name in names:
                w = module.get_parameter(name)
                diff = (_max_diff(w, ref.get_parameter(f"{prefix}.{name}"))
                        if ref is not None else 0.0)
                seen[f"{prefix}.{name}"] = (isinstance(w, DTensor), tuple(w.shape), diff)
            out["unsharded"].append(seen)
        return hook

    # Registered after fully_shard, so they run after FSDP's unshard (all-gather) pre-hook.
    net.moe.register_forward_pre_hook(check_unsharded("moe", ["gate_up.weight", "down.weight",
                                                              "down.bias"]))
    net.embed.register_forward_pre_hook(check_unsharded("embed", ["weight"]))
    for block in net.blocks():
        block.forward = torch.compile(block.forward, fullgraph=True)

    opt = torch.optim.SGD(net.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR) if ref is not None else None
    mine = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    for ids, labels in _batches():
        loss = net(ids[mine], labels[mine])
        loss.backward()
        if ref is not None:
            ref_loss = ref(ids, labels)
            ref_loss.backward()
            out["ref_losses"].append(ref_loss.item())
        grads = {}
        for name in CHECKED:
            g = params[name].grad
            full = g.full_tensor()  # a collective: every rank calls it
            grads[name] = (_placements(g), tuple(g.to_local().shape),
                           _max_diff(full, ref.get_parameter(name).grad) if ref is not None
                           else 0.0)
        out["grads"].append(grads)
        opt.step()
        opt.zero_grad()
        if ref_opt is not None:
            ref_opt.step()
            ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["losses"].append(mean.item() / WORLD)
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


def _rank_train(rank: int, world: int):
    return _train(rank)


def test_fully_shard_compiled_matches_unsharded():
    results, exit_codes = run_ranks(_rank_train, WORLD, timeout_s=240, group_timeout_s=90)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert exit_codes == [0] * WORLD
    assert sorted(results) == list(range(WORLD))

    for rank, res in results.items():
        # Dim 0 sharding: whole experts (and whole vocabulary rows) per rank.
        for name, full in CHECKED.items():
            kind, placements, local, shape = res["placements"][name]
            assert kind == "DTensor" and placements == [("Shard", 0)], (name, res["placements"])
            assert shape == full and local == (full[0] // WORLD, *full[1:]), (name, local, shape)
        # The ops see the full, all-gathered weights: plain tensors, equal to the unsharded ones.
        assert len(res["unsharded"]) == 2 * STEPS
        for seen in res["unsharded"]:
            for name, (is_dtensor, shape, diff) in seen.items():
                assert not is_dtensor and shape == CHECKED[name], (name, is_dtensor, shape)
                assert diff <= 1e-6, (rank, name, diff)
        # Gradients sharded on dim 0 as well; all-gathered, the unsharded model's.
        for step, grads in enumerate(res["grads"]):
            for name, (placements, local, diff) in grads.items():
                assert placements == [("Shard", 0)], (name, placements)
                assert local == (CHECKED[name][0] // WORLD, *CHECKED[name][1:]), (name, local)
                assert diff <= 1e-6, (rank, step, name, diff)
        # One graph per block (embedding, MoE, head); no recompile across the steps.
        assert res["graphs"] == 3, res["graphs"]

    losses = results[0]["losses"]
    assert results[1]["losses"] == losses
    ref = results[0]["ref_losses"]
    assert len(losses) == STEPS and len(ref) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
