"""tests/integrations/hf_model_tests: the pytest plugin that switches compileops on in
transformers' own model tests, and the runner's comparison of the two runs. (The runs
themselves need a transformers source checkout: opt-in, see run.py.)"""
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.7")

import compileops  # noqa: E402
import compileops.integrations.transformers as cit  # noqa: E402
from compileops.integrations import xlstm as cx  # noqa: E402
from compileops.integrations._forward import bound_function  # noqa: E402
from tests.integrations.hf_model_tests import compileops_hf_plugin as plugin  # noqa: E402
from tests.integrations.hf_model_tests import run  # noqa: E402


def _tiny_models():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, xLSTMConfig, xLSTMForCausalLM

    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2))
    xlstm = xLSTMForCausalLM(xLSTMConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1,
                                         num_heads=2))
    return moe, xlstm


def test_plugin_switches_compileops_on_in_every_model_built_and_off_again():
    plugin.install()
    try:
        moe, xlstm = _tiny_models()
    finally:
        plugin.uninstall()
    assert moe.config._experts_implementation == cit.BACKEND
    assert bound_function(moe.model.layers[0].mlp.experts) is cit.experts_forward
    assert isinstance(moe.get_input_embeddings(), compileops.nn.Embedding)
    assert bound_function(xlstm.backbone.blocks[0].mlstm_layer) is cx.layer_forward
    assert bound_function(xlstm.backbone) is cx.model_forward
    moe, xlstm = _tiny_models()  # uninstalled: transformers' own models again
    assert bound_function(moe.model.layers[0].mlp.experts) is None
    assert type(xlstm.get_input_embeddings()) is torch.nn.Embedding


def test_runner_counts_and_lists_the_tests_that_differ(tmp_path):
    def case(name, inner=""):
        return (f'<testcase classname="tests.models.xlstm.test_modeling_xlstm.xLSTMModelTest" '
                f'name="{name}">{inner}</testcase>')

    skipped = '<skipped message="no GPU">x</skipped>'
    plain = tmp_path / "plain.xml"
    plain.write_text("<testsuites><testsuite>" + case("test_a") + case("test_b")
                     + case("test_c", skipped) + "</testsuite></testsuites>")
    ours = tmp_path / "compileops.xml"
    # test_b as a test with subtests reports it: its own entry, then one per failed subtest
    ours.write_text("<testsuites><testsuite>" + case("test_a") + case("test_b")
                    + case("test_b", '<failure message="AssertionError: 3 != 2">tb</failure>')
                    + case("test_c", skipped) + "</testsuite></testsuites>")
    text = run.summary({"plain": run.outcomes(plain), "compileops": run.outcomes(ours)})
    assert "| xlstm | plain | 2 | 0 | 0 | 1 |" in text
    assert "| xlstm | compileops | 1 | 1 | 0 | 1 |" in text
    assert "Tests whose outcome differs: 1" in text
    assert ("`tests.models.xlstm.test_modeling_xlstm.xLSTMModelTest::test_b`: passed plain, "
            "failed with compileops: AssertionError: 3 != 2") in text
