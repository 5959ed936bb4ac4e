"""The chunkwise mLSTM (``kernel="chunkwise"``): the seed's fp64 contract at several chunk
sizes, states in and out (gradients included), a sequence cut in two calls, agreement with
the parallel form, ``kernel="auto"``, and the compiled op with a symbolic S.

CPU: the Triton kernels run under the interpreter; GPU tests (``-m gpu``) at real shapes.
"""
import pytest
import torch

import compileops
from compileops.mlstm import chunkwise
from compileops.mlstm.checks import MAX_CHUNK
from compileops.mlstm.api import AUTO_PARALLEL_MAX_SEQ, AUTO_PARALLEL_MAX_SEQ_INFERENCE, \
    choose_kernel
from compileops.mlstm.gates import log_forget_op
from compileops.mlstm.reference import gate_dtype
from compileops.testing import assert_close_to_reference
from tests.mlstm._helpers import OUT_TOL, cotangent, fw_bw, make_inputs, \
    out_shape, reference_out

CUDA = torch.cuda.is_available()
# The chunkwise bf16 gradients, relative L2 against fp64 (compileops.mlstm's docstring):
# looser than the parallel form's 4e-2, the states enter the MMAs in bf16; measured worst on
# the H100: dfgate 6.0e-2 at 1x2x4096x64x64, chunk 64.
CHUNKWISE_BF16_GRAD_TOL = 8e-2


def chunk_out(x, **kwargs):
    return compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight,
                            norm_bias=x.norm_bias, kernel="chunkwise", **kwargs)


def _contract(x, backend, chunk, atol=1e-5, rtol=1e-5):
    """The seed's loss ((out + 3 randn)^2).sum(): every gradient against fp64 autograd
    through the reference (parallel form, then the norm)."""
    gen = torch.Generator().manual_seed(7)
    offset = (3.0 * torch.randn(out_shape(x), generator=gen, dtype=torch.float64)).to(x.q.device)

    def loss(out):
        return ((out + offset) ** 2).sum()

    want_out, want = fw_bw(reference_out, x.map(lambda t: t.double()), loss=loss)
    with compileops.use_backend(backend):
        got_out, got = fw_bw(chunk_out, x, loss=loss, chunk_size=chunk)
    for name, g, w in [("out", got_out, want_out), *zip(x.names(), got, want)]:
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol,
                                   msg=lambda m: f"chunk {chunk} {name}: {m}")


@pytest.mark.parametrize("normed", [True, False], ids=["normed", "raw"])
@pytest.mark.parametrize("backend,chunk,seq", [
    ("triton", 16, 8), ("triton", 16, 100), ("triton", 32, 77), ("triton", 64, 200),
    ("triton", 128, 512),
    ("reference", 16, 100), ("reference", 64, 200)])
def test_contract_fp64(backend, chunk, seq, normed):
    x = make_inputs(1, 2, seq, 16, 24, weight=normed, bias=normed, seed=seq)
    _contract(x, backend, chunk)


