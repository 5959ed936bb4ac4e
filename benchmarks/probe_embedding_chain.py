"""Probe (GPU): how fast can one latency-bound hot-id chain of the embedding backward go?

The Zipf benchmark's hottest id repeats 2081 times; its grad row is the fp32 sum of 2081
grad rows of 8 KB, added one by one in token-position order (REFERENCE.md section 1). In the
full backward that chain ends ~60 us after everything else. This script times minimal
kernels that compute exactly that sum for one chain, to see which structure keeps the most
rows in flight:

* ``rows``: ``tile`` row loads per step, issued before the step's adds; the next step's
  token positions loaded during the step (what the main kernel's long path does).
* ``rows2``: the same, double-buffered: step s+1's rows are loaded before step s is added,
  so two steps of rows are in flight.
* ``long``: the existing software-pipelined long-run kernel (``embedding_long_runs_kernel``)
  on the Zipf ids with ``long_min`` 1023 (only the hot chains).

Each kernel is timed alone (do_bench) and under contention: launched on a high-priority
stream while the current stream zero-fills the V x D table (the backward's fill); CUDA
events on the side stream give the chain's own elapsed time. Results are checked bitwise
against a plain sequential fp32 sum.

    python3 benchmarks/probe_embedding_chain.py
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_embedding import zipf_ids  # noqa: E402
from benchmarks.harness import bench_ms  # noqa: E402
from compileops.embedding import kernels  # noqa: E402

V, D, N = 151936, 4096, 16384


@triton.jit
def _positions(pos_ptr, p, n, T: tl.constexpr):
    toks = ()
    for k in tl.static_range(T):
        q = p + k
        toks = toks + (tl.load(pos_ptr + q, mask=q < n, other=0),)
    return toks


@triton.jit
def _rows(grad_ptr, toks, col_off, col_ok, stride_row, T: tl.constexpr):
    rows = ()
    for k in tl.static_range(T):
        rows = rows + (tl.load(grad_ptr + toks[k].to(tl.int64) * stride_row + col_off,
                               mask=col_ok, other=0.0),)
    return rows


@triton.jit
def chain_kernel(pos_ptr, grad_ptr, out_ptr, n, dim, stride_row,
                 BC: tl.constexpr, T: tl.constexpr, DOUBLE: tl.constexpr):
    """out[cols] = sequential fp32 sum of grad[pos[i], cols], i = 0..n-1 (n % T == 0)."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    col_ok = cols < dim
    col_off = cols.to(tl.int64)
    acc = tl.zeros([BC], dtype=tl.float32)
    steps = n // T
    toks = _positions(pos_ptr, 0, n, T)
    if DOUBLE:
        rows = _rows(grad_ptr, toks, col_off, col_ok, stride_row, T)
        toks = _positions(pos_ptr, T, n, T)
        for s in range(1, steps):
            nxt = _rows(grad_ptr, toks, col_off, col_ok, stride_row, T)
            toks = _positions(pos_ptr, (s + 1) * T, n, T)
            for k in tl.static_range(T):
                acc += rows[k].to(tl.float32)
            rows = nxt
        for k in tl.static_range(T):
            acc += rows[k].to(tl.float32)
    else:
        for s in range(steps):
            rows = _rows(grad_ptr, toks, col_off, col_ok, stride_row, T)
            toks = _positions(pos_ptr, (s + 1) * T, n, T)
            for k in tl.static_range(T):
                acc += rows[k].to(tl.float32)
    tl.store(out_ptr + cols, acc, mask=col_ok)


