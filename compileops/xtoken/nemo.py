"""NeMo-RL-compatible names for the cross-tokenizer distillation utilities.

A drop-in for ``nemo_rl.algorithms.x_token.loss_utils``: change one import,

    # from nemo_rl.algorithms.x_token import loss_utils
    from compileops.xtoken import nemo as loss_utils

and the same names, argument orders and return layouts run on compileops' kernels
(:mod:`compileops.xtoken`): the fp32 projection is the ``compileops::xtoken_project`` op (CSR
gathers in a fixed order, no atomics), chunk averaging is the ``compileops::xtoken_chunk_sums``
segment sum (not a one-hot ``bmm``). Every function here is a thin adapter: it converts
arguments and results to NeMo-RL's layout and adds checks, it holds no kernel math.

Where NeMo-RL returns a silently wrong answer for bad input, these raise ``ValueError``
naming the argument instead; each docstring says which inputs. ``docs/xtoken-nemo.md`` lists
every difference from NeMo-RL.

Not provided: ``alignment_from_flat_batch`` and ``rebuild_teacher_full_logits_from_ipc``
(they depend on NeMo-RL's ``AlignmentBatch`` schema and its Ray IPC transport).

This module is not imported by ``import compileops``; ``from compileops.xtoken import nemo``
imports it (it imports nothing heavier than :mod:`compileops.xtoken` itself).
"""
from __future__ import annotations

import operator
import os
import threading
import weakref
from typing import Dict, Tuple, Union

import torch

from compileops import modes
from compileops.xtoken.chunks import chunk_average
from compileops.xtoken.chunks import valid_chunk_mask as _valid_chunk_mask
from compileops.xtoken.distributed import dp_all_reduce_sum as _dp_all_reduce_sum
from compileops.xtoken.files import _describe, _load
from compileops.xtoken.op import project_op
from compileops.xtoken.projection import ProjectionCOO, ProjectionCSR, build_csr
from compileops.xtoken.token_map import build_exact_token_map as _build_exact_token_map

PathLike = Union[str, os.PathLike]

__all__ = [
    "Fp32SparseMM",
    "build_exact_token_map",
    "chunk_average_log_probs",
    "clear_caches",
    "dp_all_reduce_sum",
    "get_sparse_projection_matrix",
    "get_topk_projection",
    "parse_projection_file",
    "valid_chunk_mask",
]

RELAXED_EXACT_MAP_THRESHOLD = 0.6

