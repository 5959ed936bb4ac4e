"""A pytest plugin that turns compileops on for every torchtitan 0.3 MoE a test session builds:
for running torchtitan's own MoE unit tests (from its repository, at the release installed)
with compileops' experts in place of its own::

    python -m pytest -p tests.integrations.titan_upstream_plugin <torchtitan>/tests/unit_tests/test_moe.py ...

``GroupedExperts.forward`` and ``RoutedExperts.forward`` become the converted classes'
(:class:`CompileopsGroupedExperts`, :class:`CompileopsRoutedExperts`) for each test, so models
built from torchtitan's registries, from configs or module by module all compute their
experts on compileops (subclasses with a forward of their own, e.g. gpt-oss's, keep it).
``COMPILEOPS_TITAN_FP8=rowwise`` selects fp8.
"""
from __future__ import annotations

import os

import pytest

if not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _compileops_experts(monkeypatch):
    from torchtitan.models.common import moe

    from compileops.integrations import _titan_v03 as v03
    from compileops.integrations._titan_experts import Options

    options = Options(os.environ.get("COMPILEOPS_TITAN_FP8") or None)
    monkeypatch.setattr(moe.GroupedExperts, "forward", v03.CompileopsGroupedExperts.forward)
    monkeypatch.setattr(moe.GroupedExperts, "compileops_options", options, raising=False)
    monkeypatch.setattr(moe.RoutedExperts, "forward", v03.CompileopsRoutedExperts.forward)
    yield
