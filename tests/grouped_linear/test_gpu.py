"""GPU tests (skipped without CUDA): real shapes, all dtypes, CUDA graph capture, compiled
template, the routing's device-side order check (in a subprocess: an assert poisons the
context)."""
import subprocess
import sys
import textwrap

import pytest
import torch

import compileops
from compileops.grouped_linear import reference
from compileops.grouped_linear.routing import dirichlet_offsets
from compileops.testing import assert_batch_invariant, assert_close_to_reference, assert_deterministic

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def nan_filled(t):
    """A new floating tensor filled with NaN (other dtypes, e.g. TMA scratch, as they come)."""
    return t.fill_(float("nan")) if t.is_floating_point() else t


def make(groups, m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = dirichlet_offsets(groups, m - 7, generator=gen)  # 7 tail rows past the last group
    offs[0] = 0  # an empty group
    offs = offs.cuda()
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    w = (torch.randn(groups, n, k, generator=gen) / k**0.5).to("cuda", dtype)
    b = torch.randn(groups, n, generator=gen).to("cuda", dtype)
    return x, w, offs, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_real_shape_fw_bw(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored after
    x, w, offs, b = make(16, 4096, 1024, 768, dtype)
    for t in (x, w, b):
        t.requires_grad_()
    y = compileops.grouped_linear(x, w, offs, b)
    grad = torch.randn_like(y)
    y.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = reference.grouped_linear_forward(leaves[0], leaves[1], offs, leaves[2])
    ref.backward(grad.double())
    tol = TOL[dtype]
    assert_close_to_reference(y, ref, max_relative_error=tol)
    for got, exp in zip((x.grad, w.grad, b.grad), leaves):
        assert_close_to_reference(got, exp.grad, max_relative_error=tol)
    assert torch.equal(w.grad[0], torch.zeros_like(w.grad[0]))
    tail = int(offs[-1])
    assert torch.equal(y[tail:], torch.zeros_like(y[tail:]))


def test_cuda_graph_capture_fw_bw():
    """Capture forward + backward once, refill every input in place (new values and new group
    sizes: the offsets are read on the device), replay, and compare with eager on the new
    inputs. Same kernels and configs, no atomics: bitwise equal."""
    x, w, offs, b = make(8, 2048, 512, 256, torch.bfloat16)
    w.requires_grad_(), b.requires_grad_()
    x.requires_grad_()

    def step():
        y = compileops.grouped_linear_swiglu(x, w, offs, b)
        y.float().sum().backward()
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm up (compiles kernels)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    x.grad = w.grad = b.grad = None
    with torch.cuda.graph(graph):
        y = step()

    x2, w2, offs2, b2 = make(8, 2048, 512, 256, torch.bfloat16, seed=1)
    assert not torch.equal(offs2, offs)
    with torch.no_grad():
        for dst, src in ((x, x2), (w, w2), (offs, offs2), (b, b2)):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()

    leaves = [t.detach().clone().requires_grad_() for t in (x2, w2, b2)]
    y_ref = compileops.grouped_linear_swiglu(leaves[0], leaves[1], offs2, leaves[2])
    y_ref.float().sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for name, got, leaf in (("dx", x.grad, leaves[0]), ("dw", w.grad, leaves[1]),
                            ("db", b.grad, leaves[2])):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_deterministic_and_batch_invariant():
    x, w, offs, b = make(8, 1024, 256, 256, torch.bfloat16)
    assert_deterministic(compileops.grouped_linear,
                         [x.requires_grad_(), w.requires_grad_(), offs, b.requires_grad_()], runs=5)
    w1, b1 = w[:1].detach(), b[:1].detach()

    def fn(xs):
        return compileops.grouped_linear(xs, w1, torch.tensor([xs.shape[0]], dtype=torch.int32,
                                                              device="cuda"), b1)

    from compileops.grouped_linear import batch_invariant

    with batch_invariant():
        assert_batch_invariant(fn, [x[:300].detach()])


def test_batch_invariant_mode_reaches_the_backward_thread(monkeypatch):
    """On CUDA the backward runs on autograd's device thread, which does not see the
    ``with compileops.batch_invariant():`` of the forward's thread: dX still runs in the mode."""
    from compileops.grouped_linear import kernels

    seen = []
    real = kernels.grouped_linear_dx

    def spy(*args, **kwargs):
        seen.append(kwargs.get("batch_invariant", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "grouped_linear_dx", spy)
    x, w, offs, b = make(8, 1024, 256, 256, torch.bfloat16)
    x.requires_grad_()
    with compileops.batch_invariant():
        compileops.grouped_linear(x, w, offs, b).float().sum().backward()
    assert seen == [True]


def test_compiled_template_fused_epilogue():
    x, w, offs, b = make(8, 2048, 512, 512, torch.bfloat16)
    p = torch.rand(2048, device="cuda")

    def f(x, w, offs, b, p):
        return compileops.grouped_linear_swiglu(x, w, offs, b) * p[:, None]

    from compileops.lowerings import _compat

    with _compat.fresh_inductor_cache():
        out, code = _compat.run_and_get_code(torch.compile(f, fullgraph=True), x, w, offs, b, p)
    assert "triton_tem_fused_grouped_linear_swiglu_mul" in "\n".join(code)
    ref = reference.swiglu(reference.grouped_linear_forward(x.double(), w.double(), offs,
                                                            b.double())) * p.double()[:, None]
    assert_close_to_reference(out, ref, max_relative_error=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_row_scaled_op_is_the_written_out_product_bitwise(dtype):
    """The row-scaled forward, eager kernel and compiled template (static and dynamic): the
    bits of ``grouped_linear(...) * scale`` written out (both roundings to nearest)."""
    from compileops.grouped_linear.op import grouped_linear_row_scaled_op

    x, w, offs, _ = make(8, 2048, 512, 1024, dtype)
    scale = torch.rand(2048, device="cuda").to(dtype)
    want = compileops.grouped_linear(x, w, offs) * scale[:, None]
    assert torch.equal(grouped_linear_row_scaled_op(x, w, offs, scale), want)
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(grouped_linear_row_scaled_op, fullgraph=True, dynamic=dynamic)
        assert torch.equal(compiled(x, w, offs, scale), want), dynamic


def test_explicit_config_that_does_not_fit_raises_and_keeps_tma_on():
    """A tuning sweep passes configs that may not fit in shared memory: such a launch must
    raise (not be timed as the pointer kernel) and must not turn TMA off for the default
    launches that follow on the device."""
    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels.mjagged import mjagged_gemm
    from compileops.grouped_linear.kernels.tma import clear_fallbacks

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90+")
    clear_fallbacks()
    x, w, offs, _ = make(4, 1024, 512, 512, torch.bfloat16)
    too_big = kernels.Config(256, 256, 128, num_warps=8, num_stages=6)  # ~1.5 MB of stages
    with pytest.raises(Exception, match="(?i)resource|shared memory"):
        mjagged_gemm(x, w, (w.stride(0), w.stride(2), w.stride(1)), offs, 512,
                     out_dtype=torch.bfloat16, config=too_big, use_tma=True)
    assert not kernels.fell_back(kernels.Fallback.TMA, x.device)
    assert not kernels.fell_back(kernels.Fallback.MJAGGED_TMA_STORE, x.device)
    grad = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="(?i)resource|shared memory"):
        kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16, config=too_big,
                                     use_tma=True)
    assert not kernels.fell_back(kernels.Fallback.TMA, x.device)


def test_default_config_that_does_not_fit_runs_with_fewer_stages(monkeypatch, caplog):
    """A default config whose stages need more shared memory than the GPU gives a block (a
    rule that miscounted; here forced) launches with fewer stages: the same bits as the
    same tile with stages that fit, one warning, and TMA stays on for the device."""
    import logging

    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels import kjagged, mjagged
    from compileops.grouped_linear.kernels.stages import clear_fitted_stages
    from compileops.grouped_linear.kernels.tma import clear_fallbacks

    clear_fallbacks()
    clear_fitted_stages()
    x, w, offs, _ = make(4, 1024, 512, 512, torch.bfloat16)
    grad = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    too_deep = kernels.Config(128, 256, 64, num_warps=8, num_stages=8)  # 384 KB of stages
    fitting = kernels.Config(128, 256, 64, num_warps=8, num_stages=2)
    strides = (w.stride(0), w.stride(2), w.stride(1))
    want_y = mjagged.mjagged_gemm(x, w, strides, offs, 512, out_dtype=torch.bfloat16,
                                  config=fitting)
    want_dw, _ = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                              config=fitting, with_db=False)
    monkeypatch.setattr(mjagged, "choose_config", lambda *a, **k: too_deep)
    monkeypatch.setattr(kjagged, "choose_wgrad_config", lambda *a, **k: too_deep)
    with caplog.at_level(logging.WARNING, logger="compileops"):
        for _ in range(2):
            y = mjagged.mjagged_gemm(x, w, strides, offs, 512, out_dtype=torch.bfloat16)
            dw, _ = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                                 with_db=False)
            assert torch.equal(y, want_y) and torch.equal(dw, want_dw)
    warned = [r.getMessage() for r in caplog.records if "stages" in r.getMessage()]
    assert len(warned) == 2, warned  # once per kernel: the fit is remembered
    assert not kernels.fell_back(kernels.Fallback.TMA, x.device)
    clear_fitted_stages()