# Process-local caches, under NeMo-RL's names (so test code that clears them keeps working).
# Keys use the absolute path and a normalised device ("cuda" -> "cuda:<current>").
_SPARSE_PROJECTION_CACHE: Dict[Tuple[str, torch.device, int, int], torch.Tensor] = {}
_TOPK_PROJECTION_CACHE: Dict[Tuple[str, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}
_EXACT_TOKEN_MAP_CACHE: Dict[Tuple[str, torch.device, bool, int], Dict[str, torch.Tensor]] = {}
# id(matrix) -> (weakref to the matrix, its _version, its CSR buffers), for Fp32SparseMM.
_CSR_OF_MATRIX: Dict[int, Tuple[weakref.ref, int, ProjectionCSR]] = {}
_lock = threading.RLock()


def clear_caches() -> None:
    """Empty every cache of this module (not part of NeMo-RL's API)."""
    with _lock:
        _SPARSE_PROJECTION_CACHE.clear()
        _TOPK_PROJECTION_CACHE.clear()
        _EXACT_TOKEN_MAP_CACHE.clear()
        _CSR_OF_MATRIX.clear()


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _abspath(path: PathLike) -> str:
    return os.path.abspath(os.fspath(path))


def _check_size(value, name: str, minimum: int) -> int:
    """``value`` as a Python int (numpy and 0-d integer tensors too), at least ``minimum``."""
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = None
    if size is None or size < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return size


# ---------------------------------------------------------------------------------------
# Fp32SparseMM


def _csr_of_tensor(matrix: torch.Tensor) -> ProjectionCSR:
    """The CSR buffers of a ``[V_s, V_t]`` tensor (sparse COO/CSR or strided), built once per
    tensor object and version (on the host; then moved to the tensor's device)."""
    if matrix.dim() != 2:
        raise ValueError(
            f"sparse_M must be a 2-D [V_s, V_t] matrix, got shape {tuple(matrix.shape)}"
        )
    if not matrix.is_floating_point():
        raise ValueError(f"sparse_M must hold real floating-point weights, got {matrix.dtype}")
    key, version = id(matrix), matrix._version
    with _lock:
        hit = _CSR_OF_MATRIX.get(key)
        if hit is not None and hit[0]() is matrix and hit[1] == version:
            return hit[2]
    m = matrix.detach()
    if m.layout == torch.strided:
        m = m.to_sparse()
    elif m.layout != torch.sparse_coo:
        m = m.to_sparse_coo()
    m = m.coalesce()
    indices, values = m.indices(), m.values()
    num_student, num_teacher = m.shape
    coo = ProjectionCOO(indices[0], indices[1], values.float(), num_student, num_teacher)
    csr = build_csr(coo, matrix.device)
    with _lock:
        _CSR_OF_MATRIX[key] = (
            weakref.ref(matrix, lambda _ref, key=key: _CSR_OF_MATRIX.pop(key, None)),
            version, csr,
        )
    return csr


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
      :class:`compileops.xtoken.ProjectionCSR`. A tensor is converted to CSR buffers once per
      object (cached while it is alive and not modified in place); its weights are used in fp32.
    * ``dense``: ``[V_s, N]``, any floating dtype.
    * returns fp32 ``[V_t, N]``: a transposed view of a contiguous ``[N, V_t]`` result (so
      ``out.t()`` is contiguous; use ``reshape``, not ``view``, on ``out`` itself).

    Gradients: ``grad_dense = M @ grad_out`` (in ``dense``'s dtype); ``M`` gets none.
    Summation order is fixed: deterministic and bitwise batch-invariant.

    Raises ``ValueError`` naming ``sparse_M`` or ``dense`` for a matrix that is not 2-D, a
    ``dense`` that is not 2-D or whose row count is not ``V_s``.

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


def chunk_average_log_probs(
    log_probs: torch.Tensor, chunk_id: torch.Tensor, max_chunks: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Average ``log_probs`` over the chunks given by ``chunk_id``.

    * ``log_probs``: ``[B, T, V]``, any floating dtype.
    * ``chunk_id``: ``[B, T]`` int64 (or int32), values in ``[-1, max_chunks)``; ``-1`` marks a
      token that belongs to no chunk.
    * returns ``chunk_log_probs [B, max_chunks, V]`` in ``log_probs.dtype`` (the mean of each
      chunk's rows; 0 for an empty chunk) and ``chunk_sizes [B, max_chunks]`` float32 (exact
      counts).

    Computed as a segment sum: each chunk's rows are added in token order in fp32 (also for
    bf16 and fp64 inputs), deterministic and batch-invariant; a ``-inf``/NaN row affects only
    its own chunk. Differentiable in ``log_probs`` (each token gets ``grad / size`` of its
    chunk; ``-1`` tokens get 0).

    Raises ``ValueError`` naming ``chunk_id`` for an id outside ``[-1, max_chunks)`` (NeMo-RL's
    one-hot would drop or misplace it). The check reads the ids on the host, so it runs for
    CPU tensors, and for CUDA tensors only under ``compileops.strict_index_checks()`` (one
    device sync); it never runs while compiling.
    """
    if (isinstance(chunk_id, torch.Tensor) and chunk_id.dtype in (torch.int32, torch.int64)
            and not torch.compiler.is_compiling()
            and (chunk_id.device.type == "cpu" or modes.STRICT_INDEX_CHECKS.enabled())):
        _check_chunk_id_values(chunk_id, max_chunks)
    avg, sizes = chunk_average(log_probs, chunk_id, max_chunks)
    return avg.to(log_probs.dtype), sizes


def valid_chunk_mask(
    s_sizes: torch.Tensor, t_sizes: torch.Tensor, pair_valid: torch.Tensor
) -> torch.Tensor:
    """``(s_sizes > 0) & (t_sizes > 0) & pair_valid``: both sides non-empty and the pair valid.

    ``s_sizes``, ``t_sizes``: ``[B, C]`` chunk sizes (student, teacher); ``pair_valid``:
    ``[B, C]`` bool. Returns ``[B, C]`` bool.

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
    return _valid_chunk_mask(s_sizes, t_sizes, pair_valid)


def dp_all_reduce_sum(local: torch.Tensor) -> torch.Tensor:
    """Sum ``local`` (a scalar count) across the default process group, which is the
    data-parallel group when tensor and context parallelism are 1.

    Returns a fresh float32 tensor of ``local``'s shape; ``local`` is not modified. Without an
    initialised process group, a float32 copy of ``local``. ``local`` must be on a device the
    group's backend supports (CPU for gloo, CUDA for NCCL). Counts above 2**24 are not exact
    in float32.
    """
    return _dp_all_reduce_sum(local)


# ---------------------------------------------------------------------------------------
# Projection files


def _is_dense_topk(obj) -> bool:
    return isinstance(obj, dict) and "indices" in obj and "likelihoods" in obj


def _dense_topk_arrays(obj: dict, path: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``indices`` int64 ``[V_s, k]`` and ``likelihoods`` float32 ``[V_s, k]``, validated."""
    indices, likelihoods = obj["indices"], obj["likelihoods"]
    for name, t in (("indices", indices), ("likelihoods", likelihoods)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(
                f"{path}: dense top-k '{name}' must be a 2-D [V_s, k] tensor, got "
                + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            )
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"{path}: dense top-k 'indices' must be an integer tensor, "
                         f"got {indices.dtype}")
    if likelihoods.is_complex() or likelihoods.dtype == torch.bool:
        raise ValueError(f"{path}: dense top-k 'likelihoods' must be real numbers, "
                         f"got {likelihoods.dtype}")
    if indices.shape != likelihoods.shape:
        raise ValueError(
            f"{path}: dense top-k 'indices' {tuple(indices.shape)} and 'likelihoods' "
            f"{tuple(likelihoods.shape)} must have the same shape [V_s, k]"
        )
    return indices.long(), likelihoods.float()


def _sparse_entries(obj: dict, path: str) -> Tuple[torch.Tensor, torch.Tensor]:
    pairs, counts = [], []
    for key, value in obj.items():
        ok_key = (isinstance(key, tuple) and len(key) == 2
                  and all(isinstance(i, int) and not isinstance(i, bool) for i in key))
        ok_value = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (ok_key and ok_value):
            raise ValueError(
                f"{path}: sparse projection entries must be (student_id, teacher_id) -> "
                f"count with int ids and a number count; found {key!r} -> {value!r}"
            )
        pairs.append(key)
        counts.append(float(value))
    indices = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).t().contiguous()
    return indices, torch.tensor(counts, dtype=torch.float32)


def _max_plus_one(ids: torch.Tensor) -> int:
    return int(ids.max()) + 1 if ids.numel() else 0


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

    No sizing or validity policy is applied (that is the callers' job). Files are read with
    ``torch.load(weights_only=True)``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for anything else: an
    unknown format (an empty dict included), a dense file whose ``indices`` are not integers
    or whose ``indices``/``likelihoods`` shapes differ, a sparse entry whose key is not two
    ints or whose count is not a number.
    """
    obj = _load(path)
    spath = os.fspath(path)
    if _is_dense_topk(obj):
        dense_idx, likelihoods = _dense_topk_arrays(obj, spath)
        num_student, k = dense_idx.shape
        students = torch.arange(num_student, dtype=torch.int64).repeat_interleave(k)
        indices = torch.stack([students, dense_idx.reshape(-1)])
        values = likelihoods.reshape(-1)
        v_student = num_student
    elif isinstance(obj, dict) and obj and all(isinstance(k, tuple) for k in obj):
        indices, values = _sparse_entries(obj, spath)
        v_student = _max_plus_one(indices[0])
    else:
        raise ValueError(
            f"{spath}: unknown projection format: found {_describe(obj)}; expected "
            "{'indices': LongTensor[V_s, k], 'likelihoods': FloatTensor[V_s, k]} or a "
            "non-empty dict[(student_id, teacher_id)] -> count"
        )
    teachers = indices[1]
    v_teacher = _max_plus_one(teachers[teachers >= 0])
    return indices, values, v_student, v_teacher


def get_sparse_projection_matrix(
    path: PathLike,
    device: torch.device,
    *,
    student_vocab_size: int,
    teacher_vocab_size: int,
) -> torch.Tensor:
    """The projection in ``path`` as a coalesced float32 ``torch.sparse_coo_tensor`` of shape
    ``(V_s, V_t)`` on ``device``, cached per ``(path, device, student_vocab_size,
    teacher_vocab_size)`` (the same key returns the same tensor, no disk I/O).

    ``-1`` teacher sentinels are dropped and duplicate ``(s, t)`` entries summed;
    ``V_s = max(student_vocab_size, max_student_idx + 1)`` and ``V_t = max(teacher_vocab_size,
    max_teacher_idx + 1)`` over the kept entries. Both sizes are keyword-only.

    Pass the result to :meth:`Fp32SparseMM.apply` (its CSR buffers are built once).

    Raises ``FileNotFoundError`` for a missing file; ``ValueError`` for an unreadable file
    (see :func:`parse_projection_file`), a negative ``student_vocab_size`` or
    ``teacher_vocab_size``, or a negative id other than a ``-1`` teacher sentinel.
    """
    student_vocab_size = _check_size(student_vocab_size, "student_vocab_size", 0)
    teacher_vocab_size = _check_size(teacher_vocab_size, "teacher_vocab_size", 0)
    device = _device(device)
    key = (_abspath(path), device, student_vocab_size, teacher_vocab_size)
    with _lock:
        hit = _SPARSE_PROJECTION_CACHE.get(key)
        if hit is not None:
            return hit
        indices, values, _, _ = parse_projection_file(path)
        keep = indices[1] != -1
        indices, values = indices[:, keep], values[keep]
        for row, name in ((0, "student"), (1, "teacher")):
            if indices.shape[1] and int(indices[row].min()) < 0:
                raise ValueError(
                    f"{os.fspath(path)}: {name} id {int(indices[row].min())} is negative; "
                    "only -1 is allowed, and only as a teacher id (a sentinel)"
                )
        num_student = max(student_vocab_size, _max_plus_one(indices[0]))
        num_teacher = max(teacher_vocab_size, _max_plus_one(indices[1]))
        matrix = torch.sparse_coo_tensor(
            indices, values, (num_student, num_teacher), dtype=torch.float32,
            check_invariants=True,
        ).coalesce().to(device)
        _SPARSE_PROJECTION_CACHE[key] = matrix
        return matrix


def get_topk_projection(
    path: PathLike, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The dense top-k arrays of ``path`` on ``device``, cached per ``(path, device)``:
    ``(indices, likelihoods)``, int64 ``[V_s, top_k]`` (``-1`` sentinels kept) and float32
    ``[V_s, top_k]``.

    Raises ``FileNotFoundError`` for a missing file; ``ValueError`` for a file not in the
    dense top-k format (the sparse ``dict[(s, t)] -> count`` format carries no per-row top-k
    weights), or whose ``indices`` are not integers, or whose two arrays differ in shape.
    """
    device = _device(device)
    key = (_abspath(path), device)
    with _lock:
        hit = _TOPK_PROJECTION_CACHE.get(key)
        if hit is not None:
            return hit
        obj = _load(path)
        if not _is_dense_topk(obj):
            raise ValueError(
                f"{os.fspath(path)}: get_topk_projection needs the dense top-k format "
                "{'indices': LongTensor[V_s, k], 'likelihoods': FloatTensor[V_s, k]}; "
                f"found {_describe(obj)}"
            )
        indices, likelihoods = _dense_topk_arrays(obj, os.fspath(path))
        result = (indices.to(device), likelihoods.to(device))
        _TOPK_PROJECTION_CACHE[key] = result
        return result


def build_exact_token_map(
    path: PathLike,
    device: torch.device,
    *,
    xtoken_loss: bool,
    teacher_vocab_size: int,
) -> Dict[str, torch.Tensor]:
    """The common/uncommon vocab partition for the gold loss, cached per ``(path, device,
    xtoken_loss, teacher_vocab_size)``.

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
    ``ValueError`` for a ``teacher_vocab_size`` below 1 (every teacher id would be dropped) or
    an ``xtoken_loss`` that is not a bool (NeMo-RL takes any truthy value, e.g. the string
    ``"false"``, as relaxed).
    """
    if not isinstance(xtoken_loss, bool):
        raise ValueError(f"xtoken_loss must be a bool, got {xtoken_loss!r}")
    teacher_vocab_size = _check_size(teacher_vocab_size, "teacher_vocab_size", 1)
    device = _device(device)
    key = (_abspath(path), device, xtoken_loss, teacher_vocab_size)
    with _lock:
        hit = _EXACT_TOKEN_MAP_CACHE.get(key)
        if hit is not None:
            return hit
        indices, likelihoods = get_topk_projection(path, torch.device("cpu"))
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
        result = {
            "common_student": tmap.common_student_ids.to(device),
            "common_teacher": tmap.common_teacher_ids.to(device),
            "uncommon_student": tmap.uncommon_student_ids.to(device),
            "uncommon_teacher": tmap.uncommon_teacher_ids.to(device),
        }
        _EXACT_TOKEN_MAP_CACHE[key] = result
        return result
