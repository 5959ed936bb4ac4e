"""grouped_linear under torch.compile: no graph breaks or recompiles, the Triton template (run
under the interpreter on CPU) with its fused epilogues, the lowering's config choice
(max-autotune, batch-invariant mode). Graph/kernel snapshots: test_snapshots.py."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import compileops
from compileops.grouped_linear import reference
from compileops.grouped_linear.kernels import Config
from compileops.testing import assert_close_to_reference
from compileops.lowerings import _compat
from tests.grouped_linear._helpers import make_expert_inputs as make
from tests.grouped_linear._helpers import moe_expert


def ref_moe_expert(x, w, offs, b, p):
    h = reference.grouped_linear_forward(x.double(), w.double(), offs, b.double())
    return reference.swiglu(h) * p.double()[:, None]


def _compiled_fw_bw(fn, args, grad):
    """Compile ``fn`` (fullgraph), run forward and backward; returns (output, generated code)."""
    compiled = torch.compile(fn, fullgraph=True)

    def fw_bw():
        out = compiled(*args)
        out.backward(grad)
        return out

    return _compat.run_and_get_code(fw_bw)


def _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p):
    """Output and the grads of x, w, b (already backpropagated) against fp64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = ref_moe_expert(leaves[0], leaves[1], offs, leaves[2], p)
    ref.backward(grad.double())
    assert_close_to_reference(out, ref, max_relative_error=1e-5)
    for got, exp, what in zip((x.grad, w.grad, b.grad), leaves, ("dX", "dW", "db")):
        assert_close_to_reference(got, exp.grad, max_relative_error=1e-5, what=what)


def test_fullgraph_dynamic_no_recompiles_fw_bw():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    def f(x, w, offs, b):
        return F.gelu(compileops.grouped_linear(x, w, offs, b)).sum()

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for sizes in ([3, 0, 5], [7, 2, 9], [1, 1, 20]):
        x, w, offs, b, _ = make(sizes)
        w.requires_grad_()
        compiled(x, w, offs, b).backward()
        wr = w.detach().double().requires_grad_()
        F.gelu(reference.grouped_linear_forward(x.double(), wr, offs, b.double())).sum().backward()
        assert_close_to_reference(w.grad, wr.grad, max_relative_error=1e-5)
    assert counter.frame_count == 1


def test_template_runs_under_interpreter_with_fused_epilogue():
    x, w, offs, b, p = make([5, 0, 11, 3])
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(moe_expert, fullgraph=True)
        out, sources = _compat.run_and_get_code(compiled, x, w, offs, b, p)
    code = "\n".join(sources)
    assert "from compileops.grouped_linear.kernels.mjagged import mjagged_tile" in code
    assert "torch.ops.compileops.grouped_linear_swiglu.default(" not in code, "must be lowered"
    assert "def triton_tem_fused_grouped_linear_swiglu_mul" in code
    assert_close_to_reference(out, ref_moe_expert(x, w, offs, b, p), max_relative_error=1e-5)


def test_compiled_fw_bw_on_triton_templates_matches_fp64():
    x, w, offs, b, p = make([5, 0, 11, 3])
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 12)
    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        out, sources = _compiled_fw_bw(moe_expert, (x, w, offs, b, p), grad)
    assert "def triton_tem_fused_grouped_linear_dx" in "\n".join(sources)
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)


def test_template_strided_offsets_fw_bw():
    """Offsets sliced out of a larger tensor inside the compiled graph (stride 2): the template
    reads offsets[g] at OFFS + g, so the lowering must hand it a dense copy."""
    x, w, offs, b, p = make([5, 0, 11, 3])
    interleaved = torch.stack([offs, torch.full_like(offs, 10**6)], 1).reshape(-1)
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 12)

    def strided_expert(x, w, interleaved, b, p):
        return moe_expert(x, w, interleaved[::2], b, p)

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        out, sources = _compiled_fw_bw(strided_expert, (x, w, interleaved, b, p), grad)
    assert "def triton_tem_fused_grouped_linear_swiglu" in "\n".join(sources)
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)


