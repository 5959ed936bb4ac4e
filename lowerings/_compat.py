"""The one module that touches private ``torch._inductor`` API.

Every import of ``torch._inductor`` in compileops goes through here, lazily (inside
functions), so importing this module is cheap and the differences between the supported
torch versions (2.11 on GPU machines, 2.13 on CPU machines; see docs/inductor-notes.md) are
absorbed in one place.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch

from compileops import _log

# Dynamic-shape guards installed by the lowerings, in one place: a later value that breaks
# one recompiles, so this is where a user chasing a recompile looks.
guard_log = _log.get_logger("guards")


# ---------------------------------------------------------------------------------------
# Lowering registration and IR construction


def load_inductor_lowerings() -> None:
    import torch._inductor.lowering  # noqa: F401


def register_lowering(op: torch._ops.OpOverload, fn: Callable) -> None:
    """Register ``fn`` as the Inductor lowering of ``op``, with no type promotion (integer
    index inputs must stay integers)."""
    from torch._inductor.lowering import register_lowering as _register

    _register(op, type_promotion_kind=None)(fn)


def ops():
    """Inductor's virtualised ``ops`` handler, for ``inner_fn`` bodies."""
    from torch._inductor.virtualized import ops as _ops

    return _ops


def pointwise(*, device, dtype, inner_fn: Callable, ranges: Sequence) -> Any:
    from torch._inductor.ir import Pointwise

    return Pointwise.create(device=device, dtype=dtype, inner_fn=inner_fn, ranges=list(ranges))


def aten_lowering(op: torch._ops.OpOverload) -> Callable:
    """Inductor's own lowering of an aten op, to compose inside ours."""
    from torch._inductor.lowering import lowerings

    return lowerings[op]


def emits_cpp(device: torch.device) -> bool:
    """True when Inductor generates C++ (OpenMP) rather than Triton for ``device``."""
    from torch._inductor import config

    return device.type == "cpu" and config.cpu_backend == "cpp"


def indirect_index(index_value, size, *, check: bool = True):
    """Turn a loaded integer into an index expression; negative ids are errors, not wrapped."""
    return ops().indirect_indexing(index_value, size, check=check, wrap_neg=False)


# ---------------------------------------------------------------------------------------
# Test and report helpers (code generation, caches)


