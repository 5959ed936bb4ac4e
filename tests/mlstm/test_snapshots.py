"""Graph and kernel snapshots of the mLSTM under torch.compile, on every supported torch
(tests/snapshot.py; regenerate with EXPECTTEST_ACCEPT=1), and the template's numerics under the interpreter.

The template is checked two ways on CPU: its Triton code (``cpu_backend="triton"``) names the
fused output-gate epilogue, and, run under Triton's interpreter, it matches the eager kernels
bitwise-close. The public function's gate prologue (``cumsum(logsigmoid(f))``) uses libdevice
functions the interpreter cannot run, so the runs call the op with a prepared ``logf``.
"""
import torch

import compileops
from compileops.mlstm import reference
from compileops.testing import aot_graph_text
from compileops.lowerings import _compat
from tests.snapshot import SnapshotTestCase


B, NH, S, DQK, DV = 2, 2, 40, 16, 32


def _inputs(dtype=torch.float32, seq=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, seq, DQK, generator=g, dtype=dtype)
    k = torch.randn(B, NH, seq, DQK, generator=g, dtype=dtype)
    v = torch.randn(B, NH, seq, DV, generator=g, dtype=dtype)
    igate = torch.randn(B, NH, seq, generator=g, dtype=dtype)
    fgate = torch.randn(B, NH, seq, generator=g, dtype=dtype) + 3
    weight = torch.randn(NH * DV, generator=g, dtype=dtype)
    o = torch.randn(B, seq, NH * DV, generator=g, dtype=dtype)
    return q, k, v, igate, fgate, weight, o


def gated_block(q, k, v, igate, fgate, weight, o):
    """The xLSTM block's use: the normed cell, then the output gate."""
    return torch.sigmoid(o) * compileops.mlstm(q, k, v, igate, fgate, norm_weight=weight)


def gated_op(q, k, v, igate, logf, weight, o):
    """:func:`gated_block` on the op, with ``logf`` prepared (runs under the interpreter)."""
    out, _, m_log2, row_sum = torch.ops.compileops.mlstm_parallel(
        q, k, v, igate, logf, weight, None, True, 1e-6, 1e-6, False, False)
    return torch.sigmoid(o) * out, m_log2, row_sum


def _kernel_names(code: list[str]) -> list[str]:
    import re

    return re.findall(r"^def (triton_\w+?)(?:_\d+)?\(", "\n".join(code), re.M)