def test_tma_path_used_on_sm90_and_matches_pointer_path():
    from compileops.grouped_linear import kernels

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90+")
    x, w, offs, b = make(16, 4096, 1024, 768, torch.bfloat16)
    cfg = kernels.choose_config(4096, 16, 768, 1024, torch.bfloat16, x.device)
    assert kernels.tma_applies(x, w, cfg)
    tma = kernels.grouped_linear_forward(x, w, offs, b, use_tma=True)
    ptr = kernels.grouped_linear_forward(x, w, offs, b, use_tma=False)
    assert not kernels.fell_back(kernels.Fallback.TMA, x.device)
    assert_close_to_reference(tma.float(), ptr.double(), max_relative_error=1e-2)
    grad = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    assert_close_to_reference(kernels.grouped_linear_dx(grad, w, offs, use_tma=True).float(),
                              kernels.grouped_linear_dx(grad, w, offs, use_tma=False).double(),
                              max_relative_error=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_groups_give_zero_rows(dtype):
    # No groups: every row is past the last group. A TMA descriptor over the empty weight
    # [0, N, K] stopped the kernel with an illegal instruction, which lost the CUDA context
    # (the GPU property fuzzing: M = 2, K = N = 76, fp32).
    x = torch.randn(2, 76, device="cuda", dtype=dtype)
    w = torch.empty(0, 76, 76, device="cuda", dtype=dtype)
    offs = torch.empty(0, device="cuda", dtype=torch.int32)
    grad = torch.randn(2, 76, device="cuda", dtype=dtype)
    compiled = torch.compile(lambda a, b, o: compileops.grouped_linear(a, b, o), fullgraph=True)
    for out in (compileops.grouped_linear(x, w, offs), compiled(x, w, offs),
                torch.ops.compileops.grouped_linear_dx(grad, w, offs)):
        torch.cuda.synchronize()
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("operand", ["x", "weight", "grad"])
def test_expanded_operands(operand):
    # Stride 0 along the rows or groups (expand; the gradient of a sum over rows has it).
    x, w, offs, _ = make(4, 512, 256, 128, torch.bfloat16)
    grad = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    if operand == "x":
        x = x[:1].expand_as(x)
    elif operand == "weight":
        w = w[:1].expand_as(w)
    else:
        grad = grad[:1].expand_as(grad)
    out = compileops.grouped_linear(x, w, offs)
    dx = torch.ops.compileops.grouped_linear_dx(grad, w, offs)
    dw, _ = torch.ops.compileops.grouped_linear_wgrad(grad, x, offs, w.dtype, w.dtype, False)
    torch.cuda.synchronize()
    want = reference.grouped_linear_forward(x.double(), w.double(), offs, None)
    assert_close_to_reference(out, want, max_relative_error=1e-2)
    assert_close_to_reference(dx, reference.grouped_linear_dx(grad.double(), w.double(), offs),
                              max_relative_error=1e-2, what="dx")
    want_dw, _ = reference.grouped_linear_wgrad(grad.double(), x.double(), offs, torch.float64,
                                                torch.float64, False)
    assert_close_to_reference(dw, want_dw, max_relative_error=1e-2, what="dw")


@pytest.mark.parametrize("product", ["fwd", "dx", "swiglu"])
def test_mjagged_tma_store_bitwise_matches_pointer_store_on_sm90(product):
    """The sweep's M-jagged TMA-store configs give the bits of the same tiles with pointer
    stores (ragged descriptor: no row of the next group or of the zero tail overwritten, even
    with several programs in flight), on group sizes that are not multiples of the tile."""
    import dataclasses

    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels.tma import mjagged_tma_store
    from tests.grouped_linear._helpers import mjagged_store_configs

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA stores need sm90+")
    x, w, offs, b = make(16, 4096, 1024, 768, torch.bfloat16)
    grad = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16)
    if product == "dx":
        args = (grad, w, (w.stride(0), w.stride(1), w.stride(2)), offs, 1024)
        kw = dict(out_dtype=grad.dtype, b_kn=True)
    else:
        args = (x, w, (w.stride(0), w.stride(2), w.stride(1)), offs,
                384 if product == "swiglu" else 768)
        kw = dict(bias=b, out_dtype=x.dtype, swiglu=product == "swiglu")
    tail = int(offs[-1])
    for cfg in mjagged_store_configs(product):
        got = kernels.mjagged_gemm(*args, config=cfg, **kw)  # explicit config: raises on failure
        assert mjagged_tma_store(got, cfg, True), cfg
        want = kernels.mjagged_gemm(*args, config=dataclasses.replace(cfg, tma_store=False), **kw)
        assert not kernels.fell_back(kernels.Fallback.TMA, x.device)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), cfg
        assert torch.equal(got[tail:], torch.zeros_like(got[tail:])), cfg


