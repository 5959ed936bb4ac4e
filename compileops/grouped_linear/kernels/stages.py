"""Operand stages that fit: an eager launch whose tile needs more shared memory than the GPU
gives a block runs again with fewer pipeline stages, instead of failing.

The config rules (:mod:`.config`) count the operand stages and, for the flattened fp8 tile,
the output tile against each part's shared memory, so a default config fits on the parts
they know. A part or a Triton version whose kernel needs more than the rule counted (its
epilogue's scratch, a layout Triton pads) would otherwise raise Triton's
``OutOfResources`` at the first launch. Triton raises it when it loads the compiled kernel,
before anything runs on the GPU, so the launch can be retried.

That error says nothing about TMA: the pointer-based kernel with the same tile and stages
needs the same shared memory, so it does not turn TMA off (:mod:`.tma`, whose fallback lets
it propagate).

With fewer stages a tile overlaps fewer K steps' loads with its MMAs (slower, the same
bits: the stages change when operands arrive, not what is summed or in which order). The
stage count that fits is remembered per kernel, config and device, and logged once. An
explicit ``config`` (a sweep, a test) is launched as given: its error propagates.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from triton.runtime.errors import OutOfResources

from compileops.grouped_linear.kernels.tma import device_index

logger = logging.getLogger("compileops")

#: (kernel, config, device index) -> the stage count that launched after a shrink.
_fitted: dict[tuple, int] = {}


def clear_fitted_stages() -> None:
    """Forget every stage count found to fit (tests)."""
    _fitted.clear()


def launch_with_stages_that_fit(launch: Callable[[int], None], num_stages: int,
                                device: torch.device, *, explicit: bool, key: tuple,
                                what: str, config: object = None) -> None:
    """``launch(stages)`` with ``num_stages``, or, when that raises ``OutOfResources`` (and
    the config is not ``explicit``), with one stage fewer at a time down to one. ``key``
    names the kernel and config (hashable); the count that fits is kept for the next
    launch of the same key on ``device``. ``what`` (the kernel) and ``config`` name them in
    the warning, formatted only then (the eager launchers' host time). Raises the last
    ``OutOfResources`` when even one stage does not fit, and any other exception as it
    comes."""
    if explicit or device.type != "cuda":
        launch(num_stages)
        return
    # Nothing has needed fewer stages on almost every machine: then the launch pays for
    # neither the device lookup nor hashing the key.
    full_key = (key, device_index(device)) if _fitted else None
    stages = _fitted.get(full_key, num_stages) if _fitted else num_stages
    error = None
    while True:
        try:
            launch(stages)
            break
        except OutOfResources as exc:
            if stages <= 1:
                raise
            error = error or exc
            stages -= 1
    if error is not None:
        full_key = full_key or (key, device_index(device))
        if full_key not in _fitted:
            logger.warning("compileops.grouped_linear: %s (%s) with %d stages needs more "
                           "shared memory than cuda:%d gives a block (%s); launched with %d "
                           "stages, slower, same results", what, config, num_stages,
                           full_key[1], error, stages)
        _fitted[full_key] = stages
