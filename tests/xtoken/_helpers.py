"""Shared builders for the xtoken tests (small, seeded)."""
from __future__ import annotations

import torch

from compileops.xtoken import ProjectionCOO, SparseProjection

BACKENDS = ("reference", "triton")


def random_coo(num_student=37, num_teacher=29, k=3, seed=0) -> ProjectionCOO:
    """k candidates per student row, some duplicates (summed) and -1 sentinels (dropped),
    and a few empty student rows and teacher columns."""
    gen = torch.Generator().manual_seed(seed)
    students = torch.arange(num_student).repeat_interleave(k)
    teachers = torch.randint(0, num_teacher - 2, (num_student * k,), generator=gen)
    teachers[::7] = -1
    students[5 * k:6 * k] = 4  # student 5 has no entries; student 4 gets duplicates
    weights = torch.rand(num_student * k, generator=gen) + 0.1
    return ProjectionCOO(students, teachers, weights, num_student, num_teacher)


def random_projection(**kwargs) -> SparseProjection:
    return SparseProjection.from_coo(random_coo(**kwargs))


def chunk_runs(B, T, C, seed=0, gaps=True) -> torch.Tensor:
    """``chunk_id [B, T]`` int64: non-decreasing contiguous runs with -1 gaps (the aligner's
    output)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, C, (B, T), generator=gen), dim=1).values
    if gaps:
        ids[torch.rand(B, T, generator=gen) < 0.2] = -1
    return ids
