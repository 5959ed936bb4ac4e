"""compileops: torch.compile custom ops with Inductor lowerings.

Importing this package registers every op under ``torch.ops.compileops`` and arms the
automatic installation of the Inductor lowerings (``compileops.lowerings.install``), which happens the
moment Inductor's lowering table is imported, i.e. before the first Inductor compile. The
import itself stays cheap: nothing here imports ``torch._inductor``.
"""
import importlib
import sys

from compileops import _log, backends
from compileops._version import __version__
from compileops.backends import BackendUnavailableError, use_backend
from compileops.embedding import embedding
from compileops.modes import (
    batch_invariant,
    set_batch_invariant,
    set_strict_index_checks,
    set_strict_offset_checks,
    strict_index_checks,
    strict_offset_checks,
)
from compileops import xtoken  # noqa: F401  (registers the xtoken ops)
from compileops.grouped_linear import (
    grouped_linear,
    grouped_linear_splits,
    grouped_linear_swiglu,
)
from compileops.mlstm import mlstm, mlstm_step, mlstm_with_stats
from compileops import nn  # noqa: E402  (registers modules; cheap)
from compileops import testing  # noqa: E402  (imports Inductor only when its helpers run)
from compileops import divergence  # noqa: E402,F401  (documented as compileops.divergence.*)


def _checkout_lowerings():
    """``compileops.lowerings`` from a source checkout that was put on ``PYTHONPATH`` rather
    than installed: there the package sits beside ``compileops/`` as ``lowerings/``, which the
    installed layout (and an editable install's import hook) maps to ``compileops.lowerings``.
    Loaded under that name, so every import of it elsewhere finds this same module."""
    import importlib.util
    import pathlib

    folder = pathlib.Path(__file__).resolve().parent.parent / "lowerings"
    spec = importlib.util.spec_from_file_location(
        "compileops.lowerings", folder / "__init__.py",
        submodule_search_locations=[str(folder)])
    if spec is None:
        raise ModuleNotFoundError("compileops.lowerings is missing: reinstall compileops",
                                  name="compileops.lowerings")
    module = importlib.util.module_from_spec(spec)
    sys.modules["compileops.lowerings"] = module
    spec.loader.exec_module(module)
    return module


try:
    _lowerings = importlib.import_module("compileops.lowerings")
except ModuleNotFoundError as _missing:
    if _missing.name != "compileops.lowerings":
        raise
    _lowerings = lowerings = _checkout_lowerings()


def _carry_namespace(function, package) -> None:
    """Make the op function ``compileops.<family>`` also carry its family package's names.

    The public functions share their names with the subpackages that define them
    (``compileops.grouped_linear`` is both the op and ``compileops/grouped_linear/``). The
    package attribute holds the function, so that ``compileops.grouped_linear(x, w, offsets)``
    works and compiles (Dynamo traces functions; it cannot call a module). The function's
    attribute dictionary *is* the package's namespace, so every name of the package, and every
    submodule once imported, is reachable through it as well:
    ``compileops.grouped_linear.permute_by_expert``, ``import compileops.mlstm.recurrent``.
    """
    if function.__dict__ and function.__dict__ is not package.__dict__:
        raise RuntimeError(f"{function.__qualname__} already has attributes of its own")
    function.__dict__ = package.__dict__


_carry_namespace(embedding, sys.modules["compileops.embedding"])
_carry_namespace(grouped_linear, sys.modules["compileops.grouped_linear"])
_carry_namespace(mlstm, sys.modules["compileops.mlstm"])

_log.configure_from_env()  # COMPILEOPS_LOG; silent without it
_lowerings.install_on_inductor_import()


__all__ = [
    "BackendUnavailableError",
    "__version__",
    "backends",
    "batch_invariant",
    "embedding",
    "grouped_linear",
    "grouped_linear_splits",
    "grouped_linear_swiglu",
    "mlstm",
    "mlstm_step",
    "mlstm_with_stats",
    "nn",
    "set_batch_invariant",
    "set_strict_index_checks",
    "set_strict_offset_checks",
    "strict_index_checks",
    "strict_offset_checks",
    "testing",
    "use_backend",
]
