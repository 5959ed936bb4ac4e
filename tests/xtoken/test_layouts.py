"""Inputs of any layout: transposed index tensors (``chunk_id``, ``columns``) and a transposed
``log_probs`` / ``p`` give contiguous outputs and gradients, as the ops' fake functions
declare, so compiled code (static and ``dynamic=True``, forward and backward) agrees with
eager on both backends. (The reference backend's results used to follow their index
inputs' layout, and the compiled step failed its stride assertion.)"""
import pytest
import torch

import compileops
from compileops.xtoken import ProjectionCOO, build_csr, chunk_average, chunk_sums, project

B, T, V, C = 2, 9, 5, 4
VS, VT, N, K = 7, 6, 5, 3
MODES = ["eager", "static", "dynamic"]
BACKENDS = ["reference", "triton"]


def _compiled(fn, mode):
    if mode == "eager":
        return fn
    return torch.compile(fn, dynamic=mode == "dynamic", fullgraph=True)


def _chunk_inputs():
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.randn(T, B, V, generator=gen).transpose(0, 1)  # [B, T, V], strided
    chunk_id = torch.randint(0, C, (T, B), generator=gen).T          # [B, T], strided
    return log_probs, chunk_id


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [chunk_sums, chunk_average], ids=["sums", "average"])
def test_chunk_ops_take_transposed_inputs(fn, mode, backend):
    log_probs, chunk_id = _chunk_inputs()
    leaf = log_probs.detach().requires_grad_()
    want_leaf = log_probs.detach().contiguous().requires_grad_()
    with compileops.use_backend(backend):
        got = _compiled(fn, mode)(leaf, chunk_id, C)[0]
        got.backward(torch.ones_like(got))
        want = fn(want_leaf, chunk_id.contiguous(), C)[0]
        want.backward(torch.ones_like(want))
    assert got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(leaf.grad, want_leaf.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_project_takes_transposed_columns(mode, backend):
    gen = torch.Generator().manual_seed(1)
    coo = ProjectionCOO(torch.randint(0, VS, (15,), generator=gen),
                        torch.randint(0, VT, (15,), generator=gen),
                        torch.rand(15, generator=gen), VS, VT)
    csr = build_csr(coo)
    p = torch.rand(VS, N, generator=gen).T                          # [N, VS], strided
    columns = torch.randint(0, VT, (K, N), generator=gen).T          # [N, K], strided
    leaf = p.detach().requires_grad_()
    want_leaf = p.detach().contiguous().requires_grad_()
    with compileops.use_backend(backend):
        got = _compiled(project, mode)(leaf, csr, columns)
        got.sum().backward()
        want = project(want_leaf, csr, columns.contiguous())
        want.sum().backward()
    assert got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(leaf.grad, want_leaf.grad)
