"""Projection files: parsing both on-disk formats, and the per-(path, device, sizes) cache.

Formats (each written with ``torch.save``):

* dense top-k: ``{"indices": LongTensor[V_s, k] (-1 = no candidate),
  "likelihoods": FloatTensor[V_s, k]}``; row ``s`` lists student ``s``'s teacher candidates.
* sparse: ``dict[(student_id, teacher_id)] -> count``.

Files are always read with ``torch.load(weights_only=True)``. Tuple-keyed dicts of Python
ints and floats load under ``weights_only=True`` (checked on torch 2.13), so no format needs
the unsafe pickle path and there is no fallback to ``weights_only=False``: a file that needs
it (e.g. numpy scalars as keys) is refused with the loader's reason.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Union

import torch

from compileops.xtoken.projection import ProjectionCOO, ProjectionCSR, build_csr

PathLike = Union[str, os.PathLike]


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


def _parse_dense_topk(obj: dict, path: str) -> ProjectionCOO:
    indices, likelihoods = obj["indices"], obj["likelihoods"]
    if not (isinstance(indices, torch.Tensor) and isinstance(likelihoods, torch.Tensor)
            and indices.dim() == 2 and indices.shape == likelihoods.shape
            and not indices.is_floating_point() and likelihoods.is_floating_point()):
        raise ValueError(
            f"{path}: dense top-k format needs integer 'indices' [V_s, k] and float "
            f"'likelihoods' [V_s, k] of the same shape; got {type(indices).__name__} "
            f"{tuple(getattr(indices, 'shape', ()))} and {type(likelihoods).__name__} "
            f"{tuple(getattr(likelihoods, 'shape', ()))}"
        )
    num_student, k = indices.shape
    students = torch.arange(num_student).repeat_interleave(k)
    teachers = indices.reshape(-1).long()
    weights = likelihoods.reshape(-1).float()
    keep = teachers >= 0
    students, teachers, weights = students[keep], teachers[keep], weights[keep]
    num_teacher = int(teachers.max()) + 1 if teachers.numel() else 0
    return ProjectionCOO(students, teachers, weights, num_student, num_teacher)


def _parse_sparse(obj: dict, path: str) -> ProjectionCOO:
    students, teachers, weights = [], [], []
    for key, value in obj.items():
        if not (isinstance(key, tuple) and len(key) == 2
                and all(isinstance(i, int) for i in key)
                and isinstance(value, (int, float))):
            raise ValueError(
                f"{path}: sparse format needs (student_id, teacher_id) -> count entries; "
                f"found {key!r} -> {value!r}"
            )
        if key[0] < 0 or key[1] < 0:
            continue  # -1 sentinels
        students.append(key[0])
        teachers.append(key[1])
        weights.append(float(value))
    s = torch.tensor(students, dtype=torch.int64)
    t = torch.tensor(teachers, dtype=torch.int64)
    return ProjectionCOO(
        s, t, torch.tensor(weights, dtype=torch.float32),
        int(s.max()) + 1 if s.numel() else 0, int(t.max()) + 1 if t.numel() else 0,
    )


def parse_projection_file(path: PathLike) -> ProjectionCOO:
    """Read either format into COO, ``-1`` sentinels dropped. The sizes are the observed
    ones (max id + 1). Raises ``FileNotFoundError`` for a missing file, ``ValueError``
    naming what was found for anything else."""
    obj = _load(path)
    path = os.fspath(path)
    if isinstance(obj, dict) and set(obj.keys()) == {"indices", "likelihoods"}:
        return _parse_dense_topk(obj, path)
    if isinstance(obj, dict) and obj and all(isinstance(k, tuple) for k in obj):
        return _parse_sparse(obj, path)
    raise ValueError(
        f"{path}: unknown projection format: found {_describe(obj)}; expected "
        "{'indices': LongTensor[V_s, k], 'likelihoods': FloatTensor[V_s, k]} or "
        "a non-empty dict[(student_id, teacher_id)] -> count"
    )


# ---------------------------------------------------------------------------------------
# Cache

_cache_lock = threading.Lock()
_cache: dict[tuple, ProjectionCSR] = {}


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
    keyword-only: two vocabulary sizes passed by position could be swapped silently. ``normalize_rows``
    divides each student row by its total (turns sparse counts into likelihoods). The cache
    key is ``(abspath, device, num_student, num_teacher, normalize_rows)``; the same key
    returns the same object. Thread-safe; :func:`clear_caches` empties it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (os.path.abspath(os.fspath(path)), str(device), int(num_student), int(num_teacher),
           bool(normalize_rows))
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        coo = parse_projection_file(path)
        coo = dataclasses.replace(
            coo,
            num_student=max(int(num_student), coo.num_student),
            num_teacher=max(int(num_teacher), coo.num_teacher),
        )
        if normalize_rows:
            coo = _normalize_rows(coo)
        csr = build_csr(coo, device)
        _cache[key] = csr
        return csr


def clear_caches() -> None:
    """Forget every cached projection."""
    with _cache_lock:
        _cache.clear()
