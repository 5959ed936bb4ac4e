"""Whole SwiGLU MoE layer, compiled, forward and forward + backward: compileops vs torch._grouped_mm.

What a user trains: router -> top-k -> ``permute_by_expert`` -> gate/up grouped GEMM with SwiGLU
-> down grouped GEMM scaled by the router probability -> ``unpermute_and_combine``, bf16,
compiled ``fullgraph=True`` (default mode), static and ``dynamic=True``. Both layers share the
routing code, the weights and the inputs; only the expert GEMMs differ:

* ``compileops``: ``grouped_linear_swiglu`` (SwiGLU in the GEMM's epilogue; by default it keeps
  the pre-activations for the backward) and ``grouped_linear(..., row_scale=p)`` (the
  probability is the template's epilogue; its gradient comes from the dX product).
* ``compileops-recompute``: the same with ``recompute=True`` (no stored pre-activations; the
  backward recomputes the gate/up GEMM): its cost and the memory it saves.
* ``grouped_mm``: ``torch._grouped_mm`` + ``F.silu(gate) * up``, the anchor.

Three more on request (``--impls``), for the forms users write:

* ``compileops-pair``: gate and up as two weights (``[G, H, D]`` each, torchtitan's layout),
  ``grouped_linear_swiglu(xs, w_gate, offsets, up_weight=w_up)``, then as ``compileops``;
* ``compileops-user-mul``: as ``compileops``, but the probability written as a product,
  ``grouped_linear(h, down, offsets) * p[:, None]``;
* ``compileops-user-two-weights``: both written out, ``F.silu(grouped_linear(xs, w_gate,
  offsets)) * grouped_linear(xs, w_up, offsets)``, then ``grouped_linear(...) * p[:, None]``
  (Hugging Face's and torchtitan's form on compileops' products; compiled, the gate/up
  half becomes the pair kernel and the product ``row_scale=``, ``lowerings/user_patterns.py``).

``--epilogue`` adds one more operation users write after the down projection, the same
code for every layer, the anchor included: ``bias`` (a per-expert bias gathered per row,
``y + b[expert]``, as GPT-OSS writes it), ``residual`` (``y + xs``, the permuted input rows) or
``cast`` (the output to fp32, ``.float()``, and the combined output back with
``.type_as(x)``).

With ``--fp8 rowwise`` (or ``blockwise``) two more, both in e4m3 (or, where ``--impls`` names
fp8 layers, those):

* ``compileops-fp8``: ``grouped_linear_swiglu(..., fp8=...)`` and ``grouped_linear(...,
  row_scale=p, fp8=...)`` with the scaling asked for (fp8 forward and dX products, the
  probability in the product's epilogue, dW in bf16); with ``--fp8-fast-accum`` (rowwise)
  their products accumulate over the whole K loop in the MMA (``fp8_fast_accum=True``);
* ``torchao-fp8``: torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` for both GEMMs (fp8
  forward, dX and dW, rowwise whatever ``--fp8`` says), the fp8 anchor. Its GEMM needs every group's row count to be a multiple
  of 16, so this layer first copies the sorted rows into groups padded to 16 (and gathers the
  output back): what a user of it has to add. Needs torchao and a CUDA device.

``compileops-fp8-dw`` and ``compileops-fp8-cached-dw``: the same with ``fp8_weight_grad=True``
(dW in e4m3 too, rowwise).

``--impls ... compileops-fp8-cached`` adds ``compileops-fp8`` with ``cache_fp8_weights=True``:
no timed step changes the weights, so their e4m3 copies are made once and reused by every
step, the limit of many micro-batches per optimizer step (with N micro-batches, add 1/N of
the difference to the ``compileops-fp8`` row). Its note gives the memory the copies hold,
which its peak does not count (they exist before the measured step).

Weights are scaled 1/sqrt(fan_in) (uniform, as ``nn.Linear``); inputs are unit normal. Routing is
``uniform`` (a plain router: near-equal expert loads) or ``skewed`` (router logits offset by
``-1.5 * log(1 + e)``: a few hot experts). Forward is timed with gradients enabled (the training
forward, which saves what the backward needs); forward + backward is ``autograd.grad`` of the
output against a fixed random cotangent, for x and every weight. Peak memory is the largest
``max_memory_allocated`` over one forward + backward, above what was allocated before it.

    python benchmarks/bench_moe_layer.py                       # every shape
    python benchmarks/bench_moe_layer.py --shapes mixtral --routing skewed --modes static
    python benchmarks/bench_moe_layer.py --smoke               # CPU, tiny shapes, seconds
    python benchmarks/bench_moe_layer.py --plan                # no GPU: the configs, as JSON
    python benchmarks/bench_moe_layer.py --fp8 rowwise         # + the two fp8 layers
    python benchmarks/bench_moe_layer.py --fp8 rowwise --fp8-fast-accum

Results: ``$COMPILEOPS_BENCH_OUT/moe_layer.csv`` (or benchmarks/out/) and a markdown table on stdout, each row
with the device's name (``torch.cuda.get_device_name()``) and the peak memory.

``--smoke`` runs every code path at tiny sizes on CPU (the kernels under Triton's
interpreter; times and peaks are meaningless). ``--plan`` compiles the layer at the real
shapes on CPU without generating code (``compileops.lowerings._compat.lower_only``) and prints,
per shape, mode and device description (H100, H200), the tile config each grouped-linear
call gets, as JSON: what a GPU would run, without one (the pinned regression test
``tests/grouped_linear/test_layer_plan.py`` reads it).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import inspect
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compileops  # noqa: E402
from benchmarks.harness import bench_ms, environment_line, out_dir  # noqa: E402
from compileops.grouped_linear import (  # noqa: E402
    cached_fp8_weight_bytes,
    clear_fp8_weight_cache,
    permute_by_expert,
    unpermute_and_combine,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    dim: int  # D: model width
    hidden: int  # H: expert intermediate width (gate/up are [2H, D], down is [D, H])
    experts: int
    top_k: int
    tokens: int


SHAPES = {
    "mixtral": Shape("Mixtral-8x7B", 4096, 14336, 8, 2, 8192),
    "qwen3-30b": Shape("Qwen3-30B-A3B", 2048, 768, 128, 8, 8192),
    # DeepSeek-V3 under expert parallelism: one rank's shard of 32 of the 256 experts, top-8.
    "deepseek-v3": Shape("DeepSeek-V3 EP shard (32 experts)", 7168, 2048, 32, 8, 4096),
    "qwen3-235b": Shape("Qwen3-235B-A22B", 4096, 1536, 128, 8, 8192),
}
# --smoke: every path at tiny sizes (16-byte aligned rows, as torch._grouped_mm needs).
SMOKE_SHAPES = {"tiny": Shape("tiny", 64, 96, 4, 2, 32)}


def _supports_recompute() -> bool:
    return "recompute" in inspect.signature(compileops.grouped_linear_swiglu).parameters


#: What ``--epilogue`` adds after the down projection, in every layer alike.
EPILOGUES = ("none", "bias", "residual", "cast")

#: The layers whose gate and up weights are two parameters.
TWO_WEIGHT_IMPLS = ("compileops-pair", "compileops-user-two-weights")
#: compileops' fp8 layers: "-cached" with cache_fp8_weights=True, "-dw" with fp8_weight_grad=True
COMPILEOPS_FP8_IMPLS = ("compileops-fp8", "compileops-fp8-cached", "compileops-fp8-dw",
                        "compileops-fp8-cached-dw")


class MoELayer(torch.nn.Module):
    """x ``[T, D]`` -> ``[T, D]``; ``impl`` picks the expert GEMMs, everything else is shared."""

    def __init__(self, shape: Shape, impl: str, skew: float, device, dtype=torch.bfloat16,
                 *, uninitialised: bool = False, fp8: str = "rowwise",
                 fp8_fast_accum: bool = False, epilogue: str = "none"):
        super().__init__()
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        self.shape, self.impl, self.fp8, self.epilogue = shape, impl, fp8, epilogue
        self.fp8_fast_accum = fp8_fast_accum
        d, h, e = shape.dim, shape.hidden, shape.experts
        gen = torch.Generator(device="cpu").manual_seed(0)

        def uniform(*size, fan_in):
            if uninitialised:  # --plan: shapes only (no page of them is ever touched)
                return torch.empty(*size, device=device, dtype=dtype)
            bound = 1.0 / math.sqrt(fan_in)
            return (torch.rand(*size, generator=gen) * 2 - 1).mul_(bound).to(device, dtype)

        self.router = torch.nn.Parameter(uniform(e, d, fan_in=d))
        gate_up = uniform(e, 2 * h, d, fan_in=d)  # [G, 2H, D]
        if impl in TWO_WEIGHT_IMPLS:  # the same values as two parameters [G, H, D]
            self.w_gate = torch.nn.Parameter(gate_up[:, :h].clone())
            self.w_up = torch.nn.Parameter(gate_up[:, h:].clone())
        else:
            self.gate_up = torch.nn.Parameter(gate_up)
        self.down = torch.nn.Parameter(uniform(e, d, h, fan_in=h))  # [G, D, H]
        if epilogue == "bias":
            self.down_bias = torch.nn.Parameter(uniform(e, d, fan_in=h))  # [G, D]
        self.register_buffer("router_bias",
                             -skew * torch.log1p(torch.arange(e, dtype=torch.float32)).to(device))

    def route(self, x):
        logits = F.linear(x, self.router).float() + self.router_bias
        probs, ids = torch.topk(torch.softmax(logits, dim=-1), self.shape.top_k, dim=-1)
        return probs / probs.sum(-1, keepdim=True), ids

    def forward(self, x):
        probs, ids = self.route(x)
        xs, order, offsets = permute_by_expert(x, ids, self.shape.experts)
        p_sorted = probs.reshape(-1)[order]
        if self.impl == "grouped_mm":
            gu = torch._grouped_mm(xs, self.gate_up.transpose(-2, -1), offs=offsets)
            gate, up = gu.chunk(2, dim=-1)
            h = F.silu(gate) * up
            y = torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offsets)
            y = y * p_sorted[:, None].to(x.dtype)
        elif self.impl == "torchao-fp8":
            y = self._torchao_fp8_experts(xs, offsets) * p_sorted[:, None].to(x.dtype)
        elif self.impl in COMPILEOPS_FP8_IMPLS:
            opts = dict(fp8=self.fp8, cache_fp8_weights="-cached" in self.impl,
                        fp8_fast_accum=self.fp8_fast_accum,
                        fp8_weight_grad=self.impl.endswith("-dw"))
            h = compileops.grouped_linear_swiglu(xs, self.gate_up, offsets, **opts)
            y = compileops.grouped_linear(h, self.down, offsets, row_scale=p_sorted, **opts)
        elif self.impl == "compileops-pair":
            h = compileops.grouped_linear_swiglu(xs, self.w_gate, offsets, up_weight=self.w_up)
            y = compileops.grouped_linear(h, self.down, offsets, row_scale=p_sorted)
        elif self.impl == "compileops-user-two-weights":
            h = (F.silu(compileops.grouped_linear(xs, self.w_gate, offsets))
                 * compileops.grouped_linear(xs, self.w_up, offsets))
            y = compileops.grouped_linear(h, self.down, offsets) * p_sorted[:, None].to(x.dtype)
        elif self.impl == "compileops-user-mul":
            h = compileops.grouped_linear_swiglu(xs, self.gate_up, offsets)
            y = compileops.grouped_linear(h, self.down, offsets) * p_sorted[:, None].to(x.dtype)
        else:
            kwargs = {"recompute": True} if self.impl == "compileops-recompute" else {}
            h = compileops.grouped_linear_swiglu(xs, self.gate_up, offsets, **kwargs)
            y = compileops.grouped_linear(h, self.down, offsets, row_scale=p_sorted)
        if self.epilogue == "bias":
            y = y + self.down_bias[ids.reshape(-1)[order]]
        elif self.epilogue == "residual":
            y = y + xs
        elif self.epilogue == "cast":
            y = y.float()
        out = unpermute_and_combine(y, order, torch.ones_like(probs), order_is_permutation=True)
        return out.type_as(x)  # a no-op but for "cast"


    def _torchao_fp8_experts(self, xs, offsets):
        """Both expert GEMMs on torchao's rowwise fp8 grouped GEMM, in groups padded to 16 rows
        (its requirement): the sorted rows are copied to the padded layout (an upper bound of
        ``M + 16 G`` rows, so the shapes stay static) and the output gathered back."""
        from torchao.prototype.moe_training.fp8_grouped_mm import (
            _to_fp8_rowwise_then_scaled_grouped_mm as fp8_mm,
        )

        align, rows = 16, xs.shape[0]
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        padded = (counts + align - 1) // align * align
        padded_ends = torch.cumsum(padded, 0)
        row = torch.arange(rows, device=xs.device)
        group = torch.searchsorted(offsets, row, right=True).clamp_max(offsets.numel() - 1)
        dest = (padded_ends - padded)[group] + row - (offsets - counts)[group]
        xp = xs.new_zeros(rows + align * offsets.numel(), xs.shape[1]).index_copy(0, dest, xs)
        padded_offsets = padded_ends.to(torch.int32)
        gu = fp8_mm(xp, self.gate_up.transpose(-2, -1), padded_offsets,
                    pad_token_groups_for_grouped_mm=False)
        gate, up = gu.chunk(2, dim=-1)
        y = fp8_mm((F.silu(gate) * up).contiguous(), self.down.transpose(-2, -1),
                   padded_offsets, pad_token_groups_for_grouped_mm=False)
        return y[dest]


def expert_loads(layer: MoELayer, x: torch.Tensor) -> str:
    with torch.no_grad():
        _, ids = layer.route(x)
        counts = torch.bincount(ids.reshape(-1), minlength=layer.shape.experts).float()
    return f"max/mean load {counts.max().item() / counts.mean().item():.2f}"


def gemm_flops(shape: Shape) -> float:
    """Forward FLOPs of the two expert GEMMs (routed rows = tokens * top_k)."""
    rows = shape.tokens * shape.top_k
    return 2 * rows * shape.dim * 2 * shape.hidden + 2 * rows * shape.hidden * shape.dim


@dataclasses.dataclass
class Result:
    shape: str
    routing: str
    mode: str
    impl: str
    fw_ms: float
    fwbw_ms: float
    peak_gib: float
    note: str
    device: str


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or what runs the CPU smoke test."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (Triton interpreter, smoke)"


def measure(compiled, layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    """``(fw ms, fw+bw ms, peak GiB)``; on CPU (``--smoke``) one timed call each and no peak."""
    params = [p for p in layer.parameters()]
    xg = x.detach().requires_grad_(True)

    def fw():
        return compiled(xg)

    def fwbw():
        out = compiled(xg)
        return torch.autograd.grad(out, [xg, *params], dy)

    fwbw()  # compiles forward and backward on the first call
    if x.device.type != "cuda":
        return once_ms(fw), once_ms(fwbw), float("nan")
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = fwbw()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    del grads
    return bench_ms(fw), bench_ms(fwbw), peak


def once_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


SKEW = {"uniform": 0.0, "skewed": 1.5}


def set_routing(layer: MoELayer, routing: str) -> None:
    """Router bias for ``routing``: none (uniform), or ``-1.5 * log(1 + e)`` (a few hot
    experts)."""
    e = layer.shape.experts
    layer.router_bias.copy_(-SKEW[routing] * torch.log1p(
        torch.arange(e, dtype=torch.float32, device=layer.router_bias.device)))


def fp8_impls(impls: list, fp8) -> list:
    """The layers to run: with ``--fp8``, both fp8 layers are added unless ``--impls`` names
    fp8 layers itself (then those run)."""
    if fp8 and not any(i.startswith(("compileops-fp8", "torchao-fp8")) for i in impls):
        return [*impls, "compileops-fp8", "torchao-fp8"]
    return list(impls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="*", default=None,
                        choices=list(SHAPES) + list(SMOKE_SHAPES))
    parser.add_argument("--routing", nargs="*", default=list(SKEW), choices=list(SKEW))
    parser.add_argument("--modes", nargs="*", default=["static", "dynamic"],
                        choices=["static", "dynamic"])
    parser.add_argument("--impls", nargs="*",
                        default=["grouped_mm", "compileops", "compileops-recompute"])
    parser.add_argument("--fp8", choices=["rowwise", "blockwise"], default=None,
                        help="also the fp8 layers: compileops-fp8 with this scaling and "
                             "torchao-fp8 (rowwise; CUDA), unless --impls names fp8 layers")
    parser.add_argument("--fp8-fast-accum", action="store_true",
                        help="the compileops fp8 layers with fp8_fast_accum=True (rowwise)")
    parser.add_argument("--epilogue", choices=EPILOGUES, default="none",
                        help="one more user-written operation after the down projection, "
                             "in every layer: a per-expert bias, a residual, or an fp32 cast")
    parser.add_argument("--csv", default=os.path.join(out_dir(), "moe_layer.csv"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU (Triton interpreter): checks the script")
    parser.add_argument("--plan", nargs="*", metavar="DEVICE", default=None,
                        choices=sorted(PLAN_DEVICES),
                        help="no GPU: print the grouped-linear configs of the compiled layer "
                             "for these device descriptions (default: all), as JSON")
    args = parser.parse_args()
    table = SMOKE_SHAPES if args.smoke else SHAPES
    shapes = args.shapes or list(table)
    if args.plan is not None:
        print(json.dumps(plan(shapes, args.modes, args.plan or sorted(PLAN_DEVICES))))
        return
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("bench_moe_layer needs a CUDA device (or --smoke, --plan)")
    impls = [i for i in args.impls if i != "compileops-recompute" or _supports_recompute()]
    impls = fp8_impls(impls, args.fp8)
    if args.fp8:
        if device.type != "cuda" and "torchao-fp8" in impls:
            print("torchao-fp8: not run (its kernels need a CUDA device)", flush=True)
            impls.remove("torchao-fp8")
    print(environment_line(), flush=True)
    name = device_name(device)
    results: list[Result] = []
    for key in shapes:
        shape = {**SHAPES, **SMOKE_SHAPES}[key]
        gen = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(shape.tokens, shape.dim, generator=gen).to(device, torch.bfloat16)
        dy = torch.randn(shape.tokens, shape.dim, generator=gen).to(device, torch.bfloat16)
        for mode in args.modes:
            for impl in impls:
                # One compile per (shape, mode, impl); the routings only change a buffer.
                torch._dynamo.reset()
                layer = MoELayer(shape, impl, 0.0, device, fp8=args.fp8 or "rowwise",
                                 fp8_fast_accum=args.fp8_fast_accum,
                                 epilogue=args.epilogue)
                compiled = torch.compile(layer, fullgraph=True, dynamic=mode == "dynamic")
                for routing in args.routing:
                    set_routing(layer, routing)
                    note = expert_loads(layer, x)
                    try:
                        fw_ms, fwbw_ms, peak = measure(compiled, layer, x, dy)
                    except Exception as exc:  # report and go on: one failure must not end the run
                        print(f"{shape.name} {routing} {mode} {impl}: FAILED {type(exc).__name__}: "
                              f"{str(exc)[:300]}", flush=True)
                        fw_ms = fwbw_ms = peak = float("nan")
                        note = f"failed: {type(exc).__name__}"
                    if impl.startswith("compileops-fp8-cached"):
                        note += (f"; fp8 weight copies {cached_fp8_weight_bytes() / 2**30:.2f}"
                                 " GiB held (made before the peak was taken)")
                    accum = ", fast accum" if args.fp8_fast_accum else ""
                    label = (f"{impl} ({args.fp8}{accum})" if impl.startswith("compileops-fp8")
                             else impl)
                    if args.epilogue != "none":
                        note += f"; epilogue {args.epilogue}"
                    r = Result(shape.name, routing, mode, label, fw_ms, fwbw_ms, peak, note, name)
                    results.append(r)
                    tflops = 3 * gemm_flops(shape) / (fwbw_ms * 1e-3) / 1e12
                    print(f"{r.shape} | {routing} | {mode} | {impl}: fw {fw_ms:.3f} ms, "
                          f"fw+bw {fwbw_ms:.3f} ms ({tflops:.0f} TFLOP/s expert GEMMs), "
                          f"peak {peak:.2f} GiB | {note}", flush=True)
                    write(results, args.csv, table=False)
                del layer, compiled
                gc.collect()
                clear_fp8_weight_cache()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    write(results, args.csv)
    if any(r.note.startswith("failed") for r in results):
        sys.exit(1)


def write(results: list[Result], path: str, *, table: bool = True) -> None:
    """The CSV of ``results`` at ``path`` (rewritten whole), and their table printed
    (``table``). Called after every result, so that a run cut short keeps what it measured."""
    anchor = {(r.shape, r.routing, r.mode): r for r in results if r.impl == "grouped_mm"}
    lines = ["| device | shape | routing | mode | impl | fw ms | fw+bw ms | peak GiB "
             "| fw vs grouped_mm | fw+bw vs grouped_mm | peak vs grouped_mm |", "|" + "---|" * 11]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["device", "shape", "routing", "mode", "impl", "fw_ms", "fwbw_ms", "peak_gib",
                    "fw_speedup", "fwbw_speedup", "peak_ratio", "note", "environment"])
        for r in results:
            a = anchor.get((r.shape, r.routing, r.mode))
            ratios = ((a.fw_ms / r.fw_ms, a.fwbw_ms / r.fwbw_ms, r.peak_gib / a.peak_gib)
                      if a else (float("nan"),) * 3)
            w.writerow([r.device, r.shape, r.routing, r.mode, r.impl, f"{r.fw_ms:.4f}",
                        f"{r.fwbw_ms:.4f}", f"{r.peak_gib:.3f}", *(f"{v:.3f}" for v in ratios),
                        r.note, environment_line()])
            lines.append(f"| {r.device} | {r.shape} | {r.routing} | {r.mode} | {r.impl} | "
                         f"{r.fw_ms:.3f} | {r.fwbw_ms:.3f} | {r.peak_gib:.2f} | {ratios[0]:.2f}x | "
                         f"{ratios[1]:.2f}x | {ratios[2]:.2f} |")
    if table:
        print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------
# --plan: the configs a GPU would run, without one


def _plan_devices() -> dict:
    from compileops.grouped_linear import kernels

    return {"h100": kernels.H100_SXM, "h200": kernels.H200}


PLAN_DEVICES = ("h100", "h200")


def plan(shapes, modes, devices) -> list[dict]:
    """Per shape, mode and device description: the tile config of every grouped-linear call
    of the compileops layer, forward and backward, as the lowering picks it (``op``, sizes
    ``m`` rows, ``n`` output columns, ``k`` reduction, ``groups``; ``config``: the Config's
    fields; ``tma``: TMA loads), and the dW calls' configs (``choose_wgrad_config``, picked by
    the eager dW kernel when it runs on that part). Compiled on CPU with real sizes and no
    data: Triton code generation for CPU tensors, lowering only."""
    from compileops.grouped_linear import kernels
    from compileops.lowerings import _compat
    from compileops.lowerings.grouped_linear import plan_for, record_decisions

    specs = [_plan_devices()[d] for d in devices]
    out = []
    for key in shapes:
        shape = {**SHAPES, **SMOKE_SHAPES}[key]
        for mode in modes:
            torch._dynamo.reset()
            layer = MoELayer(shape, "compileops", 0.0, "cpu", uninitialised=True)
            x = torch.empty(shape.tokens, shape.dim, dtype=torch.bfloat16, requires_grad=True)
            compiled = torch.compile(layer, fullgraph=True, dynamic=mode == "dynamic")
            with plan_for(specs[0]), record_decisions(*specs[1:]) as decisions, \
                    _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
                    _compat.lower_only():
                try:
                    compiled(x)
                except _compat.LoweredOnly:
                    pass
            rows = shape.tokens * shape.top_k
            for spec in specs:
                calls = [dict(op=d.op, m=d.m, n=d.n, k=d.k, groups=d.groups,
                              config=dataclasses.asdict(cfg), tma=tma)
                         for d in decisions if d.device == spec.name for cfg, tma in d.configs]
                for what, n, k in (("wgrad down", shape.dim, shape.hidden),
                                   ("wgrad gate_up", 2 * shape.hidden, shape.dim)):
                    cfg = kernels.choose_wgrad_config(rows, shape.experts, n, k, torch.bfloat16,
                                                      spec)
                    calls.append(dict(op=what, m=rows, n=n, k=k, groups=shape.experts,
                                      config=dataclasses.asdict(cfg), tma=None))
                out.append(dict(shape=key, mode=mode, device=spec.name, calls=calls))
    return out


if __name__ == "__main__":
    main()
