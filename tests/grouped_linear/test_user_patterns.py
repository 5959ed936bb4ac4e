"""The pre-grad rewrites of what users write (``lowerings/user_patterns.py``): the router
probability written as a product after ``grouped_linear`` becomes its ``row_scale``, in every
spelling it names, ``silu(grouped_linear(x, w1)) * grouped_linear(x, w3)`` becomes the
gate/up pair kernel, and nothing else is touched. Forward bits (fp32: the interpreter's bf16
casts round toward zero, so bf16 bits are checked on a GPU), gradients against fp64 next to
the written-out form's, dynamic shapes, and a user's own pre-grad pass kept."""
import pytest
import torch

import compileops
from compileops import backends
from compileops.lowerings import _compat, user_patterns
from compileops.testing import assert_close_to_reference, inductor_kernels
from tests.grouped_linear._helpers import offsets_of

ROW_SCALED = "torch.ops.compileops.grouped_linear_row_scaled.default"
PLAIN = "torch.ops.compileops.grouped_linear.default"
gl = compileops.grouped_linear

SPELLINGS = {
    "p[:, None]": lambda y, p: y * p[:, None],
    "p[..., None]": lambda y, p: y * p[..., None],
    "p.unsqueeze(-1), first": lambda y, p: p.unsqueeze(-1) * y,
    "p.unsqueeze(1)": lambda y, p: y * p.unsqueeze(1),
    "torch.unsqueeze": lambda y, p: torch.mul(y, torch.unsqueeze(p, -1)),
    "p.view(-1, 1)": lambda y, p: y * p.view(-1, 1),
    "p.reshape(-1, 1)": lambda y, p: y * p.reshape(-1, 1),
    "cast, then column": lambda y, p: y * p.to(y.dtype)[:, None],
    "column, then cast": lambda y, p: y * p[:, None].to(y.dtype),
}


def make(dtype=torch.float32, sizes=(5, 0, 17, 3), k=24, n=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(sizes) + 3
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(len(sizes), n, k, generator=gen) / k**0.5).to(dtype)
    p = torch.rand(m, generator=gen)
    return x, w, offsets_of(list(sizes)), p


def layer(spelling):
    form = SPELLINGS[spelling]
    return lambda x, w, offs, p: form(gl(x, w, offs), p)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_each_spelling_becomes_the_row_scaled_op_with_the_same_bits(spelling):
    x, w, offs, p = make()
    kernels = inductor_kernels(layer(spelling), x, w, offs, p).splitlines()
    assert ROW_SCALED in kernels and PLAIN not in kernels, kernels
    got = torch.compile(layer(spelling), fullgraph=True)(x, w, offs, p)
    assert torch.equal(got, layer(spelling)(x, w, offs, p))


LEFT_ALONE = {
    # the product is used again: its [M, N] must exist
    "product used twice": lambda x, w, offs, p, b: (lambda y: y * p[:, None] + y)(gl(x, w, offs)),
    # a bias: the row-scaled op has none
    "with a bias": lambda x, w, offs, p, b: gl(x, w, offs, b) * p[:, None],
    # a row of scales, not a column
    "row vector": lambda x, w, offs, p, b: gl(x, w, offs) * p[None, :20],
    # one scale for every row (broadcast), not one per row
    "one scale": lambda x, w, offs, p, b: gl(x, w, offs) * p[:1, None],
    # the product promoted to the scale's dtype: not the op's arithmetic
    "promoted": lambda x, w, offs, p, b: gl(x, w, offs) * p[:, None].double(),
}


@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_other_forms_are_left_as_written(case):
    x, w, offs, p = make()
    b = torch.randn(w.shape[0], w.shape[1])
    fn = LEFT_ALONE[case]
    kernels = inductor_kernels(fn, x, w, offs, p, b).splitlines()
    assert ROW_SCALED not in kernels, kernels
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x, w, offs, p, b),
                               fn(x, w, offs, p, b), rtol=0, atol=0)


