"""The ``compileops`` logger: what the lowerings chose for each compiled op, and why.

Records go to the ``compileops`` logger hierarchy (``compileops.grouped_linear``,
``compileops.mlstm``, ``compileops.embedding``, ``compileops.guards``,
``compileops.backends``). Decisions are logged at INFO, candidate lists and the Triton
backend picks at DEBUG. As a library, compileops configures no handler by default, so
nothing is printed unless you ask:

* ``COMPILEOPS_LOG=1`` (or ``info``): the decisions, on stderr;
* ``COMPILEOPS_LOG=debug``: the decisions and the detail;
* unset, empty or ``0``: nothing from us; your own ``logging`` configuration decides, as for
  any library (``logging.getLogger("compileops").setLevel(logging.INFO)`` plus a handler).

With the variable set, the ``compileops`` logger gets its own stderr handler and stops
propagating to the root logger, as ``TORCH_LOGS`` does for ``torch``, so a line is never
printed twice. Warnings (a TMA launch that failed on a GPU, ``grouped_linear/kernels/tma.py``)
print without it, through Python's last-resort handler, as any library's do.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

ENV_VAR = "COMPILEOPS_LOG"
ROOT = "compileops"
FORMAT = "%(name)s: %(message)s"

_LEVELS = {"1": logging.INFO, "info": logging.INFO, "debug": logging.DEBUG}
_OFF = ("", "0")

_once_lock = threading.Lock()
_logged_once: set[tuple] = set()


def get_logger(name: str) -> logging.Logger:
    """The logger ``compileops.<name>``."""
    return logging.getLogger(f"{ROOT}.{name}")


def level_from_env(value: str | None) -> int | None:
    """The level ``COMPILEOPS_LOG=value`` asks for; None for off. An unknown value warns and
    counts as off (a typo must not break ``import compileops``)."""
    value = (value or "").strip().lower()
    if value in _OFF:
        return None
    if value not in _LEVELS:
        warnings.warn(f"{ENV_VAR}={value!r} is not one of 1, info, debug; compileops logging "
                      "stays off", stacklevel=3)
        return None
    return _LEVELS[value]


class _EnvHandler(logging.StreamHandler):
    """The stderr handler ``COMPILEOPS_LOG`` installs (a class of its own, so it is installed
    once and a user's handlers are never touched)."""


def configure_from_env() -> None:
    """Honour ``COMPILEOPS_LOG``; without it, leave logging alone. Idempotent."""
    level = level_from_env(os.environ.get(ENV_VAR))
    if level is None:
        return
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(h, _EnvHandler) for h in logger.handlers):
        handler = _EnvHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    logger.propagate = False


def log_once(logger: logging.Logger, level: int, msg: str, *args) -> None:
    """``logger.log(level, msg, *args)`` the first time this exact record is asked for: for
    decisions taken on every eager call (the backend an op runs with)."""
    if not logger.isEnabledFor(level):
        return
    key = (logger.name, level, msg, args)
    with _once_lock:
        if key in _logged_once:
            return
        _logged_once.add(key)
    logger.log(level, msg, *args)


def shape(sizes) -> str:
    """``[s0, 16]``: sizes as Inductor holds them (ints or symbolic expressions)."""
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def dtype(value) -> str:
    """``bfloat16`` for ``torch.bfloat16``."""
    return str(value).removeprefix("torch.")


def settings(**values) -> str:
    """``BLOCK_M=128 BLOCK_N=128 num_warps=8``: a config, greppable."""
    return " ".join(f"{name}={value}" for name, value in values.items())
