"""Benchmark: cross-tokenizer kernels against their anchors, in one process on one GPU.

* chunk averaging at B=1, T=2048, C=2000, V=151936 fp32: compileops ``chunk_sums`` (the
  kernel) and ``chunk_average`` vs the one-hot bmm. Acceptance: chunk_average >= 10x the
  bmm, and chunk_sums >= 0.7 of its bytes floor (read log-probs once, write sums once).
* fp32 projection, V_s = V_t = 151936, top-8 candidates per student row, T=2048:
  compileops ``project`` vs ``torch.sparse.mm`` (COO, fp32; and CSR where it runs).
  Acceptance: >= 2x ``torch.sparse.mm``.

Prints a markdown table (``harness.report``) and writes CSV under ``harness.out_dir()``.
About a minute on one GPU. ``--smoke`` runs every piece on CPU at tiny shapes (Triton under
its interpreter; times meaningless) to check the script itself.

    python benchmarks/bench_xtoken.py            # GPU
    python benchmarks/bench_xtoken.py --smoke    # CPU, seconds
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_ms(fn, reps: int = 3) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes, untimed")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import torch

    import compileops
    from benchmarks import harness
    from compileops.xtoken import SparseProjection, chunk_average, chunk_sums
    from compileops.xtoken.reference import chunk_average_one_hot_bmm
    from compileops.xtoken.selfcheck import random_topk_projection

    if args.smoke:
        device = "cpu"
        B, T, C, V = 1, 64, 48, 300
        V_proj, T_proj, topk = 500, 32, 8
        bench = _cpu_ms

        def floor(bytes_moved):
            return float("nan")
    else:
        if not torch.cuda.is_available():
            print("bench_xtoken needs a CUDA GPU (or pass --smoke)", file=sys.stderr)
            return 2
        device = "cuda"
        B, T, C, V = 1, 2048, 2000, 151936
        V_proj, T_proj, topk = 151936, 2048, 8
        bench = harness.bench_ms

        def floor(bytes_moved):
            return harness.floor_ms(bytes_moved=bytes_moved, device=device)

    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[harness.Row] = []
    failures: list[str] = []

    # ---- chunk averaging ---------------------------------------------------------------
    case = f"chunk avg B={B} T={T} C={C} V={V} fp32"
    lp = torch.randn(B, T, V, device=device, generator=gen).log_softmax(-1)
    ids = torch.sort(torch.randint(0, C, (B, T), device=device, generator=gen), dim=1).values
    ids[:, ::9] = -1  # gaps
    sums_bytes = 4 * (B * T * V + B * C * V)  # read every row once, write every chunk once
    avg_bytes = sums_bytes + 4 * 2 * B * C * V  # + the division (read sums, write means)
    t_bmm = bench(lambda: chunk_average_one_hot_bmm(lp, ids, C))
    rows.append(harness.Row(case, "one-hot bmm", t_bmm, avg_bytes, 2.0 * B * C * T * V,
                            floor(avg_bytes)))
    t_sums = bench(lambda: chunk_sums(lp, ids, C))
    rows.append(harness.Row(case, "compileops chunk_sums", t_sums, sums_bytes, 0.0,
                            floor(sums_bytes), note="kernel"))
    t_avg = bench(lambda: chunk_average(lp, ids, C))
    rows.append(harness.Row(case, "compileops chunk_average", t_avg, avg_bytes, 0.0,
                            floor(avg_bytes)))
    compiled_avg = torch.compile(lambda x, i: chunk_average(x, i, C)[0], fullgraph=True)
    t_avg_c = bench(lambda: compiled_avg(lp, ids))
    rows.append(harness.Row(case, "compileops chunk_average", t_avg_c, avg_bytes, 0.0,
                            floor(avg_bytes), note="torch.compile"))
    mean, _ = chunk_average(lp, ids, C)
    want, _ = chunk_average_one_hot_bmm(lp, ids, C)
    err = float((mean - want).abs().max())
    if not err <= 1e-4:
        failures.append(f"chunk_average differs from the bmm anchor by {err:.3e}")
    del lp, mean, want

    # ---- projection --------------------------------------------------------------------
    case_p = f"project T={T_proj} V_s=V_t={V_proj} top-{topk} fp32"
    cpu_gen = torch.Generator().manual_seed(1)
    coo = random_topk_projection(V_proj, V_proj, topk, cpu_gen)
    proj = SparseProjection.from_coo(coo, device)
    nnz = proj.row_weights.numel()
    p = torch.rand(T_proj, V_proj, device=device, generator=gen)
    proj_bytes = 4 * 2 * T_proj * V_proj + 12 * nnz  # p once, out once, M once
    t_ours = bench(lambda: proj(p))
    rows.append(harness.Row(case_p, "compileops project", t_ours, proj_bytes,
                            2.0 * T_proj * nnz, floor(proj_bytes)))
    M_t = torch.sparse_coo_tensor(
        torch.stack([proj.csr().row_teacher_ids, torch.repeat_interleave(
            torch.arange(V_proj, device=device), proj.row_indptr.diff())]),
        proj.row_weights, (V_proj, V_proj)).coalesce()  # M^T [V_t, V_s]

    def sparse_mm():
        return torch.sparse.mm(M_t, p.t()).t()

    t_sparse = bench(sparse_mm)
    rows.append(harness.Row(case_p, "torch.sparse.mm", t_sparse, proj_bytes,
                            2.0 * T_proj * nnz, floor(proj_bytes), note="COO"))
    try:
        M_t_csr = M_t.to_sparse_csr()
        t_csr = bench(lambda: (M_t_csr @ p.t()).t())
        rows.append(harness.Row(case_p, "torch.sparse.mm", t_csr, proj_bytes,
                                2.0 * T_proj * nnz, floor(proj_bytes), note="CSR"))
    except (RuntimeError, NotImplementedError) as e:  # backend-dependent support
        print(f"(CSR anchor skipped: {e})", file=sys.stderr)
    ours = proj(p)
    diff = float((ours - sparse_mm()).abs().max())
    if not diff <= 1e-4:
        failures.append(f"project differs from torch.sparse.mm by {diff:.3e}")
    g = torch.randn(T_proj, V_proj, device=device, generator=gen)
    # The projection backward alone, through its registered op (see compileops.xtoken).
    project_backward = torch.ops.compileops.xtoken_project_backward

    t_bwd = bench(lambda: project_backward(g, proj.row_indptr, proj.row_teacher_ids,
                                           proj.row_weights, V_proj, None))
    rows.append(harness.Row(case_p, "compileops project backward", t_bwd, proj_bytes,
                            2.0 * T_proj * nnz, floor(proj_bytes)))

    title = "xtoken: chunk averaging and fp32 sparse projection"
    if args.smoke:
        title += " (SMOKE: CPU, tiny, untimed)"
    harness.report(title, rows, csv_path=os.path.join(harness.out_dir(), "bench_xtoken.csv"))

    ratio_avg = t_bmm / t_avg
    sums_row = rows[1]
    ratio_proj = t_sparse / t_ours
    print()
    print(f"chunk_average vs one-hot bmm: {ratio_avg:.1f}x (acceptance >= 10x)")
    print(f"chunk_sums bytes floor ratio (floor/measured): {sums_row.floor_ratio:.2f} "
          "(acceptance >= 0.7)")
    print(f"project vs torch.sparse.mm (COO): {ratio_proj:.2f}x (acceptance >= 2x)")
    for f in failures:
        print("CORRECTNESS FAILURE: " + f)
    if args.smoke:
        print("smoke run: timings are not meaningful")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