def _states(b, nh, dqk, dv, seed=3, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(b, nh, dqk, dv, generator=gen, dtype=torch.float64) * 0.3
    n = torch.randn(b, nh, dqk, generator=gen, dtype=torch.float64) * 0.3
    m = torch.randn(b, nh, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (c, n, m))


@pytest.mark.parametrize("chunk", [16, 32])
def test_states_gradients_match_autograd_through_the_reference(chunk):
    """Initial state in, last state out, every gradient (the states' included) against
    autograd through the plain-PyTorch chunk loop (fp64)."""
    x = make_inputs(2, 2, 70, 16, 24, seed=11)
    state = _states(2, 2, 16, 24)
    gen = torch.Generator().manual_seed(5)
    g_out = torch.randn(out_shape(x), generator=gen, dtype=torch.float64)
    g_state = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in state]

    def run(fn):
        leaves = x.leaves()
        st = [t.clone().requires_grad_(True) for t in state]
        out, last = fn(leaves, st)
        loss = (out * g_out).sum() + sum((a * b).sum() for a, b in zip(last, g_state))
        return [out, *last], torch.autograd.grad(loss, leaves.tensors() + st)

    def ours(leaves, st):
        with compileops.use_backend("triton"):
            return chunk_out(leaves, chunk_size=chunk, initial_state=tuple(st),
                             return_last_state=True)

    def truth(leaves, st):
        acc = gate_dtype(leaves.q.dtype)
        logf = torch.cumsum(torch.nn.functional.logsigmoid(leaves.fgate.to(acc)), -1)
        # One chunk of the whole row: the state enters once, the row sums are global.
        seq = leaves.q.shape[-2]
        h, _, _, _, last = chunkwise._reference_forward(
            leaves.q, leaves.k, leaves.v, leaves.igate.to(acc), logf, *st,
            1 << (seq - 1).bit_length(), 1e-6)
        from compileops.mlstm import reference
        out = reference.multihead_layernorm(h, leaves.norm_weight, leaves.norm_bias, 1e-6)
        return out, last

    got, got_grads = run(ours)
    want, want_grads = run(truth)
    for i, (g, w) in enumerate(zip(got + list(got_grads), want + list(want_grads))):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9, msg=lambda m: f"#{i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_two_calls_with_the_carried_state_equal_one_call_bitwise(dtype):
    x = make_inputs(2, 2, 64, 16, 24, dtype=dtype, seed=2)
    cut = 32

    def part(t, sl):
        return t[..., sl, :] if t.dim() == 4 else t[..., sl]

    with compileops.use_backend("triton"):
        whole, last = chunk_out(x, chunk_size=16, return_last_state=True)
        first = x.map(lambda t: part(t, slice(0, cut)) if t.dim() > 1 else t)
        second = x.map(lambda t: part(t, slice(cut, None)) if t.dim() > 1 else t)
        a, state = chunk_out(first, chunk_size=16, return_last_state=True)
        b, last2 = chunk_out(second, chunk_size=16, initial_state=state,
                             return_last_state=True)
    assert torch.equal(torch.cat([a, b], dim=1), whole)
    for got, want in zip(last2, last):
        assert torch.equal(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_states_and_packing_keep_the_fp64_contract(packed):
    """The seed's contract with an initial state (its gradient too) or with cu_seqlens, at
    S = 300 and chunk 64, against the plain-PyTorch references with states."""
    from compileops.mlstm import recurrent, reference

    x = make_inputs(1, 2, 300, 16, 24, seed=21)
    gen = torch.Generator().manual_seed(7)
    offset = 3.0 * torch.randn(out_shape(x), generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 37, 38, 190, 300], dtype=torch.int32)
    state = None if packed else _states(1, 2, 16, 24)

    def run(fn):
        leaves = x.leaves()
        st = [t.clone().requires_grad_(True) for t in state] if state else []
        out = fn(leaves, st)
        loss = ((out + offset) ** 2).sum()
        return out, torch.autograd.grad(loss, leaves.tensors() + st)

    def ours(a, st):
        with compileops.use_backend("triton"):
            return chunk_out(a, chunk_size=64, initial_state=tuple(st) if st else None,
                             cu_seqlens=cu if packed else None)

    def truth(a, st):
        h, _, _, _ = recurrent.parallel_reference_with_state(
            a.q, a.k, a.v, a.igate, a.fgate, initial_state=tuple(st) if st else None,
            cu_seqlens=cu if packed else None)
        return reference.multihead_layernorm(h, a.norm_weight, a.norm_bias, 1e-6)

    got, got_grads = run(ours)
    want, want_grads = run(truth)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad {i}: {m}")


