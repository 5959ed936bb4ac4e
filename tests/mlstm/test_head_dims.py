"""Value heads wider than one kernel call (``DV > MAX_KERNEL_HEAD_DIM``, xLSTM-7B's DV 512):
the cell runs once per slice of value columns, the norm over the whole head. Every form
(parallel, chunkwise with states, packed documents), forward and backward, eager and
compiled, against the fp64 reference.

Most tests narrow the slice width (monkeypatched) so that a small DV takes three slices, one
of them ragged, at the interpreter's speed; one runs DV 512 at the real width.
"""
import pytest
import torch

import compileops
from compileops.mlstm import api, reference
from tests.mlstm._helpers import fw_bw, make_inputs, op_out, reference_out

DQK, DV = 24, 40


@pytest.fixture
def narrow_slices(monkeypatch):
    """Slices of 16 value columns: DV 40 runs as 16 + 16 + 8."""
    monkeypatch.setattr(api, "MAX_KERNEL_HEAD_DIM", 16)


def _check(x, *, tol, **kwargs):
    want_out, want = fw_bw(reference_out, x.map(lambda t: t.to(torch.float64)),
                           loss=lambda o: (o * o).sum())
    with compileops.use_backend("triton"):
        got_out, got = fw_bw(op_out, x, loss=lambda o: (o * o).sum(), **kwargs)
    torch.testing.assert_close(got_out.double(), want_out, atol=tol, rtol=tol)
    for name, g, w in zip(x.names(), got, want):
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol,
                                   msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
@pytest.mark.parametrize("kernel", ["parallel", "chunkwise"])
def test_sliced_heads_match_the_reference(narrow_slices, kernel, normed):
    x = make_inputs(1, 2, 37, DQK, DV, weight=normed, bias=normed, seed=3)
    _check(x, tol=1e-10, kernel=kernel, chunk_size=16)


def test_sliced_heads_fp32_equal_one_pass(narrow_slices, monkeypatch, fixed_order_dots):
    """Raw h from slices: each column's sums run over the same keys in the same order as in
    one pass, so the output and the statistics are bitwise those of the unsliced call (under
    the interpreter with dots in a fixed order: the CPU's BLAS would sum a 16-column slice in
    another order than a 40-column pass)."""
    x = make_inputs(1, 2, 37, DQK, DV, dtype=torch.float32, weight=False, bias=False, seed=4)
    with compileops.use_backend("triton"):
        sliced = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate)
        monkeypatch.setattr(api, "MAX_KERNEL_HEAD_DIM", 256)
        whole = compileops.mlstm_with_stats(x.q, x.k, x.v, x.igate, x.fgate)
    for a, b in zip(sliced, whole):
        assert torch.equal(a, b)


