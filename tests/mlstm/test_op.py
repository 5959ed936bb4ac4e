"""The mLSTM ops eagerly: ``torch.library.opcheck`` of ``compileops::mlstm_parallel`` and
``compileops::mlstm_parallel_backward`` on both backends, gradient dtypes, and bad input:
each error names the argument, eagerly and under ``torch.compile(fullgraph=True)``."""
import pytest
import torch
import torch.nn.functional as F

import compileops
from compileops import use_backend
from tests.mlstm._helpers import BACKENDS, cotangent, make_inputs, out_shape

forward_op = torch.ops.compileops.mlstm_parallel.default
backward_op = torch.ops.compileops.mlstm_parallel_backward.default


def _op_inputs(normed=True, dtype=torch.float32, requires_grad=False, seed=0):
    """The op's tensor inputs: q, k, v, igate and ``logf = cumsum(log sigmoid(fgate))`` (the
    gates in the accumulation dtype), norm weight and bias (or None)."""
    x = make_inputs(1, 2, 17, 8, 12, dtype=dtype, weight=normed, bias=normed, seed=seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    logf = torch.cumsum(F.logsigmoid(x.fgate.to(acc)), dim=-1)
    tensors = [x.q, x.k, x.v, x.igate.to(acc), logf, x.norm_weight, x.norm_bias]
    if requires_grad:
        tensors = [None if t is None else t.detach().requires_grad_(True) for t in tensors]
    return tensors


# --------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normed,save_h,grad", [(True, True, True), (True, False, False),
                                                (False, False, True), (False, True, False)],
                         ids=["normed-save_h", "normed-no-grad", "raw", "raw-save_h"])
def test_opcheck_forward(backend, normed, save_h, grad):
    args = (*_op_inputs(normed, requires_grad=grad), normed, 1e-6, 1e-6, False, save_h)
    with use_backend(backend):
        torch.library.opcheck(forward_op, args)


def test_opcheck_forward_residual_weight_bias_only_fp64():
    q, k, v, igate, logf, weight, bias = _op_inputs(True, torch.float64, requires_grad=True)
    with use_backend("triton"):
        torch.library.opcheck(forward_op, (q, k, v, igate, logf, weight, None, True, 1e-5, 0.0,
                                           True, True))
        torch.library.opcheck(forward_op, (q, k, v, igate, logf, None, bias, True, 1e-6, 1e-6,
                                           False, True))


# The reference backward is plain torch (it once ran torch.func.vjp inside the op, which
# broke under TorchDispatchModes: opcheck, FlopCounterMode).
BACKWARD_BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
def test_opcheck_backward(backend, normed):
    q, k, v, igate, logf, weight, bias = _op_inputs(normed)
    with use_backend(backend):
        out, h, m, b = forward_op(q, k, v, igate, logf, weight, bias, normed, 1e-6, 1e-6, False,
                                  True)
        grad = cotangent(out.shape, out.dtype)
        torch.library.opcheck(backward_op, (grad, q, k, v, igate, logf, weight,
                                            h if normed else out, m, b, normed, 1e-6, 1e-6,
                                            False))


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_backward_under_flop_counter_mode(backend):
    from torch.utils.flop_counter import FlopCounterMode

    x = make_inputs(1, 2, 17, 8, 12, dtype=torch.float32, seed=3).leaves()
    with use_backend(backend):
        out = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight)
        with FlopCounterMode(display=False):
            out.sum().backward()
    assert x.q.grad is not None


def test_forward_op_outputs():
    q, k, v, igate, logf, weight, bias = _op_inputs(True)
    for backend in BACKENDS:
        with use_backend(backend):
            out, h, m, b = forward_op(q, k, v, igate, logf, weight, bias, True, 1e-6, 1e-6,
                                      False, True)
            assert out.shape == (1, 17, 24) and h.shape == v.shape and h.dtype == v.dtype
            assert m.shape == b.shape == (1, 2, 17) and m.dtype == b.dtype == torch.float32
            _, h0, _, _ = forward_op(q, k, v, igate, logf, weight, bias, True, 1e-6, 1e-6,
                                     False, False)
            assert h0.numel() == 0


def test_save_h_false_with_a_gradient_needed_raises():
    q, k, v, igate, logf, weight, bias = _op_inputs(True, requires_grad=True)
    out, _, _, _ = forward_op(q, k, v, igate, logf, weight, bias, True, 1e-6, 1e-6, False,
                              False)
    with pytest.raises(RuntimeError, match="save_h=False"):
        out.sum().backward()


