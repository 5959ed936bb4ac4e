"""Inductor lowering of ``compileops::grouped_linear`` and ``compileops::grouped_linear_swiglu``.

Both become a persistent Triton template (``templates/grouped_linear.py.jinja``) that calls
the same ``@triton.jit`` bodies as the eager kernel and writes through ``store_output``, so
pointwise consumers (GELU, per-row router-probability scaling, casts, residual adds) fuse as
its epilogue. The bias is applied inside the template (it is indexed by group). SwiGLU over
a fused gate/up weight cannot be an epilogue of the ``[M, 2H]`` product (its output has half
the elements, and the two halves are different tiles), so it is its own op whose template
computes the gate and up tiles together and stores ``silu(gate) * up`` ``[M, H]``; epilogues
fuse after it.

* Default mode: one heuristic config (no compile-time benchmarking) for the device the graph
  runs on (``kernels.choose_config``: the part's measured row, else the generic rule), through
  TMA descriptors where the GPU and the strides allow (``_why_no_template_tma``).
* ``max_autotune``: a bounded config list that fits the part's shared memory (on sm90+ each
  also as a TMA-descriptor variant), the heuristic pick among them, plus the extern eager op,
  benchmarked on Dirichlet(1) skewed offsets (``input_gen_fns``). On sm90+ in bf16 without
  bias, ``torch._grouped_mm`` (CUTLASS, with its uninitialised tail rows zeroed:
  :func:`grouped_mm_anchor`) is a choice too, for the forward and dX. The SwiGLU training op
  (which also writes its pre-activations) autotunes over template configs only: the extern
  choices have no second output.
* Without Triton codegen for the device (CPU C++ backend): an extern call of the op.

``grouped_linear_row_scaled`` (the MoE down projection times the router probability) is the
same template with the scale as an input, applied per row before ``store_output``.

:func:`plan_for` makes the lowering plan for a described device (an H100, an H200) whatever
the graph's device, so a CPU machine can generate, inspect and pin what a GPU would run.

Each lowering logs what it chose and why on ``compileops.grouped_linear`` (``COMPILEOPS_LOG``,
``compileops/_log.py``), and the guards it installs on ``compileops.guards``.

``grouped_linear_dx`` (the backward's ``dY_g @ W_g``) uses the same template with W's axes
swapped, so consumers of dX (e.g. a residual-gradient add, a cast) fuse too.

The rowwise fp8 ops use the same template over e4m3 operands (:class:`Fp8Operands`, the
scales applied in its epilogue); their quantisation and weight cache are
:mod:`.grouped_linear_fp8`'s.
``grouped_linear_wgrad`` (dW and db) is not lowered: it stays an extern call to our
persistent K-jagged kernel (a [G, N, K] product has no pointwise neighbours worth fusing).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
from typing import Iterator

import torch

from compileops import _log
from compileops.lowerings import _compat

logger = _log.get_logger("grouped_linear")

_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "templates", "grouped_linear.py.jinja")

# The max-autotune lists, bounded: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, flatten,
# programs per SM), the sweep's contenders (benchmarks/tuning/sweep_grouped_linear.py) and
# small-group tiles. Configs whose operand stages do not fit the part's shared memory are
# left out; BLOCK_K is capped at 32 for fp32.
AUTOTUNE_CONFIGS = (
    (16, 128, 64, 4, 4, False, 1),
    (64, 128, 64, 4, 4, False, 1),
    (128, 128, 64, 8, 3, True, 1),
    (128, 256, 64, 8, 3, True, 1),
    (128, 256, 64, 8, 4, True, 1),
    (256, 128, 64, 8, 3, True, 1),
    (128, 128, 64, 4, 3, True, 2),
)
# SwiGLU tiles hold two accumulators (gate and up): half the N width of the plain ones.
AUTOTUNE_SWIGLU_CONFIGS = (
    (16, 128, 64, 4, 4, False, 1),
    (64, 128, 64, 4, 4, False, 1),
    (128, 128, 64, 8, 3, False, 1),
    (128, 128, 64, 8, 3, True, 1),
    (128, 128, 64, 8, 4, False, 1),
    (128, 64, 64, 4, 4, True, 2),
)


# ---------------------------------------------------------------------------------------
# The device the template is planned for

_planned_device: contextvars.ContextVar = contextvars.ContextVar(
    "compileops_grouped_linear_planned_device", default=None)


@contextlib.contextmanager
def plan_for(spec) -> Iterator[None]:
    """Within this context the lowering plans every grouped-linear template for the device
    ``spec`` describes (a :class:`compileops.grouped_linear.kernels.DeviceSpec`, e.g.
    ``kernels.H100_SXM``): its config, TMA loads and persistent grid, whatever device the
    graph is on. For tests and offline inspection on a CPU machine (Triton code generation
    for CPU tensors); the generated code is only meant to run on such a device."""
    token = _planned_device.set(spec)
    try:
        yield
    finally:
        _planned_device.reset(token)


def target_spec(device):
    """The :class:`DeviceSpec` the lowering plans for: :func:`plan_for`'s, else the graph's
    device's."""
    from compileops.grouped_linear import kernels

    return _planned_device.get() or kernels.device_spec(device)