class Snapshots(SnapshotTestCase):
    def test_aot_graphs(self):
        q, k, v, igate, fgate, weight, _ = _inputs()
        for t in (q, k, v, igate, fgate, weight):
            t.requires_grad_()
        fw, bw = aot_graph_text(
            lambda *a: compileops.mlstm(*a[:5], norm_weight=a[5]), q, k, v, igate, fgate, weight)
        self.assertSnapshot(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 2, 40, 16]", primals_2: "f32[2, 2, 40, 16]", primals_3: "f32[2, 2, 40, 32]", primals_4: "f32[2, 2, 40]", primals_5: "f32[2, 2, 40]", primals_6: "f32[64]"):
        mlstm_log_forget: "f32[2, 2, 40]" = torch.ops.compileops.mlstm_log_forget.default(primals_5)

        clamp: "f32[2, 2, 40]" = torch.ops.aten.clamp.default(primals_4, -1e+30)

        mlstm_parallel = torch.ops.compileops.mlstm_parallel.default(primals_1, primals_2, primals_3, clamp, mlstm_log_forget, primals_6, None, True, 1e-06, 1e-06, False, True)
        getitem: "f32[2, 40, 64]" = mlstm_parallel[0]
        getitem_1: "f32[2, 2, 40, 32]" = mlstm_parallel[1]
        getitem_2: "f32[2, 2, 40]" = mlstm_parallel[2]
        getitem_3: "f32[2, 2, 40]" = mlstm_parallel[3];  mlstm_parallel = None

        ge: "b8[2, 2, 40]" = torch.ops.aten.ge.Scalar(primals_4, -1e+30);  primals_4 = None
        return (getitem, primals_1, primals_2, primals_3, primals_5, primals_6, mlstm_log_forget, clamp, getitem_1, getitem_2, getitem_3, ge)""")
        self.assertSnapshot(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 2, 40, 16]", primals_2: "f32[2, 2, 40, 16]", primals_3: "f32[2, 2, 40, 32]", primals_5: "f32[2, 2, 40]", primals_6: "f32[64]", mlstm_log_forget: "f32[2, 2, 40]", clamp: "f32[2, 2, 40]", getitem_1: "f32[2, 2, 40, 32]", getitem_2: "f32[2, 2, 40]", getitem_3: "f32[2, 2, 40]", ge: "b8[2, 2, 40]", tangents_1: "f32[2, 40, 64]"):
        mlstm_parallel_backward = torch.ops.compileops.mlstm_parallel_backward.default(tangents_1, primals_1, primals_2, primals_3, clamp, mlstm_log_forget, primals_6, getitem_1, getitem_2, getitem_3, True, 1e-06, 1e-06, False);  tangents_1 = primals_1 = primals_2 = primals_3 = clamp = mlstm_log_forget = primals_6 = getitem_1 = getitem_2 = getitem_3 = None
        getitem_4: "f32[2, 2, 40, 16]" = mlstm_parallel_backward[0]
        getitem_5: "f32[2, 2, 40, 16]" = mlstm_parallel_backward[1]
        getitem_6: "f32[2, 2, 40, 32]" = mlstm_parallel_backward[2]
        getitem_7: "f32[2, 2, 40]" = mlstm_parallel_backward[3]
        getitem_8: "f32[2, 2, 40]" = mlstm_parallel_backward[4]
        getitem_9: "f32[64]" = mlstm_parallel_backward[5];  mlstm_parallel_backward = None

        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 2, 40]" = torch.ops.aten.where.self(ge, getitem_7, scalar_tensor);  ge = getitem_7 = scalar_tensor = None

        mlstm_log_forget_backward: "f32[2, 2, 40]" = torch.ops.compileops.mlstm_log_forget_backward.default(getitem_8, primals_5);  getitem_8 = primals_5 = None
        return (getitem_4, getitem_5, getitem_6, where, mlstm_log_forget_backward, getitem_9)""")

    def test_chunkwise_aot_graphs(self):
        """The chunkwise form with a state in and out: the chunk-restarted forget sums, the
        chunkwise op and its backward op (the states' gradients included), no graph break."""
        q, k, v, igate, fgate, weight, _ = _inputs()
        acc = torch.float32
        state = (torch.zeros(B, NH, DQK, DV, dtype=acc), torch.zeros(B, NH, DQK, dtype=acc),
                 torch.zeros(B, NH, dtype=acc))
        for t in (q, k, v, igate, fgate, weight, *state):
            t.requires_grad_()

        def fn(q, k, v, igate, fgate, weight, c, n, m):
            out, (c2, n2, m2) = compileops.mlstm(q, k, v, igate, fgate, norm_weight=weight,
                                                 kernel="chunkwise", chunk_size=16,
                                                 initial_state=(c, n, m),
                                                 return_last_state=True)
            return out, c2, n2, m2

        fw, bw = aot_graph_text(fn, q, k, v, igate, fgate, weight, *state)
        self.assertSnapshot(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 2, 40, 16]", primals_2: "f32[2, 2, 40, 16]", primals_3: "f32[2, 2, 40, 32]", primals_4: "f32[2, 2, 40]", primals_5: "f32[2, 2, 40]", primals_6: "f32[64]", primals_7: "f32[2, 2, 16, 32]", primals_8: "f32[2, 2, 16]", primals_9: "f32[2, 2]"):
        clamp: "f32[2, 2, 40]" = torch.ops.aten.clamp.default(primals_4, -1e+30)

        mlstm_log_forget: "f32[2, 2, 40]" = torch.ops.compileops.mlstm_log_forget.default(primals_5, 16)

        mlstm_chunkwise = torch.ops.compileops.mlstm_chunkwise.default(primals_1, primals_2, primals_3, clamp, mlstm_log_forget, primals_6, None, primals_7, primals_8, primals_9, 16, True, 1e-06, 1e-06, False, True)
        getitem: "f32[2, 40, 64]" = mlstm_chunkwise[0]
        getitem_1: "f32[2, 2, 40, 32]" = mlstm_chunkwise[1]
        getitem_2: "f32[2, 2, 40]" = mlstm_chunkwise[2]
        getitem_3: "f32[2, 2, 40]" = mlstm_chunkwise[3]
        getitem_4: "f32[4, 3, 16, 32]" = mlstm_chunkwise[4]
        getitem_5: "f32[4, 4, 16]" = mlstm_chunkwise[5]
        getitem_6: "f32[4, 4]" = mlstm_chunkwise[6]
        getitem_7: "f32[2, 2, 16, 32]" = mlstm_chunkwise[7]
        getitem_8: "f32[2, 2, 16]" = mlstm_chunkwise[8]
        getitem_9: "f32[2, 2]" = mlstm_chunkwise[9];  mlstm_chunkwise = None
        detach: "f32[2, 2, 16, 32]" = torch.ops.aten.detach.default(getitem_7)
        detach_1: "f32[2, 2, 16]" = torch.ops.aten.detach.default(getitem_8)
        detach_2: "f32[2, 2, 16, 32]" = torch.ops.aten.detach.default(detach);  detach = None
        detach_3: "f32[2, 2, 16]" = torch.ops.aten.detach.default(detach_1);  detach_1 = None

        ge: "b8[2, 2, 40]" = torch.ops.aten.ge.Scalar(primals_4, -1e+30);  primals_4 = None
        return (getitem, getitem_7, getitem_8, getitem_9, primals_1, primals_2, primals_3, primals_5, primals_6, primals_7, primals_8, primals_9, clamp, mlstm_log_forget, getitem_1, getitem_2, getitem_3, getitem_4, getitem_5, getitem_6, detach_2, detach_3, ge)""")
        self.assertSnapshot(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[2, 2, 40, 16]", primals_2: "f32[2, 2, 40, 16]", primals_3: "f32[2, 2, 40, 32]", primals_5: "f32[2, 2, 40]", primals_6: "f32[64]", primals_7: "f32[2, 2, 16, 32]", primals_8: "f32[2, 2, 16]", primals_9: "f32[2, 2]", clamp: "f32[2, 2, 40]", mlstm_log_forget: "f32[2, 2, 40]", getitem_1: "f32[2, 2, 40, 32]", getitem_2: "f32[2, 2, 40]", getitem_3: "f32[2, 2, 40]", getitem_4: "f32[4, 3, 16, 32]", getitem_5: "f32[4, 4, 16]", getitem_6: "f32[4, 4]", detach_2: "f32[2, 2, 16, 32]", detach_3: "f32[2, 2, 16]", ge: "b8[2, 2, 40]", tangents_1: "f32[2, 40, 64]", tangents_2: "f32[2, 2, 16, 32]", tangents_3: "f32[2, 2, 16]", tangents_4: "f32[2, 2]"):
        mlstm_chunkwise_backward = torch.ops.compileops.mlstm_chunkwise_backward.default(tangents_1, tangents_2, tangents_3, tangents_4, primals_1, primals_2, primals_3, clamp, mlstm_log_forget, primals_6, primals_7, primals_8, primals_9, getitem_1, getitem_2, getitem_3, getitem_4, getitem_5, getitem_6, detach_2, detach_3, 16, True, 1e-06, 1e-06, False);  tangents_1 = tangents_2 = tangents_3 = tangents_4 = primals_1 = primals_2 = primals_3 = clamp = mlstm_log_forget = primals_6 = primals_7 = primals_8 = primals_9 = getitem_1 = getitem_2 = getitem_3 = getitem_4 = getitem_5 = getitem_6 = detach_2 = detach_3 = None
        getitem_10: "f32[2, 2, 40, 16]" = mlstm_chunkwise_backward[0]
        getitem_11: "f32[2, 2, 40, 16]" = mlstm_chunkwise_backward[1]
        getitem_12: "f32[2, 2, 40, 32]" = mlstm_chunkwise_backward[2]
        getitem_13: "f32[2, 2, 40]" = mlstm_chunkwise_backward[3]
        getitem_14: "f32[2, 2, 40]" = mlstm_chunkwise_backward[4]
        getitem_15: "f32[64]" = mlstm_chunkwise_backward[5]
        getitem_17: "f32[2, 2, 16, 32]" = mlstm_chunkwise_backward[7]
        getitem_18: "f32[2, 2, 16]" = mlstm_chunkwise_backward[8]
        getitem_19: "f32[2, 2]" = mlstm_chunkwise_backward[9];  mlstm_chunkwise_backward = None

        mlstm_log_forget_backward: "f32[2, 2, 40]" = torch.ops.compileops.mlstm_log_forget_backward.default(getitem_14, primals_5, 16);  getitem_14 = primals_5 = None

        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[2, 2, 40]" = torch.ops.aten.where.self(ge, getitem_13, scalar_tensor);  ge = getitem_13 = scalar_tensor = None
        return (getitem_10, getitem_11, getitem_12, where, mlstm_log_forget_backward, getitem_15, getitem_17, getitem_18, getitem_19)""")

    def test_template_fuses_the_output_gate(self):
        args = _inputs()
        with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
            code = _compat.get_code(torch.compile(gated_block, fullgraph=True), *args)
        self.assertSnapshot("\n".join(_kernel_names(code)), """\
triton_poi_fused_clamp_mlstm_parallel
triton_tem_fused_clamp_mlstm_parallel_mul_sigmoid""")


