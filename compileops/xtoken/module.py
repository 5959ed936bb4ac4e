"""``compileops.xtoken.SparseProjection``: a frozen student-to-teacher projection module."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import torch

from compileops.xtoken.projection import ProjectionCOO, ProjectionCSR, build_csr, project


class SparseProjection(torch.nn.Module):
    """``p [*, V_s]`` -> fp32 ``p @ M`` ``[*, V_t]`` (or ``[*, K]`` for ``columns [*, K]``).

    ``M`` is frozen and stored as plain buffers (both CSR layouts, see
    :class:`~compileops.xtoken.projection.ProjectionCSR`), so it follows ``.to(device)`` and
    the state dict, and gets no gradient. Build it with :meth:`from_coo` or :meth:`from_file`.
    """

    col_indptr: torch.Tensor
    col_student_ids: torch.Tensor
    col_weights: torch.Tensor
    row_indptr: torch.Tensor
    row_teacher_ids: torch.Tensor
    row_weights: torch.Tensor

    def __init__(self, csr: ProjectionCSR):
        """Takes ``csr``'s tensors as its buffers, without copying them."""
        super().__init__()
        for field in dataclasses.fields(ProjectionCSR):
            self.register_buffer(field.name, getattr(csr, field.name))

    @classmethod
    def from_coo(cls, coo: ProjectionCOO, device=None) -> "SparseProjection":
        """The projection of the triplets ``coo`` (``student_ids [nnz]``, ``teacher_ids
        [nnz]``, ``weights [nnz]`` and the two vocabulary sizes), both CSR layouts built on
        ``device`` (default: where ``coo``'s tensors are). Duplicate ``(student, teacher)``
        pairs are merged into one entry whose weight is their sum. The module owns new
        tensors: ``coo`` is not modified and shares no storage with it.

        Example::

            coo = ProjectionCOO(torch.tensor([0, 1]), torch.tensor([2, 2]),
                                torch.tensor([0.5, 0.5]), num_student=3, num_teacher=4)
            projection = SparseProjection.from_coo(coo)
            projection(torch.ones(3))  # tensor([0., 0., 1., 0.])
        """
        return cls(build_csr(coo, device))

    @classmethod
    def from_file(
        cls, path: Union[str, os.PathLike], device="cpu", *, num_student: int = 0,
        num_teacher: int = 0, normalize_rows: bool = False,
    ) -> "SparseProjection":
        """Through the shared cache (:func:`compileops.xtoken.get_projection`), which hands
        this module its own copy of the buffers: ``load_state_dict`` or an in-place change on
        one module changes no other module and not the cache. The vocabulary sizes are
        keyword-only there and here."""
        from compileops.xtoken.files import get_projection

        return cls(get_projection(path, device, num_student=num_student,
                                  num_teacher=num_teacher, normalize_rows=normalize_rows))

    @property
    def num_student(self) -> int:
        return self.row_indptr.shape[0] - 1

    @property
    def num_teacher(self) -> int:
        return self.col_indptr.shape[0] - 1

    def csr(self) -> ProjectionCSR:
        return ProjectionCSR(self.col_indptr, self.col_student_ids, self.col_weights,
                             self.row_indptr, self.row_teacher_ids, self.row_weights)

    def forward(self, p: torch.Tensor, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``p [*, V_s]`` (student probabilities, any float dtype) -> fp32 ``p @ M``
        ``[*, V_t]``; with ``columns [*, K]`` (int64 teacher ids, e.g. the teacher's top-k
        per token) only those columns, ``[*, K]``, without densifying ``M``.

        Computed in fp32, also under bf16 autocast; ``p`` gets the gradient
        ``grad @ M^T`` and ``M`` none. Deterministic and bitwise batch-invariant. See
        :func:`compileops.xtoken.project` for what is checked where.
        """
        return project(p, self, columns)

    def extra_repr(self) -> str:
        return (f"num_student={self.num_student}, num_teacher={self.num_teacher}, "
                f"nnz={self.row_weights.shape[0]}")
