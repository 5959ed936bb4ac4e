"""compileops.integrations.transformers: the "compileops" experts backend and apply().

Tiny random-init models built here (no downloads), fp32 on CPU; the Triton kernels run under
the interpreter (tests/conftest.py). Tolerances: embedding-only patching is bitwise; the
experts backend is held to the grouped linear's fp32 contract (relative 1e-5), checked on the
logits and the gradients (relative 1e-5, absolute 1e-5 of the largest element; measured:
about 1e-7 on the logits).

Compile checks use the ``aot_eager`` backend with ``fullgraph=True`` on the whole model, forward
and backward: a graph break anywhere (the patched layers included) fails the compile, and the
compileops ops must be in the one graph. Inductor itself is not run here: compiling a whole
tiny HF model with Inductor on this CPU takes over a minute, and the grouped-linear lowerings
have their own tests (tests/grouped_linear/).
"""
import copy
import io
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import compileops.integrations.transformers as cit  # noqa: E402  (registers "compileops")

if not cit.has_experts_interface():
    pytest.skip(f"transformers {transformers.__version__} has no experts interface "
                f"(needs >= {cit.MIN_TRANSFORMERS})", allow_module_level=True)

import compileops  # noqa: E402
import torch._dynamo.testing  # noqa: E402
from compileops.integrations._forward import bound_function  # noqa: E402

RTOL = 1e-5


def _close(actual, expected, what=""):
    """fp32 contract of the grouped linear: relative 1e-5, against the tensor's largest element
    for the absolute part (sums with cancellation lose digits of their small elements)."""
    atol = RTOL * max(1.0, expected.abs().max().item()) if expected.numel() else RTOL
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                               msg=(lambda m: f"{what}: {m}") if what else None)


VOCAB = 96
IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------
# Tiny models


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
        tie_word_embeddings=True)
    return Qwen3MoeForCausalLM(cfg)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, sliding_window=None)
    return MixtralForCausalLM(cfg)


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    return DeepseekV3ForCausalLM(cfg)


MODELS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3}


def _build(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    # transformers initialises the router to zeros in some models: random routers, so the
    # tokens spread over the experts.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 1.0)
            if n.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
    return model.eval()


def _experts_modules(model):
    return [m for m in model.modules() if cit._is_interface_experts(m)]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------
# The experts backend


@pytest.mark.parametrize("name", list(MODELS))
def test_backend_matches_eager_forward_and_backward(name):
    model = _build(name)
    assert _experts_modules(model), "the model should route its experts through the interface"
    model.set_experts_implementation("eager")
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    model.set_experts_implementation("compileops")
    assert model.config._experts_implementation == "compileops"
    out = model(IDS, labels=IDS)
    _close(out.logits, ref.logits)
    out.loss.backward()
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        _close(grads[n], ref_grads[n], n)
    # the expert weights and the router got gradients through the compileops path
    assert any("experts.gate_up_proj" in n for n in grads)
    assert any(n.endswith(("gate.weight",)) for n in grads)


def _ops_on(params, run):
    """Run ``run()`` and return ``(ops, offenders)``: the ops that received one of ``params``
    (by storage), and those among them that are neither compileops ops nor views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    storages = {p.untyped_storage().data_ptr() for p in params}
    seen, bad = set(), []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages
                   for t in torch.utils._pytree.tree_leaves((args, kwargs))):
                name = str(func)
                seen.add(name)
                if not (name.startswith("compileops.") or func.is_view
                        or func is torch.ops.aten.detach.default):
                    bad.append(name)
            return func(*args, **kwargs)

    with Spy():
        run()
    return seen, bad


def test_backend_runs_the_compileops_ops_without_copying_weights():
    """Every op that touches an expert weight is a compileops op or a view (no copy)."""
    model = _build("qwen3_moe")
    model.set_experts_implementation("compileops")
    weights = [p for n, p in model.named_parameters() if ".experts." in n]
    seen, bad = _ops_on(weights, lambda: model(IDS, labels=IDS).loss.backward())
    assert not bad, f"ops that read expert weights outside compileops: {bad}"
    assert any(s.startswith("compileops.grouped_linear_swiglu") for s in seen), seen
    assert any(s.startswith("compileops.grouped_linear.") for s in seen), seen
    assert any(s.startswith("compileops.grouped_linear_dx") for s in seen), seen


def test_transposed_interleaved_biased_experts_through_a_view():
    """GPT-OSS experts: weights stored [E, D, 2H] (is_transposed), gate/up interleaved, biases,
    a clamped gate: served through transpose views of the parameters and the model's own
    _apply_gate, matching the eager loop, forward and backward."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                       num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = GptOssExperts(cfg)
    assert experts.is_transposed and experts.has_bias and not experts.is_concatenated
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(12, 32)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(12)])
    w = torch.softmax(torch.randn(12, 2), -1)
    results = {}
    for impl in ("eager", "compileops"):
        cfg._experts_implementation = impl
        experts.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()

        def run():
            out = experts(xi, ids, w)
            out.square().sum().backward()
            results[impl] = (out, xi.grad, {n: p.grad for n, p in experts.named_parameters()})

        if impl == "compileops":  # the [E, D, N] weights reach the ops as views, not copies
            seen, bad = _ops_on([experts.gate_up_proj, experts.down_proj], run)
            assert not bad, f"ops that read expert weights outside compileops: {bad}"
            assert "aten.transpose.int" in seen, seen
        else:
            run()
    (o0, gx0, g0), (o1, gx1, g1) = results["eager"], results["compileops"]
    _close(o1, o0)
    _close(gx1, gx0)
    for n in g0:
        _close(g1[n], g0[n], n)
        assert g1[n].shape == getattr(experts, n).shape


