"""The backend registry: priority, forcing, and clear errors."""
import pytest
import torch

from compileops import BackendUnavailableError, backends, use_backend


def test_priority_per_device_kind():
    assert set(backends.PRIORITY) == {"cuda", "rocm", "cpu"}
    for order in backends.PRIORITY.values():
        assert order[-1] == "reference"


def test_cpu_uses_triton_only_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.select("embedding", "cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backends.select("embedding", "cpu") == "reference"


def test_forcing_an_unavailable_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"):
        with pytest.raises(BackendUnavailableError, match="set TRITON_INTERPRET=1"):
            backends.select("embedding", "cpu")
    with pytest.raises(BackendUnavailableError, match="compileops::embedding: backend 'triton'"):
        with use_backend("triton"):
            import compileops

            compileops.embedding(torch.tensor([0]), torch.randn(2, 2))


def test_use_backend_is_a_context_manager_and_decorator_and_nests():
    assert backends._forced.get() is None

    @use_backend("reference")
    def inner():
        return backends.select("x", "cpu")

    with use_backend("triton"):
        assert backends.select("x", "cpu") == "triton"
        assert inner() == "reference"
        assert backends.select("x", "cpu") == "triton"
    assert backends._forced.get() is None


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        use_backend("fast")
    assert "unknown backend" in backends.why_unavailable("fast", "cpu")
