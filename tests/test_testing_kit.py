"""compileops.testing must be able to fail: each assertion is fed a violation."""
import pytest
import torch

from compileops import testing


def test_close_to_reference_reports_error_and_worst_element():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0])
    report = testing.assert_close_to_reference(ref + 1e-4, ref, max_relative_error=1e-3)
    assert 0 < report.relative_error < 1e-3
    bad = ref.clone()
    bad[2] = 3.5
    with pytest.raises(AssertionError, match=r"worst element at \(2,\): got 3.5, expected 3.0"):
        testing.assert_close_to_reference(bad, ref, max_relative_error=1e-3)


def test_close_to_reference_zero_tolerance_is_bitwise_and_nan_fails():
    ref = torch.tensor([1.0, 2.0])
    testing.assert_close_to_reference(ref.clone(), ref, max_relative_error=0)
    with pytest.raises(AssertionError):
        testing.assert_close_to_reference(ref + 1e-7, ref, max_relative_error=0)
    with pytest.raises(AssertionError, match="inf"):
        testing.assert_close_to_reference(torch.tensor([1.0, float("nan")]), ref, max_relative_error=1.0)


def test_batch_invariance_catches_cross_row_dependence():
    x = torch.randn(6, 4)
    testing.assert_batch_invariant(lambda t: t * 2, [x])
    with pytest.raises(AssertionError, match="batch invariance"):
        testing.assert_batch_invariant(lambda t: t - t.mean(0), [x])


class _DriftingGrad(torch.autograd.Function):
    """Identity whose backward drifts by 1e-6 on every call: a nondeterministic gradient."""

    calls = 0

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        _DriftingGrad.calls += 1
        return g * (1 + 1e-6 * _DriftingGrad.calls)


def test_determinism_catches_nondeterminism_in_forward_and_backward():
    x = torch.randn(5, requires_grad=True)
    testing.assert_deterministic(lambda t: t.sin(), [x], runs=3)
    calls = []

    def drifting_forward(t):
        calls.append(1)
        return t * (1 + 1e-6 * len(calls))

    with pytest.raises(AssertionError, match="forward output 0"):
        testing.assert_deterministic(drifting_forward, [x], runs=3)

    with pytest.raises(AssertionError, match="gradient 0"):
        testing.assert_deterministic(_DriftingGrad.apply, [x], runs=3)


def test_determinism_covers_module_parameters_and_refuses_nothing_to_check():
    class Drifting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, t):
            return _DriftingGrad.apply(self.w) * t

    with pytest.raises(AssertionError, match="gradient 0"):
        testing.assert_deterministic(Drifting(), [torch.randn(3)], runs=3)
    with pytest.raises(ValueError, match="nothing to differentiate"):
        testing.assert_deterministic(lambda t: t * 2, [torch.randn(3)], runs=2)
    testing.assert_deterministic(lambda t: t * 2, [torch.randn(3)], runs=2, backward=False)
