"""The numerical contract and graph-snapshot helpers (public: use them in your own tests).

Numerical contract (docs/architecture.md, "The numerical contract"):

* :func:`assert_close_to_reference`: the low-precision result against an fp32/fp64 ground
  truth, reporting the relative error ``||out - ref|| / ||ref||`` and the worst element.
* :func:`assert_batch_invariant`: a row's result does not depend on the rest of the batch
  (slicing, padding, concatenation), bitwise.
* :func:`assert_deterministic`: forward and backward bitwise equal over N runs.

Graph snapshots, for ``expecttest.TestCase.assertExpectedInline``:

* :func:`aot_graph_text`: the normalised AOT forward and backward graphs of a function.
* :func:`inductor_kernels`: the kernels Inductor compiles a function to (CPU C++, or Triton
  through ``triton=True`` even on a CPU-only machine), each with the ops fused into it, plus
  the extern calls left in the wrapper.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import torch

# ---------------------------------------------------------------------------------------
# Numerical contract


@dataclasses.dataclass
class ErrorReport:
    relative_error: float
    max_abs_error: float
    worst_index: tuple[int, ...]
    actual_at_worst: float
    expected_at_worst: float

    def __str__(self) -> str:
        return (
            f"relative error ||out - ref|| / ||ref|| = {self.relative_error:.3e}; "
            f"worst element at {self.worst_index}: got {self.actual_at_worst!r}, "
            f"expected {self.expected_at_worst!r} (|diff| = {self.max_abs_error:.3e})"
        )


def error_report(actual: torch.Tensor, expected: torch.Tensor) -> ErrorReport:
    """Compare in fp64 on the CPU. Shapes must match exactly."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: got {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return ErrorReport(0.0, 0.0, (), float("nan"), float("nan"))
    diff = (a - e).abs()
    # NaN anywhere it is not expected is the worst possible error.
    nan_mismatch = a.isnan() != e.isnan()
    diff = torch.where(a.isnan() & e.isnan(), torch.zeros_like(diff), diff)
    diff = torch.where(nan_mismatch, torch.full_like(diff, float("inf")), diff)
    flat = int(diff.reshape(-1).argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    ref_norm = float(torch.linalg.vector_norm(torch.nan_to_num(e)))
    diff_norm = float(torch.linalg.vector_norm(diff))
    relative = diff_norm / ref_norm if ref_norm > 0 else diff_norm
    return ErrorReport(
        relative_error=relative,
        max_abs_error=float(diff.reshape(-1)[flat]),
        worst_index=worst,
        actual_at_worst=float(a.reshape(-1)[flat]),
        expected_at_worst=float(e.reshape(-1)[flat]),
    )


def assert_close_to_reference(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    max_relative_error: float,
    what: str = "output",
) -> ErrorReport:
    """Pass when ``||actual - expected|| / ||expected|| <= max_relative_error`` (0 = bitwise).

    Returns the :class:`ErrorReport`, so callers can log the measured error ratio.
    """
    report = error_report(actual, expected)
    if max_relative_error == 0:
        ok = torch.equal(actual.detach().cpu(), expected.detach().to(actual.dtype).cpu())
    else:
        ok = report.relative_error <= max_relative_error
    if not ok:
        raise AssertionError(
            f"{what} is not close to the reference (allowed relative error "
            f"{max_relative_error:.1e}): {report}"
        )
    return report


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: got {tuple(actual.shape)}/{actual.dtype}, "
            f"expected {tuple(expected.shape)}/{expected.dtype}"
        )
    if not torch.equal(actual, expected):
        raise AssertionError(f"{what} differs bitwise: {error_report(actual, expected)}")


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_batch_invariant(
    fn: Callable[..., Any],
    batched: Sequence[torch.Tensor],
    *,
    extra_args: Sequence[Any] = (),
    make_filler: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> None:
    """Bitwise: ``fn(*batched, *extra_args)`` row-for-row equals the same call on slices, on a
    padded batch and on a concatenation with other rows.

    ``batched`` are the inputs that carry the batch on dim 0 (all with the same length B >= 2);
    every output of ``fn`` must carry it on dim 0 too. ``make_filler(t, n)`` returns ``n``
    extra rows shaped like ``t``'s rows (default: ``t``'s rows reversed and repeated, which
    keeps indices valid).
    """
    batched = list(batched)
    size = batched[0].shape[0]
    if size < 2 or any(t.shape[0] != size for t in batched):
        raise ValueError("assert_batch_invariant needs batched inputs of one length >= 2")

    def filler(t: torch.Tensor, n: int) -> torch.Tensor:
        if make_filler is not None:
            return make_filler(t, n)
        rows = t.flip(0)
        return rows.repeat((n + size - 1) // size, *([1] * (t.dim() - 1)))[:n]

    def run(inputs):
        return _as_tuple(fn(*inputs, *extra_args))

    full = run(batched)
    half = size // 2
    cases = {
        "first slice": (run([t[:half] for t in batched]), slice(0, half), slice(0, half)),
        "second slice": (run([t[half:] for t in batched]), slice(0, size - half), slice(half, size)),
        "padded with 3 rows": (
            run([torch.cat([t, filler(t, 3)]) for t in batched]), slice(0, size), slice(0, size)
        ),
        "after 5 other rows": (
            run([torch.cat([filler(t, 5), t]) for t in batched]), slice(5, 5 + size), slice(0, size)
        ),
    }
    for case, (outs, take, ref_take) in cases.items():
        for i, (out, ref) in enumerate(zip(outs, full)):
            _assert_bitwise(out[take], ref[ref_take], f"batch invariance ({case}), output {i}")


def assert_deterministic(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    runs: int = 10,
    backward: bool = True,
    seed: int = 0,
    wrt: Sequence[torch.Tensor] | None = None,
) -> None:
    """Run ``fn(*args)`` ``runs`` times; outputs, and with ``backward`` the gradients (under
    one fixed random cotangent) must be bitwise equal.

    Gradients are taken with respect to ``wrt``; by default every argument that requires grad
    plus, when ``fn`` is an ``nn.Module``, its parameters that require grad.
    """
    if wrt is None:
        grad_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if isinstance(fn, torch.nn.Module):
            grad_inputs += [p for p in fn.parameters() if p.requires_grad]
    else:
        grad_inputs = list(wrt)
    if backward and not grad_inputs:
        raise ValueError("assert_deterministic(backward=True) found nothing to differentiate")
    cotangents = None
    first = None
    for run_index in range(runs):
        outs = [o for o in _as_tuple(fn(*args)) if isinstance(o, torch.Tensor)]
        grads: tuple = ()
        if backward and grad_inputs:
            if cotangents is None:
                gen = torch.Generator().manual_seed(seed)
                cotangents = [
                    torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o) for o in outs
                ]
            diff_outs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in diff_outs], grad_inputs, [c for _, c in diff_outs],
                allow_unused=True,
            )
        current = ([o.detach() for o in outs], list(grads))
        if first is None:
            first = current
            continue
        for i, (a, b) in enumerate(zip(current[0], first[0])):
            _assert_bitwise(a, b, f"forward output {i}, run {run_index} vs run 0")
        for i, (a, b) in enumerate(zip(current[1], first[1])):
            if a is None or b is None:
                continue
            _assert_bitwise(a, b, f"gradient {i}, run {run_index} vs run 0")


