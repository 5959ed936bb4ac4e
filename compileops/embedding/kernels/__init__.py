"""Triton kernels of the embedding family, with their eager launchers.

* ``forward.py``: the row gather (``embedding_forward``).
* ``backward.py``: the backward kernel, one launch writing every row of ``grad_weight``
  once (``launch_backward_kernel``).
* ``sort.py``: the stable id sort and the per-id maps the backward reads.
* ``schedule.py``: the backward on the device, sort then kernel, on one or two streams
  (``embedding_backward``).
* ``config.py``: the launch options, the tuning API (``ForwardConfig``, ``BackwardConfig``).

Imported lazily by ``compileops.embedding.op`` (Triton's interpreter must be switched on
before any kernel is defined). See ``docs/architecture.md``.
"""
from .backward import (
    ALL_PROGRAMS,
    FILL_MAP,
    FILL_PROGRAMS,
    FILL_SEARCH,
    RUN_PROGRAMS,
    embedding_backward_kernel,
    launch_backward_kernel,
)
from .config import BackwardConfig, BackwardTiles, ForwardConfig
from .forward import embedding_forward, embedding_forward_kernel, gather_rows_tile
from .schedule import embedding_backward
from .sort import (
    MAX_TOKENS,
    hot_first_fits,
    id_counts,
    resolve_sort,
    sort_ids,
    stable_sort_ids,
    touched_map,
)

__all__ = [
    "ALL_PROGRAMS", "FILL_MAP", "FILL_PROGRAMS", "FILL_SEARCH", "MAX_TOKENS", "RUN_PROGRAMS",
    "BackwardConfig", "BackwardTiles", "ForwardConfig",
    "embedding_backward", "embedding_backward_kernel", "embedding_forward",
    "embedding_forward_kernel", "gather_rows_tile", "hot_first_fits", "id_counts",
    "launch_backward_kernel", "resolve_sort", "sort_ids", "stable_sort_ids", "touched_map",
]
