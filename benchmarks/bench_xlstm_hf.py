"""Hugging Face xLSTM generation: prefill and decode on compileops against transformers' own
native code and, when ``import mlstm_kernels`` works, transformers with mlstm_kernels' Triton
kernels. One model, one process, one GPU.

The model is ``xLSTMForCausalLM`` at xLSTM-7B's widths (embedding 4096, 8 heads, DQK 256,
DV 512, feed-forward 10944, vocabulary 50304, gate soft cap 15, output logit soft cap 30) with
``--blocks`` blocks (default 2), bf16, random weights: every matrix ``N(0, 1) / sqrt(fan_in)``,
transformers' own gate biases (input -10, forget ``linspace(3, 6)``) and norm weights. The
implementations switch on that one model (same weights):

* ``native``: transformers' native xLSTM code (its default ``mode="inference"``: chunkwise
  native prefill with chunk 64, a recurrent step per token);
* ``compileops``: ``compileops.integrations.transformers.apply(model, embedding=False)``;
* ``mlstm_kernels``: each layer's ``mlstm_backend`` replaced by mlstm_kernels' ``mLSTMBackend``
  (``chunkwise--triton_xl_chunk``, chunk 128, ``native_sequence__triton``, step ``triton``,
  inference mode, fp32 states), as transformers wires it when the ``xlstm`` package is
  installed. Skipped, with a note, when mlstm_kernels does not import.

Cases, all under ``torch.no_grad()`` in eval mode, ``use_cache=True``:

* ``prefill S``: one forward over ``--prefill`` tokens (default 8192, batch 1), the cache
  filled: ms and tokens/s;
* ``decode B=b``: after a ``--prompt``-token prefill, ``--steps`` one-token forwards (each feeds
  the previous step's argmax), timed as a whole: ms per step and tokens/s (``b`` tokens per
  step), for each ``--batches`` value (default 1 and 64); the median of ``--decode-repeats``
  (default 15) such runs, with their spread in the note (decode at these sizes is bound by
  the host's launches and moves with what else the host does), and on a GPU the kernels' own
  time per step (``torch.profiler``) in the note. This is ``generate()``'s model work
  without its bookkeeping.

A failure is a status in the table, never a number (``error: ...``, ``oom``). Where our prefill
refuses a head (a query head wider than the Triton kernels' 256), the decode cases fill their
cache with the reference backend's prefill and time the steps on the Triton step kernel
(noted). Before timing, the prefill logits of each implementation are
compared with the native code's on the prompt (relative L2; bf16, so loose).

    python benchmarks/bench_xlstm_hf.py                          # GPU: 2 blocks, 7B widths
    python benchmarks/bench_xlstm_hf.py --blocks 4 --batches 1 16 64 --compile
    python benchmarks/bench_xlstm_hf.py --device cpu --tiny      # smoke test: tiny, fp32, CPU

Output: a markdown table on stdout (speed-up against ``native`` per case) and
``$COMPILEOPS_BENCH_OUT/xlstm_hf.csv`` (or benchmarks/out/).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
import compileops.integrations.transformers as cit  # noqa: E402
from compileops.integrations import xlstm as cx  # noqa: E402
from compileops.integrations._forward import bound_function  # noqa: E402
from benchmarks.harness import environment_line, sync, time_calls_ms, write_csv  # noqa: E402

IMPLS = ("native", "compileops", "mlstm_kernels")
XLSTM_7B = dict(vocab_size=50304, hidden_size=4096, num_heads=8, qk_dim_factor=0.5,
                v_dim_factor=1.0, ffn_proj_factor=2.667, ffn_round_up_to_multiple_of=64,
                gate_soft_cap=15.0, output_logit_soft_cap=30.0)
# qk_dim_factor 1: transformers' own cache needs qk and v widths that are multiples of 64
TINY = dict(vocab_size=128, hidden_size=64, num_heads=2, qk_dim_factor=1.0, v_dim_factor=1.0,
            gate_soft_cap=15.0, output_logit_soft_cap=30.0)
CSV_COLUMNS = ["impl", "case", "batch", "tokens", "ms", "tokens_per_s", "status", "note"]


# ---------------------------------------------------------------------------------------
# The model and the implementations


def build_model(args, device, dtype):
    from transformers import xLSTMConfig, xLSTMForCausalLM

    widths = TINY if args.tiny else XLSTM_7B
    config = xLSTMConfig(num_hidden_layers=args.blocks, use_cache=True,
                         max_inference_chunksize=1 << 20, **widths)
    torch.manual_seed(0)
    with torch.device(device):
        model = xLSTMForCausalLM._from_config(config, dtype=dtype)
    return scale_matrices(model, device).eval()


def scale_matrices(model, device):
    """Every matrix of ``model`` drawn ``N(0, 1) / sqrt(fan_in)`` (in fp32, seed 0): the
    scale of a trained model's activations, where transformers' init zeroes some of them."""
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) / p.shape[1] ** 0.5)
    return model


def _layers(model):
    return [block.mlstm_layer for block in model.backbone.blocks]


class _MlstmKernelsBackend(torch.nn.Module):
    """transformers' backend call (``query=, key=, ...``, states ``m [B, NH, 1]``) on
    mlstm_kernels' ``mLSTMBackend`` (``q, k, v, i, f``)."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def forward(self, query, key, value, igate, fgate, c_initial=None, n_initial=None,
                m_initial=None, **_):
        return self.backend(q=query, k=key, v=value, i=igate, f=fgate, c_initial=c_initial,
                            n_initial=n_initial, m_initial=m_initial)


