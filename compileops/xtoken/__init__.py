"""Cross-tokenizer distillation: fp32 sparse projection, chunk averaging, projection files.

Importing this package registers ``compileops::xtoken_project``,
``compileops::xtoken_project_backward``, ``compileops::xtoken_chunk_sums`` and
``compileops::xtoken_chunk_sums_backward``. Triton is imported only when a kernel runs.
"""
from compileops.xtoken.chunks import chunk_average, chunk_sums, valid_chunk_mask
from compileops.xtoken.distributed import dp_all_reduce_sum
from compileops.xtoken.files import clear_caches, get_projection, parse_projection_file
from compileops.xtoken.module import SparseProjection
from compileops.xtoken.projection import ProjectionCOO, ProjectionCSR, build_csr, project
from compileops.xtoken.token_map import ExactTokenMap, build_exact_token_map

__all__ = [
    "ExactTokenMap",
    "ProjectionCOO",
    "ProjectionCSR",
    "SparseProjection",
    "build_csr",
    "build_exact_token_map",
    "chunk_average",
    "chunk_sums",
    "clear_caches",
    "dp_all_reduce_sum",
    "get_projection",
    "parse_projection_file",
    "project",
    "valid_chunk_mask",
]