def test_stats_carry_no_gradient():
    x = make_inputs(1, 1, 9, 8, 8, dtype=torch.float32).leaves()
    out, n, m = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate,
                                            norm_weight=x.norm_weight)
    assert out.requires_grad and not n.requires_grad and not m.requires_grad
    assert n.dtype == m.dtype == torch.float32


# --------------------------------------------------------------------------- gradient dtypes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gradients_come_in_each_inputs_dtype(backend, gate_dtype):
    x = make_inputs(1, 2, 18, 8, 8, dtype=torch.bfloat16, weight=True, bias=False)
    x.igate, x.fgate = x.igate.to(gate_dtype), x.fgate.to(gate_dtype)
    x.norm_weight = x.norm_weight.float()  # an fp32 parameter with bf16 activations
    leaves = x.leaves()
    with use_backend(backend):
        out = compileops.mlstm(leaves.q, leaves.k, leaves.v, leaves.igate, leaves.fgate,
                               norm_weight=leaves.norm_weight)
        grads = torch.autograd.grad(out, leaves.tensors(), torch.ones_like(out))
    assert out.dtype == torch.bfloat16
    for t, g in zip(leaves.tensors(), grads):
        assert g.dtype == t.dtype and g.shape == t.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_bias_gradient_is_not_rounded_to_bf16(backend):
    x = make_inputs(1, 2, 20, 16, 16, dtype=torch.bfloat16, seed=2)
    bias = x.norm_bias.float().requires_grad_(True)
    weight = x.norm_weight.float().requires_grad_(True)
    grad = cotangent(out_shape(x), torch.bfloat16)
    with use_backend(backend):
        out = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=weight,
                               norm_bias=bias)
        dweight, dbias = torch.autograd.grad(out, [weight, bias], grad)
    # dbias = the output gradient summed over B and S, in fp32.
    torch.testing.assert_close(dbias, grad.float().sum(dim=(0, 1)), rtol=1e-6, atol=1e-5)


# --------------------------------------------------------------------------- bad input


def _good():
    x = make_inputs(2, 2, 6, 8, 4, dtype=torch.float32)
    return dict(q=x.q, k=x.k, v=x.v, igate=x.igate, fgate=x.fgate, norm_weight=x.norm_weight,
                norm_bias=x.norm_bias)


def _with(**changes):
    def make():
        args = _good()
        for name, fn in changes.items():
            args[name] = fn(args[name])
        return args

    return make


BAD = [
    ("q 3-D", _with(q=lambda t: t[0]), r"q must be 4-D"),
    ("k shape", _with(k=lambda t: t[:, :, :5]), r"k must have q's shape"),
    ("v shape", _with(v=lambda t: t[:, :1]), r"v must be \[B, NH, S, DV\]"),
    ("igate shape", _with(igate=lambda t: t[..., :5]), r"igate must be \[B, NH, S\]"),
    ("fgate shape", _with(fgate=lambda t: t[..., None]), r"fgate must be \[B, NH, S\]"),
    ("norm_weight length", _with(norm_weight=lambda t: t[:-1]),
     r"norm_weight must be \[NH \* DV\] = \[8\]"),
    ("norm_bias length", _with(norm_bias=lambda t: torch.cat([t, t])),
     r"norm_bias must be \[NH \* DV\] = \[8\]"),
    ("norm_weight 2-D", _with(norm_weight=lambda t: t.reshape(2, 4)), r"norm_weight must be"),
    ("int q", _with(q=lambda t: t.long()), r"q must be bf16, fp16, fp32 or fp64"),
    ("int v", _with(v=lambda t: t.int()), r"v must be bf16, fp16, fp32 or fp64"),
    ("int igate", _with(igate=lambda t: t.long()), r"igate must be floating point"),
    ("int fgate", _with(fgate=lambda t: t.int()), r"fgate must be floating point"),
    ("int norm_weight", _with(norm_weight=lambda t: t.long()),
     r"norm_weight must be floating point"),
    ("mixed dtypes", _with(k=lambda t: t.double()), r"q, k and v must share one dtype"),
    ("device mismatch k", _with(k=lambda t: t.to("meta")), r"k is on meta but q is on cpu"),
    ("device mismatch fgate", _with(fgate=lambda t: t.to("meta")),
     r"fgate is on meta but q is on cpu"),
    ("device mismatch norm_bias", _with(norm_bias=lambda t: t.to("meta")),
     r"norm_bias is on meta but q is on cpu"),
]
BAD_SCALARS = [
    ("negative eps", dict(eps=-1e-3), r"eps must be >= 0"),
    ("zero norm_eps", dict(norm_eps=0.0), r"norm_eps must be > 0"),
]