def test_template_dynamic_token_counts_bf16():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")

    def f(x, w, offs, b):
        return compileops.grouped_linear(x, w, offs, b).float() * 2

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
        for sizes in ([3, 0, 5], [9, 4, 0]):
            x, w, offs, b, _ = make(sizes)
            x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
            out = compiled(x, w, offs, b)
            ref = reference.grouped_linear_forward(x.double(), w.double(), offs, b.double()) * 2
            assert_close_to_reference(out, ref, max_relative_error=1e-2)
    assert counter.frame_count == 1


def test_gelu_and_bias_epilogue_codegen():
    x, w, offs, b, _ = make([4, 4])

    def f(x, w, offs, b):
        return F.gelu(compileops.grouped_linear(x, w, offs, b)).to(torch.float16)

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu():
        # GELU's erf goes through libdevice, which the interpreter lacks: compile only.
        sources = _compat.get_code(torch.compile(f, fullgraph=True), x, w, offs, b)
    code = "\n".join(sources)
    assert "def triton_tem_fused__to_copy_gelu_grouped_linear" in code
    assert "triton_poi" not in code, "GELU and the cast must fuse into the template"


def test_autotune_offsets_are_skewed_and_valid():
    from compileops.lowerings.grouped_linear import AUTOTUNE_CONFIGS, skewed_offsets

    offs = skewed_offsets(16, 4096, "cpu")
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert offs.dtype == torch.int32 and int(offs[-1]) == 4096 and bool((sizes >= 0).all())
    assert int(sizes.max()) > 2 * 4096 // 16, "Dirichlet(1) sizes should be skewed"
    assert len(AUTOTUNE_CONFIGS) <= 8


def test_grouped_mm_anchor_choice_zeroes_the_tail():
    from compileops.lowerings.grouped_linear import grouped_mm_anchor, grouped_mm_dx_anchor

    x, w, offs, _, _ = make([3, 0, 6], extra_rows=4)
    x, w = x.bfloat16(), w.bfloat16()
    y = grouped_mm_anchor(x, w, offs)
    assert torch.equal(y[9:], torch.zeros_like(y[9:]))
    ref = reference.grouped_linear_forward(x.double(), w.double(), offs)
    assert_close_to_reference(y.float(), ref, max_relative_error=1e-2)
    dy = torch.randn(13, 24).bfloat16()
    dx = grouped_mm_dx_anchor(dy, w, offs)
    assert_close_to_reference(dx.float(), reference.grouped_linear_dx(dy.double(), w.double(), offs),
                              max_relative_error=1e-2)


@contextlib.contextmanager
def _max_autotune_over(configs):
    """``mode="max-autotune"`` forced on CPU (Inductor's Triton codegen, a fresh cache) with
    the lowering's configs replaced by ``configs`` (``[(Config, tma), ...]``); yields the list
    of calls that generated skewed offsets for the benchmarks."""
    from unittest import mock

    import compileops.lowerings.grouped_linear as lowering

    calls = []
    real_gen = lowering.skewed_offsets

    def gen(*args, **kwargs):
        calls.append(args)
        return real_gen(*args, **kwargs)

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.inductor_config_patch(max_autotune=True), \
            mock.patch.object(lowering, "_configs", lambda *args, **kwargs: (configs, True)), \
            mock.patch.object(lowering, "skewed_offsets", gen):
        yield calls


