"""The student-to-teacher projection ``M [V_s, V_t]`` as plain buffers, and ``project``.

``M`` is never a ``torch.sparse`` tensor (those cannot enter ``torch.compile``). It is built
once, on the host, from COO triplets into two CSR layouts of the same entries:

* by teacher column (the forward gathers ``p[:, student]`` per output column);
* by student row (the backward gathers ``grad[:, teacher]`` per student).

Inside each segment entries are ordered by the other id, which fixes the summation order.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch


@dataclasses.dataclass(frozen=True)
class ProjectionCOO:
    """COO triplets of ``M``: ``student_ids [nnz]``, ``teacher_ids [nnz]`` int64,
    ``weights [nnz]`` fp32, and the axis sizes ``num_student`` x ``num_teacher``."""

    student_ids: torch.Tensor
    teacher_ids: torch.Tensor
    weights: torch.Tensor
    num_student: int
    num_teacher: int


@dataclasses.dataclass(frozen=True)
class ProjectionCSR:
    """Both CSR layouts of ``M [num_student, num_teacher]`` (int64 ids, fp32 weights).

    ``col_indptr [V_t + 1]``, ``col_student_ids [nnz]``, ``col_weights [nnz]``;
    ``row_indptr [V_s + 1]``, ``row_teacher_ids [nnz]``, ``row_weights [nnz]``.
    """

    col_indptr: torch.Tensor
    col_student_ids: torch.Tensor
    col_weights: torch.Tensor
    row_indptr: torch.Tensor
    row_teacher_ids: torch.Tensor
    row_weights: torch.Tensor

    @property
    def num_student(self) -> int:
        return self.row_indptr.numel() - 1

    @property
    def num_teacher(self) -> int:
        return self.col_indptr.numel() - 1

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The six tensors in field order (``dataclasses.astuple`` would deep-copy them)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def to(self, device) -> "ProjectionCSR":
        return ProjectionCSR(*(t.to(device) for t in self.buffers()))

    def clone(self) -> "ProjectionCSR":
        """A copy whose buffers share no memory with these."""
        return ProjectionCSR(*(t.clone() for t in self.buffers()))

    def to_dense(self) -> torch.Tensor:
        """``M`` as a dense fp32 ``[V_s, V_t]`` (tests and small debugging only)."""
        dense = torch.zeros(self.num_student, self.num_teacher, dtype=torch.float32,
                            device=self.row_indptr.device)
        rows = torch.repeat_interleave(
            torch.arange(self.num_student, device=dense.device), self.row_indptr.diff()
        )
        dense[rows, self.row_teacher_ids] = self.row_weights
        return dense


def _coalesce(coo: ProjectionCOO) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop negative (sentinel) ids and zero weights; sum duplicate (student, teacher) pairs
    in input order (on the CPU, deterministic). Returns sorted (student, teacher, weight)."""
    s = coo.student_ids.reshape(-1).long().cpu()
    t = coo.teacher_ids.reshape(-1).long().cpu()
    w = coo.weights.reshape(-1).float().cpu()
    keep = (s >= 0) & (t >= 0) & (w != 0)
    s, t, w = s[keep], t[keep], w[keep]
    if s.numel() and (int(s.max()) >= coo.num_student or int(t.max()) >= coo.num_teacher):
        raise ValueError(
            f"projection entry ({int(s.max())}, {int(t.max())}) is outside "
            f"[{coo.num_student}, {coo.num_teacher}]"
        )
    key = s * coo.num_teacher + t
    uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, w.double())
    return uniq // coo.num_teacher, uniq % coo.num_teacher, summed.float()


