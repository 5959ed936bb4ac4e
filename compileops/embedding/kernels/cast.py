"""The one conversion rule of the embedding kernels: as torch's ``Tensor.to``.

torch converts fp64 to fp16 or bf16 through fp32 (two roundings: the half-precision types
are built from a float). A GPU's own fp64 -> fp16 instruction rounds once, and the two
differ by an ulp when the fp32 rounding lands on a half-precision tie (about 1 value in
8,000). The kernels promise torch's bits (``weight[ids].to(out_dtype)``, and the backward's
single cast of its sums), so they convert the way torch does.
"""
import triton
import triton.language as tl


@triton.jit
def cast_as_torch(x, DST: tl.constexpr):
    """``x`` converted to ``DST`` with torch's ``.to`` rounding (fp64 -> fp32 -> 16-bit)."""
    if x.dtype == tl.float64:
        if (DST == tl.float16) or (DST == tl.bfloat16):
            x = x.to(tl.float32)
    return x.to(DST)
