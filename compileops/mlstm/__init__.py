"""The mLSTM with its multi-head layernorm fused (the parallel form).

Importing this package registers ``compileops::mlstm_parallel`` and
``compileops::mlstm_parallel_backward``. Triton is imported only when a kernel runs.
"""
from compileops.mlstm.api import mlstm, mlstm_with_stats
from compileops.mlstm.module import (
    MultiHeadLayerNorm,
    convert_xlstm_state_dict,
    mLSTMLayer,
    mLSTMLayerConfig,
)

__all__ = ["mlstm", "mlstm_with_stats", "MultiHeadLayerNorm", "convert_xlstm_state_dict",
           "mLSTMLayer", "mLSTMLayerConfig"]
