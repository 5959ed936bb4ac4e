"""Bounds checks for Triton kernels run under the interpreter (a CPU stand-in for a GPU's
illegal-memory-access error).

On a GPU, a kernel that loads or stores outside the memory of the tensors it was given stops
with an illegal memory access, which also poisons the CUDA context for the rest of the
process. Under Triton's interpreter the same access reads or writes whatever host memory
lies there, silently. With :func:`install`, every load and store a kernel makes under the
interpreter is checked: each active element's bytes must lie inside the storage of one of
the tensors passed to that launch; otherwise the launch raises :class:`OutOfBounds` naming
the kernel and the address. Masked-off lanes are not checked (they are not accessed on a GPU
either).

``tests/conftest.py`` installs it for the whole suite (``COMPILEOPS_CHECK_BOUNDS=0`` turns
it off).
"""
from __future__ import annotations

import threading

import numpy as np

_current = threading.local()


class OutOfBounds(IndexError):
    pass


def _storage_ranges(args) -> list[tuple[int, int]]:
    ranges = []

    def add(arg):
        if isinstance(arg, (tuple, list)):
            for item in arg:
                add(item)
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a tensor descriptor
            add(arg.base)

    add(list(args))
    return ranges


def _check(ptrs, mask, what: str) -> None:
    launch = getattr(_current, "launch", None)
    if launch is None:
        return
    name, ranges = launch
    addresses = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
    if mask is not None:
        addresses = addresses[np.asarray(mask.data, dtype=bool).reshape(-1)]
    if addresses.size == 0:
        return
    element = ptrs.dtype.scalar.element_ty.primitive_bitwidth // 8
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in ranges:
        inside |= (addresses >= start) & (addresses + element <= end)
    if not inside.all():
        bad = int(addresses[~inside][0])
        nearest = min(ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])),
                      default=None)
        where = (f"; nearest argument storage [{nearest[0]:#x}, {nearest[1]:#x})"
                 if nearest else "")
        raise OutOfBounds(f"{name}: {what} of {int((~inside).sum())} element(s) outside "
                          f"every argument's storage, first at {bad:#x}{where}")


def install() -> None:
    """Patch Triton's interpreter (idempotent): record each launch's argument storages, and
    check every load and store against them."""
    from triton.runtime import interpreter

    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if getattr(executor, "_compileops_bounds", False):
        return
    init_args, call = executor._init_args_hst, executor.__call__
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges = _storage_ranges(list(args_hst) + list(kwargs_hst.values()))
        _current.launch = (getattr(self.fn, "__name__", "kernel"), ranges)
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        finally:
            _current.launch = None

    # Newer interpreters pass options such as cache_policy by keyword: forward them all.
    def create_masked_load(self, ptrs, mask, *rest, **options):
        _check(ptrs, mask, "load")
        return masked_load(self, ptrs, mask, *rest, **options)

    def create_masked_store(self, ptrs, value, mask, *rest, **options):
        _check(ptrs, mask, "store")
        return masked_store(self, ptrs, value, mask, *rest, **options)

    executor._init_args_hst = init_args_hst
    executor.__call__ = launch
    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    executor._compileops_bounds = True
