"""compileops: torch.compile custom ops with Inductor lowerings.

Importing this package registers every op under ``torch.ops.compileops`` and arms the
automatic installation of the Inductor lowerings (``lowerings.install``), which happens the
moment Inductor's lowering table is imported, i.e. before the first Inductor compile. The
import itself stays cheap: nothing here imports ``torch._inductor``.
"""
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

import lowerings as _lowerings

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
