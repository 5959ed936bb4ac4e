"""Shared by the per-family bad-input matrices (tests/*/test_bad_inputs.py): compiled wrappers
live for a whole module, and :func:`raises` accepts an error quoted by Dynamo."""
import contextlib
import re

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Overrides the conftest's per-test ``torch._dynamo.reset()``: the compiled wrappers below
    are shared by every case of this module (a checked bad value reuses the graph compiled for
    the first one instead of recompiling per case). Reset once per module instead."""
    yield


@pytest.fixture(autouse=True, scope="module")
def _dynamo_once_per_module():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield
    torch._dynamo.reset()


@contextlib.contextmanager
def raises(error, pattern, *, compiled=False):
    """``pytest.raises(error, match=pattern)``; with ``compiled``, a check that failed while
    Dynamo traced (a fake function, or a ``raise`` in traced code) arrives as Dynamo's
    ``TorchRuntimeError``/``Unsupported`` quoting the original error: accept that, checking the
    quoted type and message."""
    with pytest.raises(Exception) as info:
        yield
    e = info.value
    if compiled and isinstance(e, torch._dynamo.exc.TorchDynamoException):
        quoted = re.search(rf"(?:got|raised exception) {error.__name__}\((.*)\)", str(e), re.S)
        assert quoted, f"expected a quoted {error.__name__} in {type(e).__name__}: {e}"
        assert re.search(pattern, quoted.group(1)), (pattern, quoted.group(1))
    else:
        assert isinstance(e, error), f"expected {error.__name__}, got {type(e).__name__}: {e}"
        assert re.search(pattern, str(e)), (pattern, str(e))
