"""Projection files: reading and validating both on-disk formats, and the projection cache.

Formats (each written with ``torch.save``):

* dense top-k: ``{"indices": LongTensor[V_s, k] (-1 = no candidate),
  "likelihoods": FloatTensor[V_s, k]}``; row ``s`` lists student ``s``'s teacher candidates.
  Other keys are ignored (as NeMo-RL does).
* sparse: ``dict[(student_id, teacher_id)] -> count``.

Files are always read with ``torch.load(weights_only=True)``. Tuple-keyed dicts of Python
ints and floats load under ``weights_only=True`` (checked on torch 2.13), so no format needs
the unsafe pickle path and there is no fallback to ``weights_only=False``: a file that needs
it (e.g. numpy scalars as keys) is refused with the loader's reason.

Every loader (this module's and :mod:`compileops.xtoken.nemo`'s) reads through
:func:`read_projection_entries` (entry types: int ids, not bools; ids that fit int64; real
weights) and, except the raw ``nemo.parse_projection_file``, applies
:func:`check_entry_ids` (ids in ``[0, MAX_VOCAB_SIZE)``; ``-1`` only as a teacher id, where
it means "no candidate"). Errors are ``ValueError``\\ s that name the file and the entry.
"""
from __future__ import annotations

import dataclasses
import operator
import os
from typing import Optional, Union

import torch

from compileops.xtoken.file_cache import FileCache, resolve_device
from compileops.xtoken.projection import ProjectionCOO, ProjectionCSR, build_csr

PathLike = Union[str, os.PathLike]

#: Vocabulary sizes (and so ids + 1) must stay below this: ids and sizes fit int32 (the
#: kernels' grid and the int32 index tensors the ops accept), and the CSR pointer arrays
#: hold one entry per id. No tokenizer comes near it.
MAX_VOCAB_SIZE = 2**31 - 1

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _load(path: PathLike):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"projection file not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends
        raise ValueError(
            f"cannot read projection file {path} with torch.load(weights_only=True): {e}. "
            "Re-save it with plain ints/floats/tensors (see compileops.xtoken.files)."
        ) from e


def _describe(obj) -> str:
    if isinstance(obj, dict):
        keys = list(obj.keys())[:5]
        return f"a dict with keys {keys!r}" + (" ..." if len(obj) > 5 else "")
    return f"an object of type {type(obj).__name__}"


def check_vocab_size(value, name: str, minimum: int = 0) -> int:
    """``value`` as a Python int (numpy and 0-d integer tensors too, not bools) in
    ``[minimum, MAX_VOCAB_SIZE]``; ``ValueError`` naming ``name`` otherwise."""
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = None
    if size is None or not minimum <= size <= MAX_VOCAB_SIZE:
        raise ValueError(f"{name} must be an int in [{minimum}, {MAX_VOCAB_SIZE}], "
                         f"got {value!r}")
    return size


# ---------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class ProjectionEntries:
    """A projection file's entries as read, ``-1`` sentinels kept, nothing dropped.

    ``indices [2, nnz]`` int64 rows ``(student_id, teacher_id)``; ``values [nnz]`` fp32.
    Dense top-k files give every ``(s, j)`` slot in row-major order and ``top_k = k``; sparse
    files give the dict's entries in its order and ``top_k = None``. ``num_student``: the
    dense row count, or the largest sparse student id + 1; ``num_teacher``: the largest
    non-negative teacher id + 1 (0 if none).
    """

    indices: torch.Tensor
    values: torch.Tensor
    num_student: int
    num_teacher: int
    top_k: Optional[int]

    def describe(self, k: int) -> str:
        """Entry ``k`` as the file spells it: ``indices[s, j] = t`` or ``entry (s, t)``."""
        s, t = int(self.indices[0, k]), int(self.indices[1, k])
        if self.top_k is not None:
            return f"indices[{k // self.top_k}, {k % self.top_k}] = {t}"
        return f"entry ({s}, {t}) -> {float(self.values[k])!r}"


def _max_plus_one(ids: torch.Tensor) -> int:
    return int(ids.max()) + 1 if ids.numel() else 0


