"""The embedding backward on the device: sort the ids, then launch the backward kernel, on one
stream or two (:func:`embedding_backward`; the options are :class:`BackwardConfig`)."""
from __future__ import annotations

from typing import Optional

import torch

from compileops._launch import interpreter_casts_wrongly
from compileops._library import as_rows

from .. import checks
from .backward import FILL_PROGRAMS, RUN_PROGRAMS, launch_backward_kernel
from .config import DEFAULT_BACKWARD, BackwardConfig, BackwardTiles
from .sort import hot_first_fits, id_counts, resolve_sort, sort_ids, touched_map


def embedding_backward(
    grad: torch.Tensor,
    ids: torch.Tensor,
    num_embeddings: int,
    padding_idx: Optional[int],
    weight_dtype: torch.dtype,
    config: Optional[BackwardConfig] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """grad ``[*ids.shape, D]`` -> grad_weight ``[V, D]`` in ``weight_dtype``.

    Each row is the fp32 sum (fp64 for fp64 grads) of its tokens' grad rows, added one by one
    in token-position order; untouched rows and ``padding_idx`` get zeros. ``config``
    (default: ``BackwardConfig()``, the shipped defaults) changes how, never the result.

    ``out`` (``[V, D]``, ``weight_dtype``) may be given as the destination; its prior contents
    never matter. Device-side work only, no host sync (CUDA-graph capturable): a stable sort,
    then one kernel launch (``fill="map"`` adds two launches for the touched map).

    The two-stream schedule (the default on CUDA) builds the touched map (``hot_first``: the
    id counts, which also order the sort) from the unsorted ids and launches the fill
    programs with it on the current stream, while a high-priority side stream sorts the ids
    and runs the run programs. The sort leaves the critical path, and the latency-bound
    hot-id chains are scheduled ahead of the remaining fill blocks. Each row is still
    written by exactly one program: the result is bitwise that of ``streams=False``.
    """
    config = config or DEFAULT_BACKWARD
    dim = grad.shape[-1]
    flat_grad = as_rows(grad)  # a view, also for stride-0 (expanded) grads
    flat_ids = checks.flatten_ids(ids)
    n_tokens = flat_ids.numel()
    if out is None:
        out = torch.empty((num_embeddings, dim), dtype=weight_dtype, device=grad.device)
    if num_embeddings == 0 or dim == 0:
        return out
    if n_tokens == 0:
        return out.zero_()
    if interpreter_casts_wrongly(flat_grad.dtype, out.dtype):
        # fp64 sums into a bf16 table, under the interpreter: summed in fp64, rounded by torch
        return out.copy_(embedding_backward(grad, ids, num_embeddings, padding_idx,
                                            torch.float64, config))
    tiles = config.resolve(flat_grad, out.dtype)
    sort = resolve_sort(config.sort, flat_ids, num_embeddings)
    streams = config.streams
    if streams is None:  # on for CUDA tensors
        streams = grad.device.type == "cuda"
    streams = streams and grad.device.type == "cuda"
    fits = sort == "triton" and hot_first_fits(n_tokens, num_embeddings)
    hot_first = config.hot_first
    if hot_first is None:  # the two-stream schedule's default, where the keys fit
        hot_first = streams and fits
    if hot_first and not (fits and (streams or config.fill == "map")):
        raise ValueError("hot_first needs the Triton sort (sort='triton', or 'auto' on CUDA), "
                         "keys that fit (sort.hot_first_fits) and a touched map (the two-stream "
                         "schedule or fill='map'): the fill's binary search needs id order")
    if streams:
        _two_stream_backward(flat_ids, num_embeddings, flat_grad, out, padding_idx, tiles,
                             sort, hot_first)
        return out
    counts = id_counts(flat_ids, num_embeddings) if hot_first else None
    sorted_ids, order = sort_ids(flat_ids, num_embeddings, sort, counts)
    if hot_first:
        touched = counts  # nonzero on touched rows: the fill reads it as its map
    else:
        touched = touched_map(flat_ids, num_embeddings) if config.fill == "map" else None
    launch_backward_kernel(sorted_ids, order, touched, flat_grad, out, padding_idx, tiles)
    return out


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The high-priority stream of a CUDA device for the sort and the run programs, created
    on first use and kept."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        _, highest = torch.cuda.Stream.priority_range()
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=highest)
    return stream


def _two_stream_backward(flat_ids: torch.Tensor, num_embeddings: int, flat_grad: torch.Tensor,
                         out: torch.Tensor, padding_idx: Optional[int], tiles: BackwardTiles,
                         sort: str, hot_first: bool) -> None:
    """The two-stream schedule (see ``embedding_backward``). Fork and join are stream waits
    on events, so CUDA graph capture records both branches. Every tensor the side stream
    touches is allocated on the current stream before the fork, or on the side stream
    itself, and the current stream joins the side stream before returning: no block can be
    freed and reused while the side stream still reads or writes it."""
    main = torch.cuda.current_stream(flat_grad.device)
    side = _side_stream(flat_grad.device)
    # The touched map; hot_first: the id counts, which also order the sort.
    touched = id_counts(flat_ids, num_embeddings) if hot_first else \
        touched_map(flat_ids, num_embeddings)
    # The fill launch reads no sorted ids (it has the touched map), but takes an int32
    # pointer there: a one-element stand-in keeps one compiled variant for any ids dtype.
    no_ids = torch.empty(1, dtype=torch.int32, device=flat_ids.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        sorted_ids, order = sort_ids(flat_ids, num_embeddings, sort,
                                     touched if hot_first else None)
        launch_backward_kernel(sorted_ids, order, None, flat_grad, out, padding_idx, tiles,
                               RUN_PROGRAMS)
    launch_backward_kernel(no_ids, no_ids, touched, flat_grad, out, padding_idx, tiles,
                           FILL_PROGRAMS)
    main.wait_stream(side)
    # The side stream's own allocations (sorted ids, positions) go back to its pool when
    # these names are dropped; later side-stream work is ordered after this launch.
    del sorted_ids, order
