"""Property fuzzing of the mLSTM: ``compileops.mlstm`` on both backends against an
fp64 oracle written here (the parallel formula, not ``compileops/mlstm/reference.py``),
forward and backward, for drawn sizes (from 0), dtypes, layouts, norm options and eps; and
no input (or memory around it) is written. Shared strategies: ``tests/fuzzing.py``."""
import math

import hypothesis.strategies as st
import torch
from hypothesis import given

import compileops
from tests.fuzzing import Example, assert_normwise, float_dtypes, gpu_variant, oracle_grads, use

# Normwise relative error allowed against the fp64 oracle, per input dtype. The cell divides
# by a normaliser and the norm by a standard deviation, so low-precision inputs lose more
# than one rounding; fp32 runs IEEE dots under the interpreter.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 8e-2,
             torch.float16: 2e-2}


def oracle_mlstm(q, k, v, igate, fgate, weight, bias, eps, norm_eps, residual, normed):
    """fp64: the stabilised parallel mLSTM, then (``normed``) the per-head layernorm over DV
    with the affine, laid out ``[B, S, NH * DV]``; raw ``[B, NH, S, DV]`` otherwise."""
    b, nh, s, dqk = q.shape
    dv = v.shape[-1]
    if s == 0:
        h = v * 0
    else:
        log_f = torch.cumsum(torch.nn.functional.logsigmoid(fgate), dim=-1)
        log_d = log_f[..., :, None] - log_f[..., None, :] + igate[..., None, :]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        log_d = log_d.masked_fill(~mask, -math.inf)
        m = log_d.max(dim=-1).values
        c = (q @ k.transpose(-1, -2)) / math.sqrt(dqk) * torch.exp(log_d - m[..., None])
        n = torch.maximum(c.sum(-1).abs(), torch.exp(-m))
        h = (c @ v) / (n[..., None] + eps)
    if not normed:
        return h
    mean = h.mean(-1, keepdim=True)
    y = (h - mean) / torch.sqrt((h - mean).square().mean(-1, keepdim=True) + norm_eps)
    y = y.transpose(1, 2).reshape(b, s, nh * dv)
    if weight is not None:
        y = y * ((1 + weight) if residual else weight)
    if bias is not None:
        y = y + bias
    return y


def check_gradient(got, want, overall: float, tol: float, what: str) -> None:
    """``||got - want|| <= tol * max(||want||, overall / 10)``: normwise, with a floor at the
    whole gradient's size. Some gradients are small only through cancellation (at S=1 the
    cell's output does not depend on q except through eps; a diagonal dlogD term enters
    dfgate twice with opposite signs), and in low precision their residue is a rounding of the
    cancelling terms, not of the small result."""
    want = want.detach().double()
    diff = float(torch.linalg.vector_norm(got.detach().cpu().double() - want))
    bound = tol * max(float(torch.linalg.vector_norm(want)), overall / 10)
    assert bool(torch.isfinite(got).all()), f"{what} is not finite"
    assert diff <= bound, f"{what}: error {diff:.3e} above {bound:.3e}"


def check_mlstm(data, device) -> None:
    ex = Example(data, device)
    batch, heads = ex.size("B", 2), ex.size("NH", 2, min_value=1)
    seq = ex.size("S", 19)
    dqk, dv = ex.size("DQK", 9, min_value=1), ex.size("DV", 9, min_value=1)
    dtype = ex.draw(float_dtypes(), "dtype")
    normed = ex.draw(st.booleans(), "normed")
    if normed:
        dv = max(dv, 4)  # a norm over one or two values is too ill-conditioned to compare
    with_weight = normed and ex.draw(st.booleans(), "weight")
    with_bias = normed and (not with_weight or ex.draw(st.booleans(), "bias"))
    residual = with_weight and ex.draw(st.booleans(), "residual_weight")
    eps = ex.draw(st.sampled_from([0.0, 1e-6, 1e-3]), "eps")
    q = ex.floats("q", (batch, heads, seq, dqk), dtype)
    k = ex.floats("k", (batch, heads, seq, dqk), dtype)
    v = ex.floats("v", (batch, heads, seq, dv), dtype)
    igate = ex.floats("igate", (batch, heads, seq), dtype)
    fgate = ex.uniform("fgate", (batch, heads, seq), dtype, -2.0, 6.0)
    weight = ex.floats("weight", (heads * dv,), dtype, scale=0.5) if with_weight else None
    bias = ex.floats("bias", (heads * dv,), dtype) if with_bias else None
    out_shape = (batch, seq, heads * dv) if normed else (batch, heads, seq, dv)
    grad_out = ex.floats("grad_out", out_shape, dtype)
    snapshot = ex.snapshot(grad_out=grad_out)

    named = {"q": q, "k": k, "v": v, "igate": igate, "fgate": fgate, "weight": weight,
             "bias": bias}
    leaves = {n: t.detach().cpu().double().requires_grad_() for n, t in named.items()
              if t is not None}
    want = oracle_mlstm(*(leaves.get(n) for n in named), eps, 1e-6, residual, normed)
    want_grads = dict(zip(leaves, oracle_grads(want, list(leaves.values()), grad_out)))

    for backend in ex.backends():
        if backend == "triton" and dtype == torch.float64 and not ex.on_cpu:
            continue  # fp64 on the GPU kernels is not a supported configuration
        args = {n: t.detach().requires_grad_() if t is not None else None
                for n, t in named.items()}
        with use(backend):
            out = compileops.mlstm(args["q"], args["k"], args["v"], args["igate"],
                                   args["fgate"], norm_weight=args["weight"],
                                   norm_bias=args["bias"], eps=eps,
                                   residual_weight=residual)
            snapshot.check(f"{backend} forward")
            assert out.shape == out_shape and out.dtype == dtype
            assert_normwise(out, want, TOLERANCE[dtype], f"{backend} out")
            if out.numel():
                grads = torch.autograd.grad(out, [args[n] for n in leaves], grad_out)
                snapshot.check(f"{backend} backward")
                overall = math.sqrt(sum(float(torch.linalg.vector_norm(g.double())) ** 2
                                        for g in want_grads.values()))
                for name, got in zip(leaves, grads):
                    assert got.dtype == named[name].dtype, f"{backend} d{name} dtype"
                    check_gradient(got, want_grads[name], overall, TOLERANCE[dtype],
                                   f"{backend} d{name}")


@given(data=st.data())
def test_mlstm(data):
    check_mlstm(data, "cpu")


@gpu_variant
@given(data=st.data())
def test_mlstm_gpu(data, device):
    check_mlstm(data, device)
