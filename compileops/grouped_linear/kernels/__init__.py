"""Triton kernels of the grouped linear family, with their eager launchers.

Two persistent grouped products (a fixed grid of programs that walk the tiles), both
reading the group offsets on the device (no host sync, CUDA-graph safe):

* M-jagged, ``out[rows_g] = A[rows_g] @ B_g (+ bias_g)``: the forward, dX and the fused
  SwiGLU forward (:mod:`.mjagged`);
* K-jagged, ``dW_g = dY_g^T @ X_g`` with ``db_g = colsum(dY_g)`` in the same pass, bitwise
  deterministic (:mod:`.kjagged`).

One job per file:

* :mod:`.tiles`: group bounds from the offsets, the two tile spaces, the dW ticket counter;
* :mod:`.mjagged`: the M-jagged tile body, kernel and launchers;
* :mod:`.pair`: the launchers of a gate/up pair kept as two weights;
* :mod:`.kjagged`: the dW/db tile body, kernel and launcher;
* :mod:`.fp8` and :mod:`.fp8_wgrad`: the e4m3 quantisers and the fp8 products' launchers
  (the products are the kernels above, on e4m3 operands);
* :mod:`.tma`: TMA descriptors (ragged ones too), when a launch takes them, and the
  per-device fallback when one fails;
* :mod:`.config`: :class:`Config` (the tuning API), :class:`DeviceSpec` (the device a config
  is picked for, with the measured picks per device in ``TUNED``) and the heuristics.

The Inductor template (``lowerings/templates/grouped_linear.py.jinja``) imports the
M-jagged ``@triton.jit`` bodies from these modules, so no kernel math is written twice
(docs/architecture.md; docs/adding-an-op.md for the recipe).
"""
from compileops.grouped_linear.kernels.config import (
    BATCH_INVARIANT_CONFIG,
    FP8_WGRAD_LONG_CONFIG,
    H100_SXM,
    H200,
    INTERPRETER,
    INTERPRETER_CONFIG,
    TUNED,
    WGRAD_FP32_CONFIG,
    WGRAD_LONG_CONFIG,
    WGRAD_MID_CONFIG,
    WGRAD_SHORT_CONFIG,
    Config,
    DeviceSpec,
    choose_config,
    choose_fp8_wgrad_config,
    choose_wgrad_config,
    device_spec,
    interpreter_dot,
    grid_size,
    group_block,
    input_precision,
    num_programs,
)
from compileops.grouped_linear.kernels.fp8_wgrad import grouped_linear_wgrad_fp8
from compileops.grouped_linear.kernels.kjagged import (
    grouped_linear_wgrad,
    kjagged_gemm_kernel,
)
from compileops.grouped_linear.kernels.mjagged import (
    grouped_linear_dx,
    grouped_linear_forward,
    grouped_linear_swiglu_forward,
    mjagged_gemm,
    mjagged_gemm_kernel,
    mjagged_tile,
    scale_rows,
    swiglu,
)
from compileops.grouped_linear.kernels.pair import (
    grouped_linear_dx_pair,
    grouped_linear_swiglu_pair_forward,
)
from compileops.grouped_linear.kernels.tiles import group_tile_table, locate_tile
from compileops.grouped_linear.kernels.tma import (
    RAGGED_ROWS,
    Fallback,
    fell_back,
    make_descriptors,
    tma_applies,
    wgrad_tma_applies,
)

__all__ = [
    "BATCH_INVARIANT_CONFIG",
    "FP8_WGRAD_LONG_CONFIG",
    "H100_SXM",
    "H200",
    "INTERPRETER",
    "INTERPRETER_CONFIG",
    "RAGGED_ROWS",
    "TUNED",
    "WGRAD_FP32_CONFIG",
    "WGRAD_LONG_CONFIG",
    "WGRAD_MID_CONFIG",
    "WGRAD_SHORT_CONFIG",
    "Config",
    "DeviceSpec",
    "Fallback",
    "choose_config",
    "choose_fp8_wgrad_config",
    "choose_wgrad_config",
    "device_spec",
    "interpreter_dot",
    "fell_back",
    "grid_size",
    "group_block",
    "group_tile_table",
    "grouped_linear_dx",
    "grouped_linear_forward",
    "grouped_linear_swiglu_forward",
    "grouped_linear_swiglu_pair_forward",
    "grouped_linear_dx_pair",
    "grouped_linear_wgrad",
    "grouped_linear_wgrad_fp8",
    "input_precision",
    "kjagged_gemm_kernel",
    "locate_tile",
    "make_descriptors",
    "mjagged_gemm",
    "mjagged_gemm_kernel",
    "mjagged_tile",
    "num_programs",
    "scale_rows",
    "swiglu",
    "tma_applies",
    "wgrad_tma_applies",
]
