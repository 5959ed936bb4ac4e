"""The Triton mLSTM kernels (under the interpreter on CPU) against the fp64 reference, and the
numerical contract: precision per dtype, bitwise determinism, bitwise batch invariance,
strided inputs, head dims, empty and one-step sequences, inputs left untouched.

Precision is the relative L2 error ``||out - ref|| / ||ref||`` of the output and of each
gradient against fp64 autograd through the reference on the same (rounded) inputs. Measured
worst cases (the shapes below, fgate centred at 0 and 3, two seeds; the interpreter, which
truncates fp32 -> 16-bit casts where GPUs round to nearest, so these are the larger figures;
H100 figures are in test_gpu.py):

======  ==========================  =========================================
dtype   output (normed / raw)       gradients (worst of q, k, v, igate, fgate,
                                    weight, bias; normed / raw)
======  ==========================  =========================================
bf16    3.5e-3 / 6.4e-3             1.2e-2 (dfgate) / 1.2e-2 (dq, dk)
fp16    2.5e-4 / 3.2e-4             1.3e-3 (dfgate) / 5.5e-4 (dk)
fp32    1.3e-7 / 2.3e-7             4.3e-7
======  ==========================  =========================================

The bounds (tests/mlstm/_helpers.py, stated in ``compileops.mlstm``'s docstring) keep about 3x
margin over these: bf16 2e-2 (output) and 4e-2 (gradients), fp16 1e-3 and 4e-3, fp32 1e-5.
"""
import re

import pytest
import torch

import compileops
from compileops.testing import assert_batch_invariant, assert_deterministic
from tests.mlstm._helpers import BACKENDS, GRAD_TOL, OUT_TOL, Inputs, check_precision, \
    cotangent, fw_bw, make_inputs, op_out, out_shape, reference_out


# (shape, normed): the normed case at 4 query tiles, the raw one ragged with DQK > DV.
PRECISION_CASES = [((1, 2, 64, 32, 64), True), ((2, 1, 45, 64, 32), False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,normed", PRECISION_CASES,
                         ids=["1x2x64x32x64-normed", "2x1x45x64x32-raw"])
def test_precision_against_fp64(dtype, shape, normed):
    x = make_inputs(*shape, weight=normed, bias=normed, seed=shape[2])
    errors = check_precision(x, dtype)
    print(f"{dtype} {shape} {'normed' if normed else 'raw'}: "
          + " ".join(f"{e:.2e}" for e in errors))


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_precision_fp32(normed):
    x = make_inputs(1, 2, 33, 32, 48, weight=normed, bias=normed, seed=50)
    check_precision(x, torch.float32)


def test_precision_fp16_closing_forget_gates():
    x = make_inputs(1, 1, 48, 64, 64, fgate_bias=0.0, seed=2)
    check_precision(x, torch.float16)


def _docstring_bound(doc: str, label: str) -> tuple[float, float]:
    m = re.search(label + r" within a relative L2 error of ([0-9.e-]+) for the output and "
                  r"([0-9.e-]+) for the gradients", doc)
    assert m, f"no {label} precision sentence in compileops.mlstm's docstring"
    return float(m.group(1)), float(m.group(2))


def test_docstring_states_the_tested_bounds():
    doc = " ".join(compileops.mlstm.__doc__.split())
    assert _docstring_bound(doc, "bf16") == (OUT_TOL[torch.bfloat16], GRAD_TOL[torch.bfloat16])
    assert _docstring_bound(doc, "fp16") == (OUT_TOL[torch.float16], GRAD_TOL[torch.float16])
    assert "fp64 and fp32 (IEEE dots) within 1e-5 relative" in doc
    assert OUT_TOL[torch.float32] == GRAD_TOL[torch.float32] == 1e-5


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("dtype,normed", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-normed", "bf16-raw"])
def test_bitwise_deterministic(dtype, normed):
    x = make_inputs(1, 1, 40, 16, 32, dtype=dtype, weight=normed, bias=normed).leaves()
    with compileops.use_backend("triton"):
        assert_deterministic(lambda *a: op_out(Inputs(*a)), x.tensors(), runs=2)


# --------------------------------------------------------------------------- batch invariance


def _fw_bw_rows(weight, bias, **kwargs):
    """``(q, k, v, igate, fgate, grad_out) -> (out, dq, dk, dv, digate, dfgate)``, every one
    carrying the batch on dim 0 (the norm's parameter gradients sum over the batch)."""

    def fn(q, k, v, igate, fgate, grad_out):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, igate, fgate)]
        out = compileops.mlstm(*leaves, norm_weight=weight, norm_bias=bias, **kwargs)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))

    return fn