@pytest.mark.parametrize("variant", [
    dict(ragged_tma=True), dict(tma_store=True), dict(tma_store=True, epilogue_subtile=True),
    dict(ragged_tma=True, tma_store=True),
    dict(ragged_tma=True, tma_store=True, epilogue_subtile=True),
    dict(dynamic_tiles=True), dict(ragged_tma=True, tma_store=True, group_n=8, dynamic_tiles=True),
    dict(ragged_tma=True, tma_store=True, epilogue_subtile=True, group_n=8, dynamic_tiles=True),
], ids=["ragged", "tma-store", "tma-store-halves", "ragged-tma-store", "ragged-tma-store-halves",
        "dynamic", "ragged-tma-store-gn8-dynamic", "ragged-tma-store-halves-gn8-dynamic"])
def test_wgrad_variants_bitwise_match_default_on_sm90(variant):
    """The dW variants (Config flags) give the plain config's exact bits on the GPU too
    (same chunk order and MMA shapes; zero-filled rows = masked rows; the dynamic schedule
    computes each tile once, with the same code, whichever program claims it). Launched
    three times: the ticket counter must start at 0 in every launch."""
    import dataclasses

    from compileops.grouped_linear import kernels

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA variants need sm90+")
    x, _, offs, _ = make(16, 4096, 1024, 768, torch.bfloat16)
    grad = torch.randn(x.shape[0], 768, device="cuda", dtype=torch.bfloat16)
    base = kernels.Config(64, 128, 256, num_warps=8, num_stages=3)
    want = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16, config=base)
    cfg = dataclasses.replace(base, **variant)
    for _ in range(3):
        got = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                           config=cfg)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("groups,n", [(4, 768), (12, 768), (4, 704), (200, 768)],
                         ids=["long", "mid", "long-n%128!=0", "many-empty-groups"])
