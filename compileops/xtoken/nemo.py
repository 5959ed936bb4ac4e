"""NeMo-RL-compatible names for the cross-tokenizer distillation utilities.

A drop-in for ``nemo_rl.algorithms.x_token.loss_utils``: change one import,

    # from nemo_rl.algorithms.x_token import loss_utils
    from compileops.xtoken import nemo as loss_utils

and the same names, argument orders and return layouts run on compileops' kernels
(:mod:`compileops.xtoken`): the fp32 projection is the ``compileops::xtoken_project`` op (CSR
gathers in a fixed order, no atomics), chunk averaging is the ``compileops::xtoken_chunk_sums``
segment sum (not a one-hot ``bmm``). Every function here is a thin adapter: it converts
arguments and results to NeMo-RL's layout and adds checks, it holds no kernel math.

Both NeMo-RL APIs are here: the current one (``chunk_log_prob_sums``,
``chunk_average_finalize``, ``chunk_average_log_probs(..., cp_group=)``,
``slice_sparse_projection_rows``) and the older one's ``dp_all_reduce_sum``, which the current
code dropped.

Where NeMo-RL returns a silently wrong answer for bad input, these raise ``ValueError``
naming the argument instead; each docstring says which inputs. The file loaders hand out
copies (never the cached tensors) and key their caches by the file's identity, so a file
changed on disk is read again. ``docs/xtoken-nemo.md`` lists every difference from NeMo-RL
and the NeMo-RL functions not provided here (those that depend on its ``AlignmentBatch``
schema, its Ray IPC transport, DTensor or its tensor-parallel helpers).

This module is not imported by ``import compileops``; ``from compileops.xtoken import nemo``
imports it (it imports nothing heavier than :mod:`compileops.xtoken` itself).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple, Union

import torch

from compileops import modes
from compileops.xtoken.chunks import chunk_sums as _chunk_sums
from compileops.xtoken.chunks import valid_chunk_mask as _valid_chunk_mask
from compileops.xtoken.distributed import all_reduce_sum_with_grad
from compileops.xtoken.distributed import dp_all_reduce_sum as _dp_all_reduce_sum
from compileops.xtoken.file_cache import FileCache, resolve_device
from compileops.xtoken.files import (
    _max_plus_one,
    check_entry_ids,
    check_vocab_size,
    read_projection_entries,
)
from compileops.xtoken.op import project_op
from compileops.xtoken.projection import ProjectionCOO, ProjectionCSR, csr_from_coalesced
from compileops.xtoken.token_map import build_exact_token_map as _build_exact_token_map

PathLike = Union[str, os.PathLike]

__all__ = [
    "Fp32SparseMM",
    "build_exact_token_map",
    "chunk_average_finalize",
    "chunk_average_log_probs",
    "chunk_log_prob_sums",
    "clear_caches",
    "dp_all_reduce_sum",
    "get_sparse_projection_matrix",
    "get_topk_projection",
    "parse_projection_file",
    "slice_sparse_projection_rows",
    "valid_chunk_mask",
]

RELAXED_EXACT_MAP_THRESHOLD = 0.6

#: ``chunk_average_finalize`` divides by ``size + EMPTY_CHUNK_EPS`` (NeMo-RL's guard: an
#: empty chunk's zero sum stays 0). In fp32 it leaves every size >= 1 unchanged.
EMPTY_CHUNK_EPS = 1e-10

# Process-local caches, under NeMo-RL's names (so test code that clears them keeps working).
# Keys are ``(file identity, params)`` (see compileops.xtoken.file_cache): the file's
# absolute path, inode, size, mtime and ctime, then NeMo-RL's parameters with the device
# normalised ("cuda" -> "cuda:<current>"). The loaders hand out copies, never these values.
_SPARSE_PROJECTION_CACHE: Dict[tuple, torch.Tensor] = {}
_TOPK_PROJECTION_CACHE: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
_EXACT_TOKEN_MAP_CACHE: Dict[tuple, Dict[str, torch.Tensor]] = {}
_sparse_cache = FileCache(_SPARSE_PROJECTION_CACHE)
_topk_cache = FileCache(_TOPK_PROJECTION_CACHE)
_exact_map_cache = FileCache(_EXACT_TOKEN_MAP_CACHE)


def clear_caches() -> None:
    """Empty every cache of this module (not part of NeMo-RL's API)."""
    for cache in (_sparse_cache, _topk_cache, _exact_map_cache):
        cache.clear()


# ---------------------------------------------------------------------------------------
# Fp32SparseMM


def _csr_of_tensor(matrix: torch.Tensor) -> ProjectionCSR:
    """The CSR buffers of a ``[V_s, V_t]`` tensor (sparse COO, other sparse layouts or
    strided), built on its device from its current values, on every call: nothing is kept
    between calls, so a matrix changed in place (``.data`` and ``_values()`` included, which
    bypass the version counter) is always read as it is now. A coalesced COO matrix (what
    :func:`get_sparse_projection_matrix` returns) costs two sorts of its entries on the
    device and no host synchronisation."""
    if matrix.dim() != 2:
        raise ValueError(
            f"sparse_M must be a 2-D [V_s, V_t] matrix, got shape {tuple(matrix.shape)}"
        )
    if not matrix.is_floating_point():
        raise ValueError(f"sparse_M must hold real floating-point weights, got {matrix.dtype}")
    m = matrix.detach()
    if m.layout == torch.strided:
        m = m.to_sparse()
    elif m.layout != torch.sparse_coo:
        m = m.to_sparse_coo()
    num_student, num_teacher = m.shape
    # A sparse tensor built without its invariants checked can hold ids outside its shape.
    # On CPU that is free to check, before coalescing (which could merge such an entry into a
    # real one): a clear error. On CUDA the ids are not read on the host: an uncoalesced
    # matrix's outside entries become explicit zeros at (0, 0) before coalescing (they add
    # nothing), and a coalesced matrix's are left out of every CSR segment
    # (csr_from_coalesced); nothing reads out of bounds.
    raw = m._indices()
    cpu = raw.device.type == "cpu"
    if cpu or not m.is_coalesced():
        inside = (raw >= 0).all(0) & (raw[0] < num_student) & (raw[1] < num_teacher)
    if cpu:
        if raw.numel() and not bool(inside.all()):
            s, t = raw[:, (~inside).nonzero()[0, 0]].tolist()
            raise ValueError(f"sparse_M holds an entry at ({s}, {t}), outside its shape "
                             f"{tuple(m.shape)}")
    elif not m.is_coalesced():
        m = torch.sparse_coo_tensor(torch.where(inside, raw, 0),
                                    torch.where(inside, m._values(), 0), m.shape,
                                    check_invariants=False)
    m = m.coalesce()  # itself when already coalesced
    indices = m.indices()
    return csr_from_coalesced(indices, m.values(), num_student, num_teacher)


def _as_csr(sparse_M) -> ProjectionCSR:
    if isinstance(sparse_M, ProjectionCSR):
        return sparse_M
    if isinstance(sparse_M, torch.nn.Module) and hasattr(sparse_M, "csr"):  # SparseProjection
        return sparse_M.csr()
    if isinstance(sparse_M, torch.Tensor):
        return _csr_of_tensor(sparse_M)
    raise ValueError(
        "sparse_M must be a [V_s, V_t] torch tensor (sparse COO, as from "
        "get_sparse_projection_matrix), a compileops.xtoken.SparseProjection or a "
        f"ProjectionCSR; got {type(sparse_M).__name__}"
    )


class Fp32SparseMM:
    """``sparse_M.t() @ dense`` in fp32, also inside bf16 autocast, forward and backward.

    Call it like NeMo-RL's autograd Function: ``Fp32SparseMM.apply(sparse_M, dense)``.

    * ``sparse_M``: the frozen projection ``M [V_s, V_t]``: a sparse COO tensor (what
      :func:`get_sparse_projection_matrix` returns), any other 2-D torch tensor (sparse CSR or
      strided; converted), a :class:`compileops.xtoken.SparseProjection` or a
      :class:`compileops.xtoken.ProjectionCSR`. A tensor is converted to CSR buffers on each
      call, on its device without a host sync (two sorts of its entries; nothing cached, so
      in-place changes to it always count); its weights are used in fp32.
    * ``dense``: ``[V_s, N]``, any floating dtype.
    * returns fp32 ``[V_t, N]``: a transposed view of a contiguous ``[N, V_t]`` result (so
      ``out.t()`` is contiguous; use ``reshape``, not ``view``, on ``out`` itself).

    Gradients: ``grad_dense = M @ grad_out`` (in ``dense``'s dtype); ``M`` gets none.
    Summation order is fixed: deterministic and bitwise batch-invariant.

    Raises ``ValueError`` naming ``sparse_M`` or ``dense`` for a matrix that is not 2-D, a
    ``dense`` that is not 2-D or whose row count is not ``V_s``, and (CPU tensors) a sparse
    matrix holding an entry outside its shape.

    Unlike NeMo-RL this is not a ``torch.autograd.Function`` subclass (the op carries its own
    autograd): only ``apply`` is offered. Under ``torch.compile`` pass a ``SparseProjection`` or
    ``ProjectionCSR``: a torch sparse tensor cannot enter a compiled graph.
    """

    @staticmethod
    def apply(sparse_M, dense: torch.Tensor) -> torch.Tensor:
        csr = _as_csr(sparse_M)
        if not isinstance(dense, torch.Tensor) or dense.dim() != 2:
            raise ValueError(
                "dense must be a 2-D [V_s, N] tensor, got "
                + (f"shape {tuple(dense.shape)}" if isinstance(dense, torch.Tensor)
                   else type(dense).__name__)
            )
        if dense.shape[0] != csr.num_student:
            raise ValueError(
                f"dense must be [V_s, N] with V_s = sparse_M.shape[0] = {csr.num_student}, "
                f"got shape {tuple(dense.shape)}"
            )
        out = project_op(dense.t(), csr.col_indptr, csr.col_student_ids, csr.col_weights,
                         csr.row_indptr, csr.row_teacher_ids, csr.row_weights, None)
        return out.t()


# ---------------------------------------------------------------------------------------
# Chunk helpers


def _check_chunk_id_values(chunk_id: torch.Tensor, max_chunks: int) -> None:
    if chunk_id.numel() == 0:
        return
    bad = (chunk_id < -1) | (chunk_id >= max_chunks)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"chunk_id{list(pos)} = {int(chunk_id[pos])} is outside [-1, max_chunks) = "
            f"[-1, {max_chunks}); -1 marks a token in no chunk"
        )