def test_chunkwise_is_batch_invariant_fp32():
    from compileops.testing import assert_batch_invariant

    x = make_inputs(3, 2, 70, 16, 24, dtype=torch.float32, seed=12)

    def fn(q, k, v, ig, fg):
        return compileops.mlstm(q, k, v, ig, fg, norm_weight=x.norm_weight, kernel="chunkwise",
                                chunk_size=16)

    with compileops.use_backend("triton"):
        assert_batch_invariant(fn, [x.q, x.k, x.v, x.igate, x.fgate])


def test_chunkwise_agrees_with_parallel_fp32():
    x = make_inputs(2, 2, 90, 16, 24, dtype=torch.float32, seed=4)
    with compileops.use_backend("triton"):
        par = compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight,
                               norm_bias=x.norm_bias, kernel="parallel")
        chk = chunk_out(x, chunk_size=16)
    assert_close_to_reference(chk, par.double(), max_relative_error=1e-5, what="chunkwise")


def test_auto_picks_by_length_and_state():
    assert choose_kernel("auto", AUTO_PARALLEL_MAX_SEQ, False) == "parallel"
    assert choose_kernel("auto", AUTO_PARALLEL_MAX_SEQ + 1, False) == "chunkwise"
    assert choose_kernel("auto", 8, True) == "chunkwise"
    assert choose_kernel("auto", AUTO_PARALLEL_MAX_SEQ_INFERENCE, False, False) == "parallel"
    assert choose_kernel("auto", AUTO_PARALLEL_MAX_SEQ_INFERENCE + 1, False,
                         False) == "chunkwise"
    with pytest.raises(ValueError, match="kernel='parallel' takes no initial_state"):
        choose_kernel("parallel", 8, True)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("bad", [0, 8, 48, 100, 8192, 2**21])
def test_chunk_size_must_be_a_power_of_two_from_16_to_4096(bad, backend):
    """Past 4096 a chunk costs more than the parallel form, and from 2**20 rows the Triton
    kernels would fail inside Triton: refused with the limit named, on both backends."""
    x = make_inputs(1, 1, 20, 8, 8)
    with compileops.use_backend(backend), pytest.raises(
            ValueError, match="chunk_size must be a power of two from 16 to 4096"):
        chunk_out(x, chunk_size=bad)


def test_the_largest_chunk_size_runs():
    x = make_inputs(1, 1, 20, 8, 8)
    out = chunk_out(x, chunk_size=MAX_CHUNK)
    assert torch.equal(out, chunk_out(x, chunk_size=32))  # one chunk either way


def test_partial_initial_state_and_wrong_shapes_are_named():
    x = make_inputs(1, 2, 20, 8, 8)
    c, n, m = _states(1, 2, 8, 8)
    with pytest.raises(ValueError, match="partial state"):
        chunk_out(x, chunk_size=16, initial_state=(c, n, None))
    with pytest.raises(RuntimeError, match="initial_state n must have shape"):
        chunk_out(x, chunk_size=16, initial_state=(c, n[..., :4], m))
    with pytest.raises(RuntimeError, match="initial_state m must be torch.float64"):
        chunk_out(x, chunk_size=16, initial_state=(c, n, m.float()))