def mlstm_kernels_backends(model, chunk: int):
    """One mlstm_kernels backend per layer, or the reason there is none."""
    try:
        from mlstm_kernels.torch.backend_module import mLSTMBackend, mLSTMBackendConfig
    except BaseException as exc:  # ImportError, or its own imports failing
        return None, f"mlstm_kernels does not import ({type(exc).__name__}: {exc})"
    config = mLSTMBackendConfig(
        chunkwise_kernel="chunkwise--triton_xl_chunk", sequence_kernel="native_sequence__triton",
        step_kernel="triton", mode="inference", chunk_size=chunk, return_last_states=True,
        autocast_kernel_dtype="bfloat16", eps=model.config.eps, inference_state_dtype="float32")
    return [_MlstmKernelsBackend(mLSTMBackend(config)) for _ in _layers(model)], None


def use(model, impl: str, state: dict) -> None:
    """Switch ``model`` to ``impl`` in place (the weights stay)."""
    ours = (cx.layer_forward, cx.model_forward, cx.rms_norm_forward)
    for module in model.modules():  # drop compileops' per-instance forwards
        if bound_function(module) in ours:
            del module.forward
    for layer, backend in zip(_layers(model), state["native_backends"]):
        layer.mlstm_backend = backend
    if impl == "compileops":
        cit.apply(model, embedding=False)
    elif impl == "mlstm_kernels":
        for layer, backend in zip(_layers(model), state["mlstm_kernels_backends"]):
            layer.mlstm_backend = backend


# ---------------------------------------------------------------------------------------
# Timing


