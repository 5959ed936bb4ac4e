"""Cross-tokenizer distillation loss with compileops.xtoken (runs on CPU in seconds).

The student's probabilities are projected into the teacher vocabulary through a frozen
sparse projection (fp32, even under bf16 autocast), both sides' log-probs are averaged per
aligned chunk, and a KL over valid chunks is the loss. Everything compiles with
fullgraph=True.

    python examples/xtoken_distillation.py
"""
import argparse
import os
import tempfile

import torch

from compileops.xtoken import (
    SparseProjection,
    build_exact_token_map,
    chunk_average,
    dp_all_reduce_sum,
    parse_projection_file,
    valid_chunk_mask,
)

V_s, V_t, D, B, T_s, T_t, C, k = 120, 100, 32, 2, 24, 20, 8, 4


def write_projection_file(path: str) -> None:
    """A projection file in the dense top-k format (-1 = no candidate)."""
    indices = torch.randint(0, V_t, (V_s, k))
    indices[:, -1] = -1
    likelihoods = torch.rand(V_s, k).softmax(-1)
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)


def make_loss_fn(projection: SparseProjection, student_head: torch.nn.Module):
    def loss_fn(hidden, teacher_logits, student_chunks, teacher_chunks):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            student_probs = student_head(hidden).float().softmax(-1)
            projected = projection(student_probs)  # fp32 [B, T_s, V_t], autocast or not
        student_lp = torch.log(projected + 1e-8)
        s_mean, s_sizes = chunk_average(student_lp, student_chunks, C)
        t_mean, t_sizes = chunk_average(teacher_logits.log_softmax(-1), teacher_chunks, C)
        valid = valid_chunk_mask(s_sizes, t_sizes, torch.ones_like(s_sizes, dtype=torch.bool))
        kl = (t_mean.exp() * (t_mean - s_mean)).sum(-1)
        return (kl * valid).sum() / valid.sum().clamp(min=1)

    return loss_fn


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "projection.pt")
        write_projection_file(path)
        projection = SparseProjection.from_file(path, "cpu", num_student=V_s, num_teacher=V_t)
        token_map = build_exact_token_map(parse_projection_file(path), "relaxed")
    print(f"{projection}; exact pairs (relaxed rule): {token_map.common_student_ids.numel()}")

    student_head = torch.nn.Linear(D, V_s)
    loss_fn = make_loss_fn(projection, student_head)

    hidden = torch.randn(B, T_s, D)
    teacher_logits = torch.randn(B, T_t, V_t)
    student_chunks = (torch.arange(T_s) * C // T_s).expand(B, T_s).clone()
    teacher_chunks = (torch.arange(T_t) * C // T_t).expand(B, T_t).clone()
    teacher_chunks[:, 3] = -1  # a teacher token that aligns with nothing

    compiled = torch.compile(loss_fn, fullgraph=True)
    loss = compiled(hidden, teacher_logits, student_chunks, teacher_chunks)
    loss.backward()
    eager = loss_fn(hidden, teacher_logits, student_chunks, teacher_chunks)
    print(f"loss compiled {loss.item():.6f} eager {eager.item():.6f}; "
          f"grad norm {student_head.weight.grad.norm():.4f}")
    print("valid tokens across data-parallel ranks: "
          f"{dp_all_reduce_sum(student_chunks.ge(0).sum())}")


if __name__ == "__main__":
    main()
