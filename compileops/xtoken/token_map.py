"""Exact token map: which student tokens have one unambiguous teacher token.

Host-side, built once from the projection's COO triplets (vectorised; no Python loop over
the vocab).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from compileops.xtoken.projection import ProjectionCOO

RELAXED_THRESHOLD = 0.6


@dataclasses.dataclass(frozen=True)
class ExactTokenMap:
    """``student_to_teacher [V_s]`` / ``teacher_to_student [V_t]`` int64, ``-1`` where unpaired.

    ``common_student_ids``/``common_teacher_ids`` are the paired ids (in student order, so
    ``common_teacher_ids[i]`` pairs with ``common_student_ids[i]``); ``uncommon_*`` the rest,
    ascending. Together they partition each vocab.
    """

    student_to_teacher: torch.Tensor
    teacher_to_student: torch.Tensor
    common_student_ids: torch.Tensor
    common_teacher_ids: torch.Tensor
    uncommon_student_ids: torch.Tensor
    uncommon_teacher_ids: torch.Tensor


def _stable_lexsort(*keys: torch.Tensor) -> torch.Tensor:
    """Indices sorting by ``keys[0]``, then ``keys[1]``, ...; ties keep input order."""
    order = torch.arange(keys[0].numel())
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    return order


def _first_of_runs(sorted_key: torch.Tensor) -> torch.Tensor:
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    return first


def build_exact_token_map(
    coo: ProjectionCOO,
    rule: str = "strict",
    *,
    num_student: Optional[int] = None,
    num_teacher: Optional[int] = None,
) -> ExactTokenMap:
    """Pair student and teacher tokens one-to-one from the projection's candidates.

    * ``rule="strict"``: a student pairs with its top candidate only if that weight is 1.0
      and it has no second candidate; when two students want one teacher token, the lowest
      student id wins.
    * ``rule="relaxed"``: the top candidate's weight is >= 0.6 (ties among a student's own
      candidates: lowest teacher id); on collision the highest weight wins, then the lowest
      student id.

    Candidates are the COO entries with a non-negative id and a non-zero weight.
    """
    if rule not in ("strict", "relaxed"):
        raise ValueError(f"rule must be 'strict' or 'relaxed', got {rule!r}")
    V_s = max(coo.num_student, num_student or 0)
    V_t = max(coo.num_teacher, num_teacher or 0)
    s = coo.student_ids.reshape(-1).long().cpu()
    t = coo.teacher_ids.reshape(-1).long().cpu()
    w = coo.weights.reshape(-1).float().cpu()
    keep = (s >= 0) & (t >= 0) & (w != 0)
    s, t, w = s[keep], t[keep], w[keep]

    # Each student's top candidate: highest weight, then lowest teacher id.
    order = _stable_lexsort(s, -w, t)
    s, t, w = s[order], t[order], w[order]
    first = _first_of_runs(s)
    n_candidates = torch.bincount(s, minlength=V_s)
    top_s, top_t, top_w = s[first], t[first], w[first]
    if rule == "strict":
        ok = (top_w == 1.0) & (n_candidates[top_s] == 1)
    else:
        ok = top_w >= RELAXED_THRESHOLD
    top_s, top_t, top_w = top_s[ok], top_t[ok], top_w[ok]

    # Collisions on a teacher id.
    if rule == "strict":
        order = _stable_lexsort(top_t, top_s)
    else:
        order = _stable_lexsort(top_t, -top_w, top_s)
    top_s, top_t = top_s[order], top_t[order]
    winner = _first_of_runs(top_t)
    pair_s, pair_t = top_s[winner], top_t[winner]

    student_to_teacher = torch.full((V_s,), -1, dtype=torch.int64)
    teacher_to_student = torch.full((V_t,), -1, dtype=torch.int64)
    student_to_teacher[pair_s] = pair_t
    teacher_to_student[pair_t] = pair_s
    common_s = (student_to_teacher >= 0).nonzero().reshape(-1)
    return ExactTokenMap(
        student_to_teacher=student_to_teacher,
        teacher_to_student=teacher_to_student,
        common_student_ids=common_s,
        common_teacher_ids=student_to_teacher[common_s],
        uncommon_student_ids=(student_to_teacher < 0).nonzero().reshape(-1),
        uncommon_teacher_ids=(teacher_to_student < 0).nonzero().reshape(-1),
    )