def build_csr(coo: ProjectionCOO, device: Union[str, torch.device, None] = None) -> ProjectionCSR:
    """Both CSR layouts of the COO matrix (duplicates summed, -1 sentinels dropped)."""
    s, t, w = _coalesce(coo)  # sorted by (student, teacher): already the row layout
    row_indptr = torch.zeros(coo.num_student + 1, dtype=torch.int64)
    row_indptr[1:] = torch.bincount(s, minlength=coo.num_student).cumsum(0)
    col_order = torch.argsort(t * coo.num_student + s)  # by (teacher, student)
    col_indptr = torch.zeros(coo.num_teacher + 1, dtype=torch.int64)
    col_indptr[1:] = torch.bincount(t, minlength=coo.num_teacher).cumsum(0)
    csr = ProjectionCSR(
        col_indptr=col_indptr, col_student_ids=s[col_order].contiguous(),
        col_weights=w[col_order].contiguous(),
        row_indptr=row_indptr, row_teacher_ids=t.contiguous(), row_weights=w.contiguous(),
    )
    return csr.to(device) if device is not None else csr


def csr_from_coalesced(indices: torch.Tensor, values: torch.Tensor, num_student: int,
                       num_teacher: int) -> ProjectionCSR:
    """Both CSR layouts of a coalesced COO matrix ``[num_student, num_teacher]`` (``indices
    [2, nnz]`` sorted by (student, teacher) without duplicates, as ``torch.sparse`` keeps
    them; ``values [nnz]`` any real dtype, used in fp32), built on their device with no
    host synchronisation, so it can run on every call.

    Entries keep their order and zero weights are kept (unlike :func:`build_csr`, which
    reads the ids on the host). An entry outside ``[0, num_student) x [0, num_teacher)``
    (a sparse tensor built without its invariants checked) is sorted past the last segment
    of both layouts: no kernel reads it.
    """
    students, teachers = indices[0], indices[1]
    inside = ((students >= 0) & (students < num_student)
              & (teachers >= 0) & (teachers < num_teacher))
    row_key = torch.where(inside, students, num_student)
    col_key = torch.where(inside, teachers, num_teacher)
    # Stable sorts keep the coalesced (student, teacher) order inside each segment: by
    # student then teacher for the rows, by teacher then student for the columns.
    by_row = torch.argsort(row_key, stable=True)
    by_col = torch.argsort(col_key, stable=True)
    weights = values.to(torch.float32)

    def indptr(sorted_keys: torch.Tensor, n_segments: int) -> torch.Tensor:
        bounds = torch.arange(n_segments + 1, dtype=sorted_keys.dtype, device=indices.device)
        return torch.searchsorted(sorted_keys, bounds)

    return ProjectionCSR(
        col_indptr=indptr(col_key[by_col], num_teacher),
        col_student_ids=students[by_col], col_weights=weights[by_col],
        row_indptr=indptr(row_key[by_row], num_student),
        row_teacher_ids=teachers[by_row], row_weights=weights[by_row],
    )


def project(p: torch.Tensor, projection, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``p [*, V_s]`` @ ``M`` -> fp32 ``[*, V_t]``; with ``columns [*, K]`` (e.g. the teacher's
    top-k ids per token) only those columns, ``[*, K]``, without densifying ``M``.

    ``projection`` is a :class:`ProjectionCSR` or a
    :class:`compileops.xtoken.SparseProjection`. Forward and backward compute in fp32, also
    under bf16 autocast; the result is fp32 and ``M`` gets no gradient (``grad_p = grad @ M^T``).
    Summation order is fixed: deterministic and bitwise batch-invariant. Against fp64
    ``p @ M`` the error is that of an fp32 sum of ``nnz(column)`` products.

    ``columns`` must lie in ``[0, V_t)``. On CPU a bad column raises ``IndexError`` naming
    it. On CUDA the ids are not read on the host (no sync): the kernels mask a bad column, so
    nothing is accessed out of bounds; its output is 0 and it passes no gradient to ``p``.
    """
    from compileops.xtoken.op import project_op

    return project_op(
        p, projection.col_indptr, projection.col_student_ids, projection.col_weights,
        projection.row_indptr, projection.row_teacher_ids, projection.row_weights, columns,
    )