def _call(args, **kwargs):
    return compileops.mlstm(args["q"], args["k"], args["v"], args["igate"], args["fgate"],
                            norm_weight=args["norm_weight"], norm_bias=args["norm_bias"],
                            **kwargs)


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_eager(case):
    _, make, message = case
    with pytest.raises((RuntimeError, TypeError, ValueError), match=message):
        _call(make())


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_at_trace_time(case):
    _, make, message = case
    compiled = torch.compile(lambda a: _call(a), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(make())


@pytest.mark.parametrize("case", BAD_SCALARS, ids=[c[0] for c in BAD_SCALARS])
def test_bad_scalars(case):
    _, kwargs, message = case
    with pytest.raises(RuntimeError, match=message):
        _call(_good(), **kwargs)
    compiled = torch.compile(lambda a: _call(a, **kwargs), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(_good())


def test_unknown_kernel_raises_value_error():
    with pytest.raises(ValueError, match="kernel must be one of .*'chunkwise'.*got 'flash'"):
        _call(_good(), kernel="flash")
    with pytest.raises(ValueError, match="kernel must be one of"):
        compileops.mlstm_with_stats(*[_good()[n] for n in ("q", "k", "v", "igate", "fgate")],
                                    kernel="flash")
    compiled = torch.compile(lambda a: _call(a, kernel="flash"), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="kernel must be one of"):
        compiled(_good())
    _call(_good(), kernel="parallel")


def test_head_dim_past_the_kernels_limit_names_the_reference_backend():
    """DQK past the limit (DV past it runs in slices: test_head_dims.py)."""
    x = make_inputs(1, 1, 5, 272, 8, dtype=torch.float32, weight=False, bias=False)
    args = dict(q=x.q, k=x.k, v=x.v, igate=x.igate, fgate=x.fgate, norm_weight=None,
                norm_bias=None)
    message = r"head dims up to 256.*use_backend\('reference'\)"
    with use_backend("triton"):
        with pytest.raises(RuntimeError, match=message):
            _call(args)
        compiled = torch.compile(lambda a: _call(a), backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception, match=message):
            compiled(args)
    with use_backend("reference"):
        assert _call(args).shape == (1, 1, 5, x.v.shape[-1])


def test_bad_backward_gradient_shape():
    q, k, v, igate, logf, weight, bias = _op_inputs(True)
    out, h, m, b = forward_op(q, k, v, igate, logf, weight, bias, True, 1e-6, 1e-6, False, True)
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \(1, 17, 24\)"):
        backward_op(out[:, :5], q, k, v, igate, logf, weight, h, m, b, True, 1e-6, 1e-6, False)


def test_op_rejects_gates_outside_the_accumulation_dtype():
    q, k, v, igate, logf, weight, bias = _op_inputs(True)
    with pytest.raises(RuntimeError, match="logf must be torch.float32"):
        forward_op(q, k, v, igate, logf.double(), weight, bias, True, 1e-6, 1e-6, False, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_stabiliser_shares_with_the_kernels_running_sum(dtype):
    """The Triton backend's stabiliser shares take a per-row running sum (a fixed order per
    row, where ``torch.cumsum`` on CUDA picks its scan by the row count): the same shares as
    with ``torch.cumsum``, and a row's shares bitwise the same in any batch."""
    from compileops.mlstm.kernels import gates
    from compileops.mlstm.op import stabiliser_column_grad

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(5, 3, 1500, generator=gen, dtype=dtype).cumsum(-1)  # long runs
    dm = torch.randn(5, 3, 1500, generator=gen, dtype=dtype)
    want = stabiliser_column_grad(keys, dm)
    got = stabiliser_column_grad(keys, dm, gates.running_sum)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 if dtype == torch.float32 else 1e-10)
    alone = stabiliser_column_grad(keys[2:3], dm[2:3], gates.running_sum)
    assert torch.equal(alone, got[2:3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stabiliser_shares_are_batch_invariant():
    from compileops.mlstm.kernels import gates
    from compileops.mlstm.op import stabiliser_column_grad

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(21, 333, generator=gen).cumsum(-1).cuda()
    dm = torch.randn(21, 333, generator=gen).cuda()
    full = stabiliser_column_grad(keys, dm, gates.running_sum)
    for rows in (slice(0, 12), slice(9, 10), slice(5, 21)):
        assert torch.equal(stabiliser_column_grad(keys[rows], dm[rows], gates.running_sum),
                           full[rows])