def test_max_autotune_path_benchmarks_choices_on_skewed_offsets():
    """The max-autotune branch (GPU-only by default) forced on CPU with two tiny template
    configs (one through TMA descriptors) + the extern op: benchmarks run on generated skewed
    offsets, result is right."""
    x, w, offs, b, _ = make([5, 0, 11, 14], extra_rows=10)

    def f(x, w, offs, b):
        return compileops.grouped_linear(x, w, offs, b) * 2

    two_configs = [(Config(16, 32, 16, 1, 1), False),
                   (Config(16, 16, 16, 1, 1, flatten=True), True)]
    with _max_autotune_over(two_configs) as calls:
        out = torch.compile(f, fullgraph=True)(x, w, offs, b)
    assert calls, "autotuning must benchmark on generated (skewed) offsets"
    ref = 2 * reference.grouped_linear_forward(x.double(), w.double(), offs, b.double())
    assert_close_to_reference(out, ref, max_relative_error=1e-5)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept-preact", "recompute"])
def test_template_tma_variant_fw_bw_under_interpreter(recompute):
    """The template's TMA-descriptor variant (a max-autotune choice on sm90) forced as the only
    config: the SwiGLU forward (storing its pre-activations by default), the recomputed
    forward (recompute=True) and dX in the backward, all through it."""
    from unittest import mock

    import compileops.lowerings.grouped_linear as lowering

    x, w, offs, b, p = make([5, 0, 11, 3], k=24, n=40)
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 20)

    def tma_only(*args, **kwargs):
        return [(Config(16, 16, 16, 1, 1), True)], False

    def expert(x, w, offs, b, p):
        return compileops.grouped_linear_swiglu(x, w, offs, b, recompute=recompute) * p[:, None]

    with _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            mock.patch.object(lowering, "_configs", tma_only):
        out, sources = _compiled_fw_bw(expert, (x, w, offs, b, p), grad)
    code = "\n".join(sources)
    templates = 3 if recompute else 2
    assert code.count("make_descriptors(") >= templates, "forward, (recompute,) dX use TMA"
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)


def test_batch_invariant_collapses_max_autotune_configs(monkeypatch):
    """Under max-autotune the lowering benchmarks several tile configs; batch-invariant mode
    must collapse that list to the single fixed config (host-only check)."""
    from compileops.grouped_linear import kernels
    from compileops.grouped_linear import batch_invariant, is_batch_invariant
    import compileops.lowerings.grouped_linear as lowering

    monkeypatch.setattr(lowering._compat, "max_autotune_enabled", lambda: True)
    cuda = kernels.H100_SXM  # a GPU's description: no GPU needed
    configs, autotune = lowering._configs(4096, 8, 256, 512, torch.bfloat16, cuda, tma=True)
    assert autotune and len(configs) > 1  # autotuning is really on outside the mode
    bi = kernels.BATCH_INVARIANT_CONFIG
    expected = [(bi, False)]
    with batch_invariant():
        for m in (1, 64, 4096, 65536):
            configs, autotune = lowering._configs(m, 8, 256, 512, torch.bfloat16, cuda, tma=True)
            assert configs == expected and not autotune, (m, configs)
    assert not is_batch_invariant()


def _offered_choices(fn, args, spec, *, max_autotune: bool):
    """The lowering's choices for each grouped-linear call of ``fn(*args)`` planned for
    ``spec`` (Triton code generation on CPU; no benchmarking: the selection is intercepted),
    as ``{op name: [choice names]}``, with the recorded decisions."""
    from unittest import mock

    import compileops.lowerings.grouped_linear as lowering

    torch._dynamo.reset()
    offered = {}
    real_select = _compat.autotune_select_algorithm

    def select(name, choices, input_nodes, layout, **kwargs):
        offered.setdefault(name, []).append([c.name for c in choices])
        return real_select(name, choices[:1], input_nodes, layout, **kwargs)

    with lowering.plan_for(spec), lowering.record_decisions() as decisions, \
            _compat.fresh_inductor_cache(), _compat.triton_codegen_on_cpu(), \
            _compat.inductor_config_patch(max_autotune=max_autotune), \
            _compat.lower_only(), mock.patch.object(lowering._compat,
                                                    "autotune_select_algorithm", select):
        try:
            torch.compile(fn, fullgraph=True)(*args)
        except _compat.LoweredOnly:
            pass
    return offered, decisions