def test_sliced_heads_states_carry(narrow_slices):
    """A row cut in two at a chunk boundary, the state carried, equals the whole row; the
    last state's C has DV columns and its n and m are the state's own."""
    x = make_inputs(1, 2, 48, DQK, DV, weight=False, bias=False, seed=5)
    with compileops.use_backend("triton"):
        whole, (c, n, m) = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, kernel="chunkwise",
                                            chunk_size=16, return_last_state=True)
        head, state = compileops.mlstm(x.q[:, :, :32], x.k[:, :, :32], x.v[:, :, :32],
                                       x.igate[..., :32], x.fgate[..., :32], kernel="chunkwise",
                                       chunk_size=16, return_last_state=True)
        tail, (c2, n2, m2) = compileops.mlstm(
            x.q[:, :, 32:], x.k[:, :, 32:], x.v[:, :, 32:], x.igate[..., 32:],
            x.fgate[..., 32:], kernel="chunkwise", chunk_size=16, initial_state=state,
            return_last_state=True)
    assert c.shape == (1, 2, DQK, DV)
    torch.testing.assert_close(torch.cat([head, tail], dim=2), whole, atol=1e-12, rtol=1e-12)
    for a, b in ((c2, c), (n2, n), (m2, m)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    want_c, want_n, want_m = _recurrent_state(x)
    torch.testing.assert_close(c * torch.exp(m)[..., None, None],
                               want_c * torch.exp(want_m)[..., None, None])
    torch.testing.assert_close(n * torch.exp(m)[..., None], want_n * torch.exp(want_m)[..., None])


def _recurrent_state(x):
    from compileops.mlstm import recurrent

    _, state = recurrent.recurrent_reference(x.q, x.k, x.v, x.igate, x.fgate)
    return state


def test_sliced_heads_state_with_the_wrong_width_names_initial_state(narrow_slices):
    x = make_inputs(1, 1, 8, DQK, DV, weight=False, bias=False)
    bad = (torch.zeros(1, 1, DQK, DV - 1, dtype=torch.float64),
           torch.zeros(1, 1, DQK, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="initial_state's C must be"):
        compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, kernel="chunkwise", initial_state=bad)


def test_sliced_heads_packed_documents(narrow_slices):
    x = make_inputs(1, 2, 40, DQK, DV, weight=True, bias=False, seed=6)
    cu = torch.tensor([0, 13, 40])
    with compileops.use_backend("triton"):
        packed = op_out(x, cu_seqlens=cu, chunk_size=16)
        alone = op_out(x.map(lambda t: t[..., 13:40, :] if t.dim() == 4
                             else (t[..., 13:40] if t.dim() == 3 else t)), chunk_size=16)
    torch.testing.assert_close(packed[:, 13:], alone, atol=1e-12, rtol=1e-12)


def test_sliced_heads_compile_fullgraph(narrow_slices):
    x = make_inputs(1, 2, 21, DQK, DV, dtype=torch.float32, seed=7)
    with compileops.use_backend("triton"):
        eager = op_out(x)
        compiled = torch.compile(op_out, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kernel", ["parallel", "chunkwise"])
def test_xlstm_7b_value_width(kernel):
    """DV 512 (xLSTM-7B's), at the real slice width, against the fp64 reference."""
    x = make_inputs(1, 1, 9, 16, 512, weight=True, bias=False, seed=8)
    _check(x, tol=1e-10, kernel=kernel, chunk_size=16)


def test_query_head_past_the_kernels_limit_still_raises():
    x = make_inputs(1, 1, 5, 272, 8, dtype=torch.float32, weight=False, bias=False)
    with compileops.use_backend("triton"), pytest.raises(RuntimeError, match="head dims up to"):
        op_out(x)


def test_reference_backend_agrees():
    x = make_inputs(1, 1, 9, 16, 300, weight=False, bias=False, seed=9)
    with compileops.use_backend("reference"):
        got = op_out(x)
    want = reference.mlstm_parallel(x.q, x.k, x.v, x.igate, x.fgate, 1e-6)[0]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- GPU

XLSTM_7B_HEAD = (256, 512)  # DQK, DV


@pytest.mark.gpu
@pytest.mark.parametrize("normed", [False, True], ids=["raw", "normed"])
@pytest.mark.parametrize("kernel", ["parallel", "chunkwise"])
def test_xlstm_7b_head_gpu(kernel, normed):
    """xLSTM-7B's head in bf16 on the GPU against fp64, within the bf16 bounds (chunkwise:
    its states enter the MMAs in bf16, the docstring's 8e-2)."""
    from tests.mlstm._helpers import check_precision

    x = make_inputs(1, 2, 300, *XLSTM_7B_HEAD, weight=normed, bias=normed, seed=10,
                    device="cuda")
    errors = check_precision(x, torch.bfloat16, kernel=kernel,
                             grad_tol=4e-2 if kernel == "parallel" else 8e-2)
    print(f"bf16 7B head {kernel} {'normed' if normed else 'raw'}: "
          + " ".join(f"{e:.2e}" for e in errors))


@pytest.mark.gpu
def test_xlstm_7b_head_states_documents_step_compiled_gpu():
    """The other forms at xLSTM-7B's head in bf16: a state carried across two calls, packed
    documents, a decode step after a prefill, and the compiled layer (Inductor)."""
    dqk, dv = XLSTM_7B_HEAD
    x = make_inputs(1, 2, 256, dqk, dv, dtype=torch.bfloat16, weight=True, bias=False,
                    seed=11, device="cuda")
    whole, state = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, kernel="chunkwise",
                                    return_last_state=True)
    head, mid = compileops.mlstm(x.q[:, :, :128], x.k[:, :, :128], x.v[:, :, :128],
                                 x.igate[..., :128], x.fgate[..., :128], kernel="chunkwise",
                                 return_last_state=True)
    tail, last = compileops.mlstm(x.q[:, :, 128:], x.k[:, :, 128:], x.v[:, :, 128:],
                                  x.igate[..., 128:], x.fgate[..., 128:], kernel="chunkwise",
                                  initial_state=mid, return_last_state=True)
    assert torch.equal(torch.cat([head, tail], dim=2), whole)
    for a, b in zip(last, state):
        assert torch.equal(a, b)
    cu = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
    packed = op_out(x, cu_seqlens=cu)
    alone = op_out(x.map(lambda t: t[..., 100:, :] if t.dim() == 4
                         else (t[..., 100:] if t.dim() == 3 else t)), kernel="chunkwise")
    assert torch.equal(packed[:, 100:], alone)
    step_out, _ = compileops.mlstm_step(x.q[:, :, 0], x.k[:, :, 0], x.v[:, :, 0],
                                        x.igate[:, :, 0], x.fgate[:, :, 0], state,
                                        norm_weight=x.norm_weight)
    assert step_out.shape == (1, 2 * dv) and torch.isfinite(step_out).all()
    compiled = torch.compile(lambda y: op_out(y), fullgraph=True)
    got = compiled(x)
    eager = op_out(x)
    torch.testing.assert_close(got.float(), eager.float(), atol=2e-2, rtol=2e-2)
