"""Test setup shared by every test module.

Without a GPU, Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1), which
must be set before any kernel is defined; compileops defines its kernels lazily, so setting
it here, before the tests import anything, is enough.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compileops  # noqa: E402  (registers the ops after the interpreter switch)

# Under the interpreter, every kernel load and store is checked against the storages of the
# launch's tensors (tests/bounds.py): what would be an illegal memory access on a GPU fails
# the test here instead of reading host memory silently.
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("COMPILEOPS_CHECK_BOUNDS") != "0":
    from tests import bounds  # noqa: E402

    bounds.install()


@pytest.fixture
def fixed_order_dots():
    """Interpreter ``tl.dot`` summing in a fixed order (``tests/fixed_order_dots.py``): for
    tests that claim bits across tile shapes, which the CPU's BLAS would decide otherwise."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield  # real GPU kernels: their MMA's order is the claim
        return
    from tests.fixed_order_dots import fixed_order_dots as context

    with context():
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The test modules that exercise code whose behaviour depends on the torch and triton
# versions: the Inductor lowerings and their private API, the graph snapshots, the Triton
# kernels (under the interpreter, and compiled for sm90), the cached launch path, the
# package as installed, and the torchtitan 0.2 integration (the torchtitan release of the
# oldest supported torch; skipped with torchtitan 0.3). `pytest -m compat` runs them alone
# (the README's command for testing another supported torch).
COMPAT_MODULES = (
    "test_compile.py", "test_snapshots.py", "test_kernels.py", "test_kernels_wgrad.py",
    "test_codegen_sm90.py", "test_launch.py", "test_import.py", "test_packaging.py",
    "test_export.py", "test_logging.py", "test_snapshot_helper.py", "test_compat.py",
    "test_user_pattern_snapshots.py", "test_torchtitan_v02.py", "test_torchtitan_v02_mesh.py",
    "test_fp8_weight_grad.py",
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compat: exercises torch- or triton-version-dependent code "
                   "(set by tests/conftest.py from the module name)")


def pytest_collection_modifyitems(config, items):
    compat = pytest.mark.compat
    for item in items:
        if item.path.name in COMPAT_MODULES:
            item.add_marker(compat)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------
# Hypothesis profiles of the property-fuzzing tests (tests/*/test_fuzz.py, the fuzzing).
# "ci" (the default): few examples, a fixed seed per test (derandomize) so CI is
# reproducible, no example database. "long": COMPILEOPS_FUZZ_PROFILE=long, random seeds,
# COMPILEOPS_FUZZ_MAX_EXAMPLES (default 2000) per test; the GPU variants always use it.
# COMPILEOPS_FUZZ_SHRINK=0 reports the first failing example as drawn, without shrinking
# it (on a GPU each shrink step may compile new kernel specialisations).
# function_scoped_fixture: the autouse _fresh_dynamo fixture above runs once per test,
# not per example, which is fine for eager fuzzing.
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "long",
    parent=settings.get_profile("ci"),
    max_examples=int(os.environ.get("COMPILEOPS_FUZZ_MAX_EXAMPLES", "2000")),
    derandomize=False,
    **({"phases": [Phase.explicit, Phase.reuse, Phase.generate]}
       if os.environ.get("COMPILEOPS_FUZZ_SHRINK") == "0" else {}),
)
settings.load_profile(os.environ.get("COMPILEOPS_FUZZ_PROFILE", "ci"))