def _is_dense_topk(obj) -> bool:
    return isinstance(obj, dict) and "indices" in obj and "likelihoods" in obj


def _dense_entries(obj: dict, path: str) -> ProjectionEntries:
    indices, likelihoods = obj["indices"], obj["likelihoods"]
    for name, t in (("indices", indices), ("likelihoods", likelihoods)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(
                f"{path}: dense top-k '{name}' must be a 2-D [V_s, k] tensor, got "
                + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            )
    if (indices.is_floating_point() or indices.is_complex()
            or indices.dtype in (torch.bool, torch.uint64)):
        raise ValueError(f"{path}: dense top-k 'indices' must be an integer tensor (not "
                         f"bool or uint64), got {indices.dtype}")
    if likelihoods.is_complex() or likelihoods.dtype == torch.bool:
        raise ValueError(f"{path}: dense top-k 'likelihoods' must be real numbers, "
                         f"got {likelihoods.dtype}")
    if indices.shape != likelihoods.shape:
        raise ValueError(
            f"{path}: dense top-k 'indices' {tuple(indices.shape)} and 'likelihoods' "
            f"{tuple(likelihoods.shape)} must have the same shape [V_s, k]"
        )
    num_student, k = indices.shape
    students = torch.arange(num_student, dtype=torch.int64).repeat_interleave(k)
    teachers = indices.reshape(-1).long()
    return ProjectionEntries(
        torch.stack([students, teachers]), likelihoods.reshape(-1).float(), num_student,
        _max_plus_one(teachers[teachers >= 0]), k,
    )


def _sparse_entries(obj: dict, path: str) -> ProjectionEntries:
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
        for i in key:
            if not _INT64_MIN <= i <= _INT64_MAX:
                raise ValueError(f"{path}: entry {key!r} -> {value!r}: id {i} does not fit "
                                 "in int64")
        try:
            counts.append(float(value))
        except OverflowError:
            raise ValueError(f"{path}: entry {key!r} -> {value!r}: the count does not fit "
                             "in a float") from None
        pairs.append(key)
    indices = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).t().contiguous()
    teachers = indices[1]
    return ProjectionEntries(
        indices, torch.tensor(counts, dtype=torch.float32), _max_plus_one(indices[0]),
        _max_plus_one(teachers[teachers >= 0]), None,
    )


def read_projection_entries(path: PathLike) -> ProjectionEntries:
    """Read either format, checking each entry's types (see the module docstring); ids are
    not range-checked here (:func:`check_entry_ids` does that).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the file for
    anything else: an unreadable file, an unknown format (an empty dict included), dense
    ``indices`` that are not integers (bools included) or ``likelihoods`` that are not real
    numbers, or arrays of different shapes; a sparse key that is not two ints (bools
    excluded) or not within int64, a count that is not a number (bools excluded).
    """
    obj = _load(path)
    spath = os.fspath(path)
    if _is_dense_topk(obj):
        return _dense_entries(obj, spath)
    if isinstance(obj, dict) and obj and all(isinstance(k, tuple) for k in obj):
        return _sparse_entries(obj, spath)
    raise ValueError(
        f"{spath}: unknown projection format: found {_describe(obj)}; expected "
        "{'indices': LongTensor[V_s, k], 'likelihoods': FloatTensor[V_s, k]} or a "
        "non-empty dict[(student_id, teacher_id)] -> count"
    )


def check_entry_ids(entries: ProjectionEntries, path: PathLike) -> None:
    """Every entry whose teacher id is not the ``-1`` sentinel has ids in
    ``[0, MAX_VOCAB_SIZE)``; ``ValueError`` naming the file and the first bad entry."""
    students, teachers = entries.indices
    out_of_range = ((students < 0) | (students >= MAX_VOCAB_SIZE)
                    | (teachers < 0) | (teachers >= MAX_VOCAB_SIZE))
    bad = out_of_range & (teachers != -1)
    if not bool(bad.any()):
        return
    k = int(bad.nonzero()[0, 0])
    s, t = int(students[k]), int(teachers[k])
    if s < 0:
        reason = (f"student id {s} is negative; only -1 is allowed, and only as a teacher "
                  "id (no candidate)")
    elif t < 0:
        reason = f"teacher id {t} is negative; only -1 is allowed (no candidate)"
    else:
        name, value = ("student", s) if s >= MAX_VOCAB_SIZE else ("teacher", t)
        reason = (f"{name} id {value} is too large: vocabulary sizes are limited to "
                  f"{MAX_VOCAB_SIZE} (ids up to {MAX_VOCAB_SIZE - 1})")
    raise ValueError(f"{os.fspath(path)}: {entries.describe(k)}: {reason}")


