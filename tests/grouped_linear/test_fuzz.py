"""Property fuzzing of the grouped linear family: ``grouped_linear``,
``grouped_linear_splits``, ``grouped_linear_swiglu`` (both backward forms), the
``compileops.nn.GroupedLinear`` module (hence ``compileops::grouped_linear*``,
``grouped_linear_dx`` and ``grouped_linear_wgrad``), and the routing helpers
``permute_by_expert`` / ``unpermute_and_combine``, on both backends, against fp64 oracles
written here.

Drawn: group counts (0 too), group sizes (random, empty groups, all rows in one group, all
empty, all equal), rows past the last group, K and N (0, 1, primes, ...), the dtype (fp32,
bf16, fp16, fp64), with or without bias, which inputs need a gradient, int32/int64
``m_splits``, and the layouts of x, the weight, the bias, the offsets and grad_output
(``tests/fuzzing.py``). Contracts (the docstrings):

* forward and gradients within the stated relative error of fp64 (``||out - ref|| /
  ||ref||``): 1e-5 fp32, 1e-2 bf16, 2e-3 fp16 (:data:`TOL`); fp64 runs on the reference
  backend, and the triton backend refuses it with an error naming the reference backend;
* rows past ``offsets[-1]`` and their dX exactly zero, dW and db of an empty group exactly zero;
* routing: ``permute_by_expert`` is a gather (bitwise, offsets exact), both helpers'
  gradients within the summation bound of their dtype;
* no input (grad_output included) and no memory around one is written.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import compileops
from compileops.grouped_linear import permute_by_expert, unpermute_and_combine
from tests.fuzzing import (
    Example,
    assert_bitwise,
    assert_normwise,
    assert_ran_on,
    assert_within,
    check_result,
    float_dtypes,
    gpu_variant,
    index_dtypes,
    known_bug,
    oracle_grads,
    recorded_backends,
    summation_bound,
    use,
)

# Relative error against fp64 per dtype: the ops' stated precision (op.py's docstring);
# fp64 (reference backend) is fp64 arithmetic.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

FP64_REFUSAL = r"triton backend runs bf16, fp16 and fp32.*use_backend\('reference'\)"

# Known bugs found by this fuzzing (each has a strict xfail test below). While one is open
# the main property steps around it, so the rest of the space keeps being fuzzed; delete
# the entry together with the fix.
KNOWN_BUGS: set[str] = set()  # none open; fixed ones keep their regression test below


# ---------------------------------------------------------------------------------------
# fp64 oracles (plain torch, from the docstrings)


def oracle_grouped_linear(x, w, b, group_sizes, swiglu: bool) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g].T + b[g]``; rows past the last group are 0;
    ``swiglu``: ``silu(gate) * up`` of the two halves of ``y``. fp64, differentiable."""
    m, n = x.shape[0], w.shape[1]
    parts, start = [], 0
    for g, rows in enumerate(group_sizes):
        y = x[start:start + rows] @ w[g].t()
        parts.append(y if b is None else y + b[g])
        start += rows
    parts.append(torch.zeros(m - start, n, dtype=x.dtype))
    y = torch.cat(parts)
    if swiglu:
        gate, up = y[:, : n // 2], y[:, n // 2:]
        y = gate * torch.sigmoid(gate) * up
    return y


def oracle_permute(x, expert_ids, num_experts):
    """``(x_sorted, order, offsets)``: assignments ``token * k + slot`` stably sorted by expert
    (Python's sort is stable), rows gathered, ``offsets[e]`` = assignments to experts <= e."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda a: flat[a])
    order_t = torch.tensor(order, dtype=torch.int64)
    x_sorted = x[order_t // top_k] if top_k else x[:0]
    offsets = torch.tensor([sum(1 for e in flat if e <= expert) for expert in range(num_experts)],
                           dtype=torch.int32)
    return x_sorted, order_t, offsets


def oracle_combine(y_sorted, order, weights):
    """``out[t] = sum_j weights[t, j] * y[t * k + j]`` where ``y[order[i]] = y_sorted[i]``."""
    tokens, top_k = weights.shape
    y = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)
    return (weights[..., None] * y.reshape(tokens, top_k, y.shape[1])).sum(1)


# ---------------------------------------------------------------------------------------
# Drawing groups


def draw_group_sizes(ex: Example, groups: int) -> list[int]:
    mode = ex.draw(st.sampled_from(["random", "one group", "equal", "all empty"]), "group sizes")
    if groups == 0 or mode == "all empty":
        return [0] * groups
    if mode == "one group":
        target = ex.draw(st.integers(0, groups - 1), "the group with all rows")
        rows = ex.size("rows of that group", 40, 400)
        return [rows if g == target else 0 for g in range(groups)]
    if mode == "equal":
        return [ex.size("rows per group", 13, 100)] * groups
    return [ex.size(f"rows of group {g}", 13, 150) for g in range(groups)]


# ---------------------------------------------------------------------------------------
# grouped_linear / grouped_linear_splits / GroupedLinear / grouped_linear_swiglu


def check_grouped_linear(data, device, *, swiglu: bool, dtype=None,
                         known_bugs=frozenset(KNOWN_BUGS)) -> None:
    """The property; ``dtype`` fixes the dtype instead of drawing it; ``known_bugs``: the
    :data:`KNOWN_BUGS` to step around."""
    ex = Example(data, device)
    dtype = ex.draw(float_dtypes(), "dtype") if dtype is None else dtype
    grad_tol = TOL[dtype]
    if swiglu and dtype == torch.float64 and "swiglu fp64 grads in fp32" in known_bugs:
        grad_tol = TOL[torch.float32]
    G = ex.size("groups", 4, 9)
    group_sizes = draw_group_sizes(ex, G)
    tail = ex.size("rows past the last group", 5, 33)
    M = sum(group_sizes) + tail
    K = ex.size("K", 40, 300)
    N = 2 * ex.size("H", 20, 150) if swiglu else ex.size("N", 40, 300)
    has_bias = ex.draw(st.booleans(), "bias")
    needs_grad = ex.draw(st.sets(st.sampled_from(["x", "weight", "bias"])), "needs grad")
    if swiglu:
        via = "function"
        recompute = ex.draw(st.booleans(), "recompute")
    else:
        via = ex.draw(st.sampled_from(["function", "splits", "module", "module offsets"]), "via")

    x = ex.floats("x", (M, K), dtype)
    w = ex.floats("weight", (G, N, K), dtype, scale=1 / math.sqrt(max(K, 1)))
    b = ex.floats("bias", (G, N), dtype) if has_bias else None
    ends = torch.tensor(group_sizes, dtype=torch.int64).cumsum(0)
    if via in ("splits", "module"):
        m_splits = ex.indices("m_splits", torch.tensor(group_sizes, dtype=torch.int64),
                              ex.draw(index_dtypes(), "m_splits dtype"))
    else:
        offsets = ex.indices("offsets", ends, torch.int32)
    grad_out = ex.floats("grad_out", (M, N // 2 if swiglu else N), dtype)

    # The fp64 oracle and its gradients (all three; compared where the call needs them).
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None
              for t in (x, w, b)]
    want = oracle_grouped_linear(*leaves, group_sizes, swiglu)
    wanted = [t for t in leaves if t is not None]
    want_grads = dict(zip(["x", "weight", "bias"][:len(wanted)],
                          oracle_grads(want, wanted, grad_out)))
    boundary = int(ends[-1]) if G else 0

    for backend in ex.backends():
        xa = x.detach().requires_grad_("x" in needs_grad)
        wa = torch.nn.Parameter(w.detach(), requires_grad="weight" in needs_grad)
        ba = (torch.nn.Parameter(b.detach(), requires_grad="bias" in needs_grad)
              if b is not None else None)
        if swiglu:
            def call():
                return compileops.grouped_linear_swiglu(xa, wa, offsets, ba, recompute=recompute)
        elif via == "function":
            def call():
                return compileops.grouped_linear(xa, wa, offsets, ba)
        elif via == "splits":
            def call():
                return compileops.grouped_linear_splits(xa, wa, m_splits, ba)
        else:
            module = compileops.nn.GroupedLinear(G, K, N, bias=has_bias, dtype=dtype,
                                                 device=ex.device)
            module.weight, module.bias = wa, ba

            def call():
                if via == "module":
                    return module(xa, m_splits)
                return module(xa, offsets, offsets=True)

        snap = ex.snapshot()
        if backend == "triton" and dtype == torch.float64:
            with use(backend), pytest.raises(TypeError, match=FP64_REFUSAL):
                call()
            snap.check("by the refused fp64 call")
            continue

        with recorded_backends() as calls:
            with use(backend):
                y = call()
            snap.check(f"by the {backend} forward")
            check_result(y, want.shape, dtype, ex.device, f"{backend} forward")
            assert_normwise(y, want, TOL[dtype], f"{backend} forward ({dtype})")
            assert_bitwise(y[boundary:], torch.zeros_like(y[boundary:]),
                           f"{backend}: rows past offsets[-1]")
            inputs = {"x": xa, "weight": wa, "bias": ba}
            names = [n for n in ("x", "weight", "bias")
                     if n in needs_grad and inputs[n] is not None]
            if not names:
                assert_ran_on(calls, backend, "forward")
                continue
            with use(backend):
                grads = torch.autograd.grad(y, [inputs[n] for n in names], grad_out)
        snap.check(f"by the {backend} backward")
        assert_ran_on(calls, backend, "forward and backward")
        for name, grad in zip(names, grads):
            check_result(grad, inputs[name].shape, dtype, ex.device, f"{backend} d{name}")
            assert_normwise(grad, want_grads[name], grad_tol, f"{backend} d{name} ({dtype})")
        got = dict(zip(names, grads))
        if "x" in got:
            dx = got["x"][boundary:]
            assert_bitwise(dx, torch.zeros_like(dx), f"{backend}: dX of rows past offsets[-1]")
        for g, rows in enumerate(group_sizes):
            for name in ("weight", "bias"):
                if rows == 0 and name in got:
                    assert_bitwise(got[name][g], torch.zeros_like(got[name][g]),
                                   f"{backend}: d{name} of empty group {g}")


@given(data=st.data())
def test_grouped_linear(data):
    check_grouped_linear(data, "cpu", swiglu=False)


@given(data=st.data())
def test_grouped_linear_swiglu(data):
    check_grouped_linear(data, "cpu", swiglu=True)


@given(data=st.data())
def test_grouped_linear_swiglu_fp64_grads(data):
    check_grouped_linear(data, "cpu", swiglu=True, dtype=torch.float64, known_bugs=())


@gpu_variant
@given(data=st.data())
def test_grouped_linear_gpu(data, device):
    check_grouped_linear(data, device, swiglu=False)


@gpu_variant
@given(data=st.data())
def test_grouped_linear_swiglu_gpu(data, device):
    check_grouped_linear(data, device, swiglu=True)


# ---------------------------------------------------------------------------------------
# Routing helpers (plain torch, no backend: run under each backend all the same)


def check_routing(data, device, *, empty=False, known_bugs=frozenset(KNOWN_BUGS)) -> None:
    """The property; ``empty``: no tokens or ``top_k = 0``; ``known_bugs``: the
    :data:`KNOWN_BUGS` to step around."""
    ex = Example(data, device)
    dtype = ex.draw(float_dtypes(), "x dtype")
    weights_dtype = ex.draw(float_dtypes(), "router weights dtype")
    if empty:
        T, top_k = ex.draw(st.sampled_from([(0, 0), (0, 1), (0, 2), (3, 0)]), "tokens, top_k")
    else:
        T = ex.size("tokens", 17, 200)
        top_k = ex.size("top_k", 4, 8)
    E = ex.size("experts", 9, 64, min_value=1 if T * top_k else 0)
    D = ex.size("D", 17, 200)
    x = ex.floats("x", (T, D), dtype)
    expert_ids = ex.indices("expert_ids", ex.randint(0, E, (T, top_k)),
                            ex.draw(index_dtypes(), "expert_ids dtype"), free=True)
    router = ex.uniform("router weights", (T, top_k), weights_dtype, 0.0, 1.0)
    grad_out = ex.floats("grad_out", (T, D), dtype)

    x64 = x.detach().cpu().double().requires_grad_()
    want_sorted, want_order, want_offsets = oracle_permute(x64, expert_ids.cpu(), E)
    grad_sorted = ex.floats("grad of x_sorted", (T * top_k, D), dtype)
    (want_dx,) = oracle_grads(want_sorted, [x64], grad_sorted)
    (abs_dx,) = oracle_grads(oracle_permute(x64, expert_ids.cpu(), E)[0], [x64],
                             grad_sorted.abs())

    for backend in ex.backends():
        xa = x.detach().requires_grad_()
        snap = ex.snapshot()
        with use(backend):
            x_sorted, order, offsets = permute_by_expert(xa, expert_ids, E)
        snap.check("by permute_by_expert")
        check_result(x_sorted, (T * top_k, D), dtype, ex.device, "x_sorted")
        assert_bitwise(order.cpu(), want_order.to(order.dtype), "order")
        assert_bitwise(offsets.cpu(), want_offsets, "offsets")
        assert_bitwise(x_sorted, want_sorted.detach().to(dtype), "x_sorted")
        with use(backend):
            (dx,) = torch.autograd.grad(x_sorted, xa, grad_sorted)
        snap.check("by permute_by_expert's backward")
        bound = summation_bound(want_dx, abs_dx, top_k, accumulate=dtype, out=dtype)
        assert_within(dx, want_dx, bound, "permute_by_expert dX")

        if T * top_k == 0 and "unpermute_and_combine empty" in known_bugs:
            continue
        # unpermute_and_combine of the sorted rows (any values: use fresh leaves).
        ys = x_sorted.detach().requires_grad_()
        ra = router.detach().requires_grad_()
        snap = ex.snapshot(y_sorted=ys, order=order)
        with use(backend):
            out = unpermute_and_combine(ys, order, ra)
        snap.check("by unpermute_and_combine")
        check_result(out, (T, D), dtype, ex.device, "combined")
        y64 = ys.detach().cpu().double().requires_grad_()
        r64 = router.detach().cpu().double().requires_grad_()
        want_out = oracle_combine(y64, order.cpu(), r64)
        abs_out = oracle_combine(y64.detach().abs(), order.cpu(), r64.detach().abs())
        # Products of the router weight rounded to x's dtype and a row, summed over k in
        # x's dtype.
        bound = summation_bound(want_out, abs_out, top_k + 1, accumulate=dtype, out=dtype)
        assert_within(out, want_out, bound, "unpermute_and_combine")
        with use(backend):
            dy, dr = torch.autograd.grad(out, [ys, ra], grad_out)
        snap.check("by unpermute_and_combine's backward")
        want_dy, want_dr = oracle_grads(want_out, [y64, r64], grad_out)
        y_abs = y64.detach().abs().requires_grad_()
        r_abs = r64.detach().abs().requires_grad_()
        abs_dy, abs_dr = oracle_grads(oracle_combine(y_abs, order.cpu(), r_abs),
                                      [y_abs, r_abs], grad_out.abs())
        assert_within(dy, want_dy, summation_bound(want_dy, abs_dy, 2, accumulate=dtype,
                                                   out=dtype), "unpermute_and_combine dY")
        # dweights: a sum over D in x's dtype, then cast to the weights' dtype.
        check_result(dr, (T, top_k), weights_dtype, ex.device, "d router weights")
        assert_within(dr, want_dr, summation_bound(want_dr, abs_dr, D + 1, accumulate=dtype,
                                                   out=weights_dtype),
                      "unpermute_and_combine d router weights")


@given(data=st.data())
def test_routing(data):
    check_routing(data, "cpu")


@given(data=st.data())
def test_routing_empty(data):
    check_routing(data, "cpu", empty=True, known_bugs=())


@gpu_variant
@given(data=st.data())
def test_routing_gpu(data, device):
    check_routing(data, device)
