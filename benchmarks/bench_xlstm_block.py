"""One xLSTM-7B block trained: forward + backward of transformers' ``xLSTMBlock`` (RMSNorm,
mLSTM layer with its projections, soft-capped gates, multi-head norm and output gate,
RMSNorm, feed-forward) on compileops against the same block on TFLA's kernels.

The block has xLSTM-7B's widths: embedding 4096, 8 heads, DQK 256, DV 512, feed-forward 10944,
gate soft cap 15; bf16, every matrix ``N(0, 1) / sqrt(fan_in)``, transformers' gate biases.
Input ``x [B, S, 4096]`` is ``N(0, 1)``, the output's cotangent ``N(0, 1)``; gradients flow to
``x`` and every parameter. Implementations (same weights, each in its own process):

* ``compileops``: ``compileops.integrations.transformers.apply(model)``, the block compiled
  (``fullgraph=True``; ``--modes static dynamic eager``);
* ``xl_chunk``: the block's ``mlstm_backend`` replaced by mlstm_kernels' ``mLSTMBackend`` in
  training mode as xLSTM-7B's own config selects it (``chunkwise--triton_xl_chunk``, chunk 64,
  no last states); the rest of the block compiled (the kernels are a graph break), or eager
  with ``--modes eager``. Run with LLVM's optimiser off (``DISABLE_LLVM_OPT=1``, triton 3.6's
  compiler aborts on these kernels otherwise);
* ``floor``: the block with the mLSTM cell replaced by an elementwise stand-in,
  ``h = v * sigmoid(i) * sigmoid(f) + sum(q * k)``, compiled: it reads q, k, v and both gates
  once, so every projection that feeds the cell stays in the graph (a stand-in that ignored
  them would let the compiler drop the q, k and gate projections). Everything else is the
  block of the other two, so ``anchor / floor`` bounds the speed-up that any cell, however
  fast, can give the block.

Cases: ``--shapes 8x8192 64x1024`` (``B x S``, 65,536 tokens each). Reported: median ms of a
forward + backward (CUDA events), peak memory above the weights and inputs, and the speed-up
against ``xl_chunk`` in the same mode.

    python benchmarks/bench_xlstm_block.py                       # GPU
    python benchmarks/bench_xlstm_block.py --device cpu --tiny   # smoke test: tiny, fp32, CPU

Output: a markdown table on stdout and ``$COMPILEOPS_BENCH_OUT/xlstm_block.csv``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_xlstm_hf import TINY as TINY_HF  # noqa: E402
from benchmarks.bench_xlstm_hf import XLSTM_7B, scale_matrices, timed_ms  # noqa: E402
from benchmarks.harness import environment_line, sync, write_csv  # noqa: E402

IMPLS = ("compileops", "xl_chunk", "floor")
ENV = {"xl_chunk": {"DISABLE_LLVM_OPT": "1"}}
# The generation bench's tiny widths with 7B's qk ratio (no cache here, so no multiple of 64)
TINY = dict(TINY_HF, qk_dim_factor=0.5)
TAG = "@@row "
CSV_COLUMNS = ["impl", "mode", "shape", "ms", "peak_gib", "status"]


class _CellBackend(torch.nn.Module):
    """transformers' backend call (``query=, key=, ...``) returning ``(h [B, NH, S, DV],
    None)``: TFLA's training kernels, or the floor's elementwise stand-in."""

    def __init__(self, backend=None):
        super().__init__()
        self.backend = backend

    def forward(self, query, key, value, igate, fgate, **_):
        if self.backend is None:
            gates = (torch.sigmoid(igate) * torch.sigmoid(fgate)).unsqueeze(-1)
            h = value * gates + (query * key).sum(-1, keepdim=True)
            return h.to(value.dtype), None
        return self.backend(q=query, k=key, v=value, i=igate, f=fgate), None


def build_block(tiny: bool, device, dtype):
    from transformers import xLSTMConfig, xLSTMModel

    config = xLSTMConfig(num_hidden_layers=1, use_cache=False, **(TINY if tiny else XLSTM_7B))
    torch.manual_seed(0)
    with torch.device(device):
        model = xLSTMModel._from_config(config, dtype=dtype)
    return scale_matrices(model, device).train()


def prepare(model, impl: str):
    """The block, switched to ``impl`` in place."""
    layer = model.blocks[0].mlstm_layer
    if impl == "compileops":
        import compileops.integrations.transformers as cit

        cit.apply(model, embedding=False)
    elif impl == "xl_chunk":
        from mlstm_kernels.torch.backend_module import mLSTMBackend, mLSTMBackendConfig

        config = mLSTMBackendConfig(
            chunkwise_kernel="chunkwise--triton_xl_chunk", sequence_kernel="native_sequence__triton",
            step_kernel="triton", mode="train", chunk_size=64, return_last_states=False,
            autocast_kernel_dtype="bfloat16", eps=model.config.eps)
        layer.mlstm_backend = _CellBackend(mLSTMBackend(config))
    elif impl == "floor":
        layer.mlstm_backend = _CellBackend()
    return model.blocks[0]


def child(cfg: dict) -> None:
    device = torch.device(cfg["device"])
    dtype = torch.float32 if cfg["tiny"] else torch.bfloat16
    model = build_block(cfg["tiny"], device, dtype)
    block = prepare(model, cfg["impl"])
    hidden = model.config.hidden_size
    for mode in cfg["modes"]:
        torch._dynamo.reset()
        if mode == "eager":
            run = block
        else:
            run = torch.compile(block, fullgraph=cfg["impl"] != "xl_chunk",
                                dynamic=mode == "dynamic")
        for shape in cfg["shapes"]:
            batch, seq = (int(n) for n in shape.split("x"))
            row = dict(impl=cfg["impl"], mode=mode, shape=shape, ms=float("nan"),
                       peak_gib=float("nan"), status="ok")
            try:
                gen = torch.Generator(device=device).manual_seed(1)
                x = torch.randn(batch, seq, hidden, generator=gen, device=device,
                                dtype=dtype).requires_grad_()
                dy = torch.randn(batch, seq, hidden, generator=gen, device=device, dtype=dtype)

                def step():
                    y, _ = run(x)
                    y.backward(dy)
                    x.grad = None
                    for p in block.parameters():
                        p.grad = None

                step()
                sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                row["ms"] = timed_ms(step, device, cfg["warmup"], cfg["iters"])
                if device.type == "cuda":
                    row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            except Exception as exc:  # a status in the table, never a number
                oom = isinstance(exc, torch.cuda.OutOfMemoryError)
                row["status"] = "oom" if oom else (
                    f"error: {type(exc).__name__}: {' '.join(str(exc).split())}"[:200])
            print(TAG + json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths, fp32 (smoke test)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--modes", nargs="+", default=["static"],
                        choices=["static", "dynamic", "eager"])
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="B x S, default 8x8192 64x1024 (tiny: 2x64)")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (cpu: 1)")
    parser.add_argument("--iters", type=int, default=None, help="default 10 (cpu: 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per impl")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0

    cpu = args.device == "cpu"  # there compileops runs its reference backend, or the
    # Triton kernels under the interpreter when TRITON_INTERPRET=1 is set
    cfg = dict(device=args.device, tiny=args.tiny, modes=args.modes,
               shapes=args.shapes or (["2x64"] if args.tiny else ["8x8192", "64x1024"]),
               warmup=args.warmup if args.warmup is not None else (1 if cpu else 3),
               iters=args.iters or (1 if cpu else 10))
    print(environment_line())
    print(f"xLSTM block, {'tiny' if args.tiny else '7B widths'}; modes {', '.join(args.modes)}")
    rows = []
    for impl in args.impls:
        env = dict(os.environ, **ENV.get(impl, {}))
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child",
                 json.dumps(dict(cfg, impl=impl))],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
            out, status = proc.stdout, f"aborted rc={proc.returncode}"
            tail = proc.stderr.strip().splitlines()[-5:]
        except subprocess.TimeoutExpired as exc:
            out, status, tail = exc.stdout or "", f"timeout (> {args.timeout:.0f} s)", []
            out = out.decode() if isinstance(out, bytes) else out
        got = [json.loads(line[len(TAG):]) for line in out.splitlines() if line.startswith(TAG)]
        done = {(r["mode"], r["shape"]) for r in got}
        for r in got:
            print(f"{r['impl']:11s} {r['mode']:8s} {r['shape']:8s} {r['ms']:9.3f} ms "
                  f"{r['peak_gib']:7.2f} GiB  {r['status']}", flush=True)
        for mode in cfg["modes"]:
            for shape in cfg["shapes"]:
                if (mode, shape) not in done:
                    got.append(dict(impl=impl, mode=mode, shape=shape, ms=float("nan"),
                                    peak_gib=float("nan"), status=status))
                    print(f"{impl} {mode} {shape}: {status}; " + " | ".join(tail), flush=True)
        rows += got

    anchor = {(r["mode"], r["shape"]): r["ms"] for r in rows
              if r["impl"] == "xl_chunk" and r["status"] == "ok"}
    print()
    print("| shape | mode | impl | fw+bw ms | peak GiB | vs xl_chunk | status |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["shape"], r["mode"], r["impl"])):
        ok = r["status"] == "ok"
        base = anchor.get((r["mode"], r["shape"]))
        ratio = f"{base / r['ms']:.2f}x" if ok and base else ""
        print(f"| {r['shape']} | {r['mode']} | {r['impl']} | "
              f"{r['ms']:.3f} | {r['peak_gib']:.2f} | {ratio} | {r['status']} |"
              if ok else f"| {r['shape']} | {r['mode']} | {r['impl']} | | | | {r['status']} |")
    print(f"csv: {write_csv('xlstm_block.csv', CSV_COLUMNS, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