def test_wgrad_flat_loop_without_db_bitwise_matches_tile_loop(groups, n, monkeypatch):
    """Without db the long and mid defaults run the flattened chunk loop (Config.flatten):
    on sm90 it gives the tile loop's dW bits (skewed groups, empty ones among 200 with 8192
    rows; N = 704 takes the pointer store), every element written (dW starts as NaN)."""
    import dataclasses

    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels.kjagged import wgrad_variant_flags

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the flattened loop needs the ragged TMA loads (sm90+)")
    x, _, offs, _ = make(groups, 8192, 1024, n, torch.bfloat16)
    grad = torch.randn(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    cfg = kernels.choose_wgrad_config(8192, min(groups, 12), n, 1024, torch.bfloat16, x.device)
    dw = torch.empty(groups, n, 1024, dtype=torch.bfloat16, device="cuda")
    assert wgrad_variant_flags(cfg, True, x.shape[0], n, 1024, dw, False)["FLATTEN"]
    want, _ = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                           config=dataclasses.replace(cfg, flatten=False),
                                           with_db=False)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan_filled(empty(*a, **kw)))
    got, db = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                           config=cfg, with_db=False)
    monkeypatch.undo()
    assert db is None and not kernels.fell_back(kernels.Fallback.WGRAD_VARIANTS, x.device)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("groups,n", [(4, 768), (12, 768), (32, 768), (4, 704)],
                         ids=["long", "mid", "short", "long-n%128!=0"])