# ---------------------------------------------------------------------------------------
# Graph snapshots


def aot_graph_text(fn: Callable[..., Any], *args, dynamic: bool = False) -> tuple[str, str]:
    """(forward, backward) AOT graph text of ``fn(*args)``, normalised for snapshots.

    Runs ``fn`` once compiled with the ``aot_eager`` recorder (fullgraph) and, if any output
    requires grad, a backward through the sum of its outputs. ``backward`` is ``""`` when no
    backward graph was built.
    """
    from torch._dynamo.testing import AotEagerAndRecordGraphs, normalize_gm

    torch._dynamo.reset()
    recorder = AotEagerAndRecordGraphs()
    compiled = torch.compile(fn, backend=recorder, fullgraph=True, dynamic=dynamic)
    outs = [o for o in _as_tuple(compiled(*args)) if isinstance(o, torch.Tensor)]
    needs_grad = [o for o in outs if o.requires_grad]
    if needs_grad:
        sum(o.float().sum() for o in needs_grad).backward()

    def text(graphs) -> str:
        return "\n".join(
            normalize_gm(gm.print_readable(print_output=False)) for gm in graphs
        ).strip()

    return text(recorder.fw_graphs), text(recorder.bw_graphs)


_KERNEL_DEF = {
    "cpp": re.compile(r"\b(cpp_fused_\w+?)(?:_\d+)?\b"),
    "triton": re.compile(r"^def (triton_\w+?)(?:_\d+)?\(", re.M),
}
_EXTERN_CALL = re.compile(
    r"\b(extern_kernels\.\w+|torch\.ops\.(?!inductor\b)\w+\.\w+(?:\.\w+)?)\("
)