def fresh_inductor_cache():
    """A context with empty Inductor caches: our lowering code is not in their key."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache()


def run_and_get_code(fn: Callable, *args, **kwargs) -> tuple[Any, list[str]]:
    from torch._inductor.utils import run_and_get_code as _run_and_get_code

    return _run_and_get_code(fn, *args, **kwargs)


def get_code(fn: Callable, *args, **kwargs) -> list[str]:
    """Compile ``fn(*args)`` and return the generated sources without running the kernels."""
    from torch._inductor.utils import get_code as _get_code

    return _get_code(fn, *args, **kwargs)


def inductor_config_patch(**changes):
    from torch._inductor import config

    return config.patch(**changes)


@contextlib.contextmanager
def triton_codegen_on_cpu() -> Iterator[None]:
    """Make Inductor emit Triton (not C++) for CPU tensors, as on a GPU.

    The hash patch avoids probing a GPU toolchain for the cache key, which fails on a
    CPU-only machine (docs/inductor-notes.md, verified on 2.13).
    """
    with inductor_config_patch(cpu_backend="triton"), mock.patch(
        "torch.utils._triton.triton_hash_with_backend", lambda *a, **k: "0" * 64
    ), _libdevice_for_the_interpreter():
        yield


@contextlib.contextmanager
def _libdevice_for_the_interpreter() -> Iterator[None]:
    """Under Triton's interpreter, Inductor's kernels get ``tl.math``'s function wherever
    one of the same name exists for their ``libdevice.<name>`` calls (an epilogue's
    ``exp`` of a SiLU, say). Newer triton's ``triton.language.extra.libdevice`` holds stubs
    that a GPU backend fills in when it compiles a kernel, which the interpreter never does:
    there ``libdevice.exp(x)`` returns None (seen with triton 3.9). The generated modules
    import ``libdevice`` from ``triton_helpers`` when they load, inside this context."""
    import os
    import types

    from torch._inductor.runtime import triton_helpers

    if os.environ.get("TRITON_INTERPRET") != "1" or triton_helpers.libdevice is None:
        yield
        return
    import triton.language as tl

    stubs = triton_helpers.libdevice

    class InterpreterLibdevice(types.ModuleType):
        def __getattr__(self, name):
            # looked up at each call: the interpreter patches tl.math while a kernel runs
            return getattr(tl.math, name) if hasattr(tl.math, name) else getattr(stubs, name)

    with mock.patch.object(triton_helpers, "libdevice", InterpreterLibdevice("libdevice")):
        yield


@contextlib.contextmanager
def reuse_realized_as_on_a_gpu() -> Iterator[None]:
    """Inductor stores a pointwise value read by several consumers, rather than computing
    it in each, by the rule it uses for a GPU, also where the tensors are on the CPU. For
    CPU tensors it also stores any such value that calls ``exp``, ``sigmoid`` and the like
    (a C++ heuristic), which for Triton codegen on the CPU (:func:`triton_codegen_on_cpu`)
    adds buffers a GPU compile does not have: an fp32 ``sigmoid`` of the SwiGLU's gate
    half, say, which moves the memory planner's order. For tests that check a GPU's
    schedule on the CPU."""
    from torch._inductor import ir

    rule = ir.StorageBox.should_realize_on_reuse

    def as_on_a_gpu(self, users, *args, **kwargs):
        with mock.patch.object(ir, "is_cpu", lambda _: False):
            return rule(self, users, *args, **kwargs)

    with mock.patch.object(ir.StorageBox, "should_realize_on_reuse", as_on_a_gpu):
        yield


class LoweredOnly(RuntimeError):
    """Raised when a function compiled under :func:`lower_only` is called."""


@contextlib.contextmanager
def operands_realized_early(op: torch._ops.OpOverload, early: bool) -> Iterator[None]:
    """For tests: whether Inductor realizes the operands of ``op`` (an op it calls as an
    extern kernel) as soon as they are lowered (``early``) or only when ``op`` itself is.
    Inductor does the first once the op's fallback exists, which a process creates at the
    first compile that lowers the op: without this, a test would see one or the other
    depending on what compiled before it."""
    from torch._inductor.lowering import needs_realized_inputs

    had = op in needs_realized_inputs
    (needs_realized_inputs.add if early else needs_realized_inputs.discard)(op)
    try:
        yield
    finally:
        (needs_realized_inputs.add if had else needs_realized_inputs.discard)(op)


@contextlib.contextmanager
def lower_only(sources: list | None = None) -> Iterator[None]:
    """Compiles inside this context lower their graphs, forward and backward (the backward
    right after the forward, not at the first backward call), so every lowering runs and
    logs or records its decisions; but nothing is compiled to a module, and calling the
    compiled function raises :class:`LoweredOnly`. With a ``sources`` list, each graph's
    generated code (forward, then backward) is appended to it; without, no code is generated.
    For planning tools and tests that ask what a compile would choose (real sizes are fine:
    no tensor data is read). Verified on 2.11 and 2.13."""
    import types

    import torch._functorch.config as functorch_config
    from torch._inductor.graph import GraphLowering

    def no_module(graph):
        if sources is None:
            # compile_fx logs the scheduler's nodes after this returns: an empty schedule.
            graph.scheduler = types.SimpleNamespace(nodes=[])
        else:
            wrapper, kernels = graph.codegen()
            sources.append("\n".join(code.value for code in (wrapper, kernels) if code))

        class _NotCompiled:
            def call(self, *args, **kwargs):
                raise LoweredOnly("compiled under lower_only(): nothing can run")

        return _NotCompiled()

    with mock.patch.object(GraphLowering, "compile_to_module", no_module), \
            mock.patch.object(GraphLowering, "save_output_code", lambda code: None), \
            functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


# ---------------------------------------------------------------------------------------
# Templates and algorithm selection (grouped linear)


def symbolic_grid_fn(fn: Callable) -> Any:
    """Wrap a ``grid(*args) -> (x, y, z)`` function for ``TritonTemplate`` (the last arg is meta)."""
    from torch._inductor.select_algorithm import SymbolicGridFn

    return SymbolicGridFn(fn)


def triton_template(name: str, grid: Any, source: str) -> Any:
    from torch._inductor.select_algorithm import TritonTemplate

    return TritonTemplate(name=name, grid=grid, source=source)


def extern_kernel_choice(op: torch._ops.OpOverload, name: str) -> Any:
    """An extern choice that calls the op itself (our eager kernels) with its input nodes."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    return ExternKernelChoice(op, name=name, has_out_variant=False, op_overload=op,
                              use_fallback_kernel=True)


