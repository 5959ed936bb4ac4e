"""use_backend() reaches the backward even when autograd runs it on another thread.

On CUDA, autograd runs the backward on its device thread, which does not see the context
variable use_backend() sets; each op's forward records the forced backend and its backward
re-enters it (compileops.backends.keep_forward_backend). A fresh thread on CPU shows the same
gap (new threads start with empty context variables), so this is tested here."""
import threading

import pytest
import torch

import compileops
from compileops import backends


def _run_in_thread(fn):
    errors = []

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (reraised below)
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _cases():
    ids = torch.tensor([[1, 3, 1]])
    yield "embedding", lambda: compileops.embedding(ids, torch.randn(5, 4, requires_grad=True))
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(2, 4, 8, requires_grad=True)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    yield "grouped_linear", lambda: compileops.grouped_linear(x, w, offs)
    yield "grouped_linear_swiglu", lambda: compileops.grouped_linear_swiglu(x, w, offs)
    q = torch.randn(1, 1, 5, 4, requires_grad=True)
    gates = torch.randn(1, 1, 5, requires_grad=True)
    yield "mlstm", lambda: compileops.mlstm(q, q, q, gates, gates, norm_weight=torch.ones(4))


@pytest.mark.parametrize("case", [name for name, _ in _cases()])
def test_forced_backend_reaches_a_backward_on_another_thread(case, monkeypatch):
    forward = dict(_cases())[case]
    seen = []
    real = backends.select

    def spy(op, device):
        chosen = real(op, device)
        seen.append((op, chosen))
        return chosen

    monkeypatch.setattr(backends, "select", spy)
    with compileops.use_backend("reference"):
        out = forward()
    seen.clear()
    _run_in_thread(lambda: out.float().sum().backward())
    assert seen, "the backward selected no backend"
    assert all(chosen == "reference" for _, chosen in seen), seen
