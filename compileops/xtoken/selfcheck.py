"""Self-check demo for the xtoken family: student head -> softmax -> fp32 projection to the
teacher vocab -> log -> chunk average, as in a cross-tokenizer distillation loss."""
from __future__ import annotations

import torch

from compileops._demo import Demo
from compileops.xtoken.chunks import chunk_average
from compileops.xtoken.module import SparseProjection
from compileops.xtoken.projection import ProjectionCOO


def random_topk_projection(num_student: int, num_teacher: int, k: int,
                           generator: torch.Generator) -> ProjectionCOO:
    """Each student row gets ``k`` random teacher candidates with weights summing to 1."""
    students = torch.arange(num_student).repeat_interleave(k)
    teachers = torch.randint(0, num_teacher, (num_student * k,), generator=generator)
    weights = torch.rand(num_student, k, generator=generator)
    weights = (weights / weights.sum(1, keepdim=True)).reshape(-1)
    return ProjectionCOO(students, teachers, weights, num_student, num_teacher)


class ChunkedTeacherLogProbs(torch.nn.Module):
    """hidden ``[B, T, D]``, chunk_id ``[B, T]`` -> per-chunk mean teacher-vocab log-probs
    ``[B, C, V_t]`` fp32."""

    def __init__(self, dim: int, coo: ProjectionCOO, max_chunks: int):
        super().__init__()
        self.head = torch.nn.Linear(dim, coo.num_student)
        self.projection = SparseProjection.from_coo(coo)
        self.max_chunks = max_chunks

    def forward(self, hidden: torch.Tensor, chunk_id: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.head(hidden).float(), dim=-1)
        teacher_log_probs = torch.log(self.projection(probs) + 1e-8)
        mean, _sizes = chunk_average(teacher_log_probs, chunk_id, self.max_chunks)
        return mean


def demo(device: torch.device) -> Demo:
    on_gpu = device.type == "cuda"
    V_s, V_t, dim, C = (8192, 6144, 256, 128) if on_gpu else (96, 80, 16, 6)
    gen = torch.Generator(device="cpu").manual_seed(0)
    model = ChunkedTeacherLogProbs(dim, random_topk_projection(V_s, V_t, 4, gen), C).to(device)

    def args_for(tokens: int) -> tuple:
        hidden = torch.randn(2, tokens, dim, generator=gen).to(device)
        # Non-decreasing chunk runs with -1 gaps, as the tokenizer alignment produces them.
        chunk_id = (torch.arange(tokens) * C // max(tokens, 1)).expand(2, tokens).clone()
        chunk_id[:, ::5] = -1
        return hidden, chunk_id.to(device)

    def reference(hidden: torch.Tensor, chunk_id: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w, b = model.head.weight.double(), model.head.bias.double()
            probs = torch.softmax(hidden.double() @ w.T + b, dim=-1)
            M = model.projection.csr().to_dense().double()
            lp = torch.log(probs @ M + 1e-8)
            ids = chunk_id.long()
            one_hot = torch.nn.functional.one_hot(ids.clamp(min=0), C).double()
            one_hot = one_hot * (ids >= 0)[..., None]
            sums = one_hot.transpose(1, 2) @ lp
            return sums / one_hot.sum(1).clamp(min=1)[..., None]

    return Demo(
        family="xtoken",
        model=model,
        args=args_for(512 if on_gpu else 24),
        reference=reference,
        ops=["xtoken_project", "xtoken_project_backward", "xtoken_chunk_sums",
             "xtoken_chunk_sums_backward"],
        max_relative_error=1e-5,  # fp32 softmax/projection/sums against fp64
        resized_args=args_for,
    )
