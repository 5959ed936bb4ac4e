"""The mLSTM with its multi-head layernorm fused (the parallel form).

Importing this package registers ``compileops::mlstm_parallel`` and
``compileops::mlstm_parallel_backward``. Triton is imported only when a kernel runs.
"""
from compileops.mlstm.api import mlstm, mlstm_with_stats

__all__ = ["mlstm", "mlstm_with_stats"]
