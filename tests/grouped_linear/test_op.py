"""grouped_linear ops: parity with the fp64 reference (eager Triton kernels under the
interpreter on CPU), edge cases, errors, determinism, batch invariance, routing helpers,
module. Kernel-level tests: test_kernels.py (M-jagged), test_kernels_wgrad.py (dW);
argument checks: test_checks.py."""
import pytest
import torch

import compileops
from compileops.grouped_linear import permute_by_expert, reference, unpermute_and_combine
from compileops.testing import (
    assert_batch_invariant,
    assert_close_to_reference,
    assert_deterministic,
)
from tests.grouped_linear._helpers import TOL, grads_fp64, offsets_of
from tests.grouped_linear._helpers import make_grouped as make


def fw_bw_checked_fp64(x, w, offs, b, ref=None):
    """grouped_linear forward and backward (a random incoming grad) on ``x, w, offs, b``, its
    output and the grads of x, w, b checked against fp64 autograd on ``ref`` (the same
    values; default: these tensors). Returns the output."""
    for t in (x, w, b):
        t.requires_grad_()
    y = compileops.grouped_linear(x, w, offs, b)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref, dx_ref, dw_ref, db_ref = grads_fp64(*(ref or (x, w, offs, b)), grad)
    for got, want, what in ((y, y_ref, "y"), (x.grad, dx_ref, "dX"), (w.grad, dw_ref, "dW"),
                            (b.grad, db_ref, "db")):
        assert_close_to_reference(got, want, max_relative_error=1e-5, what=what)
    return y


@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 0, 33, 0], [1, 2, 3, 40], [0, 0, 0, 0]],
                         ids=["mixed", "one-group", "skewed", "all-empty"])
