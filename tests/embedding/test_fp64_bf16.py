"""An fp64 table read as bf16 (``out_dtype=torch.bfloat16``), and a bf16 table read as fp64
(its gradient summed in fp64, then rounded to bf16): the Triton backend gives torch's
rounding, bitwise, on a GPU and under Triton's interpreter, whose own fp64 -> bf16 cast
writes wrong values (the launchers stage such results in fp64 there)."""
import os

import pytest
import torch

import compileops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton backend on CPU runs under the interpreter")


def _ids():
    return torch.tensor([[0, 5, 2, 5], [3, 3, 1, 5]], device=DEVICE)


def test_fp64_table_read_as_bf16():
    weight = torch.randn(6, 8, dtype=torch.float64, device=DEVICE)
    with compileops.use_backend("triton"):
        got = compileops.embedding(_ids(), weight, out_dtype=torch.bfloat16)
    assert torch.equal(got, weight[_ids()].to(torch.bfloat16))


def test_bf16_table_read_as_fp64_gets_its_gradient_rounded_from_fp64_sums():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 8, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_()
    grad = torch.randn(2, 4, 8, generator=gen, dtype=torch.float64).to(DEVICE)
    with compileops.use_backend("triton"):
        compileops.embedding(_ids(), weight, out_dtype=torch.float64).backward(grad)
    want = torch.zeros(6, 8, dtype=torch.float64, device=DEVICE)
    for token, row in enumerate(_ids().reshape(-1).tolist()):  # token order, in fp64
        want[row] += grad.reshape(-1, 8)[token]
    assert torch.equal(weight.grad, want.to(torch.bfloat16))
