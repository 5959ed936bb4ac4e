"""The mLSTM under torch.compile on CPU: fullgraph forward and backward equal eager (the ops run
as extern calls of the eager kernels here; the Triton template is GPU-only and is checked in
test_gpu.py and, as code, in test_snapshots.py), no graph breaks, and dynamic=True over
four sequence lengths in one frame."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import compileops
from compileops.testing import assert_close_to_reference
from tests.mlstm._helpers import cotangent, make_inputs


def block(q, k, v, igate, fgate, weight, bias, o):
    """The xLSTM block's use: the cell with its norm, then the output gate."""
    return torch.sigmoid(o) * compileops.mlstm(q, k, v, igate, fgate, norm_weight=weight,
                                               norm_bias=bias)


def raw(q, k, v, igate, fgate):
    out, n, m = compileops.mlstm_with_stats(q, k, v, igate, fgate, eps=0.0)
    return out * 2.0, n, m


def _block_inputs(seq=21, seed=0):
    x = make_inputs(2, 2, seq, 16, 8, dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    o = torch.randn(2, seq, 16, generator=gen)
    return [t.requires_grad_(True) for t in x.tensors()] + [o]


def _fw_bw(fn, args):
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    outs = fn(*leaves)
    out = outs[0] if isinstance(outs, tuple) else outs
    grad = cotangent(out.shape, out.dtype, seed=3)
    wrt = [t for t in leaves if t.requires_grad]
    return outs, torch.autograd.grad(out, wrt, grad)


def test_fullgraph_block_fw_bw_equals_eager_aot_eager():
    """aot_eager runs the same eager ops in the same order: bitwise. (Inductor, whose C++
    kernels for the gates' log-sigmoid/cumsum and the output gate differ by ulps, is held to
    1e-6 in test_dynamic_sequence_lengths_compile_one_frame.)"""
    args = _block_inputs()
    counters.clear()
    got, got_grads = _fw_bw(torch.compile(block, backend="aot_eager", fullgraph=True), args)
    want, want_grads = _fw_bw(block, args)
    assert not counters["graph_break"]
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_raw_with_stats_equals_eager(backend):
    x = make_inputs(1, 2, 19, 8, 16, dtype=torch.float32, weight=False, bias=False, seed=1)
    args = [t.requires_grad_(True) for t in x.tensors()]
    (got, n, m), got_grads = _fw_bw(torch.compile(raw, backend=backend, fullgraph=True), args)
    (want, n_want, m_want), want_grads = _fw_bw(raw, args)
    tol = 0 if backend == "aot_eager" else 1e-6
    for a, b in [(got, want), (n, n_want), (m, m_want), *zip(got_grads, want_grads)]:
        assert_close_to_reference(a, b, max_relative_error=tol)


# One frame: Dynamo traces ``block`` once (``unique_graphs``), and later sizes add no backend
# call (no recompile). The first compile calls the backend twice: Dynamo restarts its
# analysis once (fx/passes/_tensorify_python_scalars) when tracing the public function,
# so ``frame_count`` reads 2 after the first call and must not grow after it.


def test_dynamic_sequence_lengths_compile_one_frame():
    """Inductor, fullgraph, dynamic=True: four sequence lengths, one frame, no graph break,
    forward and backward within 1e-6 of eager each time."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    counters.clear()
    after_first = None
    for seq in (17, 24, 40, 53):
        args = _block_inputs(seq, seed=seq)
        got, got_grads = _fw_bw(compiled, args)
        after_first = after_first or counter.frame_count
        want, want_grads = _fw_bw(block, args)
        assert_close_to_reference(got, want, max_relative_error=1e-6)
        for g, w in zip(got_grads, want_grads):
            assert_close_to_reference(g, w, max_relative_error=1e-6)
    assert counter.frame_count == after_first, "recompiled for a new sequence length"
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_dynamic_batch_reuses_the_frame():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    counters.clear()
    after_first = None
    for batch in (2, 3, 4):
        x = make_inputs(batch, 1, 5, 8, 8, dtype=torch.float32, seed=batch)
        o = torch.randn(batch, 5, 8)
        args = [t.requires_grad_(True) for t in x.tensors()] + [o]
        got, _ = _fw_bw(compiled, args)
        after_first = after_first or counter.frame_count
        want, _ = _fw_bw(block, args)
        assert torch.equal(got, want)
    assert counter.frame_count == after_first, "recompiled for a new batch size"
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_backward_calls_our_backward_op():
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    recorder = AotEagerAndRecordGraphs()
    args = _block_inputs()
    _fw_bw(torch.compile(block, backend=recorder, fullgraph=True), args)
    fw = "\n".join(gm.print_readable(print_output=False) for gm in recorder.fw_graphs)
    bw = "\n".join(gm.print_readable(print_output=False) for gm in recorder.bw_graphs)
    assert "compileops.mlstm_parallel.default" in fw
    assert "compileops.mlstm_parallel_backward.default" in bw