def test_wgrad_default_config_bitwise_matches_its_plain_form(groups, n):
    """choose_wgrad_config's defaults (ragged TMA, + TMA store for long groups) run without
    falling back and give the bits of the same tiles without the variant flags; N = 704
    (not a multiple of 128) takes the pointer store."""
    import dataclasses

    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels.kjagged import is_wgrad_variant

    x, _, offs, _ = make(groups, 8192, 1024, n, torch.bfloat16)
    grad = torch.randn(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    cfg = kernels.choose_wgrad_config(8192, groups, n, 1024, torch.bfloat16, x.device)
    assert is_wgrad_variant(cfg) and cfg.tma_store == (groups < 32)
    got = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16)
    assert not kernels.fell_back(kernels.Fallback.WGRAD_VARIANTS, x.device)
    assert not kernels.fell_back(kernels.Fallback.TMA, x.device)
    plain = dataclasses.replace(cfg, ragged_tma=False, tma_store=False, epilogue_subtile=False)
    want = kernels.grouped_linear_wgrad(grad, x, offs, torch.bfloat16, torch.bfloat16,
                                        config=plain)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    ref = reference.grouped_linear_wgrad(grad.double(), x.double(), offs, torch.float64,
                                         torch.float64)
    for a, b in zip(got, ref):
        assert_close_to_reference(a, b, max_relative_error=1e-2)