def _experts_module(name):
    """One experts module of each family transformers routes through the interface, hidden
    size 32, 4 experts, top-2, random weights."""
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    build = {
        "qwen3_moe": lambda: Qwen3MoeExperts(Qwen3MoeConfig(
            hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
        "mixtral": lambda: MixtralExperts(MixtralConfig(
            hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
        "deepseek_v3": lambda: DeepseekV3Experts(DeepseekV3Config(
            hidden_size=32, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2)),
        "gpt_oss": lambda: GptOssExperts(GptOssConfig(
            hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
    }
    torch.manual_seed(0)
    experts = build[name]()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    return experts


@pytest.mark.parametrize("compiled", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_zero_tokens_give_an_empty_output_forward_and_backward(name, compiled):
    """No tokens (hidden_states [0, D], an empty batch): an empty [0, D] output, an empty
    input gradient and zero weight gradients, as transformers' grouped_mm backend gives,
    eagerly and compiled (fullgraph)."""
    experts = _experts_module(name)
    results = {}
    for impl in ("grouped_mm", "compileops"):
        experts.config._experts_implementation = impl
        experts.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        run = experts if compiled == "eager" else torch.compile(
            experts, fullgraph=True, backend=compiled)
        x = torch.randn(0, 32, requires_grad=True)
        out = run(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
        out.sum().backward()
        results[impl] = out, x.grad, {n: p.grad for n, p in experts.named_parameters()}
    (want, want_dx, want_grads), (got, got_dx, got_grads) = results.values()
    assert got.shape == want.shape == (0, 32) and got.dtype == want.dtype
    assert got_dx.shape == want_dx.shape == (0, 32)
    for n, g in want_grads.items():
        assert got_grads[n] is not None and torch.equal(got_grads[n], g), n


def test_zero_tokens_under_inductor():
    """The same with Inductor (the grouped-linear lowerings) on Qwen3-MoE's experts."""
    experts = _experts_module("qwen3_moe")
    experts.config._experts_implementation = "compileops"
    x = torch.randn(0, 32, requires_grad=True)
    out = torch.compile(experts, fullgraph=True)(x, torch.zeros(0, 2, dtype=torch.long),
                                                 torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, 32) and x.grad.shape == (0, 32)
    for n, p in experts.named_parameters():
        assert torch.equal(p.grad, torch.zeros_like(p)), n


def test_backend_sorts_once_and_combines_as_unpermute_and_combine(monkeypatch):
    """One sort per experts call (the un-permutation is the sort's inverse, a scatter, not a
    second argsort), with the same bits as the argsort form, forward and backward."""
    from compileops.grouped_linear import routing

    def run():
        model = _build("qwen3_moe")
        model.set_experts_implementation("compileops")
        out = model(IDS, labels=IDS)
        out.loss.backward()
        return out.logits, _grads(model)

    logits, grads = run()
    monkeypatch.setattr(routing, "inverse_permutation", torch.argsort)
    ref_logits, ref_grads = run()
    monkeypatch.undo()
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n

    # The Dynamo graph of the whole model: one sort per MoE layer, no argsort.
    model = _build("qwen3_moe")
    model.set_experts_implementation("compileops")
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    torch.compile(model, fullgraph=True, backend=counter)(IDS, labels=IDS)
    targets = [n.target for g in counter.graphs for n in g.graph.nodes]
    sorts = [t for t in targets if getattr(t, "__name__", str(t)) in ("sort", "argsort")]
    layers = model.config.num_hidden_layers
    assert len(sorts) == layers, sorts


def test_whole_model_compiles_fullgraph_with_the_backend_and_embedding():
    """Qwen3-MoE with the experts backend and the compileops embedding: one graph (no graph
    break anywhere), forward and backward, holding the compileops ops; same loss as eager."""
    model = _build("qwen3_moe")
    model.set_experts_implementation("compileops")
    cit.apply(model, experts=False)
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    out = compiled(IDS, labels=IDS)
    out.loss.backward()
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    for op in ("compileops.embedding.default", "compileops.grouped_linear.default"):
        assert op in targets, sorted(t for t in targets if "compileops" in t)
    assert any(t.startswith("compileops.grouped_linear_swiglu") for t in targets)
    _close(out.logits, ref.logits)
    for n, g in _grads(model).items():
        _close(g, ref_grads[n], n)


def test_save_and_load_round_trip(tmp_path):
    model = _build("qwen3_moe")
    model.set_experts_implementation("compileops")
    cit.apply(model, experts=False)
    with torch.no_grad():
        logits = model(IDS).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "compileops" not in json.dumps(saved), "the backend must not leak into config.json"

    loaded = type(model).from_pretrained(tmp_path, experts_implementation="compileops").eval()
    assert loaded.config._experts_implementation == "compileops"
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight  # still tied
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, logits)
    # a plain load (no compileops) reads the same checkpoint
    plain = type(model).from_pretrained(tmp_path, experts_implementation="eager").eval()
    with torch.no_grad():
        _close(plain(IDS).logits, logits)


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_pickles_and_deepcopies_after_apply(name):
    """torch.save of the whole model after apply(), torch.load(weights_only=False), and
    copy.deepcopy: the copies keep the compileops forwards (their experts run the compileops
    ops), their classes and state-dict keys, and give the same logits."""
    model = _build(name)
    report = cit.apply(model)
    with torch.no_grad():
        want = model(IDS).logits
    for copied in (_pickled(model), copy.deepcopy(model)):
        assert list(copied.state_dict()) == list(model.state_dict())
        assert isinstance(copied.get_input_embeddings(), compileops.nn.Embedding)
        for where in report["experts"]:
            module = copied.get_submodule(where)
            assert type(module) is type(model.get_submodule(where))
            assert bound_function(module) is cit.experts_forward, where
        weights = [p for n, p in copied.named_parameters() if ".experts." in n]
        with torch.no_grad():
            seen, bad = _ops_on(weights, lambda: copied(IDS))
            assert torch.equal(copied(IDS).logits, want)
        assert not bad and any(s.startswith("compileops.grouped_linear") for s in seen), seen


def test_loaded_model_compiles_fullgraph():
    """The forwards apply() sets (and torch.load restores) trace with no graph break: one
    frame holding the compileops ops, forward and backward."""
    model = _build("qwen3_moe")
    cit.apply(model)
    model = _pickled(model)
    ref = model(IDS, labels=IDS)
    ref.loss.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    out = torch.compile(model, fullgraph=True, backend=counter)(IDS, labels=IDS)
    out.loss.backward()
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    assert "compileops.embedding.default" in targets
    assert any(t.startswith("compileops.grouped_linear") for t in targets), sorted(targets)
    _close(out.logits, ref.logits)
    for n, g in _grads(model).items():
        _close(g, ref_grads[n], n)


# ---------------------------------------------------------------------------------------
# apply()


def test_apply_embedding_only_is_bitwise_and_keeps_state_and_ties():
    model = _build("qwen3_moe")
    old = model.get_input_embeddings()
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = model(IDS).logits
    report = cit.apply(model, experts=False)
    new = model.get_input_embeddings()
    assert report == {"embedding": ["model.embed_tokens"], "experts": [], "xlstm": []}
    assert isinstance(new, compileops.nn.Embedding) and new is not old
    assert new.weight is old.weight  # the same Parameter
    assert model.lm_head.weight is new.weight  # tied weights untouched
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref)
    model(IDS, labels=IDS).loss.backward()
    assert new.weight.grad is not None
    assert cit.apply(model, experts=False) == {"embedding": [], "experts": [], "xlstm": []}  # idempotent


def test_apply_patches_interface_experts_by_type():
    model = _build("mixtral")
    model.set_experts_implementation("eager")
    with torch.no_grad():
        ref = model(IDS).logits
    report = cit.apply(model)
    assert report["embedding"] == ["model.embed_tokens"]
    assert report["experts"] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    # config still says eager: the modules' own forward now is the compileops one
    assert model.config._experts_implementation == "eager"
    with torch.no_grad():
        _close(model(IDS).logits, ref)


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
        max_position_embeddings=64, attention_chunk_size=64)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.normal_(0, 0.2)
    return model.eval()


def test_apply_serves_llama4_experts_outside_the_interface():
    """Llama-4 (text) keeps its own experts forward: apply() patches it by type, reading the
    [E, D, 2H] / [E, H, D] weights through transpose views; the backend name is refused."""
    model = _llama4()
    with torch.no_grad():
        ref = model(IDS).logits
    with pytest.raises(ValueError, match="does not route its experts through"):
        model.set_experts_implementation("compileops")
    report = cit.apply(model)
    assert len(report["experts"]) == 2 and report["embedding"] == ["model.embed_tokens"]
    with torch.no_grad():
        _close(model(IDS).logits, ref)
    model(IDS, labels=IDS).loss.backward()
    assert model.model.layers[0].feed_forward.experts.gate_up_proj.grad is not None


def _enable_checkpointing(model):
    # activation_checkpointing_enable is gradient_checkpointing_enable's newer name
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


# An embedding's inputs are integer ids: torch says its backward hook sees no input gradient.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_apply_moves_the_embedding_hooks_of_gradient_checkpointing():
    """Gradient checkpointing puts an input-require-grads hook on the embedding (so does
    PEFT): apply() moves it, and the other forward and backward hooks, to the new embedding,
    where transformers' own handles still remove it."""
    model = _build("qwen3_moe").train()
    _enable_checkpointing(model)
    old = model.get_input_embeddings()
    assert old._forward_hooks  # transformers' make_inputs_require_grads
    calls = []
    old.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    old.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append("backward"))
    assert cit.apply(model)["embedding"] == ["model.embed_tokens"]
    new = model.get_input_embeddings()
    assert isinstance(new, compileops.nn.Embedding)
    new(IDS).sum().backward()
    assert calls == ["pre", "backward"]
    new.weight.requires_grad_(False)  # frozen, as with adapters: the hook still makes the
    assert new(IDS).requires_grad  # output require grad
    model.disable_input_require_grads()
    assert not new._forward_hooks and not new(IDS).requires_grad


def test_apply_refuses_an_embedding_with_state_dict_hooks():
    model = _build("qwen3_moe")
    model.get_input_embeddings().register_state_dict_post_hook(lambda *args: None)
    with pytest.raises(NotImplementedError, match="state-dict hooks"):
        cit.apply(model)
    assert type(model.get_input_embeddings()) is torch.nn.Embedding  # nothing changed
    assert bound_function(model.model.layers[0].mlp.experts) is None


# ---------------------------------------------------------------------------------------
# Clear errors, never a silent fallback


def test_backend_refuses_expert_parallel_and_quantized_experts():
    model = _build("qwen3_moe")
    model.set_experts_implementation("compileops")
    experts = model.model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        model(IDS)
    experts._is_expert_parallel = False
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().to(torch.int8),
                                           requires_grad=False)
    with pytest.raises(NotImplementedError, match=r"down_proj is torch.int8"):
        model(IDS)
    with pytest.raises(NotImplementedError, match=r"model.layers.0.mlp.experts .*int8"):
        cit.apply(model)


def test_apply_refuses_per_expert_module_lists_before_changing_anything():
    """The transformers < 5 layout: experts as a ModuleList of per-expert MLPs."""

    class Expert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(8, 4, bias=False)
            self.up_proj = torch.nn.Linear(8, 4, bias=False)
            self.down_proj = torch.nn.Linear(4, 8, bias=False)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 8)
            self.experts = torch.nn.ModuleList([Expert() for _ in range(3)])

        def get_input_embeddings(self):
            return self.embed_tokens

    block = Block()
    with pytest.raises(NotImplementedError, match="ModuleList of per-expert modules"):
        cit.apply(block)
    assert type(block.embed_tokens) is torch.nn.Embedding  # nothing changed
    assert cit.apply(block, experts=False)["embedding"] == ["embed_tokens"]
    assert isinstance(block.embed_tokens, compileops.nn.Embedding)


def test_apply_refuses_a_non_plain_embedding():
    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = Scaled(10, 4)

        def get_input_embeddings(self):
            return self.emb

    with pytest.raises(NotImplementedError, match="not a plain torch.nn.Embedding"):
        cit.apply(M())


def test_import_compileops_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, compileops, compileops.integrations; "
            "print('transformers' in sys.modules)")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.strip() == "False", out.stderr