def parse_projection_file(path: PathLike) -> ProjectionCOO:
    """Read either format into COO, ``-1`` teacher sentinels dropped. The sizes are the
    observed ones (dense: the row count; sparse: max student id + 1; max teacher id + 1).
    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` naming the file (and the
    entry) for anything else: see :func:`read_projection_entries` and
    :func:`check_entry_ids`."""
    entries = read_projection_entries(path)
    check_entry_ids(entries, path)
    keep = entries.indices[1] != -1
    students, teachers = entries.indices[:, keep]
    num_student = entries.num_student if entries.top_k is not None else _max_plus_one(students)
    return ProjectionCOO(students, teachers, entries.values[keep], num_student,
                         _max_plus_one(teachers))


# ---------------------------------------------------------------------------------------
# Cache

_cache = FileCache()


def _normalize_rows(coo: ProjectionCOO) -> ProjectionCOO:
    """Divide each student row by its total. A row whose total is zero or negative (all-zero
    weights) gets zero weights, which :func:`build_csr` drops: no 0/0 NaN entries. A NaN in
    the file is not hidden: its row's total is NaN, and so is every weight of that row."""
    totals = torch.zeros(coo.num_student, dtype=torch.float64).index_add_(
        0, coo.student_ids, coo.weights.double()
    )
    row_total = totals[coo.student_ids]
    w = coo.weights.double()
    divide = ~(row_total <= 0)  # NaN totals divide (and stay NaN), never become 0
    safe = torch.where(divide, row_total, torch.ones_like(row_total))
    w = torch.where(divide, w / safe, torch.zeros_like(w)).float()
    return dataclasses.replace(coo, weights=w)


def get_projection(
    path: PathLike,
    device: Union[str, torch.device] = "cpu",
    *,
    num_student: int = 0,
    num_teacher: int = 0,
    normalize_rows: bool = False,
) -> ProjectionCSR:
    """The projection in ``path`` as :class:`ProjectionCSR` buffers on ``device``, cached.

    Axis sizes are ``max(configured, observed + 1)`` (``num_student``/``num_teacher`` are the
    configured ones, e.g. the model vocab sizes; pass 0 to use the file's). Both are
    keyword-only: two vocabulary sizes passed by position could be swapped silently.
    ``normalize_rows`` divides each student row by its total (turns sparse counts into
    likelihoods).

    Every call returns the caller's own copy of the buffers (changing them changes nothing
    else). The file is parsed once per version of it on disk: the cache key is the file's
    identity (path, inode, size, mtime and ctime; see :mod:`compileops.xtoken.file_cache`),
    ``device``, the two sizes and ``normalize_rows``. Thread-safe; :func:`clear_caches`
    empties it.

    Raises ``FileNotFoundError`` for a missing file; ``ValueError`` naming the file and the
    entry for a malformed one (see :func:`parse_projection_file`), and naming the argument
    for a size that is not an int in ``[0, MAX_VOCAB_SIZE]``.
    """
    num_student = check_vocab_size(num_student, "num_student")
    num_teacher = check_vocab_size(num_teacher, "num_teacher")
    device = resolve_device(device)
    normalize_rows = bool(normalize_rows)

    def build() -> ProjectionCSR:
        coo = parse_projection_file(path)
        coo = dataclasses.replace(coo, num_student=max(num_student, coo.num_student),
                                  num_teacher=max(num_teacher, coo.num_teacher))
        if normalize_rows:
            coo = _normalize_rows(coo)
        return build_csr(coo, device)

    return _cache.get(path, (str(device), num_student, num_teacher, normalize_rows), build,
                      ProjectionCSR.clone)


def clear_caches() -> None:
    """Forget every cached projection."""
    _cache.clear()
