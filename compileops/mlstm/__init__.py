"""The mLSTM with its multi-head layernorm fused: the parallel form, the chunkwise form
(states in and out, packed documents) and the one-token step for generation.

Importing this package registers ``compileops::mlstm_parallel``, ``compileops::mlstm_chunkwise``
(:mod:`compileops.mlstm.chunkwise`), their backward ops, ``compileops::mlstm_log_forget``,
``compileops::mlstm_column_terms`` (the forward's stabiliser, for its lowering) and
``compileops::mlstm_step`` (:mod:`compileops.mlstm.step`). Triton is imported only when a
kernel runs.
"""
from compileops.mlstm.api import mlstm, mlstm_with_stats
from compileops.mlstm.op import fast_gate_gradients, set_fast_gate_gradients
from compileops.mlstm.step import mlstm_step
from compileops.mlstm.module import (
    MultiHeadLayerNorm,
    convert_xlstm_state_dict,
    mLSTMLayer,
    mLSTMLayerConfig,
)

__all__ = ["mlstm", "mlstm_step", "mlstm_with_stats", "MultiHeadLayerNorm",
           "convert_xlstm_state_dict", "fast_gate_gradients", "mLSTMLayer", "mLSTMLayerConfig",
           "set_fast_gate_gradients"]
