"""Per-instance ``forward`` replacements that survive ``torch.save`` / ``torch.load`` and
``copy.deepcopy``.

A bound method (``types.MethodType(fn, module)``) pickles by name, as
``getattr(module, fn.__name__)``, which the loaded module does not have. A
``functools.partial`` of a module-level function pickles the function by its qualified name
and the module by value, so a whole model saved after
:func:`compileops.integrations.transformers.apply` loads with its compileops forwards (the
loader imports the function's module). Dynamo traces a ``partial`` as it traces the method
(no graph break), ``inspect.signature`` drops the bound module as it drops ``self``, and the
module keeps its class (``type()`` checks and state-dict keys are untouched).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

__all__ = ["bind", "bound_function"]


def bind(module: torch.nn.Module, fn: Callable) -> None:
    """Make ``module(...)`` run ``fn(module, ...)``: ``fn`` must be a module-level function (it
    is pickled by its qualified name)."""
    module.forward = functools.partial(fn, module)


def bound_function(module: torch.nn.Module) -> Optional[Callable]:
    """The function :func:`bind` set as ``module``'s forward, or None (the class's forward or
    another instance forward)."""
    current = vars(module).get("forward")
    if (isinstance(current, functools.partial) and len(current.args) == 1
            and current.args[0] is module and not current.keywords):
        return current.func
    return None