def test_log_forget_restarts_every_chunk():
    f = torch.randn(2, 3, 50, dtype=torch.float64)
    for backend in ("reference", "triton"):
        with compileops.use_backend(backend):
            got = log_forget_op(f, 16)
        terms = torch.nn.functional.logsigmoid(f)
        want = torch.cat([torch.cumsum(terms[..., s:s + 16], -1) for s in range(0, 50, 16)], -1)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def _state_walk_inputs(seed=0, b=1, nh=2, s=70, dqk=16, dv=48, chunk=16):
    """fp32 inputs of the two state walks (the restarted forget sums, the per-row terms)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    q, k, v, dh = rand(b, nh, s, dqk), rand(b, nh, s, dqk), rand(b, nh, s, dv), rand(b, nh, s, dv)
    igate, logf = rand(b, nh, s), log_forget_op(rand(b, nh, s) + 3.0, chunk)
    r, beta = rand(b, nh, s).abs(), rand(b, nh, s)
    return q, k, v, dh, igate, logf, r, beta


@pytest.mark.parametrize("config", [
    dict(block_v=16, sub=16), dict(block_v=32, sub=16, num_stages=2),
    dict(block_v=64, sub=16, num_warps=2), dict(block_v=16, sub=64)], ids=str)
def test_every_state_walk_config_computes_the_same_states(config):
    """The walks' tiles change only how the work is cut (a wider ``sub`` is capped at the
    chunk): every config's states and state gradients agree with the default's, and its
    value tiles cover DV = 48 (not a multiple of 32 or 64) exactly once."""
    from compileops.mlstm.kernels import StateConfig, chunkwise as walks

    chunk = 16
    q, k, v, dh, igate, logf, r, beta = _state_walk_inputs(chunk=chunk)
    m_log2 = logf * 1.4426950408889634
    cfg = StateConfig(**config)
    want = walks.chunk_states(k, v, igate, logf, chunk)
    got = walks.chunk_states(k, v, igate, logf, chunk, config=cfg)
    for name, g, w in zip(("C", "n", "m", "C_last"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    grads = [walks.chunk_state_grads(q, dh, logf, m_log2, r, beta, want[2], chunk, config=c)
             for c in (None, cfg)]
    for name, g, w in zip(("dC", "dn", "dC0"), grads[1], grads[0]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_walk_value_tiles_do_not_change_a_bit(dtype, fixed_order_dots):
    """The walks' value tile is the one tile that follows the batch size (the rule keeps 64
    programs): each value column's state is computed alike in any tile, so batch invariance
    holds bitwise across it. Interpreter here, with dots in a fixed order (the CPU's BLAS
    sums 16 columns in another order than 64); the GPU test below on the real kernels."""
    from compileops.mlstm.kernels import StateConfig, chunkwise as walks

    chunk = 16
    q, k, v, dh, igate, logf, r, beta = _state_walk_inputs(chunk=chunk, dv=64)
    q, k, v, dh = (t.to(dtype) for t in (q, k, v, dh))
    runs = []
    for block_v in (16, 32, 64):
        cfg = StateConfig(block_v=block_v, sub=16)
        states = walks.chunk_states(k, v, igate, logf, chunk, config=cfg)
        grads = walks.chunk_state_grads(q, dh, logf, logf * 1.4426950408889634, r, beta,
                                        states[2], chunk, config=cfg)
        runs.append([*states, *grads[:3]])
    for other in runs[1:]:
        for name, a, b in zip(("C", "n", "m", "C_last", "dC", "dn", "dC0"), runs[0], other):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_chunkwise_batch_invariant_across_the_walks_value_tiles():
    """bf16 at TFLA's head dims: a batch of 1 (16 rows: 64-column walk tiles) and of 32 (512
    rows: 128-column tiles) give the first sample's output and gradients bitwise alike."""
    big = make_inputs(32, 16, 256, 128, 256, dtype=torch.bfloat16, device="cuda", seed=5)
    one = big.map(lambda t: t[:1].clone() if t.dim() >= 3 else t)
    grad = cotangent(out_shape(big), torch.bfloat16, device="cuda")
    out_big, grads_big = fw_bw(chunk_out, big, grad, chunk_size=128)
    out_one, grads_one = fw_bw(chunk_out, one, grad[:1], chunk_size=128)
    assert torch.equal(out_big[:1], out_one)
    for name, a, b in zip(big.names(), grads_big, grads_one):
        if a.dim() >= 3:
            assert torch.equal(a[:1], b), f"d{name}"


