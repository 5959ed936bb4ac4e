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
