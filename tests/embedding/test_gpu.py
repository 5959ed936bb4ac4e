"""Embedding on a real GPU: Qwen3-8B-sized table, boundary ids, fp32 path, bitwise contract,
compiled kernel names, device-side bounds assert (in a subprocess: it poisons the context)."""
import subprocess
import sys
import textwrap

import pytest
import torch

import compileops
from compileops import testing, use_backend
from compileops.embedding import reference, strict_index_checks

pytestmark = pytest.mark.gpu

V, D = 151936, 4096

@pytest.fixture(scope="module")
def table():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(V, D, device="cuda", generator=gen, dtype=torch.bfloat16)


def _ids(n=16384, dtype=torch.int64):
    ids = torch.randint(0, V, (n,), device="cuda", dtype=dtype)
    ids[0], ids[1], ids[-1] = 0, V - 1, V - 1  # boundary ids
    ids[2:400] = 17  # a long run of one id
    return ids


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_forward_real_shape_bitwise(table, id_dtype, out_dtype):
    ids = _ids(dtype=id_dtype).reshape(8, 2048)
    out = compileops.embedding(ids, table, out_dtype=out_dtype)
    assert torch.equal(out, table[ids.long()].to(out_dtype or table.dtype))


def test_forward_table_over_2_31_elements():
    big = torch.empty(2**31 // 1024 + 8, 1024, device="cuda", dtype=torch.bfloat16)
    big[-1].fill_(3.0)
    big[0].fill_(-1.0)
    ids = torch.tensor([big.shape[0] - 1, 0], device="cuda")
    out = compileops.embedding(ids, big)
    assert torch.all(out[0] == 3.0) and torch.all(out[1] == -1.0)
    del big


def test_backward_real_shape_bitwise_vs_reference_and_deterministic(table):
    ids = _ids().reshape(8, 2048)
    grad = torch.randn(8, 2048, D, device="cuda", dtype=torch.float32)
    got = torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16)
    with use_backend("reference"):
        want = torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16)
    assert torch.equal(got, want)
    for _ in range(10):
        assert torch.equal(torch.ops.compileops.embedding_backward(grad, ids, V, None, torch.bfloat16), got)


def test_backward_batch_invariant_gpu():
    w = torch.randn(5000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 5000, (6, 300), device="cuda")
    testing.assert_batch_invariant(lambda i: compileops.embedding(i, w), [ids])
    grad = torch.randn(6, 300, 256, device="cuda")
    alone = torch.ops.compileops.embedding_backward(grad[:3], ids[:3], 5000, None, torch.float32)
    touched = torch.unique(ids[:3])
    only_a = touched[~torch.isin(touched, ids[3:])]
    both = torch.ops.compileops.embedding_backward(grad, ids, 5000, None, torch.float32)
    assert torch.equal(both[only_a], alone[only_a])


def test_compiled_gather_scale_cast_is_one_triton_kernel(table):
    ids = _ids(4096).reshape(2, 2048)

    def stem(i, w):
        return (compileops.embedding(i, w, out_dtype=torch.float32) * 2.5).to(torch.bfloat16)

    kernels = testing.inductor_kernels(stem, ids, table)
    assert kernels == "triton_poi_fused__to_copy_embedding_mul", kernels
    out = torch.compile(stem, fullgraph=True)(ids, table)
    assert torch.equal(out, stem(ids, table))


def test_compiled_backward_uses_our_op_and_matches_eager(table):
    w = table[:8192].clone().requires_grad_(True)
    ids = torch.randint(0, 8192, (4, 1024), device="cuda")
    f = lambda i, w: compileops.embedding(i, w, out_dtype=torch.float32).sin().sum()
    kernels = testing.inductor_kernels(f, ids, w, backward=True)
    assert "torch.ops.compileops.embedding_backward.default" in kernels
    (g_compiled,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(ids, w), w)
    (g_eager,) = torch.autograd.grad(f(ids, w), w)
    assert torch.equal(g_compiled, g_eager)


