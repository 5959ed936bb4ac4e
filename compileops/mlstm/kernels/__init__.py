"""Triton kernels of the mLSTM family, with their eager launchers.

* :mod:`.forward`: the parallel forward with the multi-head layernorm fused (tile body,
  kernel, launcher); the Inductor template calls the same tile body;
* :mod:`.backward`: the norm-backward row preprocess, the dQ programs and the dK/dV programs;
* :mod:`.common`: the MMA wrapper and tile loads they share;
* :mod:`.chunkwise`: the chunkwise form's state walks (the states between chunks, forward and
  backward);
* :mod:`.config`: tile configs and the heuristics that pick them.
"""
from compileops.mlstm.kernels.backward import cell_backward
from compileops.mlstm.kernels.norm_backward import norm_backward
from compileops.mlstm.kernels.config import (
    BackwardConfig,
    ForwardConfig,
    StateConfig,
    choose_backward_config,
    choose_forward_config,
    choose_state_config,
    head_tile,
    norm_rows_per_program,
)
from compileops.mlstm.kernels.forward import mlstm_forward, mlstm_forward_tile

__all__ = [
    "BackwardConfig",
    "ForwardConfig",
    "StateConfig",
    "cell_backward",
    "choose_backward_config",
    "choose_forward_config",
    "choose_state_config",
    "head_tile",
    "mlstm_forward",
    "mlstm_forward_tile",
    "norm_backward",
    "norm_rows_per_program",
]