@pytest.mark.parametrize("groups", [8, 17, 32, 128])
def test_compiled_dynamic_matches_eager_at_many_groups(groups):
    """dynamic=True at MoE sizes: the compiled template equals the eager kernel bitwise (same
    config). With the group count symbolic, the H100 build once gave wrong rows for every
    group >= 16; the lowering keeps G static."""
    x, w, offs, _ = make(groups, 8192, 768, 512, torch.bfloat16)
    eager = compileops.grouped_linear(x, w, offs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, o: compileops.grouped_linear(a, b, o), fullgraph=True,
                             dynamic=True)
    assert torch.equal(compiled(x, w, offs), eager)
    # and the SwiGLU training op with the dX template in its backward
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def swiglu_fw_bw(a, b, o):
        out = compileops.grouped_linear_swiglu(a, b, o)
        return (out, *torch.autograd.grad(out.float().square().sum(), [a, b]))

    expected = swiglu_fw_bw(xg, wg, offs)
    torch._dynamo.reset()
    got = torch.compile(swiglu_fw_bw, dynamic=True)(xg, wg, offs)
    for g, e, what in zip(got, expected, ("out", "dX", "dW")):
        assert_close_to_reference(g, e.double(), max_relative_error=TOL[torch.bfloat16], what=what)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_moe_layer_backward_is_bitwise_deterministic_at_real_width(compiled):
    # Top-8 of 64 experts over 4096 tokens: each token's 8 copies meet again in the input
    # gradient. Summed by autograd's index_add (atomics) that sum changed from run to run;
    # the routing backwards are gathers now (test_routing_determinism.py on CPU).
    from tests.grouped_linear.test_training import MoE

    layer = MoE(dim=1024, hidden=512, experts=64, top_k=8).to("cuda", torch.bfloat16)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16,
                    generator=torch.Generator(device="cuda").manual_seed(0))
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    assert_deterministic(fn, [x.requires_grad_()], runs=5)


# ---------------------------------------------------------------------------------------
# unpermute_and_combine: an order that is not a permutation, without a host sync


@pytest.mark.parametrize("as_permutation", [False, True], ids=["sorted", "scattered"])
def test_valid_order_combines_without_a_host_sync(as_permutation):
    # The permutation check runs on the device: a sync here would break CUDA graph capture.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen).cuda().requires_grad_()
    ids = torch.randint(0, 8, (64, 4), generator=gen).cuda()
    probs = torch.rand(64, 4, generator=gen).cuda()
    xs, order, _ = compileops.grouped_linear.permute_by_expert(x, ids, 8)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compileops.grouped_linear.unpermute_and_combine(
            xs * 2, order, probs, order_is_permutation=as_permutation)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, 2 * x.detach() * probs.sum(1, keepdim=True))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("as_permutation", [False, True], ids=["sorted", "scattered"])
@pytest.mark.parametrize("bad", ["8", "-1", "duplicate"])
def test_bad_order_trips_the_device_side_assert(bad, as_permutation, compiled):
    code = textwrap.dedent(
        f"""
        import torch, compileops
        from compileops.grouped_linear import unpermute_and_combine
        def combine(y, order, w):
            return unpermute_and_combine(y, order, w, order_is_permutation={as_permutation})
        if {compiled}:
            combine = torch.compile(combine, fullgraph=True)
        order = torch.tensor([3, 0, 5, 1, 2, 4, 7, 6], device="cuda")
        order[5] = {'order[0]' if bad == 'duplicate' else bad}
        out = combine(torch.randn(8, 16, device="cuda"), order, torch.rand(4, 2, device="cuda"))
        torch.cuda.synchronize()
        print("NO ERROR", out.isfinite().all().item())
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0, result.stdout
    assert "NO ERROR" not in result.stdout
    assert "device-side assert" in result.stderr or "not a permutation" in result.stderr, (
        result.stderr[-2000:])
    assert "illegal memory access" not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("bad, error", [(8, IndexError), (-1, IndexError), (0, ValueError)])
def test_strict_checks_name_the_bad_order_entry_on_gpu(bad, error):
    order = torch.tensor([3, 0, 5, 1, 2, 4, 7, 6], device="cuda")
    order[5] = bad
    y, w = torch.randn(8, 16, device="cuda"), torch.rand(4, 2, device="cuda")
    for as_permutation in (False, True):
        with compileops.strict_offset_checks(), pytest.raises(error, match="order"):
            compileops.grouped_linear.unpermute_and_combine(
                y, order, w, order_is_permutation=as_permutation)
