"""``grouped_linear_swiglu(x, w_gate, offsets, up_weight=w_up)``: the gate/up pair kept as two
weights. Against an fp64 oracle written here, against the concatenated weight's op (the same
bits), edge cases, errors, opcheck, compiled (the Triton template under the interpreter, and
dynamic shapes without recompiles). The sm90 builds of its kernels: test_codegen_sm90.py;
on a GPU: the ``gpu`` cases at the end."""
import pytest
import torch
import torch.nn.functional as F

import compileops
from compileops import backends
from compileops.lowerings import _compat
from compileops.testing import assert_close_to_reference, inductor_kernels
from tests.grouped_linear._helpers import TOL, offsets_of

PAIR_OPS = ("grouped_linear_swiglu_pair", "grouped_linear_swiglu_pair_with_preact",
            "grouped_linear_dx_pair")


def make_pair(sizes, k=24, h=32, dtype=torch.float32, extra_rows=3, seed=0, device="cpu"):
    """``(x [M, k], w_gate [G, h, k], w_up [G, h, k], offsets)``, weights scaled 1/sqrt(k)."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes) + extra_rows
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w_gate = (torch.randn(len(sizes), h, k, generator=gen) / k**0.5).to(device, dtype)
    w_up = (torch.randn(len(sizes), h, k, generator=gen) / k**0.5).to(device, dtype)
    return x, w_gate, w_up, offsets_of(sizes).to(device)


def oracle_fp64(x, w_gate, w_up, offsets, grad):
    """``(y, dX, dW_gate, dW_up)`` in fp64 by autograd of the math written out per group:
    ``silu(x_g W_gate_g^T) * (x_g W_up_g^T)``, rows past the last group zero."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate, w_up)]
    xd, gd, ud = leaves
    rows = []
    start = 0
    for g, end in enumerate(offsets.tolist()):
        xs = xd[start:end]
        rows.append(F.silu(xs @ gd[g].T) * (xs @ ud[g].T))
        start = end
    rows.append(xd.new_zeros((xd.shape[0] - start, gd.shape[1])))
    y = torch.cat(rows)
    y.backward(grad.double())
    return y, xd.grad, gd.grad, ud.grad


def fw_bw(x, w_gate, w_up, offsets, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up)]
    y = compileops.grouped_linear_swiglu(leaves[0], leaves[1], offsets, up_weight=leaves[2],
                                         **kwargs)
    y.backward(grad)
    return (y.detach(), *(t.grad for t in leaves))


