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


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------
# Hypothesis profiles of the property-fuzzing tests (tests/*/test_fuzz.py, issue 24).
# "ci" (the default): few examples, a fixed seed per test (derandomize) so CI is
# reproducible, no example database. "long": COMPILEOPS_FUZZ_PROFILE=long, random seeds,
# COMPILEOPS_FUZZ_MAX_EXAMPLES (default 2000) per test; the GPU variants always use it.
# function_scoped_fixture: the autouse _fresh_dynamo fixture above runs once per test,
# not per example, which is fine for eager fuzzing.
from hypothesis import HealthCheck, settings  # noqa: E402

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
)
settings.load_profile(os.environ.get("COMPILEOPS_FUZZ_PROFILE", "ci"))
