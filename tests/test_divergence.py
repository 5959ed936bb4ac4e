"""compileops.divergence: exact op fingerprints and the first op that differs on equal
inputs (the tool behind ``examples/fsdp2_moe.py --trace-ops``)."""
import torch

import compileops
from compileops.divergence import OpFingerprints, fingerprint, first_divergence


def _step(x, w, alpha):
    h = torch.addmm(x, x, w, alpha=alpha)       # equal tensor inputs, scalar differs
    return torch.mm(torch.relu(h), w).sum()     # then inputs already differ


def _trace(fn, *args):
    with OpFingerprints() as trace:
        fn(*args)
    return trace.calls


def test_fingerprint_is_exact_on_bits():
    x = torch.randn(5, 7, dtype=torch.float64)
    y = x.clone()
    assert fingerprint(x) == fingerprint(y)
    y[3, 2] = torch.nextafter(y[3, 2], torch.tensor(float("inf"), dtype=torch.float64))
    assert fingerprint(x) != fingerprint(y)
    assert fingerprint(x.t()) == fingerprint(x.t().contiguous())
    z = x.clone()
    z[0, 0], z[0, 1] = x[0, 1], x[0, 0]  # a permutation: same plain sum, other weighted sum
    assert fingerprint(x) != fingerprint(z)


def test_no_divergence_between_identical_runs():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    report = first_divergence(_trace(_step, x, w, 1.0), _trace(_step, x.clone(), w.clone(), 1.0))
    assert report.first_cause is None and report.same_sequence
    assert report.per_op["aten::addmm"] == {"equal": 1, "differs": 0, "inputs_differ": 0}


def test_names_the_op_that_differs_on_equal_inputs_not_its_consumers():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    report = first_divergence(_trace(_step, x, w, 1.0), _trace(_step, x, w, 2.0))
    assert report.first_cause == (0, "aten::addmm")
    assert report.per_op["aten::addmm"]["differs"] == 1
    assert report.per_op["aten::mm"] == {"equal": 0, "differs": 0, "inputs_differ": 1}
    assert "first op to differ on equal inputs: #0 aten::addmm" in report.summary()


def test_traces_compileops_ops_forward_and_backward():
    emb = compileops.nn.Embedding(10, 4)
    ids = torch.tensor([1, 3, 3, 7])
    with OpFingerprints() as trace:
        emb(ids).square().sum().backward()
    names = [c.name for c in trace.calls]
    assert "compileops::embedding" in names and "compileops::embedding_backward" in names