def fw_bw_concatenated(x, w_gate, w_up, offsets, grad, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up)]
    y = compileops.grouped_linear_swiglu(leaves[0], torch.cat(leaves[1:], 1), offsets,
                                         **kwargs)
    y.backward(grad)
    return (y.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("sizes", [[5, 0, 17, 3], [0, 0, 0, 0], [40]],
                         ids=["mixed", "all-empty", "one-group"])
def test_matches_fp64_and_the_concatenated_weight_bitwise(backend, recompute, sizes):
    x, w_gate, w_up, offs = make_pair(sizes)
    grad = torch.randn(x.shape[0], w_gate.shape[1], generator=torch.Generator().manual_seed(1))
    with backends.use_backend(backend):
        got = fw_bw(x, w_gate, w_up, offs, grad, recompute=recompute)
        concatenated = fw_bw_concatenated(x, w_gate, w_up, offs, grad, recompute=recompute)
    for what, g, want, same in zip(("y", "dX", "dW_gate", "dW_up"), got,
                                   oracle_fp64(x, w_gate, w_up, offs, grad), concatenated):
        assert_close_to_reference(g, want, max_relative_error=1e-5, what=what)
        # H = 32 is a multiple of the interpreter's BLOCK_K: dX sums in the same order too.
        assert torch.equal(g, same), f"{what} differs from the concatenated weight's"
    tail = offs[-1].item()
    assert torch.equal(got[0][tail:], torch.zeros_like(got[0][tail:]))
    assert torch.equal(got[1][tail:], torch.zeros_like(got[1][tail:]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_the_stated_bound(dtype):
    x, w_gate, w_up, offs = make_pair([7, 0, 21], k=40, h=24, dtype=dtype)
    grad = torch.randn(x.shape[0], 24).to(dtype)
    got = fw_bw(x, w_gate, w_up, offs, grad)
    for what, g, want in zip(("y", "dX", "dW_gate", "dW_up"), got,
                             oracle_fp64(x, w_gate, w_up, offs, grad)):
        assert g.dtype == dtype
        assert_close_to_reference(g.float(), want, max_relative_error=TOL[dtype], what=what)


def test_up_weight_with_other_strides_and_inputs_untouched():
    """An up weight stored transposed ([G, K, H] memory) gives the same result; neither the
    inputs nor the weights are modified."""
    x, w_gate, w_up, offs = make_pair([6, 9, 4], k=32, h=16)
    w_up_t = w_up.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    before = [t.clone() for t in (x, w_gate, w_up_t, offs)]
    grad = torch.randn(x.shape[0], 16)
    assert all(torch.equal(a, b) for a, b in zip(fw_bw(x, w_gate, w_up_t, offs, grad),
                                                 fw_bw(x, w_gate, w_up, offs, grad)))
    for t, b in zip((x, w_gate, w_up_t, offs), before):
        assert torch.equal(t, b)


def test_dx_pair_sums_in_fp32_once():
    """dX of the pair is one fp32 sum over both halves, rounded once: in bf16, the same bits
    as dX on the concatenated weight, and closer to fp64 than the two halves' products added
    after rounding."""
    gen = torch.Generator().manual_seed(3)
    g, h, k, m = 2, 64, 48, 64
    grad = torch.randn(m, 2 * h, generator=gen).bfloat16()
    w_gate = torch.randn(g, h, k, generator=gen).bfloat16()
    w_up = torch.randn(g, h, k, generator=gen).bfloat16()
    offs = torch.tensor([20, 64], dtype=torch.int32)
    ops = torch.ops.compileops
    pair = ops.grouped_linear_dx_pair(grad, w_gate, w_up, offs)
    one = ops.grouped_linear_dx(grad, torch.cat([w_gate, w_up], 1), offs)
    assert torch.equal(pair, one)
    halves = (ops.grouped_linear_dx(grad[:, :h].contiguous(), w_gate, offs)
              + ops.grouped_linear_dx(grad[:, h:].contiguous(), w_up, offs))
    w = torch.cat([w_gate, w_up], 1).double()
    exact = torch.cat([grad[:20].double() @ w[0], grad[20:].double() @ w[1]])
    assert (pair.double() - exact).norm() < (halves.double() - exact).norm()


def test_errors_name_the_argument():
    x, w_gate, w_up, offs = make_pair([3, 4])
    cases = [
        (dict(up_weight=w_up[:, :8]), ValueError, "up_weight .* must have the gate weight's shape"),
        (dict(up_weight=w_up.double()), TypeError, "up_weight dtype"),
        (dict(up_weight=w_up.tolist()), TypeError, "up_weight must be a torch.Tensor"),
        (dict(up_weight=w_up[0]), RuntimeError, "up_weight must be 3-D"),
        (dict(up_weight=w_up, bias=torch.zeros(2, 32)), ValueError, "no bias with up_weight"),
        (dict(up_weight=w_up, fp8="rowwise"), ValueError, "no fp8 form with up_weight"),
    ]
    for kwargs, error, match in cases:
        bias = kwargs.pop("bias", None)
        with pytest.raises(error, match=match):
            compileops.grouped_linear_swiglu(x, w_gate, offs, bias, **kwargs)


def test_errors_at_trace_time():
    x, w_gate, w_up, offs = make_pair([3, 4])
    f = torch.compile(lambda x, a, b, o: compileops.grouped_linear_swiglu(x, a, o, up_weight=b),
                      fullgraph=True)
    with pytest.raises(Exception, match="must have the gate weight's shape"):
        f(x, w_gate, w_up[:, :8], offs)


@pytest.mark.parametrize("op", PAIR_OPS)
def test_opcheck(op):
    x, w_gate, w_up, offs = make_pair([3, 0, 5], k=16, h=8)
    if op == "grouped_linear_dx_pair":
        args = (torch.randn(x.shape[0], 16), w_gate, w_up, offs)
    else:
        args = (x.requires_grad_(), w_gate.requires_grad_(), w_up.requires_grad_(), offs)
    torch.library.opcheck(getattr(torch.ops.compileops, op), args)


def pair_layer(x, w_gate, w_up, w_down, offs, p):
    """An MoE expert block as torchtitan writes it, gate and up as two weights."""
    h = compileops.grouped_linear_swiglu(x, w_gate, offs, up_weight=w_up)
    return compileops.grouped_linear(h, w_down, offs) * p[:, None]


def test_compiled_template_kernels_and_numerics():
    """Compiled to Triton on CPU (run under the interpreter): the forward is the pair's
    template (no concatenated copy: no cat kernel), the backward runs dX through the pair's
    template and dW per weight; the results match fp64."""
    x, w_gate, w_up, offs = make_pair([5, 0, 11, 3], k=32, h=16)
    w_down = torch.randn(4, 32, 16) / 4
    p = torch.rand(x.shape[0])
    for t in (x, w_gate, w_up):
        t.requires_grad_()
    kernels = inductor_kernels(pair_layer, x, w_gate, w_up, w_down, offs, p, triton=True,
                               backward=True).splitlines()
    forward = kernels[:kernels.index("# backward")]
    assert forward[0] == "triton_tem_fused_grouped_linear_swiglu_pair_with_preact", kernels
    assert not any("cat" in k for k in kernels), kernels
    assert "triton_tem_fused_grouped_linear_dx_pair" in kernels, kernels
    assert "torch.ops.compileops.grouped_linear_wgrad.default" in kernels, kernels

    x.grad = w_gate.grad = w_up.grad = None
    grad = torch.randn(x.shape[0], 32)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        y = torch.compile(pair_layer, fullgraph=True)(x, w_gate, w_up, w_down, offs, p)
        y.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (x, w_gate, w_up)]
    y_ref = pair_layer_fp64(*leaves, w_down, offs, p)
    y_ref.backward(grad.double())
    assert_close_to_reference(y, y_ref, max_relative_error=1e-5)
    for got, want, what in zip((x.grad, w_gate.grad, w_up.grad), leaves,
                               ("dX", "dW_gate", "dW_up")):
        assert_close_to_reference(got, want.grad, max_relative_error=1e-5, what=what)


def pair_layer_fp64(x, w_gate, w_up, w_down, offs, p):
    rows, start = [], 0
    for g, end in enumerate(offs.tolist()):
        xs = x[start:end]
        h = F.silu(xs @ w_gate[g].T) * (xs @ w_up[g].T)
        rows.append(h @ w_down[g].double().T * p[start:end, None].double())
        start = end
    rows.append(x.new_zeros((x.shape[0] - start, w_down.shape[1])))
    return torch.cat(rows)


def test_dynamic_shapes_no_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    f = torch.compile(lambda x, a, b, o: compileops.grouped_linear_swiglu(x, a, o, up_weight=b)
                      .sum(), backend=counter, fullgraph=True, dynamic=True)
    for seed, sizes in enumerate(([3, 0, 5], [7, 2, 9], [1, 1, 20])):
        x, w_gate, w_up, offs = make_pair(sizes, seed=seed)
        w_gate.requires_grad_(), w_up.requires_grad_()
        f(x, w_gate, w_up, offs).backward()
        _, _, dg, du = oracle_fp64(x, w_gate, w_up, offs, torch.ones(x.shape[0], 32))
        assert_close_to_reference(w_gate.grad, dg, max_relative_error=1e-5)
        assert_close_to_reference(w_up.grad, du, max_relative_error=1e-5)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------
# GPU: the pair's kernels (TMA on sm90+) against the concatenated weight's, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_pair_is_the_concatenated_weight_bitwise(compiled):
    """bf16, H a multiple of every BLOCK_K: output and every gradient bitwise those of the
    concatenated weight, eager and compiled; deterministic across two runs."""
    from compileops.grouped_linear.routing import dirichlet_offsets

    gen = torch.Generator().manual_seed(0)
    g, h, k, m = 16, 768, 1024, 8192
    offs = dirichlet_offsets(g, m - 5, generator=gen).cuda()
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    w_gate = (torch.randn(g, h, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    w_up = (torch.randn(g, h, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    grad = torch.randn(m, h, generator=gen).to("cuda", torch.bfloat16)

    def pair(x, a, b, o):
        return compileops.grouped_linear_swiglu(x, a, o, up_weight=b)

    def concatenated(x, a, b, o):
        return compileops.grouped_linear_swiglu(x, torch.cat([a, b], 1), o)

    def run(fn):
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        leaves = [t.clone().requires_grad_() for t in (x, w_gate, w_up)]
        y = fn(leaves[0], leaves[1], leaves[2], offs)
        y.backward(grad)
        return [y.detach(), *(t.grad for t in leaves)]

    first, again, one = run(pair), run(pair), run(concatenated)
    for what, a, b, c in zip(("y", "dX", "dW_gate", "dW_up"), first, again, one):
        assert torch.equal(a, b), f"{what}: not deterministic"
        assert torch.equal(a, c), f"{what}: differs from the concatenated weight's"
    _, dx_ref, dg_ref, du_ref = oracle_fp64(x.float(), w_gate.float(), w_up.float(),
                                            offs, grad.float())
    for got, want, what in zip(first[1:], (dx_ref, dg_ref, du_ref), ("dX", "dW_gate", "dW_up")):
        assert_close_to_reference(got.float(), want, max_relative_error=1e-2, what=what)


def test_compiled_halves_of_one_weight_are_read_in_place():
    """Gate and up as the two halves of one ``[G, 2H, K]`` parameter (views with the same
    strides): the compiled pair reads them where they are, no copy kernel before it."""
    x, w_gate, w_up, offs = make_pair([5, 0, 11, 3], k=32, h=32)
    gate_up = torch.cat([w_gate, w_up], 1).requires_grad_()

    def halves(x, gate_up, offs):
        h = gate_up.shape[1] // 2
        return compileops.grouped_linear_swiglu(x, gate_up[:, :h], offs,
                                                up_weight=gate_up[:, h:])

    kernels = inductor_kernels(halves, x, gate_up, offs, triton=True).splitlines()
    # One kernel: the pair's template (the slices are views it reads through; no copy).
    assert len(kernels) == 1, kernels
    assert kernels[0].startswith("triton_tem_fused_grouped_linear_swiglu_pair"), kernels
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        y = torch.compile(halves, fullgraph=True)(x, gate_up, offs)
    assert torch.equal(y, compileops.grouped_linear_swiglu(x, gate_up, offs))