#: A launch in a wrapper's ``call``: a Triton kernel's ``.run(`` (group 1) or an extern call
#: (group 2, :data:`_EXTERN_CALL`).
_LAUNCH = re.compile(r"\b(triton_\w+?)(?:_\d+)?\.run\(|" + _EXTERN_CALL.pattern)


def _launch_lines(sources: Sequence[str]) -> list[str]:
    """Every launch of the wrappers' ``call`` functions, in order, repeats kept."""
    lines: list[str] = []
    for source in sources:
        call = source.split("\ndef call(", 1)[-1]
        lines += [m.group(1) or m.group(2) for m in _LAUNCH.finditer(call)]
    return lines


def _kernel_lines(sources: Sequence[str], backend: str) -> list[str]:
    lines: list[str] = []
    for source in sources:
        seen: set[str] = set()
        names = [m.group(1) for m in _KERNEL_DEF[backend].finditer(source)]
        externs = [m.group(1) for m in _EXTERN_CALL.finditer(source)]
        for name in names + externs:
            if name not in seen:
                seen.add(name)
                lines.append(name)
    return lines


def backend_is_gpu(args: Sequence[Any]) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


def inductor_kernels(
    fn: Callable[..., Any],
    *args,
    triton: bool = False,
    backward: bool = False,
    dynamic: bool = False,
    launches: bool = False,
) -> str:
    """The kernels Inductor compiles ``fn(*args)`` into, one per line, in wrapper order.

    Kernel names carry what fused into them (``cpp_fused__to_copy_embedding_mul``: the
    compileops embedding, a multiply and a cast in one loop nest); trailing counters are
    dropped so snapshots survive renumbering. Extern calls (``torch.ops.compileops.*``,
    ``extern_kernels.*``) are listed too. With ``backward=True`` a backward through the sum
    of the outputs is compiled and its kernels follow a ``# backward`` line. ``triton=True``
    makes Inductor emit Triton for CPU tensors (works without a GPU; see docs/inductor-notes.md).
    Each kernel is named once; with ``launches=True`` (Triton only) the lines are instead
    every launch of a step in the order the wrapper makes them, a kernel launched twice
    listed twice: a count of a step's kernels. A forward-only Triton listing on CPU
    tensors is compiled and read without running its kernels (what they compute is for
    other tests to check); with ``backward=True`` the step runs, under the interpreter.
    """
    if launches and not (triton or backend_is_gpu(args)):
        raise ValueError("inductor_kernels(launches=True) reads Triton wrappers: pass triton=True")
    import contextlib

    from compileops.lowerings import _compat

    torch._dynamo.reset()
    codegen = _compat.triton_codegen_on_cpu() if triton else contextlib.nullcontext()
    backend = "triton" if triton or backend_is_gpu(args) else "cpp"
    from compileops.backends import triton_interpret_enabled

    # Triton for CPU tensors runs only under the interpreter, where running a step's kernels
    # took most of a listing's time (40 of 44 s for one fp8 layer's forward): a forward is
    # compiled and read without running it. A backward needs the forward run.
    can_run = not triton or backend_is_gpu(args) or (backward and triton_interpret_enabled())
    if backward and not can_run:
        raise ValueError(
            "inductor_kernels(triton=True, backward=True) on CPU tensors needs TRITON_INTERPRET=1"
        )
    with _compat.fresh_inductor_cache(), codegen:
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)

        def run():
            outs = [o for o in _as_tuple(compiled(*args)) if isinstance(o, torch.Tensor)]
            if backward:
                sum(o.float().sum() for o in outs if o.requires_grad).backward()
            return outs

        if can_run:
            _, sources = _compat.run_and_get_code(run)
        else:
            sources = _compat.get_code(compiled, *args)
    def lines(part):
        return _launch_lines(part) if launches else _kernel_lines(part, backend)

    if backward and len(sources) >= 2:
        return "\n".join(lines(sources[:1]) + ["# backward"] + lines(sources[1:]))
    return "\n".join(lines(sources))
