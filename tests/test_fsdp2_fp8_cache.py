"""FSDP2 over ``GroupedLinear(fp8=..., cache_fp8_weights=True)``, in 2 CPU processes over
gloo: after an optimizer step the fp8 copies follow the new weights.

FSDP2 all-gathers the updated shards into the same unsharded parameter storage and keeps the
parameter's version counter as it was, so a cache keyed on storage and version alone would
hand the forward after the step the copies of the weights before it, whenever the allocator
gives the unsharded storage back at the same address (on a GPU it did; on the CPU the address
moved in the runs seen, so the one-process test of the same write pattern in
tests/grouped_linear/test_fp8_cache.py is the one that fails without the fix). Checked here,
end to end: every forward after a step, with the cache on, gives the bits of the same forward
with the cache cleared, resharding after the forward or not; and the bits of the same layer
unsharded, taking the same steps (each rank quantises the all-gathered weight, so fp8 under
FSDP2 computes what the unsharded layer does).
"""
from __future__ import annotations

import torch

import compileops
from compileops.grouped_linear import clear_fp8_weight_cache
from tests.gloo import run_ranks

GROUPS, IN, OUT, ROWS, STEPS, WORLD = 4, 32, 32, 24, 3, 2


def _rank(rank: int, world: int, reshard: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = compileops.nn.GroupedLinear(GROUPS, IN, OUT, bias=False, dtype=torch.bfloat16,
                                        fp8="rowwise", cache_fp8_weights=True)
    # The same layer unsharded (no cache), trained on the same rows: every rank feeds the same
    # x, so FSDP2's averaged gradient is each rank's own and the two take the same steps.
    unsharded = compileops.nn.GroupedLinear(GROUPS, IN, OUT, bias=False, dtype=torch.bfloat16,
                                            fp8="rowwise")
    unsharded.load_state_dict(layer.state_dict())
    fully_shard(layer, reshard_after_forward=reshard)
    optimizer = torch.optim.SGD(layer.parameters(), lr=5.0)
    unsharded_optimizer = torch.optim.SGD(unsharded.parameters(), lr=5.0)
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    splits = torch.tensor([6, 6, 6, 6])
    stale = against_unsharded = 0.0
    for _ in range(STEPS):
        with torch.no_grad():
            cached = layer(x, splits)
            want = unsharded(x, splits)
            clear_fp8_weight_cache()
            fresh = layer(x, splits)
        stale = max(stale, (cached.float() - fresh.float()).abs().max().item())
        against_unsharded = max(against_unsharded,
                                (cached.float() - want.float()).abs().max().item())
        for model, opt in ((layer, optimizer), (unsharded, unsharded_optimizer)):
            model(x, splits).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    return {"stale": stale, "against_unsharded": against_unsharded}


def _both_ways(rank: int, world: int) -> dict:
    """Resharding after the forward and keeping the weights unsharded, in one process group."""
    return {reshard: _rank(rank, world, reshard) for reshard in (True, False)}


def test_fp8_weight_cache_follows_fsdp2_all_gathers():
    results, codes = run_ranks(_both_ways, WORLD, timeout_s=240)
    assert codes == [0] * WORLD, results
    for rank in range(WORLD):
        assert "error" not in results[rank], results[rank]["error"]
        for reshard in (True, False):
            assert results[rank][reshard]["stale"] == 0.0, (reshard, results)
            assert results[rank][reshard]["against_unsharded"] == 0.0, (reshard, results)