# ---------------------------------------------------------------------------------------
# What each lowering decided (for tests and tools; the log says it in words)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One grouped-linear lowering as planned for one device: the op, its sizes (hints under
    ``dynamic=True``; ``n`` the output width, ``k`` the reduction), the device's name, and
    the template configs with their TMA flag (``(Config, bool)`` pairs): one in default
    mode, the bounded list under max-autotune (``autotune``), which ``extern`` extern-call
    choices join."""

    op: str
    m: int
    n: int
    k: int
    groups: int
    device: str
    configs: tuple
    autotune: bool
    extern: int


_decision_sinks: contextvars.ContextVar = contextvars.ContextVar(
    "compileops_grouped_linear_decisions", default=None)


@contextlib.contextmanager
def record_decisions(*also_for) -> Iterator[list]:
    """Collect a :class:`Decision` for every grouped-linear lowering inside the context: the
    one the lowering makes, and the one it would make for each device description in
    ``also_for`` (same graph, same sizes; only the part differs)."""
    sink: list = []
    token = _decision_sinks.set((sink, also_for))
    try:
        yield sink
    finally:
        _decision_sinks.reset(token)


def _grid(*args):
    meta = args[-1]
    return (meta["NUM_PROGS"], 1, 1)


@functools.lru_cache(maxsize=None)
def template():
    with open(_TEMPLATE_PATH) as f:
        source = f.read()
    return _compat.triton_template("compileops_grouped_linear", _compat.symbolic_grid_fn(_grid), source)


@functools.lru_cache(maxsize=None)
def extern_choice(op_name: str):
    op = getattr(torch.ops.compileops, op_name).default
    return _compat.extern_kernel_choice(op, f"compileops_{op_name}_eager")


def grouped_mm_anchor(a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, weight^T)`` (forward) with rows past ``offsets[-1]`` zeroed
    (``_grouped_mm`` leaves them uninitialised); sync-free."""
    out = torch._grouped_mm(a, weight.transpose(-2, -1), offs=offsets)
    return _zero_tail(out, offsets)