def extern_function_choice(fn: Callable, name: str) -> Any:
    """An extern choice calling a plain Python function (``extern_kernels.<name>``)."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    return ExternKernelChoice(fn, name=name, has_out_variant=False)


def require_contiguous(node):
    """``node`` as a contiguous buffer (a copy only when its layout is not already one):
    for template inputs indexed with unit strides (the grouped-linear offsets)."""
    from torch._inductor.ir import ExternKernel

    return ExternKernel.require_contiguous(node)


def require_unit_last_stride(node):
    """``node`` realized, with stride 1 in its last dim (a copy only when it has not one):
    for template inputs addressed with a row stride of their own (the fp8 column scales
    ``[G, N]``, whose group stride may be 0: one row shared by every group)."""
    from torch._inductor.ir import ExternKernel

    node = ExternKernel.realize_input(node)
    if statically_equal(node.get_stride()[-1], 1):
        return node
    return ExternKernel.require_contiguous(node)


def same_fixed_strides(a, b) -> bool:
    """Whether two realized nodes have fixed layouts (graph inputs, views of them, buffers
    whose layout is decided) with the same strides: then a template may address both
    through one set of strides without copying either."""
    from torch._inductor.ir import FixedLayout

    layouts = []
    for node in (a, b):
        try:
            layout = node.get_layout()
        except (AttributeError, NotImplementedError):
            return False
        if not isinstance(layout, FixedLayout):
            return False
        layouts.append(layout)
    return list(layouts[0].stride) == list(layouts[1].stride)


def realize_inputs(*nodes):
    from torch._inductor.select_algorithm import realize_inputs as _realize

    out = _realize(*nodes)
    return out if isinstance(out, (list, tuple)) else [out]


def fixed_layout(device, dtype, size, stride) -> Any:
    from torch._inductor.ir import FixedLayout

    return FixedLayout(device, dtype, list(size), list(stride))


def fallback(op: torch._ops.OpOverload) -> Callable:
    """Lower ``op`` as an extern call of itself (the eager implementation)."""
    from torch._inductor.lowering import fallback_handler

    return fallback_handler(op, add_to_fallback_set=False)


def fallback_held_outside_the_step(op: torch._ops.OpOverload) -> Callable:
    """:func:`fallback` for an op whose outputs are held outside the compiled step (a cache's
    entries): Inductor's memory planner is told the step never frees them.

    Inductor's planner (``reorder_for_peak_memory``, which picks the order of the kernels
    with the lowest estimated peak) counts an extern call's outputs as memory the step
    allocates and frees after their last reader. For a cache lookup that is wrong both ways:
    on a hit nothing is allocated, on a miss the copy outlives the step. Counted as freed,
    the planner ran the reader (the fp8 backward's dX product) early to release it, which
    put dX's output beside the gate/up dW, the step's peak (one ``[tokens, dim]`` buffer
    above the bf16 layer's). Counted as never freed, the estimate has no such release to
    chase."""
    call = fallback(op)

    def lower(*args):
        result = call(*args)
        _held_outside_the_step().update(_buffer_names(result))
        return result

    _count_held_buffers_as_never_freed()
    return lower


def hold_graph_inputs(*nodes) -> None:
    """Tell the memory planner that the step never frees the graph inputs behind ``nodes``
    (those that are graph inputs or views of one; see :func:`fallback_held_outside_the_step`):
    a cache's entries saved by the forward for the backward, which the backward's last read
    does not release."""
    held = _held_outside_the_step()
    for node in nodes:
        box = graph_input_behind(node)
        if box is not None:
            held.add(box.get_name())
    _count_held_buffers_as_never_freed()


def _buffer_names(value) -> list[str]:
    """The names of the buffers a lowering returned (a ``TensorBox`` or a list of them)."""
    from torch._inductor import ir

    if isinstance(value, (list, tuple)):
        return [name for item in value for name in _buffer_names(item)]
    node = value
    while isinstance(node, (ir.TensorBox, ir.StorageBox)):
        node = node.data
    return [node.get_name()] if isinstance(node, ir.Buffer) else []


def _held_outside_the_step() -> set:
    """The names of the graph being lowered's buffers that :func:`fallback_held_outside_the_step`
    returned (kept on the graph: buffer names repeat between graphs)."""
    from torch._inductor.virtualized import V

    graph = V.graph
    held = getattr(graph, "_compileops_held_buffers", None)
    if held is None:
        held = set()
        graph._compileops_held_buffers = held
    return held


def _count_held_buffers_as_never_freed() -> None:
    """Wrap the planner's sizes so that the buffers and graph inputs of
    :func:`_held_outside_the_step` free nothing: ``memory.compute_size_for_scheduler_buffer``
    (a buffer's name -> (bytes allocated at its creation, bytes freed after its last reader))
    and ``memory.get_freeable_input_buf`` (the graph inputs the step may free, with their
    sizes). Once; a torch without them keeps its planner as it is."""
    import torch._inductor.memory as memory

    sizes = getattr(memory, "compute_size_for_scheduler_buffer", None)
    if sizes is not None and not getattr(sizes, "_compileops_wrapped", False):
        def sizes_with_held_buffers(name_to_buf):
            result = sizes(name_to_buf)
            for name in _held_names():
                if name in result:
                    result[name] = (result[name][0], 0)
            return result

        sizes_with_held_buffers._compileops_wrapped = True
        memory.compute_size_for_scheduler_buffer = sizes_with_held_buffers

    freeable = getattr(memory, "get_freeable_input_buf", None)
    if freeable is not None and not getattr(freeable, "_compileops_wrapped", False):
        def freeable_without_held_inputs(*args, **kwargs):
            result = freeable(*args, **kwargs)
            for name in _held_names():
                info = getattr(result.get(name), "mpi_buffer", None)
                if info is not None:
                    info.size_free = 0
            return result

        freeable_without_held_inputs._compileops_wrapped = True
        memory.get_freeable_input_buf = freeable_without_held_inputs


def _held_names():
    from torch._inductor.virtualized import V

    return getattr(V.graph, "_compileops_held_buffers", ())


def graph_input_behind(node) -> Any:
    """The graph input (its ``TensorBox``) that ``node`` is, or is a strided view of (a
    ``ReinterpretView`` of the input's storage); None when ``node`` is computed inside the
    graph."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    try:
        storage, _ = ir.as_storage_and_layout(node, freeze=False)
    except NotImplementedError:
        return None
    buffer = storage.data if isinstance(storage, ir.StorageBox) else storage
    if not isinstance(buffer, ir.InputBuffer) or isinstance(buffer, ir.ConstantBuffer):
        return None
    return V.graph.graph_inputs.get(buffer.get_name())


def graph_input_written(input_box) -> bool:
    """Whether the graph being lowered writes into the graph input ``input_box`` (a
    ``TensorBox`` of :func:`graph_input_behind`): an in-place op on it, or on a view of it
    (``w[:, :4].mul_(2)`` is ``copy_`` into a ``slice`` of the input), or in a list of
    tensors written in place (``torch._foreach_mul_([w], 0.5)``, an EMA or weight decay),
    that AOTAutograd kept in the graph (under ``no_grad``), its arguments given by position
    or by name. Its version counter is then raised before the graph runs, while its values
    change only where the write is."""
    from torch._inductor.virtualized import V

    name = input_box.get_name()
    for node in V.graph.module.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for position, argument in enumerate(node.target._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = (node.args[position] if position < len(node.args)
                     else node.kwargs.get(argument.name))
            for written in (value if isinstance(value, (list, tuple)) else (value,)):
                base = _view_base(written)
                if base is not None and base.op == "placeholder" and base.target == name:
                    return True
    return False


def _view_base(value):
    """The FX node that ``value`` is a view of, through chains of view ops (``slice``,
    ``select``, ``view``, ``transpose``, ``as_strided``, ...: ops whose output aliases their
    first argument), or ``value`` itself; None for a non-node."""
    while isinstance(value, torch.fx.Node):
        target = value.target
        if value.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return value
        returns = target._schema.returns
        aliases = (len(returns) == 1 and returns[0].alias_info is not None
                   and not returns[0].alias_info.is_write)
        if not aliases or not value.args:
            return value
        value = value.args[0]
    return None


def size_hint(expr) -> int:
    """A concrete hint for a possibly symbolic size (``size_hint`` on 2.11, ``optimization_hint``
    on 2.13)."""
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    if hasattr(sizevars, "optimization_hint"):
        return int(sizevars.optimization_hint(expr))
    return int(sizevars.size_hint(expr))


def max_autotune_enabled() -> bool:
    from torch._inductor import config

    return bool(config.max_autotune or config.max_autotune_gemm)


def emits_triton_for(device: torch.device) -> bool:
    """Whether Inductor generates Triton (so Triton templates apply) for ``device``."""
    from torch._inductor import config

    if device.type == "cuda":
        return True
    return device.type == "cpu" and config.cpu_backend == "triton"


def why_no_triton(device: torch.device) -> str | None:
    """None when Inductor generates Triton for ``device``, else why not (for log lines)."""
    if emits_triton_for(device):
        return None
    if emits_cpp(device):
        return "Inductor emits C++ for CPU tensors (cpu_backend='cpp'), no Triton template"
    return f"Inductor emits no Triton for {device.type} tensors"


def autotune_select_algorithm(name: str, choices, input_nodes, layout, *, input_gen_fns=None):
    """The chosen node: 2.11 returns a ``TensorBox``, 2.13 a ``(node, choice)`` tuple."""
    from torch._inductor.select_algorithm import autotune_select_algorithm as _select

    out = _select(name, choices, input_nodes, layout, input_gen_fns=input_gen_fns or {})
    if isinstance(out, tuple):
        return out[0]
    return out


def is_static(expr) -> bool:
    """Whether a size or stride is a concrete number (an int, or a sympy number), not a
    symbol of ``dynamic=True``."""
    return isinstance(expr, int) or bool(getattr(expr, "is_number", False))


def multiple_of(expr, divisor: int, *, what: str = "a size") -> bool:
    """Whether a size or stride (an int or a sympy expression) is a multiple of ``divisor``.

    Statically known: no guard. Symbolic (``dynamic=True``, or automatic dynamic after a shape
    change) with a hint that is a multiple: a guard ``expr % divisor == 0`` is installed and the
    answer is yes, so the kernel keeps its aligned (vectorised, TMA) form; a later size that
    breaks the guard recompiles instead of running a slow path. Otherwise no. The template
    must then show Triton the factor itself, as ``(x // divisor) * divisor`` (the same value
    under the guard): ``tl.multiple_of`` on a scalar kernel argument does not reach Triton
    3.6's alignment analysis, and Inductor's kernel signature (torch 2.13, Triton on CPU) did
    not mark the guarded size divisible. ``what`` names the size in the guard's log line.
    """
    import sympy
    from torch._inductor.virtualized import V

    if is_static(expr):
        return int(expr) % divisor == 0
    sizevars = V.graph.sizevars
    if sizevars.statically_known_multiple_of(expr, divisor):
        return True
    if size_hint(expr) % divisor != 0:
        return False
    condition = sympy.Eq(sympy.Mod(expr, divisor), 0)
    if hasattr(sizevars, "guard_or_false"):
        guarded = bool(sizevars.guard_or_false(condition))
    else:
        guarded = bool(sizevars.evaluate_expr(condition))
    if guarded:
        guard_log.info("%s %% %d == 0 on %s (first value %d): aligned form; a value that "
                       "breaks it recompiles", expr, divisor, what, size_hint(expr))
    return guarded


def statically_one(expr) -> bool:
    """Whether a stride is the literal 1 (unit inner stride), with no guard."""
    from torch._inductor.virtualized import V

    if is_static(expr):
        return int(expr) == 1
    return bool(V.graph.sizevars.statically_known_equals(expr, 1))


def empty_buffer(device, dtype, size) -> Any:
    """A fresh contiguous buffer for a template's extra output (passed as a mutated input, the
    flex-attention pattern)."""
    from torch._inductor.lowering import empty_strided

    return empty_strided(list(size), None, dtype=dtype, device=device)


def specialize(expr, *, what: str = "a size") -> int:
    """A symbolic size made static: guard it equal to its hint and return that int (a later
    call with another value recompiles). For sizes that are model constants, not data sizes.
    ``what`` names the size in the guard's log line."""
    from torch._inductor.virtualized import V

    if is_static(expr):
        return int(expr)
    value = int(V.graph.sizevars.guard_int(expr))
    guard_log.info("%s == %d on %s: specialised (a model constant); another value recompiles",
                   expr, value, what)
    return value


# ---------------------------------------------------------------------------------------
# Inductor's pre-grad custom pass (the graph Dynamo captured, before autograd)

def _custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


CustomGraphPass = _custom_graph_pass_base()


class _ChainedPasses(CustomGraphPass):
    """Two pre-grad passes run one after the other (the user's first). Its uuid is None when
    either has none: Inductor then runs it without caching, as it would the user's alone."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self):
        uuids = [getattr(p, "uuid", lambda: None)() for p in (self.first, self.second)]
        return None if None in uuids else tuple(uuids)


def add_pre_grad_pass(graph_pass) -> None:
    """Run ``graph_pass`` (a :data:`CustomGraphPass`) in Inductor's pre-grad custom pass slot,
    after any pass the user has put there (idempotent). A pass the user sets later replaces
    it: compileops' rewrites are then not made, and nothing else changes."""
    import torch._inductor.config as config

    current = config.pre_grad_custom_pass
    if current is graph_pass or (isinstance(current, _ChainedPasses)
                                 and current.second is graph_pass):
        return
    config.pre_grad_custom_pass = (graph_pass if current is None
                                   else _ChainedPasses(current, graph_pass))


def statically_equal(a, b) -> bool:
    """Whether two sizes (ints or SymInts) are equal without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# Inductor keeps a whole row in registers (a persistent reduction, the row read once) only
# up to this many elements along an inner reduction (``InductorChoices.
# should_use_persistent_reduction``, the same in torch 2.11 to 2.15); a wider row is reduced
# in a loop, and a pointwise consumer fused after that loop reads the row a second time.
PERSISTENT_ROW_LIMIT = 1024


def inner_row_max(*, device, inner_fn: Callable, ranges: Sequence, row_width) -> Any:
    """The max over ``row_width`` of ``inner_fn(index, [j])`` (fp32), marked as a reduction
    along contiguous rows: Inductor infers that only when every load is contiguous, which
    a row read in several parts is not, and would otherwise keep a loop (and read the row
    twice) for any but a few rows."""
    from torch._inductor.ir import Reduction
    from torch._inductor.runtime.hints import ReductionHint

    result = Reduction.create(device=device, dst_dtype=torch.float32,
                              src_dtype=torch.float32, inner_fn=inner_fn, ranges=list(ranges),
                              reduction_ranges=[row_width], reduction_type="max",
                              reduction_hint=ReductionHint.INNER)
    result.realize()  # as Inductor's own reductions: a loader reads the reduced buffer
    return result


def _realized_pointwise(node) -> Any:
    """The ``ComputedBuffer`` behind ``node`` (a ``TensorBox``) when it is a realized
    pointwise buffer the graph does not write in place; else None."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    storage = getattr(node, "data", None)
    buffer = getattr(storage, "data", None)
    if (not isinstance(storage, ir.StorageBox) or not isinstance(buffer, ir.ComputedBuffer)
            or not isinstance(buffer.data, ir.Pointwise) or buffer.get_reduction_type()
            or buffer.get_name() in V.graph.mutated_buffers):
        return None
    return buffer


def gather_recomputed(node) -> Callable | None:
    """A loader that recomputes ``node`` (a ``TensorBox``) from what it reads, when ``node``
    is a realized pointwise buffer every one of whose inputs has fewer elements than it (a
    gather or broadcast: the MoE layer's permuted tokens ``x[token_of_row]``); else None.

    Inductor realizes such a buffer when the graph also saves it (the permuted tokens kept
    for dW), and a consumer then reads the buffer back from memory. Recomputed, the consumer
    reads the smaller inputs instead (each row top-k times, which the cache may serve) and
    no longer waits for the buffer's kernel. The value is rounded to the buffer's dtype, so the
    consumer sees the bits the buffer holds."""
    buffer = _realized_pointwise(node)
    if buffer is None or not _expands_its_inputs(buffer):
        return None
    compute, dtype = buffer.data.make_loader(), buffer.get_dtype()
    return lambda index: ops().to_dtype(compute(index), dtype)


class RowGather:
    """A realized buffer ``g [M, K]`` whose row ``r`` is row ``i(r)`` of a contiguous
    ``source [T, K]`` of the same dtype, ``i`` computed from other (index) buffers: the MoE
    layer's permuted tokens ``x[token_of_row]``. :func:`row_gather` finds one.

    ``gathered_from(other)`` and ``rows_gathered_from(other_rows)`` give loaders that read
    ``other [T, K]`` (contiguous) and ``other_rows [T]`` at the rows ``g`` reads: the same
    index computation, with the source's loads redirected. A consumer of ``g`` that only
    needs a row-wise function of it (a row quantisation) can then apply the function to the
    ``T`` source rows and gather its result."""

    def __init__(self, buffer, source, buffer_name: str, width: int):
        self._compute = buffer.data.inner_fn
        self.source = source  # IR [T, K]
        self._source_name = buffer_name
        self._width = width

    def _redirected(self, index, redirect):
        from torch._inductor.virtualized import V

        with V.set_ops_handler(_RedirectLoads(V.get_ops_handler(), self._source_name,
                                              redirect)):
            return self._compute(index)

    def gathered_from(self, other) -> Callable:
        """Loader of ``other`` (IR, contiguous ``[T, K]``) at ``g``'s elements."""
        other.realize()
        name = other.get_name()
        return lambda index: self._redirected(
            index, lambda parent, flat: parent.load(name, flat))

    def rows_gathered_from(self, other_rows) -> Callable:
        """Loader ``[M]`` of ``other_rows`` (IR ``[T]``) at ``g``'s rows."""
        from torch._inductor.utils import FloorDiv

        other_rows.realize()
        name, width = other_rows.get_name(), self._width
        # Element (r, 0) of g is source element K * i(r) (plus whole rows where the source
        # is a row slice): its row is that offset // K.
        return lambda index: self._redirected(
            [*index, 0], lambda parent, flat: parent.load(name, FloorDiv(flat, width)))


class _RedirectLoads:
    """An ops handler that forwards every op to ``parent`` but loads of ``source``, which
    ``redirect(parent, index)`` answers."""

    def __init__(self, parent, source: str, redirect: Callable):
        self._parent, self._source, self._redirect = parent, source, redirect

    def __getattr__(self, name):
        return getattr(self._parent, name)

    def load(self, name, index):
        if name == self._source:
            return self._redirect(self._parent, index)
        return self._parent.load(name, index)


class _RecordLoads:
    """An ops handler that runs an ``inner_fn`` symbolically: every op returns an opaque
    token, loads are recorded as ``(name, index)`` and return their own token, and each
    indirect index is a fresh symbol."""

    def __init__(self):
        self.loads, self._symbols = [], 0

    def load(self, name, index):
        token = object()
        self.loads.append((name, index, token))
        return token

    def indirect_indexing(self, value, size, check=True, wrap_neg=True):
        import sympy

        self._symbols += 1
        return sympy.Symbol(f"gathered_row{self._symbols}", integer=True)

    def __getattr__(self, name):
        return lambda *args, **kwargs: object()


def row_gather(node) -> RowGather | None:
    """A :class:`RowGather` when ``node`` (a ``TensorBox``) is a realized 2-D pointwise
    buffer that only copies rows of a contiguous buffer of its dtype and row width (``[T,
    K]``, or ``[B, S, K]`` read as ``[B * S, K]``), through an index read from other
    buffers, into more rows than the source has; else None."""
    import sympy
    from torch._inductor import ir
    from torch._inductor.utils import sympy_product
    from torch._inductor.virtualized import V

    buffer = _realized_pointwise(node)
    if buffer is None or len(buffer.get_size()) != 2 or not is_static(buffer.get_size()[1]):
        return None
    width = int(buffer.get_size()[1])
    row, column = sympy.Symbol("row", integer=True), sympy.Symbol("column", integer=True)
    recorder = _RecordLoads()
    # As Inductor's own read analyses do: the index buffers' layouts may still be flexible;
    # only the form of the source's index matters here, and that layout is fixed below.
    with V.set_ops_handler(recorder), mock.patch.object(ir.FlexibleLayout, "allow_indexing",
                                                        True):
        value = buffer.data.inner_fn([row, column])
    value = getattr(value, "value", value)  # unwrapped from Inductor's OpsValue
    copied = [load for load in recorder.loads if load[2] is value]
    if len(copied) != 1:
        return None  # the buffer computes something from what it loads, not a copy
    name, index, _ = copied[0]
    if sum(load[0] == name for load in recorder.loads) != 1 or name in V.graph.mutated_buffers:
        return None
    source = V.graph.try_get_buffer(name)
    if source is None or source.get_dtype() != buffer.get_dtype():
        return None
    size = list(source.get_size())
    if not size or not statically_equal(size[-1], width):
        return None
    # Contiguous, so that a [B, S, K] source is read as its [B * S, K] rows.
    layout = source.get_layout()
    if not _contiguous(layout):
        return None
    # The element read must be source[i(row), column] with i free of the column: the index
    # is column + width * i, and i reads the index buffers only.
    index = sympy.expand(index)
    rest = sympy.expand(index - column)
    if rest.has(column) or rest.has(row):
        return None
    if any(sympy.Mod(term.as_coeff_Mul()[0], width) != 0 for term in sympy.Add.make_args(rest)):
        return None
    rows = sympy_product(size[:-1])
    if size_hint(rows) >= size_hint(buffer.get_size()[0]):
        return None  # no more rows than the source: nothing to gain
    if isinstance(layout, ir.FlexibleLayout):
        source.freeze_layout()  # the rows are addressed as contiguous from here on
    box = V.graph.graph_inputs.get(name)
    if box is None:
        box = ir.TensorBox.create(source)
    if len(size) != 2:
        box = aten_lowering(torch.ops.aten.reshape.default)(box, [rows, width])
    return RowGather(buffer, box, name, width)


def _elements(node) -> int:
    """How many elements ``node`` (IR) holds, from the size hints."""
    from torch._inductor.utils import sympy_product

    return size_hint(sympy_product(node.get_size()))


def concatenated_inputs(node, dim: int) -> list | None:
    """``[(start, buffer), ...]``: the buffers a realized concatenation along ``dim`` is
    written from, each with its offset along ``dim``, when ``node`` (a ``TensorBox``) is
    such a concatenation (Inductor's ``ConcatKernel``: each input computed straight into its
    slice); else None. A consumer that loads from these buffers rather than from the
    concatenation can fuse with the kernels that compute them, which Inductor does not do
    across the concatenation itself."""
    from torch._inductor.ir import ConcatKernel

    storage = getattr(node, "data", None)
    kernel = getattr(storage, "data", None)
    if not isinstance(kernel, ConcatKernel) or not kernel.inputs:
        return None
    starts, start = [], 0
    for buffer in kernel.inputs:
        size = buffer.get_size()
        if len(size) != len(node.get_size()) or not is_static(size[dim]):
            return None
        starts.append((start, buffer))
        start += int(size[dim])
    if not is_static(node.get_size()[dim]) or start != int(node.get_size()[dim]):
        return None
    return starts


def kept_beside(node) -> bool:
    """Whether ``node`` (IR), an operand of the FX node being lowered, is also an output of
    the graph (a tensor saved for the backward) or an operand of another op of this library
    (a template or an extern call, which reads it from memory): it will be written to memory
    whatever this lowering does."""
    from torch._inductor.virtualized import V

    current = V.graph.current_node
    for argument in getattr(current, "all_input_nodes", ()):
        if V.graph.env.get(argument) is not node:
            continue
        return any(user is not current and (
            user.op == "output" or getattr(user.target, "namespace", None) == "compileops")
            for user in argument.users)
    return False


def realize_gathered_in_parts(node, part: int) -> list | None:
    """Realizes ``node`` (a ``TensorBox`` of pointwise IR ``[R..., K]`` every input of
    which has fewer elements: a gather, as the MoE layer's dY permuted to the experts' rows)
    as the concatenation of its ``K / part`` slices along the last dim, each computed straight into
    its place by a node of its own (:func:`concat_parts`), and returns the pieces as
    :func:`concatenated_inputs` does; None, with ``node`` unchanged, when it is not such a
    node. Every consumer lowered from here on reads the one contiguous buffer; a reduction
    over a part's width can fuse with the nodes that compute it, which it cannot with one
    node computing whole rows.

    ``node`` may already be realized as whole rows (Inductor realizes an operand of an
    extern op early, when the op's fallback exists already), provided no operation reads
    that buffer yet: the pieces are computed from its pointwise body, and the buffer, read
    by nothing, is removed by the scheduler."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    storage = getattr(node, "data", None)
    if not isinstance(storage, ir.StorageBox):
        return None
    body = storage.data
    if type(body) is not ir.Pointwise:
        buffer = _realized_pointwise(node)
        if buffer is None or _read_by_an_operation(buffer.get_name()):
            return None
        layout = buffer.get_layout()
        if not isinstance(layout, ir.FlexibleLayout) and not _contiguous(layout):
            return None
        body = buffer.data
    size = list(node.get_size())
    if not is_static(size[-1]) or int(size[-1]) % part or not _expands_its_inputs(body):
        return None
    load = body.make_loader()

    def piece(first):
        return pointwise(device=node.get_device(), dtype=node.get_dtype(),
                         inner_fn=lambda idx: load([*idx[:-1], first + idx[-1]]),
                         ranges=[*size[:-1], part])

    whole = concat_parts([piece(first) for first in range(0, int(size[-1]), part)],
                         len(size) - 1)
    # As StorageBox.realize does: the box now holds the buffer, for every view of it.
    storage.data = whole.data.data
    return concatenated_inputs(node, len(size) - 1)


def _expands_its_inputs(node) -> bool:
    """Whether ``node`` (pointwise IR, or a buffer computed from it) reads buffers, each
    with fewer elements than it (a gather or a broadcast) and none written in place by the
    graph so far: recomputed from them, it gives the values it was computed as."""
    from torch._inductor.virtualized import V

    elements, names = _elements(node), node.get_read_names()
    return bool(names) and all(
        (source := V.graph.try_get_buffer(name)) is not None
        and name not in V.graph.mutated_buffers and _elements(source) < elements
        for name in names)


def _contiguous(layout) -> bool:
    """Whether ``layout`` is row-major contiguous from offset 0."""
    from torch._inductor import ir

    contiguous = ir.FlexibleLayout.contiguous_strides(layout.size)
    return statically_equal(layout.offset, 0) and all(
        statically_equal(a, b) for a, b in zip(layout.stride, contiguous))


def _read_by_an_operation(name: str) -> bool:
    """Whether an operation lowered so far reads the buffer ``name``."""
    from torch._inductor.virtualized import V

    return any(name in operation.get_read_names() for operation in V.graph.operations
               if operation.get_name() != name)


def concat_parts(parts: Sequence, dim: int) -> Any:
    """One contiguous buffer whose slices along ``dim`` are ``parts`` (pointwise IR of one
    dtype and device), each part computed straight into its slice (no copy), so each stays a
    node of its own size and can fuse with a reduction over that size.

    This is the tail of ``ConcatKernel.create``, without its head: torch 2.11's reads the
    arguments of the ``aten.cat`` node being lowered, and here no such node exists."""
    from torch._inductor.ir import (ConcatKernel, FixedLayout, FlexibleLayout, SliceView,
                                    StorageBox, TensorBox)
    from torch._inductor.virtualized import V

    size = list(parts[0].get_size())
    size[dim] = sum(part.get_size()[dim] for part in parts)
    layout = FixedLayout(parts[0].get_device(), parts[0].get_dtype(), size,
                         FlexibleLayout.contiguous_strides(size))
    kernel = ConcatKernel(name=None, layout=layout, inputs=[])
    storage = StorageBox(kernel)
    start = 0
    for part in parts:
        end = start + part.get_size()[dim]
        kernel.inputs.append(ConcatKernel.realize_into(
            part, SliceView.create(storage, dim, start, end, clamp=False)))
        start = end
    kernel.name = V.graph.register_buffer(kernel)
    kernel.inputs = ConcatKernel.unwrap_storage(kernel.inputs)
    V.graph.register_operation(kernel)
    return TensorBox(storage)
