"""Triton kernels of the cross-tokenizer family, with their eager launchers.

One file per job:

* :mod:`.projection`: the sparse projection ``p @ M`` and its backward (CSR gathers).
* :mod:`.chunks`: the chunk segment sum and its backward gather.

Every kernel is a gather with a fixed summation order and no atomics, so every result is
deterministic and bitwise batch-invariant. No ``libdevice`` function is used, so everything
also runs under ``TRITON_INTERPRET=1``. Importing this package imports Triton: the ops
import it only when a kernel runs.
"""
from compileops.xtoken.kernels.chunks import (
    chunk_gather_kernel,
    chunk_sums,
    chunk_sums_backward,
    chunk_sums_kernel,
)
from compileops.xtoken.kernels.projection import (
    csr_gather_sum,
    csr_gather_sum_kernel,
    csr_match_sum,
    csr_match_sum_kernel,
)

__all__ = [
    "chunk_gather_kernel",
    "chunk_sums",
    "chunk_sums_backward",
    "chunk_sums_kernel",
    "csr_gather_sum",
    "csr_gather_sum_kernel",
    "csr_match_sum",
    "csr_match_sum_kernel",
]
