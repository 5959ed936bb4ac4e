"""compileops: torch.compile custom ops with Inductor lowerings.

Importing this package registers every op under ``torch.ops.compileops`` and arms the
automatic installation of the Inductor lowerings (``lowerings.install``), which happens the
moment Inductor's lowering table is imported, i.e. before the first Inductor compile. The
import itself stays cheap: nothing here imports ``torch._inductor``.
"""
from compileops import backends
from compileops.backends import BackendUnavailableError, use_backend
from compileops.embedding import embedding, set_strict_index_checks
from compileops import xtoken  # noqa: F401  (registers the xtoken ops)
from compileops.grouped_linear import (
    grouped_linear,
    grouped_linear_splits,
    grouped_linear_swiglu,
)
from compileops import nn  # noqa: E402  (registers modules; cheap)
from compileops import testing  # noqa: E402  (imports Inductor only when its helpers run)

import lowerings as _lowerings

_lowerings.install_on_inductor_import()

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "backends",
    "embedding",
    "grouped_linear",
    "grouped_linear_splits",
    "grouped_linear_swiglu",
    "nn",
    "set_strict_index_checks",
    "testing",
    "use_backend",
]