def test_state_walk_config_rule_is_pinned():
    """The state walks' tiles per head, batch and dtype, as swept on the GPU (config.py): a
    change here is a change of the chunkwise form's speed, to be re-measured."""
    from compileops.mlstm.kernels import StateConfig, choose_state_config

    def rule(dtype, chunk, dqk, dv, backward, b=64, nh=16, device="meta"):
        q = torch.empty(b, nh, 0, dqk, dtype=dtype, device=device)  # meta: the GPU's rule
        return choose_state_config(q, chunk, dqk, dv, backward=backward)

    bf16 = torch.bfloat16
    # TFLA's head (NH 16, DQK 128, DV 256), B * S = 65,536.
    assert rule(bf16, 128, 128, 256, False) == StateConfig(128, 64, 4, 1)
    assert rule(bf16, 128, 128, 256, True) == StateConfig(128, 128, 4, 2)
    assert rule(bf16, 128, 128, 256, True, b=8) == StateConfig(128, 128, 4, 2)
    assert rule(bf16, 256, 128, 256, True) == StateConfig(128, 128, 4, 2)
    assert rule(bf16, 64, 128, 256, True) == StateConfig(128, 64, 4, 1)
    assert rule(torch.float16, 128, 64, 64, True, b=8) == StateConfig(64, 128, 4, 2)
    assert rule(bf16, 16, 64, 64, False) == StateConfig(64, 16, 4, 1)
    # Few rows: narrower value tiles, so that the walk still has 64 programs.
    assert rule(bf16, 128, 128, 256, False, b=1) == StateConfig(64, 64, 4, 1)
    assert rule(bf16, 128, 128, 256, False, b=1, nh=1) == StateConfig(16, 64, 4, 1)
    # xLSTM-7B's head (NH 8, DQK 256, a 256-column value slice).
    assert rule(bf16, 128, 256, 256, False, b=8, nh=8) == StateConfig(128, 128, 8, 1)
    assert rule(bf16, 128, 256, 256, True, b=8, nh=8) == StateConfig(128, 128, 8, 2)
    assert rule(bf16, 64, 256, 256, True, b=8, nh=8) == StateConfig(128, 64, 8, 1)
    assert rule(bf16, 128, 256, 256, False, b=1, nh=8) == StateConfig(32, 128, 8, 1)
    # fp32 and fp64 keep the narrow tiles; the interpreter small ones.
    assert rule(torch.float32, 128, 128, 256, True) == StateConfig(64, 32, 4, 1)
    assert rule(torch.float64, 128, 128, 256, False) == StateConfig(64, 16, 4, 1)
    assert rule(bf16, 128, 128, 256, True, device="cpu") == StateConfig(32, 64, 1, 1)


@pytest.mark.parametrize("bad", [dict(block_v=48), dict(sub=8), dict(sub=0)], ids=str)
def test_state_config_refuses_tiles_that_are_not_powers_of_two(bad):
    from compileops.mlstm.kernels import StateConfig

    with pytest.raises(ValueError, match="power of two"):
        StateConfig(**bad)


def test_compiled_dynamic_no_recompile_over_four_lengths():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def fn(x):
        return chunk_out(x, chunk_size=16)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with compileops.use_backend("triton"):
        for seq in (20, 33, 47, 64):
            x = make_inputs(1, 2, seq, 8, 8, dtype=torch.float32, seed=seq)
            torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("chunk", [16, 64, 128, 256, 512])