def grouped_mm_dx_anchor(grad: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``dX = dY_g @ W_g`` through ``torch._grouped_mm``, tail rows zeroed."""
    return _zero_tail(torch._grouped_mm(grad, weight, offs=offsets), offsets)


def _zero_tail(out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(out.shape[0], device=out.device, dtype=offsets.dtype)
    return torch.where((rows < offsets[-1])[:, None], out, out.new_zeros(()))


@functools.lru_cache(maxsize=None)
def grouped_mm_choice(dx: bool):
    # Created when the lowerings install (see register), so the extern_kernels attribute
    # exists before any cached compiled graph that calls it is loaded.
    fn = grouped_mm_dx_anchor if dx else grouped_mm_anchor
    return _compat.extern_function_choice(fn, "compileops_grouped_mm_dx" if dx else "compileops_grouped_mm")


def _grouped_mm_applies(device, spec, dtype, plain: bool, groups_hint: int) -> bool:
    """``torch._grouped_mm`` as an autotuning choice: a plain product (no bias, SwiGLU or row
    scale), bf16, on a CUDA sm90+ part."""
    return (device.type == "cuda" and not torch.version.hip and hasattr(torch, "_grouped_mm")
            and spec.capability >= (9, 0) and dtype == torch.bfloat16 and plain
            and groups_hint > 0)


def skewed_offsets(groups: int, m: int, device, seed: int = 0) -> torch.Tensor:
    """int32 cumulative end rows of Dirichlet(1)-skewed group sizes summing to ``m``
    (:func:`compileops.grouped_linear.routing.dirichlet_offsets`)."""
    from compileops.grouped_linear.routing import dirichlet_offsets

    return dirichlet_offsets(groups, m, seed=seed, device=device)


def _configs(m_hint: int, groups: int, n_out: int, k: int, dtype, spec, tma: bool = False,
             swiglu: bool = False, fp8_fast_accum: bool = False, out_dtype=None):
    """``([(Config, USE_TMA)], autotune)`` for the part ``spec`` describes: the heuristic
    config alone (default mode; batch-invariant mode: pointer loads, one code path; the
    interpreter), or under max-autotune the heuristic pick first, then the bounded list that
    fits the part's shared memory (each also through TMA descriptors where ``tma``).
    ``out_dtype``: the product's output dtype (:func:`kernels.choose_config`)."""
    from compileops.grouped_linear import kernels
    from compileops.modes import is_batch_invariant

    heuristic = kernels.choose_config(m_hint, groups, n_out, k, dtype, spec,
                                      batch_invariant=is_batch_invariant(), swiglu=swiglu,
                                      fp8_fast_accum=fp8_fast_accum, out_dtype=out_dtype)
    if is_batch_invariant() or not _compat.max_autotune_enabled() or spec.interpreter:
        return [(heuristic, tma and not is_batch_invariant())], False
    small_k = 32 if dtype == torch.float32 else 64
    listed = AUTOTUNE_SWIGLU_CONFIGS if swiglu else AUTOTUNE_CONFIGS
    tiles = [heuristic]
    for bm, bn, bk, warps, stages, flatten, per_sm in listed:
        cfg = kernels.Config(bm, bn, min(bk, small_k), warps, stages, flatten=flatten,
                             programs_per_sm=per_sm)
        fits = (kernels.config.operand_stage_bytes(cfg, dtype.itemsize, swiglu=swiglu)
                * cfg.num_stages <= spec.smem_per_block - kernels.config.EPILOGUE_SMEM_RESERVE)
        if fits and cfg not in tiles:
            tiles.append(cfg)
    configs = [(cfg, False) for cfg in tiles]
    if tma:  # the same tiles again through TMA descriptors
        configs = [(cfg, True) for cfg in tiles] + configs
    return configs, True


def _why_no_template_tma(device, spec, strides_aligned: bool) -> str | None:
    """None when the template may load through TMA descriptors (an sm90+ part and aligned
    strides, :func:`_strides_aligned`), else why not (for the log). Base pointers: Inductor
    copies misaligned graph inputs and aligns its buffers."""
    import triton.language as tl

    if spec.interpreter:
        return f"no TMA on {device.type}"
    if torch.version.hip:
        return "no TMA on ROCm"
    if not hasattr(tl, "make_tensor_descriptor"):
        return "no TMA: this Triton has no tensor descriptors"
    if not strides_aligned:
        return "no TMA: strides not unit-inner with 16-byte rows"
    if spec.capability < (9, 0):
        return "no TMA below sm90"
    return None


def _strides_aligned(x, weight, dtype) -> tuple[bool, bool]:
    """``(tma_ok, aligned_rows)`` for x ``[M, K]`` and weight ``[G, N, K]``.

    ``tma_ok``: unit inner strides and 16-byte row strides (TMA's rule). ``aligned_rows``: the
    row strides are symbolic (``dynamic=True``) and multiples of 16 elements, which the template
    then tells Triton (``tl.multiple_of``) so it vectorises the loads. Symbolic strides qualify
    through divisibility guards when their hints do (:func:`compileops.lowerings._compat.multiple_of`):
    without them a dynamic compile silently ran the unaligned form, 40x slower on an H100.
    """
    xs, ws = x.get_stride(), weight.get_stride()
    rows = (xs[0], ws[0], ws[1])
    per_16_bytes = max(1, 16 // dtype.itemsize)
    names = ("grouped linear input row stride", "weight group stride", "weight row stride")
    by_16 = all(_compat.multiple_of(s, 16, what=name) for s, name in zip(rows, names))
    unit_inner = _compat.statically_one(xs[1]) and _compat.statically_one(ws[2])
    tma_ok = unit_inner and (by_16 or all(_compat.multiple_of(s, per_16_bytes, what=name)
                                          for s, name in zip(rows, names)))
    symbolic = not all(_compat.is_static(s) for s in rows)
    return tma_ok, unit_inner and by_16 and symbolic


def _output_rows_aligned(weight, dx: bool, swiglu: bool) -> bool:
    """Whether the template may tell Triton that the output's row stride (W's N, or its K for
    dX; N / 2 with SwiGLU) is a multiple of 16: only when that size is a plain symbol
    (``dynamic=True``; the template re-binds the kernel's size argument) whose hint is, under a
    guard. Static sizes are constants Triton already sees."""
    import sympy

    size = weight.get_size()[2 if dx else 1]
    if not isinstance(size, sympy.Symbol):
        return False
    return _compat.multiple_of(size, 32 if swiglu else 16, what="grouped linear output width")


# ---------------------------------------------------------------------------------------
# The log lines ("compileops.grouped_linear"): what each lowering chose, and why


def _why_no_template(device, dtype) -> str | None:
    """None when the template applies, else why the op stays an extern call."""
    if not _compat.emits_triton_for(device):
        return _compat.why_no_triton(device)
    if dtype == torch.float64:
        return "fp64 (the reference backend's dtype) has no template"
    return None


def _describe_inputs(x, weight) -> str:
    return (f"x {_log.shape(x.get_size())} {_log.dtype(x.get_dtype())}, "
            f"weight {_log.shape(weight.get_size())}")


def _describe_config(cfg, spec) -> str:
    from compileops.grouped_linear import kernels

    return _log.settings(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         GROUP_M=cfg.group_m, FLATTEN=cfg.flatten,
                         WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, NUM_PROGS=kernels.grid_size(spec, cfg))


def _why_config(spec, m_hint: int, g_hint: int, n_hint: int, dtype, swiglu: bool) -> str:
    """Why the one config (outside max-autotune) is the one :func:`_configs` picked."""
    from compileops.grouped_linear import kernels
    from compileops.modes import is_batch_invariant

    if spec.interpreter:
        return "the interpreter's small tiles (CPU)"
    if is_batch_invariant():
        return "batch-invariant mode: one fixed config"
    case = kernels.config.mjagged_case(m_hint, g_hint, n_hint, dtype, swiglu=swiglu)
    source = ("measured row" if case and kernels.config.tuned_config(spec, case)
              else "generic rule")
    return (f"heuristic for {m_hint / max(g_hint, 1):.0f} rows per group on {spec.name} "
            f"({source}), no benchmarking")


def _why_pointer_loads(no_tma: str | None) -> str:
    return no_tma or "no TMA in batch-invariant mode (one code path)"


def _log_extern_call(op_name: str, x, weight, why: str) -> None:
    logger.info("%s: extern call of the eager op for %s: %s", op_name,
                _describe_inputs(x, weight), why)


def _log_decision(op_name: str, x, weight, spec, configs, errors, *, built: bool,
                  autotune: bool, externs: str, no_tma: str | None, flags: str,
                  why_config: str) -> None:
    """The lowering's one INFO line (template and config, autotuning, or extern call), with
    DEBUG lines for the autotuning candidates and any config the template rejected."""
    for cfg, tma, error in errors:
        logger.debug("%s: template rejected (%s, TMA=%s): %s", op_name,
                     _describe_config(cfg, spec), tma, error)
    if not built:
        why = "; ".join(str(error) for _, _, error in errors)
        _log_extern_call(op_name, x, weight, f"the template could not be built ({why})")
        return
    if autotune:
        with_tma = sum(tma for _, tma in configs) - sum(tma for _, tma, _ in errors)
        logger.info("%s: max-autotune over %d template configs (%d with TMA)%s for %s on %s; "
                    "%s; %s", op_name, len(configs) - len(errors), with_tma, externs,
                    _describe_inputs(x, weight), spec.name, _why_pointer_loads(no_tma)
                    if not with_tma else "TMA and pointer loads", flags)
        for cfg, tma in configs:
            logger.debug("%s: candidate (%s, TMA=%s)", op_name, _describe_config(cfg, spec), tma)
        return
    cfg, tma = configs[0]
    logger.info("%s: template %s (%s, %s) for %s: %s; %s", op_name, template().name,
                _describe_config(cfg, spec), "TMA loads" if tma else "pointer loads",
                _describe_inputs(x, weight), why_config,
                flags if tma else f"{_why_pointer_loads(no_tma)}; {flags}")


# ---------------------------------------------------------------------------------------
# The lowerings


@dataclasses.dataclass(frozen=True)
class Fp8Operands:
    """What makes a template product a rowwise fp8 one: x ``[M, K]`` and the weight ``[G, N,
    K]`` reach :func:`_lower` already in e4m3, with these fp32 scales (IR nodes): ``x_scale
    [M]`` per row, ``weight_scale [G, N]`` per output channel. ``out_dtype``: the product's
    (the unquantised x's dtype); ``fast_accum``: the MMA sums over the whole K loop."""

    x_scale: object
    weight_scale: object
    out_dtype: torch.dtype
    fast_accum: bool


def _lower(op_name: str, swiglu: bool, x, weight, offsets, bias=None, *, dx: bool = False,
           save_preact: bool = False, row_scale=None, second_weight=None,
           fp8: Fp8Operands | None = None):
    """The template for one of the M-jagged ops. ``save_preact`` (the training SwiGLU op):
    the template also writes the pre-activations ``[M, 2H]`` into a buffer passed as a
    mutated input, and the lowering returns ``(out, preact)``. ``row_scale`` (the row-scaled
    op): an ``[M]`` input in the output's dtype, each output row times its scale.
    ``second_weight`` (the gate/up pair ops): the up weight, with the gate weight's shape;
    both are made contiguous, so the template addresses them with one set of strides.
    ``fp8`` (the rowwise fp8 ops, :mod:`.grouped_linear_fp8`): x and the weight in e4m3 with
    their scales; template configs only (the eager op takes unquantised operands), and None
    comes back when no config could be built, for the caller's extern call."""
    op = getattr(torch.ops.compileops, op_name).default
    device = x.get_device()
    pair = second_weight is not None
    no_template = _why_no_template(device, x.get_dtype())
    if no_template is not None and fp8 is not None:
        return None  # the caller checks first; its operands are not the op's
    if no_template is not None:
        # No Triton template (C++ backend), or fp64 (the reference backend's dtype): the op
        # itself, as an extern call.
        _log_extern_call(op_name, x, weight, no_template)
        if pair:
            return _compat.fallback(op)(x, weight, second_weight, offsets)
        extra = () if dx else (row_scale,) if row_scale is not None else (bias,)
        return _compat.fallback(op)(x, weight, offsets, *extra)
    from compileops.grouped_linear import kernels

    spec = target_spec(device)
    # The template (as the eager kernel) reads offsets[g] at OFFS + g and the row scale at
    # SCALE + i: make them dense.
    offsets = _compat.require_contiguous(offsets)
    extra_inputs = []
    if fp8 is not None:
        extra_inputs += [_compat.require_contiguous(fp8.x_scale),
                         _compat.require_unit_last_stride(fp8.weight_scale)]
    if bias is not None:
        extra_inputs.append(bias)
    if row_scale is not None:
        extra_inputs.append(_compat.require_contiguous(row_scale))
    weights = [weight]
    if pair:
        # One set of strides for both (the template addresses W2 through W's): as they are
        # when they already agree (two parameters, or two halves of one), else contiguous.
        weights = _compat.realize_inputs(weight, second_weight)
        if not _compat.same_fixed_strides(*weights):
            weights = [_compat.require_contiguous(w) for w in weights]
    nodes = _compat.realize_inputs(x, *weights, offsets, *extra_inputs)
    x, weight = nodes[:2]
    offsets = nodes[len(weights) + 1]
    m, k = x.get_size()
    groups, n, _ = weight.get_size()
    # The number of groups (experts) is a model constant: keep it static under dynamic=True.
    # With a symbolic G the H100 build of the template gave wrong rows for groups >= 16 (G > 16;
    # tests/grouped_linear/test_gpu.py), a miscompile not reproduced under the interpreter.
    groups = _compat.specialize(groups, what="the number of groups G")
    n_out = weight.get_size()[2] if dx else (n // 2 if swiglu and not pair else n)
    dtype = x.get_dtype()  # the operands' (e4m3 for fp8): it picks the config and TMA rule
    out_dtype = fp8.out_dtype if fp8 is not None else dtype
    layout = _compat.fixed_layout(device, out_dtype, [m, n_out], [n_out, 1])
    m_hint = _compat.size_hint(m)
    g_hint, n_hint, k_hint = (_compat.size_hint(s) for s in (groups, n_out, k))
    tma_ok, aligned_rows = _strides_aligned(x, weight, dtype)
    fast_accum = fp8 is not None and fp8.fast_accum

    def plan(spec):
        """``(why no TMA or None, [(Config, USE_TMA)], autotune)`` on the part ``spec``."""
        no_tma = _why_no_template_tma(device, spec, tma_ok)
        if no_tma is None and g_hint == 0:
            # No groups: the weight [0, N, K] is empty, and a descriptor over it stops the
            # kernel with an illegal instruction (tma.tma_compatible).
            no_tma = "no TMA: no groups (an empty weight)"
        if no_tma is None and pair and dx and not _compat.multiple_of(
                n, max(1, 16 // dtype.itemsize), what="gate/up pair width H"):
            # dX's second A descriptor starts H elements into each row of dY.
            no_tma = "no TMA: the pair's second half of dY is not 16-byte aligned"
        no_tma, configs, autotune = (no_tma, *_configs(m_hint, g_hint, n_hint, k_hint, dtype,
                                                       spec, tma=no_tma is None,
                                                       swiglu=swiglu,
                                                       fp8_fast_accum=fast_accum,
                                                       out_dtype=out_dtype))
        if pair and dx:
            # Two K loops per tile: the persistent loop is flattened over a single one only.
            configs = [(dataclasses.replace(cfg, flatten=False), tma) for cfg, tma in configs]
        return no_tma, configs, autotune

    no_tma, configs, autotune = plan(spec)
    constexprs = dict(
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        SECOND_WEIGHT=pair,
        DX=dx,
        SAVE_PREACT=save_preact,
        ROW_SCALE=row_scale is not None,
        ALIGNED_ROWS=aligned_rows,
        ALIGNED_OUT=_output_rows_aligned(weight, dx, swiglu),
        G_BLOCK=kernels.group_block(g_hint),
        TF32=kernels.input_precision(dtype) == "tf32",
        INTERPRETER_DOT=device.type == "cpu",
        FP8=fp8 is not None,
        FP8_FAST_ACCUM=fast_accum,
    )
    extra = {}
    if save_preact:
        # The extern choices have no second output: template configs only.
        preact = _compat.empty_buffer(device, out_dtype, [m, 2 * n if pair else n])
        nodes = [*nodes, preact]
        extra = dict(mutated_inputs=[preact])
    choices: list = []
    errors = []
    for cfg, tma in configs:
        error = template().maybe_append_choice(
            choices, input_nodes=nodes, layout=layout, num_stages=cfg.num_stages,
            num_warps=cfg.num_warps, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, USE_TMA=tma, FLATTEN=cfg.flatten, GROUP_M=cfg.group_m,
            WARP_SPECIALIZE=cfg.warp_specialize, NUM_PROGS=kernels.grid_size(spec, cfg),
            **constexprs, **extra,
        )
        if error is not None:
            errors.append((cfg, tma, error))
    plain = bias is None and not swiglu and row_scale is None
    grouped_mm = autotune and _grouped_mm_applies(device, spec, dtype, plain, g_hint)
    # The extern choices take the op's own arguments: neither has the pre-activations' second
    # output, nor takes e4m3 operands with their scales.
    eager_op = not save_preact and fp8 is None and (autotune or not choices)
    externs = (" + the eager op" if eager_op else "") + (" + torch._grouped_mm" if grouped_mm
                                                           else "")
    recording = _decision_sinks.get()
    if recording is not None:
        sink, also_for = recording
        sink.append(Decision(op_name, m_hint, n_hint, k_hint, g_hint, spec.name, tuple(configs),
                             autotune, int(eager_op) + int(grouped_mm)))
        for other in also_for:
            _, other_configs, other_autotune = plan(other)
            other_extern = (int(not save_preact and fp8 is None and other_autotune)
                            + int(other_autotune and _grouped_mm_applies(
                                device, other, dtype, plain, g_hint)))
            sink.append(Decision(op_name, m_hint, n_hint, k_hint, g_hint, other.name,
                                 tuple(other_configs), other_autotune, other_extern))
    if logger.isEnabledFor(logging.INFO):
        flags = _log.settings(ALIGNED_ROWS=aligned_rows, ALIGNED_OUT=constexprs["ALIGNED_OUT"])
        _log_decision(op_name, x, weight, spec, configs, errors, built=bool(choices),
                      autotune=autotune, externs=externs, no_tma=no_tma, flags=flags,
                      why_config=_why_config(spec, m_hint, g_hint, n_hint, dtype, swiglu))
    input_gen_fns = {len(weights) + 1: lambda node: skewed_offsets(g_hint, m_hint,
                                                                   node.get_device())}
    if fp8 is not None and not choices:
        return None
    if save_preact:
        if not choices:  # the template could not be built: the op itself, as an extern call
            if pair:
                return _compat.fallback(op)(*nodes[:4])
            return _compat.fallback(op)(*nodes[:3], nodes[3] if bias is not None else None)
        out = _compat.autotune_select_algorithm(f"compileops_{op_name}", choices, nodes, layout,
                                                input_gen_fns=input_gen_fns)
        return out, preact
    if eager_op:
        choices.append(extern_choice(op_name).bind(nodes, layout))
    if grouped_mm:
        choices.append(grouped_mm_choice(dx).bind(nodes, layout))
    return _compat.autotune_select_algorithm(
        f"compileops_{op_name}", choices, nodes, layout, input_gen_fns=input_gen_fns
    )


def lower_grouped_linear(x, weight, offsets, bias=None):
    return _lower("grouped_linear", False, x, weight, offsets, bias)


def lower_grouped_linear_swiglu(x, weight, offsets, bias=None):
    return _lower("grouped_linear_swiglu", True, x, weight, offsets, bias)


def lower_grouped_linear_swiglu_with_preact(x, weight, offsets, bias=None):
    return _lower("grouped_linear_swiglu_with_preact", True, x, weight, offsets, bias,
                  save_preact=True)


def lower_grouped_linear_row_scaled(x, weight, offsets, row_scale):
    return _lower("grouped_linear_row_scaled", False, x, weight, offsets, row_scale=row_scale)


def lower_grouped_linear_dx(grad, weight, offsets):
    return _lower("grouped_linear_dx", False, grad, weight, offsets, dx=True)


def lower_grouped_linear_swiglu_pair(x, w_gate, w_up, offsets):
    return _lower("grouped_linear_swiglu_pair", True, x, w_gate, offsets, second_weight=w_up)


def lower_grouped_linear_swiglu_pair_with_preact(x, w_gate, w_up, offsets):
    return _lower("grouped_linear_swiglu_pair_with_preact", True, x, w_gate, offsets,
                  save_preact=True, second_weight=w_up)


def lower_grouped_linear_dx_pair(grad, w_gate, w_up, offsets):
    return _lower("grouped_linear_dx_pair", False, grad, w_gate, offsets, dx=True,
                  second_weight=w_up)


def register() -> None:
    import compileops.grouped_linear.op  # noqa: F401  (the ops must exist before lowering)
    import compileops.grouped_linear.pair_op  # noqa: F401

    grouped_mm_choice(False)
    grouped_mm_choice(True)

    _compat.register_lowering(torch.ops.compileops.grouped_linear.default, lower_grouped_linear)
    _compat.register_lowering(
        torch.ops.compileops.grouped_linear_swiglu.default, lower_grouped_linear_swiglu
    )
    _compat.register_lowering(
        torch.ops.compileops.grouped_linear_swiglu_with_preact.default,
        lower_grouped_linear_swiglu_with_preact,
    )
    _compat.register_lowering(torch.ops.compileops.grouped_linear_row_scaled.default,
                              lower_grouped_linear_row_scaled)
    _compat.register_lowering(torch.ops.compileops.grouped_linear_dx.default, lower_grouped_linear_dx)
    _compat.register_lowering(torch.ops.compileops.grouped_linear_swiglu_pair.default,
                              lower_grouped_linear_swiglu_pair)
    _compat.register_lowering(torch.ops.compileops.grouped_linear_swiglu_pair_with_preact.default,
                              lower_grouped_linear_swiglu_pair_with_preact)
    _compat.register_lowering(torch.ops.compileops.grouped_linear_dx_pair.default,
                              lower_grouped_linear_dx_pair)