def chunk_log_prob_sums(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk sums of ``log_probs`` and chunk sizes, not yet divided: summable across
    context-parallel ranks before :func:`chunk_average_finalize`.

    * ``log_probs``: ``[B, T, V]``, any floating dtype.
    * ``chunk_id``: ``[B, T]`` int64 (or int32), values in ``[-1, max_chunks)``; ``-1`` marks a
      token that belongs to no chunk.
    * returns ``chunk_sums [B, max_chunks, V]`` (0 for an empty chunk) in fp32, or fp64 for an
      fp64 ``log_probs`` (NeMo-RL: ``log_probs.dtype``), and ``chunk_sizes [B, max_chunks]``
      float32 (exact counts).

    Each chunk's rows are added in token order in fp32 (the ``compileops::xtoken_chunk_sums``
    segment sum: deterministic, batch-invariant, a ``-inf`` row affects only its chunk).
    Differentiable in ``log_probs`` (each token gets its chunk's gradient; ``-1`` tokens 0).

    Raises ``ValueError`` naming ``chunk_id`` for an id outside ``[-1, max_chunks)``, checked
    as in :func:`chunk_average_log_probs`.
    """
    if (isinstance(chunk_id, torch.Tensor) and chunk_id.dtype in (torch.int32, torch.int64)
            and not torch.compiler.is_compiling()
            and (chunk_id.device.type == "cpu" or modes.STRICT_INDEX_CHECKS.enabled())):
        _check_chunk_id_values(chunk_id, max_chunks)
    sums, sizes = _chunk_sums(log_probs, chunk_id, max_chunks)
    return sums.to(torch.promote_types(log_probs.dtype, torch.float32)), sizes


def chunk_average_finalize(
    chunk_sums: torch.Tensor, chunk_sizes: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``chunk_sums / (chunk_sizes + EMPTY_CHUNK_EPS)`` per chunk, and ``chunk_sizes``.

    * ``chunk_sums``: ``[B, C, V]`` (any leading dims ``[*, V]``), floating.
    * ``chunk_sizes``: ``[B, C]`` (``chunk_sums.shape[:-1]``), floating.
    * returns ``chunk_log_probs [B, C, V]`` in the promoted dtype of the two (fp32 for bf16
      sums and fp32 sizes) and ``chunk_sizes`` itself.

    The ``1e-10`` is added in ``chunk_sizes``' dtype: in fp32 it leaves every size >= 1 as
    it is, and an empty chunk's zero sum gives 0. Differentiable in ``chunk_sums``.

    Raises ``ValueError`` naming the argument when ``chunk_sizes`` is not
    ``chunk_sums.shape[:-1]`` (NeMo-RL would broadcast) or either is not floating.
    """
    for name, t in (("chunk_sums", chunk_sums), ("chunk_sizes", chunk_sizes)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got "
                             + (str(t.dtype) if isinstance(t, torch.Tensor)
                                else type(t).__name__))
    if chunk_sums.dim() < 1 or tuple(chunk_sizes.shape) != tuple(chunk_sums.shape[:-1]):
        raise ValueError(
            f"chunk_sizes must be chunk_sums.shape[:-1] = {tuple(chunk_sums.shape[:-1])} "
            f"([B, C] for [B, C, V] sums), got {tuple(chunk_sizes.shape)}"
        )
    return chunk_sums / (chunk_sizes.unsqueeze(-1) + EMPTY_CHUNK_EPS), chunk_sizes


def chunk_average_log_probs(
    log_probs: torch.Tensor,
    chunk_id: torch.Tensor,
    max_chunks: int,
    *,
    cp_group: Optional["torch.distributed.ProcessGroup"] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Average ``log_probs`` over the chunks given by ``chunk_id``.

    * ``log_probs``: ``[B, T, V]``, any floating dtype (with ``cp_group``: this rank's part
      of the sequence).
    * ``chunk_id``: ``[B, T]`` int64 (or int32), values in ``[-1, max_chunks)``; ``-1`` marks a
      token that belongs to no chunk.
    * ``cp_group``: a context-parallel process group, or ``None``. With more than one rank the
      chunk sums and sizes are summed across its ranks before the division (a chunk may span
      ranks), and every rank gets the same result; the gradient passes back through the sum
      to each rank's own tokens.
    * returns ``chunk_log_probs [B, max_chunks, V]`` in fp32 (fp64 for an fp64 ``log_probs``,
      the dtype NeMo-RL's promotion gives) and ``chunk_sizes [B, max_chunks]`` float32
      (exact counts).

    :func:`chunk_log_prob_sums`, the optional sum across ``cp_group``, then
    :func:`chunk_average_finalize`. An empty chunk gives 0; a ``-inf``/NaN row affects only its
    own chunk. Differentiable in ``log_probs`` (each token gets ``grad / size`` of its chunk;
    ``-1`` tokens get 0).

    Raises ``ValueError`` naming ``chunk_id`` for an id outside ``[-1, max_chunks)`` (NeMo-RL's
    one-hot would drop or misplace it). The check reads the ids on the host, so it runs for
    CPU tensors, and for CUDA tensors only under ``compileops.strict_index_checks()`` (one
    device sync); it never runs while compiling. ``ValueError`` too for a ``cp_group``
    without an initialised ``torch.distributed``.
    """
    sums, sizes = chunk_log_prob_sums(log_probs, chunk_id, max_chunks)
    sums = all_reduce_sum_with_grad(sums, cp_group)
    sizes = all_reduce_sum_with_grad(sizes, cp_group)
    return chunk_average_finalize(sums, sizes)


def valid_chunk_mask(
    s_sizes: torch.Tensor, t_sizes: torch.Tensor, pair_valid: torch.Tensor
) -> torch.Tensor:
    """``(s_sizes > 0) & (t_sizes > 0) & pair_valid``: both sides non-empty and the pair valid.

    ``s_sizes``, ``t_sizes``: chunk sizes (student, teacher), ``[B, C]`` or any other shape;
    ``pair_valid``: bool, the same shape. Returns bool of that shape.

    Raises ``ValueError`` naming the argument when the three shapes differ (NeMo-RL would
    broadcast silently) or when ``pair_valid`` is not bool (NeMo-RL's ``&`` with an integer
    mask is a bitwise and: ``True & 2 == 0``).
    """
    for name, t in (("s_sizes", s_sizes), ("t_sizes", t_sizes), ("pair_valid", pair_valid)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t_sizes.shape != s_sizes.shape:
        raise ValueError(f"t_sizes has shape {tuple(t_sizes.shape)} but s_sizes has "
                         f"{tuple(s_sizes.shape)}; they must match")
    if pair_valid.shape != s_sizes.shape:
        raise ValueError(f"pair_valid has shape {tuple(pair_valid.shape)} but s_sizes has "
                         f"{tuple(s_sizes.shape)}; they must match")
    if pair_valid.dtype != torch.bool:
        raise ValueError(f"pair_valid must be a bool tensor, got {pair_valid.dtype} "
                         "(convert it with pair_valid != 0)")
    # The shared function takes [B, C]; any other shape goes through it as one row.
    if s_sizes.dim() == 2:
        return _valid_chunk_mask(s_sizes, t_sizes, pair_valid)
    flat = [t.reshape(1, -1) for t in (s_sizes, t_sizes, pair_valid)]
    return _valid_chunk_mask(*flat).reshape(s_sizes.shape)


def dp_all_reduce_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum ``local`` (a scalar count) across the default process group, which is the
    data-parallel group when tensor and context parallelism are 1. (NeMo-RL's older API;
    its current code sums with ``group_all_reduce_sum`` in ``nemo_rl.distributed``.)

    Returns a fresh float32 tensor of ``local``'s shape; ``local`` is not modified. Without an
    initialised process group, a float32 copy of ``local``. ``local`` must be on a device the
    group's backend supports (CPU for gloo, CUDA for NCCL). Counts above 2**24 are not exact
    in float32.
    """
    return _dp_all_reduce_sum(local)


def slice_sparse_projection_rows(
    sparse_matrix: torch.Tensor, row_start: int, row_end: int
) -> torch.Tensor:
    """Rows ``[row_start, row_end)`` of a sparse COO projection ``[V_s, V_t]``: a new coalesced
    sparse COO tensor ``[row_end - row_start, V_t]`` of the same dtype and device, row ids
    shifted down by ``row_start`` (e.g. the student-vocab slab a tensor-parallel rank owns).
    ``sparse_matrix`` is not modified and shares no memory with the result; an uncoalesced
    one is coalesced first (duplicates summed).

    Pass the result to :meth:`Fp32SparseMM.apply` like the full matrix.

    Raises ``ValueError`` naming the argument for a ``sparse_matrix`` that is not a 2-D sparse
    COO tensor, or a range that is not ``0 <= row_start <= row_end <= V_s`` (ints; NeMo-RL
    returns rows past the matrix as empty ones).
    """
    if not (isinstance(sparse_matrix, torch.Tensor) and sparse_matrix.layout == torch.sparse_coo
            and sparse_matrix.dim() == 2):
        raise ValueError(
            "sparse_matrix must be a 2-D sparse COO tensor [V_s, V_t], got "
            + (f"{sparse_matrix.layout} of shape {tuple(sparse_matrix.shape)}"
               if isinstance(sparse_matrix, torch.Tensor) else type(sparse_matrix).__name__)
        )
    num_student, num_teacher = sparse_matrix.shape
    row_start = check_vocab_size(row_start, "row_start")
    row_end = check_vocab_size(row_end, "row_end")
    if not row_start <= row_end <= num_student:
        raise ValueError(f"need 0 <= row_start <= row_end <= V_s = {num_student}, got "
                         f"row_start={row_start}, row_end={row_end}")
    m = sparse_matrix.detach().coalesce()
    students, teachers = m.indices()
    in_slab = (students >= row_start) & (students < row_end)
    indices = torch.stack([students[in_slab] - row_start, teachers[in_slab]])
    # Filtering a coalesced matrix keeps it sorted and free of duplicates, and the kept ids
    # lie inside the new shape: no invariant check needed.
    return torch.sparse_coo_tensor(indices, m.values()[in_slab],
                                   (row_end - row_start, num_teacher),
                                   is_coalesced=True, check_invariants=False)


# ---------------------------------------------------------------------------------------
# Projection files


def parse_projection_file(path: PathLike) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Read a projection file (either format) into COO components, sentinels kept.

    Formats (``torch.save``d): dense top-k ``{"indices": LongTensor[V_s, k], "likelihoods":
    FloatTensor[V_s, k]}`` (extra keys are ignored), or sparse ``dict[(student_id,
    teacher_id)] -> count``.

    Returns ``(indices, values, v_student_inferred, v_teacher_inferred)``:

    * ``indices``: int64 ``[2, nnz]``, rows ``(student_idx, teacher_idx)``. Dense: every
      ``(s, j)`` slot in row-major order (``nnz = V_s * k``), ``-1`` teacher sentinels kept;
      sparse: the dict's entries in its order.
    * ``values``: float32 ``[nnz]`` (likelihoods, or counts).
    * ``v_student_inferred``: dense: ``V_s`` (the row count); sparse: ``max(student_idx) + 1``.
    * ``v_teacher_inferred``: ``max(teacher_idx >= 0) + 1``, 0 if there is none.

    No sizing or id-range policy is applied (that is the callers' job; the loaders below
    apply it). Files are read with ``torch.load(weights_only=True)``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file for
    anything else: an unknown format (an empty dict included), dense ``indices`` that are not
    integers (bools included) or ``likelihoods`` that are not real numbers, or arrays of
    different shapes; a sparse key that is not two ints (bools excluded) or does not fit
    int64, a count that is not a number (bools excluded).
    """
    entries = read_projection_entries(path)
    return entries.indices, entries.values, entries.num_student, entries.num_teacher


def _sparse_matrix_from_file(path: PathLike, student_vocab_size: int, teacher_vocab_size: int,
                             device: torch.device) -> torch.Tensor:
    entries = read_projection_entries(path)
    check_entry_ids(entries, path)
    keep = entries.indices[1] != -1
    indices, values = entries.indices[:, keep], entries.values[keep]
    num_student = max(student_vocab_size, _max_plus_one(indices[0]))
    num_teacher = max(teacher_vocab_size, _max_plus_one(indices[1]))
    return torch.sparse_coo_tensor(
        indices, values, (num_student, num_teacher), dtype=torch.float32,
        check_invariants=True,
    ).coalesce().to(device)


def get_sparse_projection_matrix(
    path: PathLike,
    device: torch.device,
    *,
    student_vocab_size: int,
    teacher_vocab_size: int,
) -> torch.Tensor:
    """The projection in ``path`` as a coalesced float32 ``torch.sparse_coo_tensor`` of shape
    ``(V_s, V_t)`` on ``device``.

    ``-1`` teacher sentinels are dropped and duplicate ``(s, t)`` entries summed;
    ``V_s = max(student_vocab_size, max_student_idx + 1)`` and ``V_t = max(teacher_vocab_size,
    max_teacher_idx + 1)`` over the kept entries. Both sizes are keyword-only.

    Cached per version of the file and ``(device, student_vocab_size, teacher_vocab_size)``
    (see the cache note in ``docs/xtoken-nemo.md``): a repeated call reads nothing from disk
    and returns a fresh copy of the cached matrix (one device copy), so no caller can change
    what another gets, and a file changed on disk is read again.

    Pass the result to :meth:`Fp32SparseMM.apply`.

    Raises ``FileNotFoundError`` for a missing file; ``ValueError`` for an unreadable or
    malformed file (see :func:`parse_projection_file`), naming the file and the entry for a
    negative id other than a ``-1`` teacher sentinel or an id of ``2**31 - 1`` or more; and
    naming the argument for a ``student_vocab_size`` or ``teacher_vocab_size`` that is not an
    int in ``[0, 2**31 - 1]``.
    """
    student_vocab_size = check_vocab_size(student_vocab_size, "student_vocab_size", 0)
    teacher_vocab_size = check_vocab_size(teacher_vocab_size, "teacher_vocab_size", 0)
    device = resolve_device(device)
    return _sparse_cache.get(
        path, (device, student_vocab_size, teacher_vocab_size),
        lambda: _sparse_matrix_from_file(path, student_vocab_size, teacher_vocab_size, device),
        lambda matrix: matrix.clone(),
    )


def _topk_arrays_from_file(path: PathLike) -> Tuple[torch.Tensor, torch.Tensor]:
    entries = read_projection_entries(path)
    if entries.top_k is None:
        raise ValueError(
            f"{os.fspath(path)}: get_topk_projection needs the dense top-k format "
            "{'indices': LongTensor[V_s, k], 'likelihoods': FloatTensor[V_s, k]}; "
            "found the sparse dict[(student_id, teacher_id)] -> count format"
        )
    check_entry_ids(entries, path)
    shape = (entries.num_student, entries.top_k)
    return entries.indices[1].reshape(shape), entries.values.reshape(shape)


def get_topk_projection(
    path: PathLike, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The dense top-k arrays of ``path`` on ``device``: ``(indices, likelihoods)``, int64
    ``[V_s, top_k]`` (``-1`` sentinels kept) and float32 ``[V_s, top_k]``.

    Cached per version of the file and ``device``; every call returns fresh copies.

    Raises ``FileNotFoundError`` for a missing file; ``ValueError`` for a file not in the
    dense top-k format (the sparse ``dict[(s, t)] -> count`` format carries no per-row top-k
    weights), or malformed (see :func:`parse_projection_file`), or with a teacher id below
    ``-1`` or of ``2**31 - 1`` or more (naming the file and the entry).
    """
    device = resolve_device(device)

    def build():
        indices, likelihoods = _topk_arrays_from_file(path)
        return indices.to(device), likelihoods.to(device)

    return _topk_cache.get(path, (device,), build,
                           lambda arrays: tuple(t.clone() for t in arrays))


def _exact_token_map_from_file(path: PathLike, device: torch.device, xtoken_loss: bool,
                               teacher_vocab_size: int) -> Dict[str, torch.Tensor]:
    indices, likelihoods = _topk_arrays_from_file(path)
    num_student, k = indices.shape
    if k == 0:
        eligible = torch.zeros(num_student, dtype=torch.bool)
        top_t = top_w = torch.zeros(num_student)
    else:
        top = torch.sort(likelihoods, dim=1, descending=True, stable=True).indices[:, :1]
        top_w = likelihoods.gather(1, top).squeeze(1)
        top_t = indices.gather(1, top).squeeze(1)
        if xtoken_loss:
            eligible = top_w >= RELAXED_EXACT_MAP_THRESHOLD
        else:
            no_second = indices[:, 1] == -1 if k > 1 else torch.ones_like(top_w).bool()
            eligible = (top_w == 1.0) & no_second
        eligible &= (top_t >= 0) & (top_t < teacher_vocab_size)
    # One candidate per eligible student: the shared builder resolves the collisions with
    # the same rules (strict: lowest student; relaxed: highest weight, then lowest student).
    students = torch.arange(num_student, dtype=torch.int64)[eligible]
    coo = ProjectionCOO(students, top_t[eligible].long(), top_w[eligible].float(),
                        num_student, teacher_vocab_size)
    tmap = _build_exact_token_map(coo, "relaxed" if xtoken_loss else "strict",
                                  num_student=num_student, num_teacher=teacher_vocab_size)
    return {
        "common_student": tmap.common_student_ids.to(device),
        "common_teacher": tmap.common_teacher_ids.to(device),
        "uncommon_student": tmap.uncommon_student_ids.to(device),
        "uncommon_teacher": tmap.uncommon_teacher_ids.to(device),
    }


def build_exact_token_map(
    path: PathLike,
    device: torch.device,
    *,
    xtoken_loss: bool,
    teacher_vocab_size: int,
) -> Dict[str, torch.Tensor]:
    """The common/uncommon vocab partition for the gold loss, cached per version of the file
    and ``(device, xtoken_loss, teacher_vocab_size)``; every call returns fresh copies.

    From the dense top-k file (:func:`get_topk_projection`), each student row ``s`` is sorted
    by weight, descending (equal weights keep their column order), giving its top weight
    ``w_s`` and the teacher id ``t_s`` in that slot. Student ``s`` has an exact map when:

    * ``xtoken_loss=False`` (strict): ``w_s == 1.0`` and ``indices[s, 1] == -1`` (the file's
      second column is a sentinel; with ``k == 1`` there is no second column and this holds).
      Collision on a teacher id: the lowest student id wins.
    * ``xtoken_loss=True`` (relaxed): ``w_s >= 0.6``. Collision: the highest ``w_s`` wins,
      then the lowest student id.

    Teacher ids outside ``[0, teacher_vocab_size)`` (``-1`` included) are dropped.

    Returns a dict of int64 tensors on ``device``: ``common_student`` and ``common_teacher``
    ``[n_common]``, paired (``common_student[i]`` maps to ``common_teacher[i]``), in ascending
    student order; ``uncommon_student`` (the rest of ``[0, V_s)``) and ``uncommon_teacher``
    (the rest of ``[0, teacher_vocab_size)``), each ascending.

    Raises ``FileNotFoundError``/``ValueError`` as :func:`get_topk_projection`, and
    ``ValueError`` for a ``teacher_vocab_size`` that is not an int in ``[1, 2**31 - 1]``
    (below 1 every teacher id would be dropped) or an ``xtoken_loss`` that is not a bool
    (NeMo-RL takes any truthy value, e.g. the string ``"false"``, as relaxed).
    """
    if not isinstance(xtoken_loss, bool):
        raise ValueError(f"xtoken_loss must be a bool, got {xtoken_loss!r}")
    teacher_vocab_size = check_vocab_size(teacher_vocab_size, "teacher_vocab_size", 1)
    device = resolve_device(device)
    return _exact_map_cache.get(
        path, (device, xtoken_loss, teacher_vocab_size),
        lambda: _exact_token_map_from_file(path, device, xtoken_loss, teacher_vocab_size),
        lambda partition: {name: t.clone() for name, t in partition.items()},
    )