def timed_ms(fn, device, warmup: int, iters: int) -> float:
    """Median ms of ``fn()`` over ``iters`` calls after ``warmup``."""
    times = sorted(time_calls_ms(fn, device, warmup, iters))
    return times[len(times) // 2]


def _short(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom"
    return "error: " + f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:200]


def _is_head_dim_refusal(exc: BaseException) -> bool:
    return "head dims up to" in str(exc)


def _cache_of(output):
    """The cache an output carries (transformers renamed ``cache_params`` to ``cache``)."""
    return output.cache if hasattr(output, "cache") else output.cache_params


def _cache_argument(model) -> str:
    """The forward's name for the cache: ``cache``, or ``cache_params`` before the rename."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "cache_params"


def run_prefill(model, impl, args, device, forward):
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prefill), generator=gen,
                        device=device)
    row = dict(impl=impl, case=f"prefill S={args.prefill}", batch=1, tokens=args.prefill,
               status="ok", note="")
    try:
        ms = timed_ms(lambda: forward(ids, use_cache=True), device, args.warmup, args.iters)
    except BaseException as exc:  # a status, never a number
        row.update(ms=float("nan"), tokens_per_s=float("nan"), status=_short(exc))
        return row
    row.update(ms=ms, tokens_per_s=args.prefill / (ms * 1e-3))
    return row


def run_decode(model, impl, args, device, forward, batch):
    gen = torch.Generator(device=device).manual_seed(2)
    prompt = torch.randint(3, model.config.vocab_size, (batch, args.prompt), generator=gen,
                           device=device)
    row = dict(impl=impl, case=f"decode B={batch}", batch=batch, tokens=batch * args.steps,
               status="ok", note="")
    try:
        try:
            out = forward(prompt, use_cache=True)
        except RuntimeError as exc:
            if impl != "compileops" or not _is_head_dim_refusal(exc):
                raise
            with compileops.use_backend("reference"):
                out = forward(prompt, use_cache=True)
            row["note"] = "prompt prefilled on the reference backend (head dims)"
        cache, token = _cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)
        name = _cache_argument(model)

        def steps():
            nonlocal cache, token
            for _ in range(args.steps):
                out = forward(token, use_cache=True, **{name: cache})
                cache, token = _cache_of(out), out.logits[:, -1].argmax(-1, keepdim=True)

        # Decode is bound by the host's launches at these sizes, so its timings move with
        # whatever else the host does: many repeats, and their spread in the note.
        times = sorted(time_calls_ms(steps, device, max(1, args.warmup // 5),
                                     args.decode_repeats))
        kernels = kernel_ms(steps, device) / args.steps if device.type == "cuda" else None
    except BaseException as exc:
        row.update(ms=float("nan"), tokens_per_s=float("nan"), status=_short(exc))
        return row
    per_step = times[len(times) // 2] / args.steps
    notes = [row["note"], f"{len(times)} repeats of {args.steps} steps: "
             f"{times[0] / args.steps:.3f}-{times[-1] / args.steps:.3f} ms a step"]
    if kernels is not None:
        notes.append(f"GPU kernels {kernels:.3f} ms a step")
    row.update(ms=per_step, tokens_per_s=batch / (per_step * 1e-3),
               note="; ".join(n for n in notes if n))
    return row


def kernel_ms(fn, device) -> float:
    """Milliseconds the GPU spends in kernels during one ``fn()`` (``torch.profiler``, every
    kernel's device time summed): what a decode step costs the GPU, apart from the host
    time that bounds its wall clock."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def check_against_native(model, impls, state, args, device) -> list[str]:
    """Prefill logits on a short prompt, each implementation against the native code."""
    gen = torch.Generator(device=device).manual_seed(3)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=gen,
                        device=device)
    lines, logits = [], {}
    for impl in impls:
        use(model, impl, state)
        try:
            with torch.no_grad():
                logits[impl] = model(ids, use_cache=True).logits.float()
        except Exception as exc:  # a line in the report, never the end of the run
            if impl == "compileops" and _is_head_dim_refusal(exc):
                with torch.no_grad(), compileops.use_backend("reference"):
                    logits[impl] = model(ids, use_cache=True).logits.float()
                lines.append("check compileops: prefill on the reference backend (head dims)")
            else:
                lines.append(f"check {impl}: {_short(exc)}")
    base = logits.get("native")
    for impl, value in logits.items():
        if impl != "native" and base is not None:
            rel = ((value - base).norm() / base.norm()).item()
            agree = (value.argmax(-1) == base.argmax(-1)).float().mean().item()
            lines.append(f"check {impl} vs native: prefill logits relative L2 {rel:.2e}, "
                         f"argmax agreement {agree:.1%}")
    return lines


# ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (smoke test)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=None, help="default 8192 (tiny: 64)")
    parser.add_argument("--prompt", type=int, default=None, help="default 128 (tiny: 8)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed, default 32 "
                        "(tiny: 3)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes, default 1 64 (tiny: 1 4)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                        help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (default mode) for every implementation")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (cpu: 1)")
    parser.add_argument("--iters", type=int, default=None, help="default 20 (cpu: 1)")
    parser.add_argument("--decode-repeats", type=int, default=None,
                        help="timed repeats of the decode steps, default 15 (cpu: 1)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --device cpu --tiny for a smoke test")
    cpu = device.type != "cuda"
    args.prefill = args.prefill or (64 if args.tiny else 8192)
    args.prompt = args.prompt or (8 if args.tiny else 128)
    args.steps = args.steps or (3 if args.tiny else 32)
    args.batches = args.batches or ([1, 4] if args.tiny else [1, 64])
    args.dtype = args.dtype or ("fp32" if cpu else "bf16")
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 5)
    args.iters = args.iters or (1 if cpu else 20)
    args.decode_repeats = args.decode_repeats or (1 if cpu else 15)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]

    import transformers

    print(environment_line())
    model = build_model(args, device, dtype)
    layer = _layers(model)[0]
    print(f"transformers {transformers.__version__} | xLSTM {'tiny' if args.tiny else '7B widths'}"
          f", {args.blocks} blocks, DQK {layer.qk_dim // model.config.num_heads}, DV "
          f"{layer.v_dim // model.config.num_heads} | {args.dtype} | "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters"
          f"{' | compiled' if args.compile else ''}")

    state = {"native_backends": [layer.mlstm_backend for layer in _layers(model)]}
    impls = list(args.impls)
    if "mlstm_kernels" in impls:
        backends, why = mlstm_kernels_backends(model, chunk=128)
        if backends is None:
            print(f"note: skipping the mlstm_kernels anchor: {why}")
            impls.remove("mlstm_kernels")
        else:
            state["mlstm_kernels_backends"] = [b.to(device) for b in backends]

    for line in check_against_native(model, impls, state, args, device):
        print(line)

    rows = []
    for impl in impls:
        use(model, impl, state)
        torch._dynamo.reset()
        forward = torch.compile(model) if args.compile else model
        with torch.no_grad():
            cases = [lambda: run_prefill(model, impl, args, device, forward)]
            cases += [lambda b=b: run_decode(model, impl, args, device, forward, b)
                      for b in args.batches]
            for case in cases:
                row = case()
                rows.append(row)
                print(f"{row['impl']:14s} {row['case']:16s} {row['ms']:10.3f} ms "
                      f"{row['tokens_per_s']:14,.0f} tokens/s  {row['status']} {row['note']}",
                      flush=True)
                gc.collect()
                if not cpu:
                    torch.cuda.empty_cache()

    native = {r["case"]: r["ms"] for r in rows if r["impl"] == "native" and r["status"] == "ok"}
    print()
    print("| case | impl | ms | tokens/s | speed-up vs native | status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = native.get(r["case"])
        ok = r["status"] == "ok"
        speedup = f"{base / r['ms']:.2f}x" if ok and base else ""
        ms = f"{r['ms']:.3f}" if ok else ""
        tps = f"{r['tokens_per_s']:,.0f}" if ok else ""
        note = f" ({r['note']})" if r["note"] else ""
        print(f"| {r['case']} | {r['impl']}{note} | {ms} | {tps} | {speedup} | {r['status']} |")
    print(f"csv: {write_csv('xlstm_hf.csv', CSV_COLUMNS, rows)}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
