"""The fp8 weight gradient of the grouped linear (experimental, opt-in through
``fp8_weight_grad=True``, rowwise):

* ``compileops::grouped_linear_wgrad_fp8(grad [M, N], x [M, K], offsets int32 [G],
  weight_dtype, fast_accum=False) -> dW [G, N, K]``: both operands quantised to e4m3 with
  one scale per group and column over the group's rows, the e4m3 products summed in fp32
  and scaled (:mod:`compileops.grouped_linear.fp8`, "dW in fp8"; the kernels:
  :mod:`compileops.grouped_linear.kernels.fp8_wgrad`). Compiled, an extern call, as the
  16-bit dW is.

The forward fp8 ops (:mod:`.fp8_op`) call it from their backward when their
``fp8_weight_grad`` is set.

**The cost of fp8 dW, in accuracy.** dW's relative L2 error against fp64 of the same bf16
operands (unit-normal x and dY, one group of 512 rows, K = N = 256, three seeds; the kernels
under Triton's interpreter, whose e4m3 products and fp32 sums are the GPU's up to summation
order): **3.68-3.73e-2 with fp8 dW**, the same as the fp8 forward and dX products' own. dW
from the bf16 operands: 1.65-1.66e-3 rounded (to nearest) to a bf16 weight's gradient, and
1.0e-7 as an fp32 master weight's gradient. So fp8 dW costs about 22 times a bf16 weight's
gradient error, and far more against fp32 master weights
(``tests/grouped_linear/test_fp8_weight_grad.py`` checks a smaller case against these
figures). A column's scale spans all of its group's rows, so a token far larger than the
rest coarsens that column for the whole group. That is why it is not the default:
``fp8="rowwise"`` alone keeps dW in x's dtype.
"""
from __future__ import annotations

import torch

from compileops._library import custom_op
from compileops.grouped_linear import fp8 as fp8_rule
from compileops.grouped_linear.backward_ops import use_triton
from compileops.grouped_linear.checks import check_offsets_eagerly, check_wgrad_args


@custom_op("grouped_linear_wgrad_fp8")
def grouped_linear_wgrad_fp8_op(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                                weight_dtype: torch.dtype,
                                fast_accum: bool = False) -> torch.Tensor:
    """fp8 ``dW [G, N, K] = grad_g^T x_g`` in ``weight_dtype`` for ``grad [M, N]`` and ``x [M,
    K]`` (bf16, fp16 or fp32), int32 ``offsets [G]``: both operands quantised to e4m3 with
    one scale per group and column over the group's rows, the e4m3 products summed in fp32
    and scaled (:func:`compileops.grouped_linear.fp8.grouped_linear_wgrad_reference`); empty
    groups give zeros. ``fast_accum``: the MMA accumulates over each group's whole
    reduction. Deterministic (no atomics, no split of the reduction). Not differentiable."""
    _check_wgrad_fp8(grad, x, offsets, weight_dtype)
    check_offsets_eagerly(offsets, grad.shape[0])
    if use_triton("grouped_linear_wgrad_fp8", grad):
        from compileops.grouped_linear.kernels import grouped_linear_wgrad_fp8

        return grouped_linear_wgrad_fp8(grad, x, offsets, weight_dtype, fast_accum=fast_accum)
    return fp8_rule.grouped_linear_wgrad_reference(grad, x, offsets).to(weight_dtype)


def _check_wgrad_fp8(grad, x, offsets, weight_dtype) -> None:
    check_wgrad_args(grad, x, offsets, weight_dtype)
    torch._check_type(grad.dtype != torch.float64,
                      lambda: "the fp8 weight gradient takes bf16, fp16 or fp32 operands, "
                              "got fp64")


@grouped_linear_wgrad_fp8_op.register_fake
def _grouped_linear_wgrad_fp8_fake(grad, x, offsets, weight_dtype, fast_accum=False):
    _check_wgrad_fp8(grad, x, offsets, weight_dtype)
    return grad.new_empty((offsets.shape[0], grad.shape[1], x.shape[1]), dtype=weight_dtype)