def test_forward_backward_match_fp64(sizes):
    x, w, offs, b = make(sizes, k=24, n=20, extra_rows=3)
    y = fw_bw_checked_fp64(x, w, offs, b)
    tail = offs[-1].item()
    assert torch.equal(y[tail:], torch.zeros_like(y[tail:])), "rows past offsets[-1] must be 0"
    assert torch.equal(x.grad[tail:], torch.zeros_like(x.grad[tail:]))
    for g, size in enumerate(sizes):
        if size == 0:  # empty group: exactly zero dW_g and db_g
            assert torch.equal(w.grad[g], torch.zeros_like(w.grad[g]))
            assert torch.equal(b.grad[g], torch.zeros_like(b.grad[g]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_forward_and_grads(dtype):
    x, w, offs, b = make([7, 0, 21], k=40, n=24, dtype=dtype, extra_rows=2)
    for t in (x, w, b):
        t.requires_grad_()
    y = compileops.grouped_linear(x, w, offs, b)
    assert y.dtype == dtype
    grad = torch.randn(y.shape).to(dtype)
    y.backward(grad)
    y_ref, dx_ref, dw_ref, db_ref = grads_fp64(x, w, offs, b, grad)
    # Compare in fp32 terms: the interpreter truncates fp32 -> bf16 casts.
    tol = TOL[dtype]
    assert_close_to_reference(y.float(), y_ref, max_relative_error=tol, what="y")
    assert_close_to_reference(x.grad.float(), dx_ref, max_relative_error=tol, what="dX")
    assert_close_to_reference(w.grad.float(), dw_ref, max_relative_error=tol, what="dW")
    assert_close_to_reference(b.grad.float(), db_ref, max_relative_error=tol, what="db")


def test_no_bias_and_m_splits_variant():
    x, w, offs, _ = make([3, 9, 4], k=16, n=8, bias=False)
    y = compileops.grouped_linear_splits(x, w, torch.tensor([3, 9, 4]))
    assert_close_to_reference(y, reference.grouped_linear_forward(x.double(), w.double(), offs),
                              max_relative_error=1e-5)


def test_m_zero():
    x, w, offs, b = make([0, 0], k=8, n=8)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = compileops.grouped_linear(x, w, offs, b)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8)
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_stride0_and_noncontiguous_grad():
    x, w, offs, b = make([6, 10, 0, 5], k=16, n=12)
    for t in (x, w, b):
        t.requires_grad_()
    compileops.grouped_linear(x, w, offs, b).sum().backward()  # stride-0 incoming grad
    _, dx_ref, dw_ref, db_ref = grads_fp64(x, w, offs, b, torch.ones(21, 12))
    assert_close_to_reference(x.grad, dx_ref, max_relative_error=1e-5)
    assert_close_to_reference(w.grad, dw_ref, max_relative_error=1e-5)
    assert_close_to_reference(b.grad, db_ref, max_relative_error=1e-5)
    grad_t = torch.randn(12, 21).t()  # non-contiguous
    dx = torch.ops.compileops.grouped_linear_dx(grad_t, w.detach(), offs)
    assert_close_to_reference(dx, reference.grouped_linear_dx(grad_t.double(), w.double(), offs),
                              max_relative_error=1e-5)


def test_strided_offsets_and_operands_fw_bw():
    """Offsets as a stride-2 view, x as a transposed view, weight and bias as strided views:
    forward, dX, dW and db match fp64 (the kernels read offsets[g] at a unit stride, so the
    launchers make them dense)."""
    x, w, offs, b = make([6, 0, 10, 5], k=16, n=12, extra_rows=2)
    offs_view = torch.stack([offs, torch.full_like(offs, 10**6)], 1).reshape(-1)[::2]
    x_view = x.t().contiguous().t()
    w_view = w.transpose(1, 2).contiguous().transpose(1, 2)
    b_view = torch.stack([b, b + 100], 2)[..., 0]
    assert not (offs_view.is_contiguous() or x_view.is_contiguous()
                or w_view.is_contiguous() or b_view.is_contiguous())
    fw_bw_checked_fp64(x_view, w_view, offs_view, b_view, ref=(x, w, offs, b))


def test_swiglu_matches_reference_fw_bw():
    x, w, offs, b = make([4, 0, 13], k=16, n=24, extra_rows=2)
    for t in (x, w, b):
        t.requires_grad_()
    out = compileops.grouped_linear_swiglu(x, w, offs, b)
    assert out.shape == (19, 12)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = reference.swiglu(reference.grouped_linear_forward(leaves[0], leaves[1], offs, leaves[2]))
    ref.backward(grad.double())
    assert_close_to_reference(out, ref, max_relative_error=1e-5)
    for got, exp in zip((x.grad, w.grad, b.grad), leaves):
        assert_close_to_reference(got, exp.grad, max_relative_error=1e-5)


def test_opcheck():
    x, w, offs, b = make([3, 0, 6], k=8, n=8, extra_rows=1)
    args = (x.requires_grad_(), w.requires_grad_(), offs, b.requires_grad_())
    torch.library.opcheck(torch.ops.compileops.grouped_linear.default, args)
    torch.library.opcheck(torch.ops.compileops.grouped_linear_swiglu.default, args)
    grad = torch.randn(10, 8)
    torch.library.opcheck(torch.ops.compileops.grouped_linear_dx.default, (grad, w.detach(), offs))
    torch.library.opcheck(torch.ops.compileops.grouped_linear_wgrad.default,
                          (grad, x.detach(), offs, torch.float32, torch.float32))
    torch.library.opcheck(torch.ops.compileops.grouped_linear_wgrad.default,
                          (grad, x.detach(), offs, torch.float32, torch.float32, False))


@pytest.mark.parametrize("bias", ["none", "frozen", "trainable"])
def test_backward_computes_db_only_for_a_trainable_bias(bias, monkeypatch):
    """dW is the same either way; the column sums run only when the bias needs a gradient
    (``with_db``), and ``with_db=False`` returns an empty ``db [G, 0]``."""
    from compileops.grouped_linear import backward_ops as op

    x, w, offs, b = make([3, 0, 6], k=8, n=8, extra_rows=1)
    w.requires_grad_()
    if bias == "none":
        b = None
    elif bias == "trainable":
        b.requires_grad_()
    calls = []
    real = op.grouped_linear_wgrad_op

    def spy(*args):
        calls.append(args[5] if len(args) > 5 else True)
        return real(*args)

    monkeypatch.setattr(op, "grouped_linear_wgrad_op", spy)
    grad = torch.randn(10, 8)
    compileops.grouped_linear(x, w, offs, b).backward(grad)
    assert calls == [bias == "trainable"]
    want_dw, want_db = real(grad, x, offs, torch.float32, torch.float32)
    assert torch.equal(w.grad, want_dw)
    if bias == "trainable":
        assert torch.equal(b.grad, want_db)
    dw, db = torch.ops.compileops.grouped_linear_wgrad(grad, x, offs, torch.float32,
                                                       torch.float32, False)
    assert torch.equal(dw, want_dw) and db.shape == (3, 0)


BAD = {
    "decreasing offsets": (lambda x, w, o, b: (x, w, torch.tensor([5, 3, 9], dtype=torch.int32), b),
                           ValueError, "non-decreasing"),
    "offsets exceed M": (lambda x, w, o, b: (x, w, torch.tensor([5, 6, 99], dtype=torch.int32), b),
                         ValueError, "exceeds"),
    "int64 offsets": (lambda x, w, o, b: (x, w, o.long(), b), TypeError, "int32"),
    "wrong offsets length": (lambda x, w, o, b: (x, w, o[:2], b), ValueError, "one entry per group"),
    "mismatched K": (lambda x, w, o, b: (x[:, :7], w, o, b), ValueError, "mismatched K"),
    "bias shape": (lambda x, w, o, b: (x, w, o, b[:, :3]), ValueError, "bias must be"),
    "dtype mismatch": (lambda x, w, o, b: (x, w.double(), o, b), TypeError, "weight dtype"),
    "device mismatch": (lambda x, w, o, b: (x, w.to("meta"), o, b), (ValueError, RuntimeError), "device"),
}


@pytest.mark.parametrize("op", [compileops.grouped_linear, compileops.grouped_linear_swiglu],
                         ids=["plain", "swiglu"])
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_errors_eagerly(case, op):
    make_args, exc, msg = BAD[case]
    x, w, offs, b = make([3, 4, 5], k=8, n=6)
    with pytest.raises(exc, match=msg):
        op(*make_args(x, w, offs, b))


@pytest.mark.parametrize("case", [c for c in BAD if "offsets exceed" not in c and "decreasing" not in c
                                  and "device" not in c])
def test_bad_input_errors_in_fake(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    make_args, exc, msg = BAD[case]
    x, w, offs, b = make([3, 4, 5], k=8, n=6)
    args = make_args(x, w, offs, b)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(exc, match=msg):
            torch.ops.compileops.grouped_linear(*args)


def _odd_n_swiglu_args():
    x, w, offs, b = make([3, 4, 5], k=8, n=7)  # N = 7: no even gate/up split
    return x, w, offs, b


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_swiglu_odd_n_errors_eagerly(backend):
    from compileops import backends

    with backends.use_backend(backend):
        with pytest.raises(ValueError, match="even N"):
            compileops.grouped_linear_swiglu(*_odd_n_swiglu_args())


def test_swiglu_odd_n_errors_in_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _odd_n_swiglu_args()
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(ValueError, match="even N"):
            torch.ops.compileops.grouped_linear_swiglu(*args)


def test_deterministic_fw_bw():
    x, w, offs, b = make([9, 0, 30, 2], k=32, n=24, extra_rows=3)
    assert_deterministic(compileops.grouped_linear,
                         [x.requires_grad_(), w.requires_grad_(), offs, b.requires_grad_()], runs=3)


def test_batch_invariant_mode_bitwise():
    x, w, offs, b = make([12], k=32, n=24)
    # One group holding every row, so slices/concatenations keep each row in its group.
    def fn(xs):
        o = torch.tensor([xs.shape[0]], dtype=torch.int32)
        return compileops.grouped_linear(xs, w, o, b)

    with compileops.batch_invariant():
        assert_batch_invariant(fn, [x])


@pytest.mark.parametrize("op", [compileops.grouped_linear, compileops.grouped_linear_swiglu],
                         ids=["plain", "swiglu"])
def test_backward_keeps_the_forwards_batch_invariant_mode(op, monkeypatch):
    """On CUDA the backward runs on autograd's device thread, which does not see the
    forward thread's ``with compileops.batch_invariant():`` (a contextvar): the backward ops
    keep the mode the forward ran in. Here the backward runs on a new thread."""
    import threading

    from compileops.grouped_linear import kernels

    seen, errors = [], []
    real = kernels.grouped_linear_dx

    def spy(*args, batch_invariant=False, **kwargs):
        seen.append(batch_invariant)
        return real(*args, batch_invariant=batch_invariant, **kwargs)

    monkeypatch.setattr(kernels, "grouped_linear_dx", spy)
    x, w, offs, b = make([3, 0, 6], k=8, n=8, extra_rows=1)
    x.requires_grad_()
    for mode in (True, False):
        with compileops.batch_invariant(mode):
            y = op(x, w, offs, b)

        def backward():
            try:
                y.sum().backward()
            except Exception as exc:  # pragma: no cover  (reported below)
                errors.append(exc)

        worker = threading.Thread(target=backward)
        worker.start()
        worker.join()
        assert not errors, errors
        assert seen == [mode], (mode, seen)
        seen.clear()


def test_routing_round_trip():
    gen = torch.Generator().manual_seed(0)
    tokens, k, experts, d = 11, 2, 5, 6
    x = torch.randn(tokens, d, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    ids[:, 0] = 3  # skew: expert 3 is popular; some experts stay empty
    probs = torch.rand(tokens, k, generator=gen)
    xs, order, offs = permute_by_expert(x, ids, experts)
    assert offs.dtype == torch.int32 and offs[-1] == tokens * k
    assert torch.equal(offs, torch.cumsum(torch.bincount(ids.reshape(-1), minlength=experts), 0).int())
    sorted_ids = ids.reshape(-1)[order]
    assert bool((sorted_ids[1:] >= sorted_ids[:-1]).all())
    back = unpermute_and_combine(xs, order, probs)
    assert torch.allclose(back, x * probs.sum(1, keepdim=True))


def test_module_state_dict_round_trips():
    from compileops.grouped_linear.module import from_per_group_state_dict, to_per_group_state_dict

    mod = compileops.nn.GroupedLinear(3, 8, 5)
    sd = mod.state_dict()
    per_group = to_per_group_state_dict(sd)
    assert set(per_group) == {f"{n}{i}" for n in ("weight", "bias") for i in range(3)}
    assert per_group["weight1"].shape == (5, 8)
    back = from_per_group_state_dict(per_group, 3)
    assert torch.equal(back["weight"], sd["weight"]) and torch.equal(back["bias"], sd["bias"])
    other = compileops.nn.GroupedLinear(3, 8, 5)
    other.load_state_dict(per_group)  # TransformerEngine layout accepted directly
    assert torch.equal(other.weight, mod.weight) and torch.equal(other.bias, mod.bias)
    other.load_state_dict(sd)
    x = torch.randn(7, 8)
    y = other(x, torch.tensor([2, 0, 5]))
    assert_close_to_reference(
        y, reference.grouped_linear_forward(x.double(), mod.weight.double(),
                                            offsets_of([2, 0, 5]), mod.bias.double()),
        max_relative_error=1e-5)
    with pytest.raises(KeyError, match="missing"):
        from_per_group_state_dict({"weight0": per_group["weight0"]}, 3)


def test_import_stays_cheap():
    import subprocess
    import sys

    code = ("import sys, compileops; "
            "print('triton' in sys.modules, 'torch._inductor.lowering' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_device_mismatch_in_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(10, 8, device="cuda")
        w = torch.empty(2, 6, 8)
        offs = torch.empty(2, dtype=torch.int32, device="cuda")
        with pytest.raises(RuntimeError, match="weight is on cpu but x is on cuda"):
            torch.ops.compileops.grouped_linear(x, w, offs)


def test_large_group_spans_several_tile_super_groups():
    # 16-row tiles under the interpreter: 150 rows = 10 M-tiles > GROUP_M (8), x 2 N-tiles.
    x, w, offs, b = make([3, 150, 1], k=16, n=40, extra_rows=5)
    y = compileops.grouped_linear(x, w, offs, b)
    ref = reference.grouped_linear_forward(x.double(), w.double(), offs, b.double())
    assert_close_to_reference(y, ref, max_relative_error=1e-5)
    assert torch.equal(y[154:], torch.zeros_like(y[154:]))


def test_k_zero_gives_bias_only_and_bias_grad():
    x, w, offs, b = make([3, 3], k=0, n=5, extra_rows=1)
    for t in (x, w, b):
        t.requires_grad_()
    y = compileops.grouped_linear(x, w, offs, b)
    grad = torch.randn(7, 5)
    y.backward(grad)
    _, _, _, db_ref = grads_fp64(x, w, offs, b, grad)
    assert_close_to_reference(y, reference.grouped_linear_forward(x.double(), w.double(), offs, b.double()),
                              max_relative_error=1e-6)
    assert_close_to_reference(b.grad, db_ref, max_relative_error=1e-6)
    assert w.grad.shape == (2, 5, 0) and x.grad.shape == (7, 0)


def _oracle_fp64(x, w, offs):
    """Per-group ``x_g @ w_g^T`` in fp64 written here (not reference.py); tail rows zero."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[g].double().t()
        start = end
    return out


def test_fp64_runs_on_the_reference_backend_forward_and_backward():
    """fp64 ground truth everywhere: the reference backend runs every grouped-linear op in
    fp64 (forward, SwiGLU with kept pre-activations, dX, dW); the Triton kernels refuse it
    with an error naming the reference backend, eagerly and compiled."""
    x, w, offs, _ = make([4, 0, 7], k=12, n=10, dtype=torch.float64, extra_rows=2)
    x.requires_grad_()
    w.requires_grad_()
    with compileops.use_backend("reference"):
        y = compileops.grouped_linear(x, w, offs)
        dx, dw = torch.autograd.grad(y.square().sum(), [x, w])
        h = compileops.grouped_linear_swiglu(x, w, offs)
        torch.autograd.grad(h.sum(), [x, w])
    assert y.dtype == torch.float64
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    yr = _oracle_fp64(xr, wr, offs)
    dxr, dwr = torch.autograd.grad(yr.square().sum(), [xr, wr])
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dxr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, dwr, rtol=1e-12, atol=1e-12)
    with compileops.use_backend("triton"):
        with pytest.raises(TypeError, match="reference backend"):
            compileops.grouped_linear(x, w, offs)
    # compiled: the lowering leaves fp64 to the op itself (an extern call)
    compiled = torch.compile(lambda a, b, o: compileops.grouped_linear(a, b, o), fullgraph=True)
    with compileops.use_backend("reference"), torch.no_grad():
        torch.testing.assert_close(compiled(x, w, offs), yr.detach(), rtol=1e-12, atol=1e-12)


_FUNCTIONS = {
    "grouped_linear": lambda x, w, o, b: compileops.grouped_linear(x, w, o, b),
    "row_scale": lambda x, w, o, b: compileops.grouped_linear(x, w, o, row_scale=torch.rand(6)),
    "splits": lambda x, w, o, b: compileops.grouped_linear_splits(x, w, torch.tensor([2, 4]), b),
    "swiglu": lambda x, w, o, b: compileops.grouped_linear_swiglu(x, w, o, b),
    "swiglu recompute": lambda x, w, o, b: compileops.grouped_linear_swiglu(x, w, o, b,
                                                                          recompute=True),
    "routing": lambda x, w, o, b: unpermute_and_combine(
        *permute_by_expert(x, torch.tensor([[0, 1], [1, 1], [0, 1]]), 2)[:2],
        torch.rand(3, 2)),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("function", list(_FUNCTIONS))
def test_output_takes_in_place_ops(function, backend):
    # As with torch.nn.Linear: an output that is a view of a custom op's result refuses
    # in-place ops under autograd (the embedding's did).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=gen, requires_grad=True)
    w = torch.randn(2, 6, 4, generator=gen, requires_grad=True)
    b = torch.randn(2, 6, generator=gen, requires_grad=True)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    with compileops.use_backend(backend):
        out = _FUNCTIONS[function](x[:3] if function == "routing" else x, w, offs, b)
        assert out._base is None
        out.mul_(2)
        out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