def test_template_matches_eager_kernels_under_the_interpreter():
    q, k, v, igate, fgate, weight, o = _inputs()
    logf = reference.log_forget_cumsum(fgate)
    eager = gated_op(q, k, v, igate, logf, weight, o)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled, code = _compat.run_and_get_code(torch.compile(gated_op, fullgraph=True), q, k, v,
                                                  igate, logf, weight, o)
    assert any(name.startswith("triton_tem_fused_mlstm_parallel") for name in _kernel_names(code))
    # The stabiliser and row sum come from the same tile body: bitwise. The gated output
    # differs from eager only by the epilogue's fused sigmoid-multiply rounding.
    assert torch.equal(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2])
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-6, rtol=1e-6)


def test_template_keeps_the_sequence_symbolic():
    # dynamic=True over four sequence lengths: one frame, no recompile, the template each time.
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(gated_op, backend=counter, fullgraph=True, dynamic=True)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        for seq in (17, 40, 64, 71):
            q, k, v, igate, fgate, weight, o = _inputs(seq=seq, seed=seq)
            logf = reference.log_forget_cumsum(fgate)
            got = compiled(q, k, v, igate, logf, weight, o)
            want = gated_op(q, k, v, igate, logf, weight, o)
            torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 1


def test_template_keeps_a_symbolic_length_aligned_when_it_is_a_multiple_of_16():
    # dynamic=True from S = 48: the lowering guards S % 16 == 0 and the template shows Triton
    # the factor (SEQ = (S // 16) * 16), so the per-row gate accesses stay vectorised; S = 64
    # reuses the frame, S = 40 recompiles once (the unaligned form) and is still right. From
    # S = 40 there is no guard: one frame for every length. (16 and 32 are this test's head
    # dims, and a length equal to one would be specialised: avoided.)
    from torch._dynamo.testing import CompileCounterWithBackend

    def run(seqs):
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(gated_op, backend=counter, fullgraph=True, dynamic=True)
        frames = []
        for seq in seqs:
            q, k, v, igate, fgate, weight, o = _inputs(seq=seq, seed=seq)
            logf = reference.log_forget_cumsum(fgate)
            got = compiled(q, k, v, igate, logf, weight, o)
            want = gated_op(q, k, v, igate, logf, weight, o)
            torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
            frames.append(counter.frame_count)
        return frames

    def first_code(seq):
        torch._dynamo.reset()
        q, k, v, igate, fgate, weight, o = _inputs(seq=seq)
        logf = reference.log_forget_cumsum(fgate)
        _, code = _compat.run_and_get_code(torch.compile(gated_op, fullgraph=True, dynamic=True),
                                           q, k, v, igate, logf, weight, o)
        return "\n".join(code)

    # A fresh cache each time: Inductor's graph cache would hand a later compile the first
    # one's kernel whenever its guards still hold.
    for check in (lambda: run((48, 64, 40)) == [1, 1, 2],
                  lambda: run((40, 48, 64)) == [1, 1, 1],
                  lambda: "SEQ = (ks0 // 16) * 16" in first_code(48),
                  lambda: "SEQ = ks0\n" in first_code(40)):
        torch._dynamo.reset()
        with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
            assert check()