def test_gpu_fp64_contract_at_every_chunk_size(chunk):
    """TFLA's backward is wrong above chunk 128; ours is held to the contract at each."""
    x = make_inputs(1, 2, 700, 64, 128, device="cuda", seed=chunk)
    _contract(x, "triton", chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("shape", [(2, 4, 1000, 128, 256), (1, 2, 4096, 64, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_bf16_precision(shape, chunk):
    x = make_inputs(*shape, device="cuda", seed=1)
    rounded = x.map(lambda t: t.to(torch.bfloat16).double())
    grad = cotangent(out_shape(x), torch.bfloat16, device="cuda")
    want_out, want = fw_bw(reference_out, rounded, grad.double())
    got_out, got = fw_bw(chunk_out, rounded.map(lambda t: t.to(torch.bfloat16)), grad,
                         chunk_size=chunk)
    assert_close_to_reference(got_out, want_out, max_relative_error=OUT_TOL[torch.bfloat16],
                              what="bf16 out")
    for name, g, w in zip(x.names(), got, want):
        assert_close_to_reference(g, w, max_relative_error=CHUNKWISE_BF16_GRAD_TOL,
                                  what=f"bf16 d{name}")


@pytest.mark.gpu
@pytest.mark.slow  # about 110 s on an H200 (kernel builds for two head shapes)
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_deterministic_and_split_bitwise():
    x = make_inputs(2, 4, 1024, 128, 256, dtype=torch.bfloat16, device="cuda", seed=3)
    grad = cotangent(out_shape(x), torch.bfloat16, device="cuda")
    first = fw_bw(chunk_out, x, grad, chunk_size=128)
    again = fw_bw(chunk_out, x, grad, chunk_size=128)
    assert torch.equal(first[0], again[0]), "forward not deterministic"
    for name, a, b in zip(x.names(), first[1], again[1]):
        assert torch.equal(a, b), f"d{name} not deterministic"
    xf = make_inputs(2, 4, 1024, 128, 256, dtype=torch.float32, device="cuda", seed=3)
    whole, last = chunk_out(xf, chunk_size=128, return_last_state=True)
    head = xf.map(lambda t: t[..., :512, :] if t.dim() == 4 else (t[..., :512] if t.dim() == 3 else t))
    tail = xf.map(lambda t: t[..., 512:, :] if t.dim() == 4 else (t[..., 512:] if t.dim() == 3 else t))
    a, state = chunk_out(head, chunk_size=128, return_last_state=True)
    b, last2 = chunk_out(tail, chunk_size=128, initial_state=state, return_last_state=True)
    joined = torch.cat([a, b], 1)
    assert torch.equal(joined, whole), f"split differs by {(joined - whole).abs().max()}"
    for name, p, q in zip("Cnm", last2, last):
        assert torch.equal(p, q), f"last {name} differs by {(p - q).abs().max()}"


# ------------------------------------------------------------------ packed documents


def _packed(lengths, seed=0, dtype=torch.float64, device="cpu"):
    x = make_inputs(1, 2, sum(lengths), 16, 24, dtype=dtype, seed=seed, device=device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    return x, cu


def _doc(x, start, end):
    def cut(t):
        if t.dim() == 4:
            return t[..., start:end, :]
        return t[..., start:end] if t.dim() == 3 else t
    return x.map(cut)


def _same(got, want, backend, what):
    """Bitwise on the kernels. The reference backend's elementwise CPU ops (exp, sigmoid)
    round an element by where it falls in the row (vector body or scalar tail): a few ulps."""
    if backend == "triton":
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, atol=1e-15, rtol=1e-13, msg=what)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_documents_equal_each_document_alone(backend):
    """fp64 forward and every gradient: the packed row against each document run alone
    (each document runs on its own chunks)."""
    lengths = [5, 40, 1, 23, 18]
    x, cu = _packed(lengths)
    gen = torch.Generator().manual_seed(9)
    g_out = torch.randn(out_shape(x), generator=gen, dtype=torch.float64)
    with compileops.use_backend(backend):
        out, grads = fw_bw(lambda a: compileops.mlstm(
            a.q, a.k, a.v, a.igate, a.fgate, norm_weight=a.norm_weight, norm_bias=a.norm_bias,
            kernel="chunkwise", chunk_size=16, cu_seqlens=cu), x, g_out)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            doc = _doc(x, start, end)
            want_out, want = fw_bw(lambda a: compileops.mlstm(
                a.q, a.k, a.v, a.igate, a.fgate, norm_weight=a.norm_weight,
                norm_bias=a.norm_bias, kernel="chunkwise", chunk_size=16), doc,
                g_out[:, start:end])
            _same(out[:, start:end], want_out, backend, f"doc {start}:{end} out")
            for name, g, w in zip(x.names()[:5], grads[:5], want[:5]):
                cut = g[..., start:end, :] if g.dim() == 4 else g[..., start:end]
                _same(cut, w, backend, f"doc {start}:{end} d{name}")


def test_packed_documents_refuse_the_parallel_form():
    x, cu = _packed([4, 4])
    with pytest.raises(ValueError, match="cu_seqlens.*chunkwise form.*kernel='chunkwise'"):
        compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, kernel="parallel", cu_seqlens=cu)


def _packed_normed(x, cu):
    return compileops.mlstm(x.q, x.k, x.v, x.igate, x.fgate, norm_weight=x.norm_weight,
                            chunk_size=16, cu_seqlens=cu)


def test_packed_compiles_once_for_every_packing():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = _packed_normed

    # Same token count, any packing: new document lengths change values only; a new
    # document count changes cu_seqlens' length, symbolic under dynamic=True.
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with compileops.use_backend("triton"):
        for lengths in ([10, 22], [3, 3, 26], [1, 30, 1], [16, 16], [2, 5, 9, 16]):
            x, cu = _packed(lengths, dtype=torch.float32)
            torch.testing.assert_close(compiled(x, cu), fn(x, cu), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_trains_compiled_with_dynamic_shapes(backend):
    """Packed documents under torch.compile(dynamic=True) with a gradient (Dynamo failed to
    trace the layout's autograd function then: a float fill became a symbolic input): the
    outputs and every gradient are the eager ones, over packings of other document counts
    and one compile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = _packed_normed
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with compileops.use_backend(backend):
        for lengths in ([10, 22], [3, 3, 26], [2, 5, 9, 16]):
            x, cu = _packed(lengths, dtype=torch.float32)
            grads = []
            for run in (compiled, fn):
                leaves = x.leaves()
                out = run(leaves, cu)
                out.backward(torch.ones_like(out))
                grads.append([out.detach()] + [t.grad for t in (
                    leaves.q, leaves.k, leaves.v, leaves.igate, leaves.fgate,
                    leaves.norm_weight)])
            for got, want in zip(*grads):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_packed_bad_input_is_named():
    x, cu = _packed([4, 4])
    with pytest.raises(ValueError, match="cu_seqlens must be int32 or int64"):
        chunk_out(x, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="B must be 1"):
        y = x.map(lambda t: torch.cat([t, t]) if t.dim() > 1 else t)
        chunk_out(y, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens takes no initial_state"):
        chunk_out(x, cu_seqlens=cu, return_last_state=True)


@pytest.mark.gpu
@pytest.mark.slow  # about 110 s on an H200 (kernel builds for two head shapes)
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_prompt_then_steps_equal_the_whole_sequence(dtype):
    """Generation: a chunkwise prompt with its last state, then compileops.mlstm_step one
    token at a time, against one call on the whole sequence (normed, xLSTM-7B head dims)."""
    x = make_inputs(2, 4, 300, 128, 256, dtype=dtype, device="cuda", seed=8)
    whole = chunk_out(x, chunk_size=64)
    prompt = x.map(lambda t: t[..., :256, :] if t.dim() == 4 else (
        t[..., :256] if t.dim() == 3 else t))
    out, state = chunk_out(prompt, chunk_size=64, return_last_state=True)
    steps = [out]
    for t in range(256, 300):
        o, state = compileops.mlstm_step(
            x.q[:, :, t], x.k[:, :, t], x.v[:, :, t], x.igate[..., t], x.fgate[..., t], state,
            norm_weight=x.norm_weight, norm_bias=x.norm_bias)
        steps.append(o[:, None])
    got = torch.cat(steps, dim=1)
    assert_close_to_reference(got, whole.double(),
                              max_relative_error=1e-5 if dtype == torch.float32 else 2e-2,
                              what=f"{dtype} prompt + steps")
