"""``compileops::swiglu_derivative``: the op equals the torch function eagerly, its compiled
values are the ones Inductor generates for the torch function (the column pieces and the
concatenation paths alike), bad shapes raise, and in a compiled fp8 backward at a row
wider than the persistent-reduction limit the derivative and dX's quantisation are one
kernel with the concatenation a GPU takes (lowerings/swiglu_derivative.py)."""
import os
import re

import pytest
import torch

import compileops
from compileops.grouped_linear.backward_ops import swiglu_derivative, swiglu_derivative_op
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import empty_fp8_cache  # noqa: F401  (a fixture)

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton for CPU tensors runs under the interpreter")


def _operands(rows, h, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    preact = (torch.randn(rows, 2 * h, generator=gen) * 3).to(dtype)
    grad = torch.randn(rows, h, generator=gen).to(dtype)
    return preact, grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_op_is_the_function(dtype):
    preact, grad = _operands(5, 24, dtype)
    before = preact.clone(), grad.clone()
    d = swiglu_derivative_op(preact, grad)
    assert d.dtype == dtype and d.shape == (5, 48)
    assert torch.equal(d, swiglu_derivative(preact, grad))
    assert torch.equal(preact, before[0]) and torch.equal(grad, before[1])
    torch.library.opcheck(swiglu_derivative_op, (preact, grad))


@pytest.mark.parametrize("preact_shape, grad_shape", [((4, 10), (4, 4)), ((4, 8), (3, 4)),
                                                      ((8,), (4, 4))])
def test_mismatched_shapes_raise(preact_shape, grad_shape):
    with pytest.raises(ValueError, match="preact must be"):
        swiglu_derivative_op(torch.zeros(preact_shape), torch.zeros(grad_shape))


def test_integer_tensors_raise():
    with pytest.raises(ValueError, match="floating-point"):
        swiglu_derivative_op(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 4))


@interpreter
@pytest.mark.parametrize("h", [48, 768, 1536], ids=["one-part", "two-pieces", "four-pieces"])
@pytest.mark.parametrize("pointwise_cat", [False, True], ids=["cpu-cat", "gpu-cat"])
def test_compiled_op_is_the_compiled_function(h, pointwise_cat):
    """At H = 48 the halves go through Inductor's concatenation; at 768 and 1536 the row
    (2H > 1024) is written in the quantiser's 768-wide parts. Either way the bits of the
    torch function compiled."""
    preact, grad = _operands(6, h, torch.bfloat16, seed=h)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.inductor_config_patch(force_pointwise_cat=pointwise_cat):
        torch._dynamo.reset()
        want = torch.compile(swiglu_derivative, fullgraph=True)(preact, grad)
        torch._dynamo.reset()
        got = torch.compile(swiglu_derivative_op, fullgraph=True)(preact, grad)
    assert torch.equal(got, want)


def _backward_kernels(h):
    """The kernel definitions of the compiled fp8 SwiGLU backward (nothing runs), with the
    concatenation a GPU takes (``force_pointwise_cat``: Inductor's CUDA choice for the
    derivative's two halves)."""
    gen = torch.Generator().manual_seed(0)
    rows, dim, groups = 256, 2048, 4
    x = torch.randn(rows, dim, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(groups, 2 * h, dim, generator=gen) / dim ** 0.5).bfloat16().requires_grad_()
    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)

    def step(x, w):
        return compileops.grouped_linear_swiglu(x, w, offsets, fp8="rowwise",
                                                fp8_fast_accum=True).sum()

    sources: list[str] = []
    torch._dynamo.reset()
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.inductor_config_patch(force_pointwise_cat=True), \
            _compat.lower_only(sources), pytest.raises(_compat.LoweredOnly):
        torch.compile(step, fullgraph=True)(x, w)  # compiles the forward and the backward
    return re.findall(r"def (triton_\w+)\(", sources[-1])


@interpreter
@pytest.mark.usefixtures("empty_fp8_cache")
def test_fp8_backward_derivative_and_quantisation_are_one_kernel():
    """Qwen3-30B-A3B's H = 768: the row of the derivative (1536) is quantised in two parts of
    768; the derivative's kernel is that persistent reduction, and no other kernel reads
    the derivative back to quantise it."""
    kernels = _backward_kernels(768)
    # (written as torch ops, the derivative's kernel is named after its sigmoid)
    derivative = [k for k in kernels if "swiglu_derivative" in k or "sigmoid" in k]
    assert len(derivative) == 1, kernels
    assert derivative[0].startswith("triton_per_") and "fp8_dx_from_copy" in derivative[0], kernels
    assert not [k for k in kernels if k.startswith("triton_per_") and "dx_from_copy" in k
                and k not in derivative], kernels