def test_cuda_graph_capture_forward_and_backward():
    w = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (512,), device="cuda")
    grad = torch.randn(512, 128, device="cuda")
    compileops.embedding(ids, w)
    torch.ops.compileops.embedding_backward(grad, ids, 1000, None, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compileops.embedding(ids, w)
        gw = torch.ops.compileops.embedding_backward(grad, ids, 1000, None, torch.bfloat16)
    ids.copy_(torch.randint(0, 1000, (512,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, w[ids])
    assert torch.equal(gw, reference.embedding_backward(grad, ids, 1000, None, torch.bfloat16))


def test_device_side_assert_on_bad_id():
    code = textwrap.dedent(
        """
        import torch, compileops
        w = torch.randn(100, 64, device="cuda")
        ids = torch.tensor([3, 100], device="cuda")
        compileops.embedding(ids, w)
        torch.cuda.synchronize()
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "id out of range" in result.stderr or "device-side assert" in result.stderr, result.stderr[-2000:]


def test_strict_mode_raises_index_error_on_gpu():
    w = torch.randn(100, 64, device="cuda")
    compileops.set_strict_index_checks(True)
    try:
        with pytest.raises(IndexError, match="id 100 is out of range"):
            compileops.embedding(torch.tensor([3, 100], device="cuda"), w)
    finally:
        compileops.set_strict_index_checks(False)
    with strict_index_checks(), pytest.raises(IndexError, match="id -1 is out of range"):
        compileops.embedding(torch.tensor([-1, 3], device="cuda"), w)


def test_device_mismatch_is_a_clear_error_eagerly_and_compiled():
    w = torch.randn(10, 4, device="cuda")
    ids = torch.tensor([1, 2])  # on the CPU
    with pytest.raises(RuntimeError, match="ids is on cpu but weight is on cuda"):
        compileops.embedding(ids, w)
    compiled = torch.compile(lambda i, w: compileops.embedding(i, w), fullgraph=True)
    with pytest.raises(Exception, match="ids is on cpu but weight is on cuda"):
        compiled(ids, w)


@pytest.mark.parametrize("schedule", [{}, {"hot_first": False}], ids=["default", "id-order"])
@pytest.mark.parametrize("padding_idx", [None, 17])
def test_two_stream_schedule_is_bitwise_the_one_launch_schedule(padding_idx, schedule):
    """The default CUDA schedule (fill on the current stream, sort + run programs on a
    high-priority side stream) against the single-launch one, on Zipf-like ids with a
    hot id; the result is read on the current stream right after the call (the join)."""
    from compileops.embedding import kernels

    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = (torch.rand(16384, device="cuda", generator=gen) ** 6 * 50000).long()
    ids[::7] = 17
    grad = torch.randn(16384, 512, device="cuda", generator=gen, dtype=torch.bfloat16)
    one = kernels.embedding_backward(grad, ids, 50000, padding_idx, torch.bfloat16,
                                     kernels.BackwardConfig(streams=False))
    for _ in range(3):
        two = kernels.embedding_backward(grad, ids, 50000, padding_idx, torch.bfloat16,
                                         kernels.BackwardConfig(streams=True, **schedule))
        assert torch.equal(two, one)
    want = reference.embedding_backward(grad, ids, 50000, padding_idx, torch.bfloat16)
    assert torch.equal(one, want)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 1000, 1024, 1025, 16384, 65536])
def test_triton_id_sort_is_torch_stable_sort(n, id_dtype):
    """The two-launch Triton sort (the default for <= 65536 ids on CUDA) is exactly
    torch.sort(stable=True): ids and token positions, on heavy repeats and on the full
    id range."""
    from compileops.embedding.kernels import stable_sort_ids

    gen = torch.Generator(device="cuda").manual_seed(n)
    ids = (torch.rand(n, device="cuda", generator=gen) ** 6 * V).to(id_dtype)
    ids[: n // 3] = V - 1
    ids[::5] = 0
    got_ids, got_order = stable_sort_ids(ids)
    want_ids, want_order = torch.sort(ids.to(torch.int32), stable=True)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_order, want_order)


@pytest.mark.parametrize("sort", ["triton", "torch"])
def test_backward_sorts_agree_bitwise(sort):
    """Both sorts give the same grad_weight, bitwise the reference's, in the two-stream
    schedule on Zipf-like ids."""
    from compileops.embedding import kernels

    gen = torch.Generator(device="cuda").manual_seed(2)
    ids = (torch.rand(16384, device="cuda", generator=gen) ** 6 * 50000).long()
    grad = torch.randn(16384, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = kernels.embedding_backward(grad, ids, 50000, None, torch.bfloat16,
                                     kernels.BackwardConfig(sort=sort))
    want = reference.embedding_backward(grad, ids, 50000, None, torch.bfloat16)
    assert torch.equal(got, want)


def test_cached_launches_follow_alignment_and_match_the_normal_path():
    """compileops._launch reuses a compiled kernel only for arguments Triton would specialize
    the same way: after aligned calls, 2-byte-misaligned views of the table and the grad
    (so no 16-byte vector accesses) still give bitwise the reference, and every result is
    bitwise the one from Triton's normal launch path."""
    from compileops import _launch
    from compileops.embedding import kernels

    v, d, n = 5000, 512, 4096
    gen = torch.Generator(device="cuda").manual_seed(1)
    flat = torch.randn(v * d + 1, device="cuda", generator=gen, dtype=torch.bfloat16)
    aligned, misaligned = flat[:-1].view(v, d), flat[1:].view(v, d)
    assert misaligned.data_ptr() % 16 == 2
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    ids[:300] = 7
    grads = torch.randn(n * d + 1, device="cuda", generator=gen, dtype=torch.bfloat16)
    grad_aligned, grad_misaligned = grads[:-1].view(n, d), grads[1:].view(n, d)
    results = {}
    for enabled in (True, False):
        _launch.enabled = enabled
        try:
            for name, weight, grad in (("aligned", aligned, grad_aligned),
                                       ("misaligned", misaligned, grad_misaligned),
                                       ("aligned again", aligned, grad_aligned)):
                fwd = kernels.embedding_forward(ids, weight)
                bwd = kernels.embedding_backward(grad, ids, v, None, torch.bfloat16)
                assert torch.equal(fwd, weight[ids]), (enabled, name)
                assert torch.equal(bwd, reference.embedding_backward(grad, ids, v, None,
                                                                     torch.bfloat16)), (enabled, name)
                results[enabled, name] = (fwd, bwd)
        finally:
            _launch.enabled = True
    for name in ("aligned", "misaligned", "aligned again"):
        for got, want in zip(results[True, name], results[False, name]):
            assert torch.equal(got, want), name


def test_cached_launch_skips_tritons_binding_on_a_repeat_call(monkeypatch):
    """The second identical forward call launches the cached kernel without going through
    JITFunction.run (which would rebind every argument)."""
    from compileops.embedding import kernels

    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (512,), device="cuda")
    first = kernels.embedding_forward(ids, weight)

    def bound_again(*args, **kwargs):
        raise AssertionError("JITFunction.run was called: the launch cache missed")

    monkeypatch.setattr(kernels.embedding_forward_kernel, "run", bound_again)
    assert torch.equal(kernels.embedding_forward(ids, weight), first)
