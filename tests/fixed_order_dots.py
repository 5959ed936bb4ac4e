"""``tl.dot`` under Triton's interpreter with a summation order that tests control.

The interpreter computes ``tl.dot`` with numpy's ``matmul``, that is with the CPU's BLAS,
whose order of summation over K depends on the processor and on the matrix shapes (OpenBLAS
picks its kernels by core type: the same call gives other bits on an AMD EPYC than on an
Intel Xeon, and other bits for 16 columns than for 64). A test that claims bits across tile
shapes (a value tile of 16 columns against one of 64) would then test the BLAS, not our
kernel. Inside :func:`fixed_order_dots`, every interpreter dot sums over K in ascending
order, one rounded product and one rounded add per term, element by element: the bits of
each output element depend only on its own row of A and column of B, as on the GPU's MMA.
Slower than BLAS: for the few tests that claim bits.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


class _FixedOrderNumpy:
    """numpy, except ``matmul``, which sums over K term by term in ascending order."""

    def __init__(self, numpy):
        self._numpy = numpy

    def __getattr__(self, name):
        return getattr(self._numpy, name)

    def matmul(self, a, b, dtype=None):
        np = self._numpy
        dtype = dtype or np.result_type(a, b)
        a, b = np.asarray(a, dtype=dtype), np.asarray(b, dtype=dtype)
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        out = np.zeros(batch + (a.shape[-2], b.shape[-1]), dtype=dtype)
        for k in range(a.shape[-1]):
            out = out + a[..., :, k:k + 1] * b[..., k:k + 1, :]
        return out


@contextlib.contextmanager
def fixed_order_dots() -> Iterator[None]:
    """Interpreter dots in a fixed, shape-independent summation order (module docstring)."""
    import triton.runtime.interpreter as interpreter

    numpy = interpreter.np
    interpreter.np = _FixedOrderNumpy(numpy)
    try:
        yield
    finally:
        interpreter.np = numpy