# NH * S = 32 per batch row on CPU, a whole number of ATen's vector steps: the backward's
# host-side torch.exp2 (the normaliser's floor exp(-m), op.normaliser_terms) runs ATen's
# vectorised exp2 in the body of a CPU loop and the scalar one in its 16-element tail, which
# differ in the last bit, so a row's bits would depend on where the batch puts it (found
# here with NH * S = 40). CUDA's elementwise kernels have no such tail: test_gpu.py runs
# ragged shapes.
@pytest.mark.parametrize("dtype,normed", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-normed", "bf16-raw"])
def test_bitwise_batch_invariant(dtype, normed):
    """A row of a batch gets the same output and input gradients (bitwise) whether it runs
    alone, sliced out, padded or after other rows."""
    x = make_inputs(2, 2, 16, 16, 8, dtype=dtype, weight=normed, bias=normed, seed=4)
    grad = cotangent(out_shape(x), dtype)
    with compileops.use_backend("triton"):
        assert_batch_invariant(_fw_bw_rows(x.norm_weight, x.norm_bias),
                               [x.q, x.k, x.v, x.igate, x.fgate, grad])


def test_a_row_alone_equals_the_row_in_a_batch():
    """The plainest form, on both backends: row 1 of B=3 against B=1."""
    x = make_inputs(3, 2, 16, 16, 16, dtype=torch.float32, seed=6)
    grad = cotangent(out_shape(x), torch.float32)
    for backend in BACKENDS:
        with compileops.use_backend(backend):
            fn = _fw_bw_rows(x.norm_weight, x.norm_bias)
            full = fn(x.q, x.k, x.v, x.igate, x.fgate, grad)
            alone = fn(x.q[1:2], x.k[1:2], x.v[1:2], x.igate[1:2], x.fgate[1:2], grad[1:2])
        for i, (a, f) in enumerate(zip(alone, full)):
            assert torch.equal(a, f[1:2]), (backend, i)


# --------------------------------------------------------------------------- strided inputs


def _strided_fw_bw(x: Inputs, grad: torch.Tensor):
    """The op on the same values in other layouts, gradients taken at those views: q from
    ``[B, S, NH, D]`` transposed, k with column stride 2, v permuted from ``[S, B, NH, DV]``
    with a storage offset, the gates transposed from ``[B, S, NH]`` / strided in a wider
    tensor, the output gradient transposed."""
    b, nh, s, dqk = x.q.shape
    dv = x.v.shape[-1]
    q_base = x.q.transpose(1, 2).contiguous().requires_grad_(True)  # [B, S, NH, D]
    k_base = torch.zeros(b, nh, s, 2 * dqk, dtype=x.k.dtype)
    k_base[..., ::2] = x.k
    v_base = torch.zeros(s + 1, b, nh, dv, dtype=x.v.dtype)
    v_base[1:] = x.v.permute(2, 0, 1, 3)
    i_base = x.igate.transpose(1, 2).contiguous()  # [B, S, NH]
    f_base = torch.zeros(b, nh, s, 3, dtype=x.fgate.dtype)
    f_base[..., 1] = x.fgate
    bases = [t.requires_grad_(True) for t in (k_base, v_base, i_base, f_base)]
    views = Inputs(q_base.transpose(1, 2), bases[0][..., ::2], bases[1][1:].permute(1, 2, 0, 3),
                   bases[2].transpose(1, 2), bases[3][..., 1],
                   *[None if p is None else p.detach().clone().requires_grad_(True)
                     for p in (x.norm_weight, x.norm_bias)])
    assert not any(t.is_contiguous() for t in views.tensors()[:5])
    assert views.v.storage_offset() > 0 and views.k.stride(-1) == 2
    g = grad.transpose(0, 1).contiguous().transpose(0, 1)
    assert not g.is_contiguous()
    out = op_out(views)
    return out.detach(), list(torch.autograd.grad(out, views.tensors(), g))


@pytest.mark.parametrize("dtype,normed", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-normed", "bf16-raw"])
def test_strided_inputs_equal_contiguous_bitwise(dtype, normed):
    x = make_inputs(2, 2, 9, 16, 8, dtype=dtype, weight=normed, bias=normed, seed=8)
    grad = cotangent(out_shape(x), dtype)
    with compileops.use_backend("triton"):
        want_out, want = fw_bw(op_out, x, grad)
        got_out, got = _strided_fw_bw(x, grad)
    assert torch.equal(got_out, want_out)
    for name, g, w in zip(x.names(), got, want):
        assert torch.equal(g, w), name


def test_strided_norm_weight_and_bias():
    x = make_inputs(1, 2, 9, 16, 16, seed=9)
    grad = cotangent(out_shape(x), torch.float64)
    wide = torch.zeros(2 * x.norm_weight.numel(), dtype=torch.float64)
    wide[::2] = x.norm_weight
    biases = torch.zeros(2 * x.norm_bias.numel(), dtype=torch.float64)
    biases[1::2] = x.norm_bias
    wide.requires_grad_(True), biases.requires_grad_(True)
    with compileops.use_backend("triton"):
        want_out, want = fw_bw(op_out, x, grad)
        leaves = x.leaves()
        leaves.norm_weight, leaves.norm_bias = wide[::2], biases[1::2]
        got_out = op_out(leaves)
        got = torch.autograd.grad(got_out, leaves.tensors(), grad)
    torch.testing.assert_close(got_out, want_out, rtol=1e-12, atol=1e-12)
    for name, g, w in zip(x.names(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


def test_expanded_output_gradient():
    """``out.sum().backward()`` hands the backward a stride-0 gradient."""
    x = make_inputs(1, 2, 18, 16, 8, weight=False, bias=False, seed=10)
    with compileops.use_backend("triton"):
        got_out, got = fw_bw(op_out, x, loss=lambda out: out.sum())
    want_out, want = fw_bw(reference_out, x, loss=lambda out: out.sum())
    for name, g, w in zip(x.names(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


# --------------------------------------------------------------------------- head dims, sizes


@pytest.mark.parametrize("dqk,dv", [(64, 64), (64, 128), (128, 64), (128, 128), (256, 256),
                                    (48, 80), (4, 12)])
def test_head_dims_fp32(dqk, dv):
    """fp32 vs the fp64 reference, forward and every gradient, within 1e-5 (IEEE dots)."""
    x = make_inputs(1, 1, 20, dqk, dv, seed=dqk + dv)
    check_precision(x, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 2, 0, 16, 8), (0, 2, 5, 16, 8), (0, 0, 0, 16, 8)],
                         ids=["S0", "B0", "all0"])
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_empty(backend, shape, normed):
    x = make_inputs(*shape, dtype=torch.float32, weight=normed, bias=normed)
    grad = torch.zeros(out_shape(x))
    with compileops.use_backend(backend):
        out, grads = fw_bw(op_out, x, grad)
        _, n, m = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate,
                                              norm_weight=x.norm_weight, norm_bias=x.norm_bias)
    assert out.shape == out_shape(x) and n.shape == m.shape == x.q.shape[:3]
    for name, g, t in zip(x.names(), grads, x.tensors()):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert torch.equal(g, torch.zeros_like(t)), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_single_step(backend, normed):
    """S = 1: ``m_0 = igate_0``, ``n_0 = max(|q.k| / sqrt(DQK), exp(-igate_0))``; output and
    gradients as the fp64 reference's."""
    x = make_inputs(1, 2, 1, 16, 8, weight=normed, bias=normed, seed=12)
    grad = cotangent(out_shape(x), torch.float64)
    want_out, want = fw_bw(reference_out, x, grad)
    with compileops.use_backend(backend):
        got_out, got = fw_bw(op_out, x, grad)
        _, n, m = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate)
    torch.testing.assert_close(got_out, want_out, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(x.names(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(m, x.igate, rtol=1e-14, atol=1e-14)
    score = (x.q * x.k).sum(-1) / 4.0
    torch.testing.assert_close(n, torch.maximum(score.abs(), torch.exp(-x.igate)), rtol=1e-12,
                               atol=1e-14)


# --------------------------------------------------------------------------- inputs untouched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_inputs_not_modified(backend, normed):
    x = make_inputs(1, 2, 9, 16, 8, dtype=torch.float32, weight=normed, bias=normed, seed=13)
    leaves = x.leaves()
    before = [t.detach().clone() for t in leaves.tensors()]
    grad = cotangent(out_shape(x), torch.float32)
    grad_before = grad.clone()
    with compileops.use_backend(backend):
        out = op_out(leaves)
        torch.autograd.grad(out, leaves.tensors(), grad)
        # The ops directly: the backward's saved inputs and its gradient too.
        acc_igate = x.igate.clone()
        logf = torch.cumsum(torch.nn.functional.logsigmoid(x.fgate), -1)
        op_inputs = [x.q, x.k, x.v, acc_igate, logf]
        op_before = [t.clone() for t in op_inputs]
        fw = torch.ops.compileops.mlstm_parallel(*op_inputs, x.norm_weight, x.norm_bias,
                                                 normed, 1e-6, 1e-6, False, True)
        fw_before = [t.clone() for t in fw]
        torch.ops.compileops.mlstm_parallel_backward(
            grad, *op_inputs, x.norm_weight, fw[1] if normed else fw[0], fw[2], fw[3], normed,
            1e-6, 1e-6, False)
    for t, b in zip(leaves.tensors(), before):
        assert torch.equal(t, b)
    for t, b in zip(op_inputs + list(fw), op_before + fw_before):
        assert torch.equal(t, b)
    assert torch.equal(grad, grad_before)


# --------------------------------------------------------------------------- norm preprocess


def test_norm_rows_per_program():
    """The span of rows a norm-preprocess program walks: whole tiles of ``block_rows``, about
    ``norm_programs`` programs in all, never fewer than one tile each."""
    from compileops.mlstm.kernels import BackwardConfig, norm_rows_per_program

    cfg = BackwardConfig(block_rows=8, norm_programs=8192)
    assert norm_rows_per_program(1024, 1024, cfg) == 128  # 8 programs per head
    assert norm_rows_per_program(65536, 1024, cfg) == 1024  # the heads alone fill the grid
    assert norm_rows_per_program(64, 1024, cfg) == 8  # one tile per program
    assert norm_rows_per_program(1, 100, cfg) == 8  # 13 programs, the last ragged
    assert norm_rows_per_program(3, 1000, BackwardConfig(block_rows=8, norm_programs=1)) == 1000
    assert norm_rows_per_program(2, 0, cfg) == 8


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_norm_preprocess_span_changes_no_row(normed):
    """One program walking all of a head's rows and one program per tile give bitwise the same
    per-row outputs (dh, r, beta, dm), and the same weight and bias gradients up to the order
    of their sums."""
    from compileops.mlstm import kernels

    gen = torch.Generator().manual_seed(11)
    b, nh, s, dv = 2, 3, 45, 32
    h = torch.randn(b, nh, s, dv, generator=gen, dtype=torch.float64)
    grad = torch.randn(b, s, nh * dv, generator=gen, dtype=torch.float64)
    if not normed:
        grad = grad.view(b, s, nh, dv).transpose(1, 2)
    weight = torch.randn(nh * dv, generator=gen, dtype=torch.float64) if normed else None
    m_log2 = torch.randn(b, nh, s, generator=gen, dtype=torch.float64)
    row_sum = torch.randn(b, nh, s, generator=gen, dtype=torch.float64)
    grad_before = grad.clone()

    def run(norm_programs):
        cfg = kernels.BackwardConfig(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                     block_rows=16, norm_warps=1, norm_programs=norm_programs)
        return kernels.norm_backward(grad, h, weight, m_log2, row_sum, normed, 1e-5, 1e-6,
                                     False, cfg)

    walked, tiled = run(1), run(10_000)
    for name, got, want in zip(("dh", "r", "beta", "dm"), walked[:4], tiled[:4]):
        assert torch.equal(got, want), name
    if normed:
        assert walked[4].shape[0] == 1 and tiled[4].shape[0] == 3
        for got, want in zip(walked[4:], tiled[4:]):
            torch.testing.assert_close(got.sum((0, 1)), want.sum((0, 1)), rtol=1e-12, atol=1e-12)
    assert torch.equal(grad, grad_before)