def main() -> None:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
    ids = zipf_ids(N, V).to(dev)
    grad = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    hot = torch.mode(ids).values
    pos_full = (ids == hot).nonzero().flatten().to(torch.int32)
    print(f"hot id repeats {pos_full.numel()} times")
    table = torch.empty(V, D, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])

    def timed(name, launch, n_rows):
        launch()
        torch.cuda.synchronize()
        alone = bench_ms(launch)
        # Under contention: the chain on the high-priority side stream, the fill on the
        # current one; events on the side stream time the chain itself.
        spans = []
        for _ in range(15):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            side.wait_stream(torch.cuda.current_stream())
            table.zero_()
            with torch.cuda.stream(side):
                start.record()
                launch()
                end.record()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            spans.append(start.elapsed_time(end))
        busy = statistics.median(spans)
        print(f"{name:58s} alone {alone * 1e3:8.1f} us   beside the fill {busy * 1e3:8.1f} us"
              f"   ({n_rows} rows, {n_rows * D * 2 / alone / 1e6:6.1f} GB/s alone)", flush=True)

    n_rows = 1920  # a multiple of every tile below (the probe kernel has no tail step)
    pos = pos_full[:n_rows].contiguous()
    ref = grad[pos.long()].float()
    want = torch.zeros(D, device=dev)
    for i in range(n_rows):
        want += ref[i]
    # (columns per program, warps, rows per step, double-buffered)
    variants = [(512, 4, 32, False), (64, 1, 32, False), (64, 1, 64, False),
                (32, 1, 64, False), (64, 2, 64, False), (128, 4, 64, False),
                (64, 1, 48, False), (32, 1, 96, False), (64, 1, 32, True),
                (32, 1, 128, False)]
    for bc, warps, t, double in variants:
        out = torch.empty(D, device=dev)

        def launch(bc=bc, t=t, double=double, out=out, warps=warps):
            chain_kernel[(triton.cdiv(D, bc),)](
                pos, grad, out, n_rows, D, grad.stride(0), BC=bc, T=t, DOUBLE=double,
                num_warps=warps, maxnreg=255 if double or t > 32 else 128)
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile: report, go on
            print(f"bc {bc} w{warps} t {t} double {double}: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:120]}")
            continue
        ok = torch.equal(out, want)
        timed(f"rows{'2' if double else ''} bc {bc:4d} w{warps} tile {t:3d}"
              f"{'' if ok else '  MISMATCH'}", launch, n_rows)

    # The existing pipelined long-run kernel, only runs of 1024+ entries (the hot id's).
    sorted_ids, order = kernels._sort_ids(ids, V)
    for tile, bc, warps, stages in ((32, 256, 1, 6),):
        def launch(tile=tile, bc=bc, warps=warps, stages=stages):
            kernels.launch_long_runs_kernel(sorted_ids, order, grad, table, None, long_min=1023,
                                            long_tile=tile, long_block_col=bc,
                                            long_stages=stages, long_warps=warps,
                                            long_block=1024)
        timed(f"long kernel tile {tile} bc {bc} w{warps} stages {stages}", launch,
              pos_full.numel())

    timeline(ids, grad, table)


def timeline(ids, grad, out, reps: int = 20, **config_kwargs) -> None:
    """When does each part of the two-stream backward end? Events on both streams, medians
    over ``reps`` runs, microseconds from the start (``_two_stream_backward``'s steps)."""
    main = torch.cuda.current_stream()
    side = kernels._side_stream(grad.device)
    config = kernels.backward_config(grad, **config_kwargs)
    for label, diag, fill in (("default", 0, True), ("long runs skipped (output wrong)", 1, True),
                              ("no fill (output wrong)", 0, False)):
        marks: dict[str, list[float]] = {}
        for _ in range(reps):
            ev = {k: torch.cuda.Event(enable_timing=True)
                  for k in ("start", "sorted", "runs", "fill", "end")}
            torch.cuda.synchronize()
            ev["start"].record(main)
            touched = kernels._touched_map(ids, out.shape[0])
            stand_in = torch.empty(1, dtype=torch.int32, device=ids.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                sorted_ids, order = kernels._sort_ids(ids, out.shape[0])
                ev["sorted"].record(side)
                kernels.launch_backward_kernel(sorted_ids, order, None, grad, out, None,
                                               programs=1, diag=diag, **config)
                ev["runs"].record(side)
            if fill:
                kernels.launch_backward_kernel(stand_in, stand_in, touched, grad, out, None,
                                               programs=2, **config)
            ev["fill"].record(main)
            main.wait_stream(side)
            ev["end"].record(main)
            torch.cuda.synchronize()
            for k in ("sorted", "runs", "fill", "end"):
                marks.setdefault(k, []).append(ev["start"].elapsed_time(ev[k]) * 1e3)
        print(f"timeline ({label}): " + ", ".join(
            f"{k} ends {statistics.median(v):6.1f} us" for k, v in marks.items()), flush=True)

if __name__ == "__main__":
    main()
