"""fp64 to 16-bit conversions round as torch's ``.to`` does (fp64 -> fp32 -> 16-bit), in the
Triton kernels, the reference and the compiled lowering, at the values where rounding once
and rounding twice differ: an fp64 value a hair past a half-precision tie, which fp32 rounds
onto the tie (a GPU's own fp64 -> fp16 instruction rounds it up; torch rounds to even).

A fuzzed case showed it: 37 fp64 gradient rows summed into one fp16 row came back an ulp from
the reference's."""
import os

import pytest
import torch

import compileops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_INTERPRETER = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["reference"] + (["triton"] if DEVICE == "cuda" or ON_INTERPRETER else [])

#: ``{dtype: (a value past a tie, torch's rounding of it, rounding once)}``
TIES = {
    torch.float16: (1 + 2**-11 + 2**-30, 1.0, 1 + 2**-10),
    torch.bfloat16: (1 + 2**-8 + 2**-30, 1.0, 1 + 2**-7),
}
DTYPES = [torch.float16, torch.bfloat16]


def _table(value, dim=8):
    """``[2, dim]`` fp64: row 0 is ``±value`` alternating, row 1 ones."""
    signs = torch.tensor([1.0, -1.0] * (dim // 2), dtype=torch.float64)
    return torch.stack([signs * value, torch.ones(dim, dtype=torch.float64)]).to(DEVICE)


def test_the_ties_are_ties():
    """The premise: torch rounds twice, and rounding once would differ."""
    for dtype, (value, twice, once) in TIES.items():
        x = torch.tensor([value], dtype=torch.float64)
        assert x.to(dtype).item() == twice != once, dtype
        assert x.float().to(dtype).item() == twice, dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_fp64_table_read_as_16_bit_rounds_as_torch(backend, dtype):
    table = _table(TIES[dtype][0])
    ids = torch.tensor([0, 1, 0], device=DEVICE)
    with compileops.use_backend(backend):
        got = compileops.embedding(ids, table, out_dtype=dtype)
    assert torch.equal(got, table[ids].to(dtype))
    assert got[0, 0].item() == TIES[dtype][1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_16_bit_table_gradient_summed_in_fp64_rounds_as_torch(backend, dtype):
    """Two fp64 gradient rows for row 0, 1 and the rest: their exact sum is past a tie."""
    value = TIES[dtype][0]
    weight = torch.zeros(2, 8, dtype=dtype, device=DEVICE).requires_grad_()
    ids = torch.tensor([0, 0, 1], device=DEVICE)
    grad = torch.stack([torch.ones(8, dtype=torch.float64),
                        torch.full((8,), value - 1, dtype=torch.float64),
                        torch.full((8,), value, dtype=torch.float64)]).to(DEVICE)
    with compileops.use_backend(backend):
        compileops.embedding(ids, weight, out_dtype=torch.float64).backward(grad)
    want = torch.stack([grad[0] + grad[1], grad[2]]).to(dtype)
    assert torch.equal(weight.grad, want)
    assert weight.grad[0, 0].item() == TIES[dtype][1]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_compiled_fp64_table_read_as_16_bit_rounds_as_torch(dtype):
    """The Inductor lowering (pointwise IR, so its own conversion code)."""
    table = _table(TIES[dtype][0])
    ids = torch.tensor([0, 1, 0], device=DEVICE)

    def read(i, t):
        return compileops.embedding(i, t, out_dtype=dtype) * 1

    torch._dynamo.reset()
    got = torch.compile(read, fullgraph=True)(ids, table)
    assert torch.equal(got, table[ids].to(dtype))
