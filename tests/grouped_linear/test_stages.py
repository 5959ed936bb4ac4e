"""The eager launchers' retry with fewer operand stages when a tile's shared memory does not
fit (``compileops/grouped_linear/kernels/stages.py``), against fake launches: the GPU error
comes from Triton when it loads a kernel, which the CPU cannot raise."""
from __future__ import annotations

import logging

import pytest
import torch
from triton.runtime.errors import OutOfResources

from compileops.grouped_linear.kernels.stages import (
    clear_fitted_stages,
    launch_with_stages_that_fit,
)

CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def no_fitted_stages():
    clear_fitted_stages()
    yield
    clear_fitted_stages()


def fits_up_to(most: int, calls: list):
    """A launch that records each stage count asked for and runs only with ``most`` or
    fewer (Triton's error for more)."""
    def launch(stages: int) -> None:
        calls.append(stages)
        if stages > most:
            raise OutOfResources(200000 + 40000 * stages, 232448, "shared memory")
    return launch


def test_a_launch_that_fits_runs_once_as_asked():
    calls = []
    launch_with_stages_that_fit(fits_up_to(4, calls), 4, CUDA0, explicit=False, key="k",
                                what="the kernel")
    assert calls == [4]


def test_too_many_stages_retry_with_fewer_and_the_fit_is_remembered(caplog):
    calls = []
    with caplog.at_level(logging.WARNING, logger="compileops"):
        launch_with_stages_that_fit(fits_up_to(2, calls), 4, CUDA0, explicit=False, key="k",
                                    what="the kernel", config="128 x 256 x 64")
        assert calls == [4, 3, 2]
        calls.clear()
        launch_with_stages_that_fit(fits_up_to(2, calls), 4, CUDA0, explicit=False, key="k",
                                    what="the kernel")
    assert calls == [2]  # straight to the count that fit
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "the kernel (128 x 256 x 64) with 4 stages" in messages[0]
    assert "with 2 stages" in messages[0]
    assert "cuda:0" in messages[0]


def test_the_fit_is_per_key_and_per_device():
    launch_with_stages_that_fit(fits_up_to(2, []), 4, CUDA0, explicit=False, key="k",
                                what="the kernel")
    for key, device in (("other", CUDA0), ("k", torch.device("cuda", 1))):
        calls = []
        launch_with_stages_that_fit(fits_up_to(4, calls), 4, device, explicit=False, key=key,
                                    what="the kernel")
        assert calls == [4], (key, device)


def test_an_explicit_config_is_launched_as_given():
    """A sweep or test that names a config must see its error, not time another config."""
    calls = []
    with pytest.raises(OutOfResources):
        launch_with_stages_that_fit(fits_up_to(2, calls), 4, CUDA0, explicit=True, key="k",
                                    what="the kernel")
    assert calls == [4]


def test_no_stage_count_that_fits_raises_the_error():
    calls = []
    with pytest.raises(OutOfResources):
        launch_with_stages_that_fit(fits_up_to(0, calls), 3, CUDA0, explicit=False, key="k",
                                    what="the kernel")
    assert calls == [3, 2, 1]


@pytest.mark.parametrize("exc", [ValueError("a bug"), RuntimeError("driver"),
                                 torch.OutOfMemoryError("CUDA out of memory")],
                         ids=["ValueError", "RuntimeError", "OutOfMemoryError"])
def test_other_errors_are_not_retried(exc):
    calls = []

    def launch(stages):
        calls.append(stages)
        raise exc

    with pytest.raises(type(exc)):
        launch_with_stages_that_fit(launch, 4, CUDA0, explicit=False, key="k",
                                    what="the kernel")
    assert calls == [4]


def test_cpu_launches_are_not_retried():
    """The interpreter ignores stages; an error there is a bug to see."""
    calls = []
    with pytest.raises(OutOfResources):
        launch_with_stages_that_fit(fits_up_to(2, calls), 4, torch.device("cpu"),
                                    explicit=False, key="k", what="the kernel")
    assert calls == [4]


def test_the_eager_launchers_launch_through_the_retry(monkeypatch):
    """The M-jagged and K-jagged launchers go through the retry with their config's stage
    count and a key naming the kernel and config (on the CPU the retry launches once)."""
    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels import kjagged, mjagged, stages

    seen = []

    def spy(launch, num_stages, device, *, explicit, key, what, config):
        seen.append((key[0], config.num_stages, num_stages, explicit))
        stages.launch_with_stages_that_fit(launch, num_stages, device, explicit=explicit,
                                           key=key, what=what, config=config)

    monkeypatch.setattr(mjagged, "launch_with_stages_that_fit", spy)
    monkeypatch.setattr(kjagged, "launch_with_stages_that_fit", spy)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=gen)
    w = torch.randn(2, 16, 32, generator=gen)
    offsets = torch.tensor([10, 24], dtype=torch.int32)
    y = kernels.grouped_linear_forward(x, w, offsets)
    dw, _ = kernels.grouped_linear_wgrad(torch.ones_like(y), x, offsets, x.dtype, x.dtype)
    assert [entry[0] for entry in seen] == ["M-jagged", "K-jagged"]
    assert all(cfg_stages == asked and not explicit for _, cfg_stages, asked, explicit in seen)
    torch.testing.assert_close(y[:10], x[:10] @ w[0].T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw[1], torch.ones(14, 16).T @ x[10:], rtol=1e-4, atol=1e-4)