def _moe_expert_bf16(recompute=False):
    x, w, offs, _, p = make([96, 0, 160, 64], k=64, n=128)
    w2 = torch.randn(4, 64, 64) / 8
    x, w, w2 = (t.bfloat16().requires_grad_() for t in (x, w, w2))

    def expert(x, w, w2, offs, p):
        h = compileops.grouped_linear_swiglu(x, w, offs, recompute=recompute)
        return compileops.grouped_linear(h, w2, offs, row_scale=p)

    return expert, (x, w, w2, offs, p)


def test_max_autotune_offers_the_bounded_config_list():
    """Under max-autotune, planned for an H100: every grouped-linear call (the SwiGLU
    training op, the row-scaled down projection, both dX in the backward) is offered
    several template configs (pointer and TMA loads, the heuristic pick first), that fit
    the part's shared memory; the ops with an eager extern form offer it too. In default
    mode each is offered the one heuristic config."""
    from compileops.grouped_linear import kernels
    from compileops.grouped_linear.kernels import config as config_mod
    import compileops.lowerings.grouped_linear as lowering

    fn, args = _moe_expert_bf16()
    spec = kernels.H100_SXM
    offered, decisions = _offered_choices(fn, args, spec, max_autotune=True)
    ops = [d.op for d in decisions]
    assert ops == ["grouped_linear_swiglu_with_preact", "grouped_linear_row_scaled",
                   "grouped_linear_dx", "grouped_linear_dx"], ops
    for d in decisions:
        names = offered[f"compileops_{d.op}"].pop(0)
        assert d.autotune and len(d.configs) >= 6, d
        assert len(names) == len(d.configs) + d.extern, (d.op, names)
        assert {tma for _, tma in d.configs} == {True, False}, d
        tiles = [cfg for cfg, _ in d.configs]
        swiglu = d.op.startswith("grouped_linear_swiglu")
        assert tiles[0] == kernels.choose_config(d.m, d.groups, d.n, d.k, torch.bfloat16, spec,
                                                 swiglu=swiglu), d
        for cfg in tiles:
            stages = config_mod.operand_stage_bytes(cfg, 2, swiglu=swiglu) * cfg.num_stages
            assert stages <= spec.smem_per_block - config_mod.EPILOGUE_SMEM_RESERVE, cfg
        # The eager op is an extern choice, except for the op with a second output.
        assert d.extern == (0 if swiglu else 1), d
        assert any(n.startswith("compileops_") and "eager" in n for n in names) == (not swiglu)
    assert len(lowering.AUTOTUNE_CONFIGS) <= 8 and len(lowering.AUTOTUNE_SWIGLU_CONFIGS) <= 8

    offered, decisions = _offered_choices(fn, args, spec, max_autotune=False)
    assert [len(d.configs) for d in decisions] == [1, 1, 1, 1], decisions
    assert all(len(v) == 1 for names in offered.values() for v in names), offered


def test_max_autotune_of_the_swiglu_training_op_runs():
    """The SwiGLU op that also writes its pre-activations, autotuned over two template
    configs (tiny tiles, interpreter) with its extra output as a mutated input: benchmarked
    on skewed offsets, and the chosen kernel writes both outputs."""
    x, w, offs, b, p = make([5, 0, 11, 3])
    for t in (x, w, b):
        t.requires_grad_()
    grad = torch.randn(21, 12)
    two_configs = [(Config(16, 32, 16, 1, 1), False), (Config(16, 16, 16, 1, 1), False)]
    with _max_autotune_over(two_configs) as calls:
        out, _ = _compiled_fw_bw(moe_expert, (x, w, offs, b, p), grad)
    assert calls, "autotuning must benchmark on generated (skewed) offsets"
    _assert_fw_bw_match_fp64(out, grad, x, w, offs, b, p)
