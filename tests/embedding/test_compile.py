"""torch.compile of the embedding ops: fullgraph fw/bw, dynamic shapes, fusion, numerics."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import compileops
from compileops import testing


def _stem(ids, weight):
    """Lookup, fp32 scale, cast back: the fusion target (one kernel)."""
    return (compileops.embedding(ids, weight, out_dtype=torch.float32) * 3.0).to(torch.bfloat16)


def _inputs(V=64, D=32, shape=(4, 9), seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=gen).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, V, shape, generator=gen)
    ids[0, :5] = 11
    return ids, weight


def test_fullgraph_forward_and_backward_match_eager():
    ids, weight = _inputs()
    compiled = torch.compile(_stem, fullgraph=True)
    out = compiled(ids, weight)
    grad_out = torch.randn_like(out, dtype=torch.float32).to(torch.bfloat16)
    (g_compiled,) = torch.autograd.grad(out, weight, grad_out)
    eager = _stem(ids, weight)
    (g_eager,) = torch.autograd.grad(eager, weight, grad_out)
    assert torch.equal(out, eager)
    assert torch.equal(g_compiled, g_eager)


def test_dynamic_no_recompiles_over_five_token_counts():
    _, weight = _inputs()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_stem, backend=counter, dynamic=True, fullgraph=True)
    for tokens in (3, 5, 17, 64, 129):
        ids = torch.randint(0, 64, (2, tokens))
        out = compiled(ids, weight)
        out.float().sum().backward()
        assert torch.equal(out, _stem(ids, weight))
    assert counter.frame_count == 1


def test_lookup_scale_cast_is_one_cpp_kernel_and_backward_is_our_extern():
    ids, weight = _inputs()
    kernels = testing.inductor_kernels(_stem, ids, weight, backward=True).splitlines()
    forward, backward = kernels[: kernels.index("# backward")], kernels[kernels.index("# backward") + 1 :]
    assert forward == ["cpp_fused__to_copy_embedding_mul"]
    assert "torch.ops.compileops.embedding_backward.default" in backward


def test_lookup_scale_cast_is_one_triton_kernel():
    ids, weight = _inputs()
    assert testing.inductor_kernels(_stem, ids, weight, triton=True) == (
        "triton_poi_fused__to_copy_embedding_mul"
    )


def test_compiled_backward_never_uses_atomic_scatter():
    from compileops.lowerings import _compat

    ids, weight = _inputs()
    compiled = torch.compile(_stem, fullgraph=True)

    def fw_bw():
        compiled(ids, weight).float().sum().backward()

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        _, sources = _compat.run_and_get_code(fw_bw)
    code = "\n".join(sources)
    assert "compileops.embedding_backward" in code
    for forbidden in ("tl.atomic_add", "'atomic_add_found': True", "index_put", "scatter_add",
                      "embedding_dense_backward"):
        assert forbidden not in code, forbidden


def test_triton_codegen_runs_under_interpreter_and_is_bitwise():
    from compileops.lowerings import _compat

    def lookup_scale(ids, weight):
        # fp32 output: the interpreter truncates fp32->bf16 casts instead of rounding.
        return compileops.embedding(ids, weight, out_dtype=torch.float32) * 3.0

    ids, weight = _inputs()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        out, code = _compat.run_and_get_code(torch.compile(lookup_scale, fullgraph=True), ids, weight)
    assert "def triton_poi_fused_embedding_mul" in code[0]
    assert torch.equal(out, lookup_scale(ids, weight))


def test_compiled_rejects_out_of_range_ids():
    ids, weight = _inputs()
    ids[1, 1] = 64
    compiled = torch.compile(_stem, fullgraph=True)
    with pytest.raises(RuntimeError, match=r"compileops.embedding: an id in ids is out of range"):
        compiled(ids, weight)
    ids[1, 1] = -1  # negative ids are rejected too, not wrapped
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"compileops.embedding: an id in ids is out of range"):
        torch.compile(_stem, fullgraph=True)(ids, weight)


def test_module_compiles_fullgraph():
    emb = compileops.nn.Embedding(50, 8, padding_idx=0)
    ids = torch.randint(0, 50, (3, 6))
    ids[0, 0] = 0
    compiled = torch.compile(emb, fullgraph=True)
    out = compiled(ids)
    out.sum().backward()
    assert torch.equal(out, emb.weight[ids])
    assert torch.all(emb.weight.grad[0] == 0)
