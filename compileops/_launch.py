"""Cached Triton launches: the eager launchers' fast path past Triton's per-call binding.

``kernel[grid](*args, **kwargs)`` binds every argument, derives the specialization and builds
a cache key on every call. That is tens of microseconds of host time per launch, and the
embedding backward makes four launches per call against ~0.5 ms of GPU time: on a slow host
the eager op became host-bound (benchmarks/RESULTS.md). :func:`launch` does that work once
per specialization and then calls the compiled kernel's launcher directly.

Correctness rests on the key being at least as fine as Triton's own specialization: the
constexpr values and compile options, the device, and for each runtime argument its type,
and for tensors the dtype and 16-byte alignment, for ints whether they equal 1, divide by
16, and fit in 32 bits (what Triton specializes on in 3.6 through 3.9). A miss goes through
Triton's normal path, so the kernel stored is the one Triton itself chose for those arguments.
Arguments of other types (tensor descriptors, ...) are not cached: normal path.

Falls back to the normal path, uncached, under the Triton interpreter, while launch hooks
(profilers) are installed, and on Triton versions this was not checked on.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

#: Set False to launch every kernel through Triton's normal path (benchmarks compare both).
enabled = True

# Triton versions whose launcher call (below) and specialization rules (_arg_key) were
# checked: the call is the one JITFunction.run makes in each, and tests/test_launch.py
# checks _arg_key against the installed Triton's own specialization. Other versions take
# the normal path until checked.
_TRITON_CHECKED = ("3.6.", "3.7.", "3.8.", "3.9.")

_CACHE: dict[tuple, tuple[Any, tuple]] = {}
_UNSUPPORTED = object()


def _arg_key(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return (bool, arg)
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg >= 2**63)
    if arg is None:
        return None
    if isinstance(arg, float):
        return float
    return _UNSUPPORTED  # e.g. a TMA descriptor: Triton specializes on more than its type


def _version_checked() -> bool:
    import triton

    return triton.__version__.startswith(_TRITON_CHECKED)


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is installed: in Triton 3.6 the knob is a ``HookChain``
    (never None) whose ``calls`` list is empty when no profiler has added a hook."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def _constexpr_tail(fn, n_args: int, constexprs: dict) -> tuple:
    """The values of ``fn``'s parameters after the ``n_args`` positional ones, in order."""
    tail = []
    for param in fn.params[n_args:]:
        if param.name in constexprs:
            tail.append(constexprs[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            raise TypeError(f"{fn.__name__}: no value for parameter {param.name!r}")
    return tuple(tail)


def _cache_key(fn, args: Sequence[Any], constexprs: dict, options: dict) -> Optional[tuple]:
    """The launch's cache key, or None where the launch must take Triton's normal path
    (switched off, another Triton version, the interpreter, launch hooks, an argument type
    whose specialization is not modelled here). Its second entry is the current device."""
    from triton import knobs

    runtime = knobs.runtime
    if (not enabled or not _version_checked() or getattr(fn, "device_caches", None) is None
            or runtime.interpret
            or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)):
        return None
    arg_keys = tuple(map(_arg_key, args))
    if _UNSUPPORTED in arg_keys:
        return None
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    return (fn, device, tuple(constexprs.items()), tuple(options.items()), arg_keys)


def launch(fn, grid: Sequence[int], args: Sequence[Any], constexprs: dict, options: dict) -> None:
    """``fn[grid](*args, **constexprs, **options)``, with the compiled kernel cached.

    ``args``: every runtime argument, positionally, in signature order; ``constexprs``: the
    remaining parameters by name (defaults apply); ``options``: launch options
    (``num_warps``, ``maxnreg``, ``debug``, ...).
    """
    key = _cache_key(fn, args, constexprs, options)
    entry = None if key is None else _CACHE.get(key)
    if entry is None:  # Triton's normal path; its kernel is kept for the next launch
        kernel = fn[grid](*args, **constexprs, **options)
        if key is not None:
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            _CACHE[key] = (kernel, _constexpr_tail(fn, len(args), constexprs))
        return
    from triton.runtime.driver import driver

    kernel, tail = entry
    grid_x = grid[0]
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    stream = driver.active.get_current_stream(key[1])
    kernel.run(grid_x, grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, None,
               None, None, *args, *tail)


def interpreter_casts_wrongly(source: torch.dtype, dest: torch.dtype) -> bool:
    """Whether a kernel's cast from ``source`` to ``dest`` stores wrong values under Triton's
    interpreter: fp64 -> bf16 there writes bit patterns unrelated to the value (triton 3.6 to
    3.9; 1.0 becomes 9.2e-41). Launchers that would make that cast stage the result in
    ``source``'s dtype and let torch round it instead."""
    from compileops.backends import triton_interpret_enabled

    return source == torch.float64 and dest == torch.bfloat16 and triton_interpret_enabled()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` is a constexpr function: ~2 us per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` (``n >= 0``; 0 gives 0, as Triton's does), without
    its constexpr wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