def _errors(run, x, w, offs, p, grad):
    """Relative L2 errors of (y, dX, dW, dp) from ``run`` against fp64 autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, p)]
    y = run(leaves[0], leaves[1], offs, leaves[2])
    y.backward(grad)
    exact = [t.detach().double().requires_grad_() for t in (x, w, p)]
    y64 = layer("p[:, None]")(exact[0], exact[1], offs, exact[2].double())
    y64.backward(grad.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return [rel(y, y64)] + [rel(a.grad, b.grad) for a, b in zip(leaves, exact)]


def test_bf16_gradients_as_accurate_as_the_written_out_form():
    """bf16 (the reference backend, which rounds as a GPU does): the rewritten layer's output
    and its gradients for x, w and p are within the bf16 bound of fp64, and never more than
    1.5x the written-out product's own error (the two round each factor of a gradient once,
    at different places)."""
    x, w, offs, p = make(torch.bfloat16, sizes=(40, 0, 70, 30), k=64, n=48)
    grad = torch.randn(x.shape[0], w.shape[1]).bfloat16()
    fn = layer("column, then cast")
    with backends.use_backend("reference"):
        written = _errors(fn, x, w, offs, p, grad)
        compiled = _errors(torch.compile(fn, fullgraph=True), x, w, offs, p, grad)
    assert ROW_SCALED in inductor_kernels(fn, x, w, offs, p)
    for what, got, ref in zip(("y", "dX", "dW", "dp"), compiled, written):
        assert got <= 1e-2, (what, got)
        assert got <= 1.5 * ref + 1e-4, (what, got, ref)


def test_dynamic_shapes_rewritten_without_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    fn = layer("p.unsqueeze(-1), first")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for seed, sizes in enumerate(((3, 0, 5), (7, 2, 9), (1, 1, 20))):
        x, w, offs, p = make(sizes=sizes, seed=seed)
        assert torch.equal(compiled(x, w, offs, p), fn(x, w, offs, p))
    assert counter.frame_count == 1
    x, w, offs, p = make()
    assert ROW_SCALED in inductor_kernels(fn, x, w, offs, p, dynamic=True)


def test_a_users_own_pre_grad_pass_runs_first_and_is_kept():
    import torch._inductor.config as config

    seen = []

    def users_pass(graph):
        seen.append(sum(1 for _ in graph.nodes))

    x, w, offs, p = make()
    with _compat.inductor_config_patch(pre_grad_custom_pass=users_pass):
        _compat.add_pre_grad_pass(user_patterns.PASS)
        _compat.add_pre_grad_pass(user_patterns.PASS)  # idempotent
        chained = config.pre_grad_custom_pass
        assert chained.first is users_pass and chained.second is user_patterns.PASS
        assert chained.uuid() is None  # the user's pass has none: no caching, as before
        kernels = inductor_kernels(layer("p[:, None]"), x, w, offs, p).splitlines()
    assert seen and ROW_SCALED in kernels
    assert config.pre_grad_custom_pass is user_patterns.PASS


PAIR_OPS = ("torch.ops.compileops.grouped_linear_swiglu_pair_with_preact.default",
            "torch.ops.compileops.grouped_linear_swiglu_pair.default")
silu = torch.nn.functional.silu

SWIGLU_SPELLINGS = {
    "silu(gate) * up": lambda x, w1, w3, offs: silu(gl(x, w1, offs)) * gl(x, w3, offs),
    "up * silu(gate)": lambda x, w1, w3, offs: gl(x, w3, offs) * silu(gl(x, w1, offs)),
    "torch.mul, nn.SiLU": lambda x, w1, w3, offs: torch.mul(
        torch.nn.SiLU()(gl(x, w1, offs)), gl(x, w3, offs)),
}


def make_pair(dtype=torch.float32, sizes=(5, 0, 17, 3), k=24, h=20, seed=0):
    x, w1, offs, _ = make(dtype, sizes, k, h, seed)
    w3 = (torch.randn(w1.shape, generator=torch.Generator().manual_seed(seed + 100))
          / k**0.5).to(dtype)
    return x, w1, w3, offs


def _pair_in(kernels: str) -> bool:
    lines = kernels.splitlines()
    return any(op in lines for op in PAIR_OPS) and PLAIN not in lines


@pytest.mark.parametrize("spelling", list(SWIGLU_SPELLINGS))
def test_written_out_swiglu_becomes_the_pair_kernel(spelling):
    """Each spelling compiles to the pair op alone (no plain product left), forward and
    backward, and computes what ``grouped_linear_swiglu(..., up_weight=)`` computes, bitwise
    (fp32), with the same gradients."""
    fn = SWIGLU_SPELLINGS[spelling]
    x, w1, w3, offs = make_pair()
    assert _pair_in(inductor_kernels(fn, x, w1, w3, offs))
    leaves = [t.clone().requires_grad_() for t in (x, w1, w3)]
    got = torch.compile(fn, fullgraph=True)(leaves[0], leaves[1], leaves[2], offs)
    exact = [t.clone().requires_grad_() for t in (x, w1, w3)]
    want = compileops.grouped_linear_swiglu(exact[0], exact[1], offs, up_weight=exact[2])
    assert torch.equal(got, want)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    got.backward(grad)
    want.backward(grad)
    for a, b in zip(leaves, exact):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_module_parameters_rewritten():
    """torchtitan's experts' form: w1 and w3 as parameters of a module, compiled whole."""
    x, w1, w3, offs = make_pair()

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w3.clone())

        def forward(self, x, offs):
            return silu(gl(x, self.w1, offs)) * gl(x, self.w3, offs)

    experts = Experts()
    assert _pair_in(inductor_kernels(experts, x, offs))
    got = torch.compile(experts, fullgraph=True)(x, offs)
    assert torch.equal(got, compileops.grouped_linear_swiglu(x, w1, offs, up_weight=w3))


SWIGLU_LEFT_ALONE = {
    # two inputs: not one product's rows
    "other x": lambda x, w1, w3, offs, b: silu(gl(x, w1, offs)) * gl(x * 2, w3, offs),
    # other groups
    "other offsets": lambda x, w1, w3, offs, b: silu(gl(x, w1, offs)) * gl(
        x, w3, offs.clamp(max=10)),
    # a bias: the pair has none
    "with a bias": lambda x, w1, w3, offs, b: silu(gl(x, w1, offs, b)) * gl(x, w3, offs),
    # the gate's product used again: its [M, H] must exist
    "gate used twice": lambda x, w1, w3, offs, b: (
        lambda g: silu(g) * gl(x, w3, offs) + g)(gl(x, w1, offs)),
    # the activation used again
    "silu used twice": lambda x, w1, w3, offs, b: (
        lambda a: a * gl(x, w3, offs) + a)(silu(gl(x, w1, offs))),
    # not SiLU
    "relu": lambda x, w1, w3, offs, b: torch.relu(gl(x, w1, offs)) * gl(x, w3, offs),
}


@pytest.mark.parametrize("case", list(SWIGLU_LEFT_ALONE))
def test_other_swiglu_forms_are_left_as_written(case):
    x, w1, w3, offs = make_pair()
    b = torch.randn(w1.shape[0], w1.shape[1])
    fn = SWIGLU_LEFT_ALONE[case]
    kernels = inductor_kernels(fn, x, w1, w3, offs, b).splitlines()
    assert not any(op in kernels for op in PAIR_OPS), kernels
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x, w1, w3, offs, b),
                               fn(x, w1, w3, offs, b), rtol=0, atol=0)


def _row_scale_under_no_grad(x, w, offs, p):
    with torch.no_grad():
        y = gl(x, w, offs)
    return y * p[:, None]


def _pair_gate_under_no_grad(x, w1, w3, offs):
    with torch.no_grad():
        g = gl(x, w1, offs)
    return silu(g) * gl(x, w3, offs)


def _row_scale_x_written_between(x, w, offs, p):
    y = gl(x, w, offs)
    x.mul_(2)
    return y * p[:, None]


def _row_scale_p_written_after_its_column(x, w, offs, p):
    column = p.to(torch.float32)[:, None]
    p.mul_(2)
    return gl(x, w, offs) * column


def _pair_x_written_between(x, w1, w3, offs):
    g = gl(x, w1, offs)
    x.add_(1)
    return silu(g) * gl(x, w3, offs)


def _pair_weight_zeroed_between(x, w1, w3, offs):
    g = gl(x, w1, offs)
    u = gl(x, w3, offs)
    w1.zero_()
    return silu(g) * u


def _pair_x_set_between(x, w1, w3, offs):
    g = gl(x, w1, offs)
    x[0] = 1.0
    return silu(g) * gl(x, w3, offs)


#: Programs where the fused op, put at the multiply, would compute under another grad mode
#: or on values written in place since the products read them: left as written.
ACROSS_A_BARRIER = {
    "row scale, product under no_grad": (_row_scale_under_no_grad, "row"),
    "pair, gate under no_grad": (_pair_gate_under_no_grad, "pair"),
    "row scale, x written in place": (_row_scale_x_written_between, "row"),
    "row scale, p written after its column": (_row_scale_p_written_after_its_column, "row"),
    "pair, x written in place": (_pair_x_written_between, "pair"),
    "pair, w1 zeroed in place": (_pair_weight_zeroed_between, "pair"),
    "pair, x set by index": (_pair_x_set_between, "pair"),
}


@pytest.mark.parametrize("case", list(ACROSS_A_BARRIER))
def test_no_rewrite_across_grad_mode_switches_or_in_place_writes(case):
    """Compiled equals eager, and the products stay apart: values, and where no input is
    written in place (autograd refuses a backward through those), gradients, None where
    eager has none."""
    fn, kind = ACROSS_A_BARRIER[case]
    args = list(make()) if kind == "row" else list(make_pair())
    with_grad = "no_grad" in case
    runs = []
    for run in (fn, torch.compile(fn, fullgraph=True)):
        torch._dynamo.reset()
        leaves = [a.clone().requires_grad_(with_grad and a.is_floating_point()) for a in args]
        y = run(*leaves)
        if with_grad:
            y.sum().backward()
        runs.append((y.detach(), [a.grad for a in leaves if a.is_floating_point()]))
    (y_e, g_e), (y_c, g_c) = runs
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_c, g_e):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    kernels = inductor_kernels(fn, *[a.clone() for a in args]).splitlines()
    assert ROW_SCALED not in kernels and not any(op in kernels for op in PAIR_OPS), kernels


def test_pair_refuses_fp8_only_options_without_fp8():
    x, w1, w3, offs = make_pair()
    for option in ("cache_fp8_weights", "fp8_fast_accum"):
        with pytest.raises(ValueError, match="needs fp8"):
            compileops.grouped_linear_swiglu(x, w1, offs, up_weight=w3, **{option: True})


def _swiglu_errors(run, x, w1, w3, offs, grad):
    """Relative L2 errors of (y, dX, dW1, dW3) from ``run`` against fp64 autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w3)]
    y = run(*leaves, offs)
    y.backward(grad)
    exact = [t.detach().double().requires_grad_() for t in (x, w1, w3)]
    y64 = SWIGLU_SPELLINGS["silu(gate) * up"](*exact, offs)
    y64.backward(grad.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return [rel(y, y64)] + [rel(a.grad, b.grad) for a, b in zip(leaves, exact)]


def test_bf16_swiglu_rewrite_no_less_accurate_than_written_out():
    """bf16 (the reference backend, which rounds as a GPU does): the pair's output and
    gradients are within the bf16 bound of fp64 and within 1.25x (plus a bf16 ulp's worth)
    of the written-out form's own error; its forward rounds once where the written-out form
    rounds three times."""
    x, w1, w3, offs = make_pair(torch.bfloat16, sizes=(40, 0, 70, 30), k=64, h=48)
    grad = torch.randn(x.shape[0], w1.shape[1]).bfloat16()
    fn = SWIGLU_SPELLINGS["silu(gate) * up"]
    with backends.use_backend("reference"):
        written = _swiglu_errors(fn, x, w1, w3, offs, grad)
        compiled = _swiglu_errors(torch.compile(fn, fullgraph=True), x, w1, w3, offs, grad)
    assert _pair_in(inductor_kernels(fn, x, w1, w3, offs))
    for what, got, ref in zip(("y", "dX", "dW1", "dW3"), compiled, written):
        assert got <= 1e-2, (what, got)
        assert got <= 1.25 * ref + 1e-3, (what, got, ref)
    assert compiled[0] <= written[0], (compiled[0], written[0])


def test_swiglu_dynamic_shapes_rewritten_without_recompiles():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    fn = SWIGLU_SPELLINGS["up * silu(gate)"]
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for seed, sizes in enumerate(((3, 0, 5), (7, 2, 9), (1, 1, 20))):
        x, w1, w3, offs = make_pair(sizes=sizes, seed=seed)
        assert torch.equal(compiled(x, w1, w3, offs),
                           compileops.grouped_linear_swiglu(x, w1, offs, up_weight=w3))
    assert counter.frame_count == 1
    x, w1, w3, offs = make_pair()
    assert _pair_in(inductor_kernels(fn, x, w1, w3, offs, dynamic=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpu_rewritten_product_keeps_the_written_out_bits(dynamic):
    """On a GPU (bf16 rounds to nearest there), the rewritten product's forward is the
    written-out one's, bitwise, at an MoE down projection's size; its gradients are
    deterministic and within the bf16 bound of fp64."""
    from compileops.grouped_linear.routing import dirichlet_offsets

    gen = torch.Generator().manual_seed(0)
    g, k, n, m = 16, 768, 2048, 8192
    offs = dirichlet_offsets(g, m - 5, generator=gen).cuda()
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(g, n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    p = torch.rand(m, generator=gen).cuda()
    fn = layer("column, then cast")
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    assert torch.equal(compiled(x, w, offs, p), fn(x, w, offs, p))
    grad = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, p)]
        compiled(leaves[0], leaves[1], offs, leaves[2]).backward(grad)
        runs.append([t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, p)]
    with backends.use_backend("reference"):  # fp64 runs there
        fn(*leaves[:2], offs, leaves[2]).backward(grad.double())
    for got, want, what in zip(runs[0], leaves, ("dX", "dW", "dp")):
        assert_close_to_reference(got, want.grad, max_relative_error=1e-2, what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpu_rewritten_swiglu_is_the_pair_kernel_bitwise(dynamic):
    """On a GPU, at an MoE gate/up size: the compiled written-out SwiGLU computes the pair
    kernel's forward bits (the eager launcher's), and its forward and gradients are those of
    the pair called explicitly and compiled the same way, bitwise, static and dynamic (the
    compiled dX template may block K unlike the eager launcher, so eager gradients are not
    its bits)."""
    from compileops.grouped_linear.routing import dirichlet_offsets

    gen = torch.Generator().manual_seed(0)
    g, k, h, m = 16, 2048, 768, 8192
    offs = dirichlet_offsets(g, m - 5, generator=gen).cuda()
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    w1, w3 = ((torch.randn(g, h, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
              for _ in range(2))
    grad = torch.randn(m, h, generator=gen).to("cuda", torch.bfloat16)
    written = SWIGLU_SPELLINGS["silu(gate) * up"]

    def explicit(a, b, c, o):
        return compileops.grouped_linear_swiglu(a, b, o, up_weight=c)

    results = []
    for fn in (written, explicit):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        leaves = [t.clone().requires_grad_() for t in (x, w1, w3)]
        y = compiled(*leaves, offs)
        y.backward(grad)
        results.append([y.detach()] + [t.grad for t in leaves])
    for what, a, b in zip(("y", "dX", "dW1", "dW3"), *results):
        assert torch.equal(a, b), what
    leaves = [t.clone().requires_grad_() for t in (x, w1, w3)]
    assert torch.equal(results[0][0], explicit(*leaves, offs).detach())
