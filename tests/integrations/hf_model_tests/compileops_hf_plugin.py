"""pytest plugin: transformers' own model tests with compileops switched on.

Loaded with ``-p compileops_hf_plugin`` (its folder on ``PYTHONPATH``; ``run.py`` beside it
does both) in a transformers source checkout. Every model the tests build, at the end of its
``PreTrainedModel.post_init`` (which every model's ``__init__`` calls, ``from_pretrained`` and
``_from_config`` included):

* a model whose experts go through transformers' experts interface is set to the
  ``"compileops"`` experts backend (``set_experts_implementation``);
* :func:`compileops.integrations.transformers.apply` patches it: the input embedding, every
  experts module, xLSTM's layers, norms and model forward.

A model ``apply()`` refuses fails its test with apply()'s message: a refusal is a result. The ops
run on the backend compileops picks for the tensors' device: the Triton kernels on a GPU; on a
CPU the reference backend (plain PyTorch), or the Triton kernels under Triton's interpreter when
``TRITON_INTERPRET=1`` is set (slow: minutes per xLSTM test on a small CPU).
"""
from __future__ import annotations

import functools

_original_post_init = None
_switched_on = {"models": 0}


def switch_on(model) -> None:
    """The experts backend where the model has interface experts, then ``apply()``."""
    import compileops.integrations.transformers as cit

    if cit.has_experts_interface() and type(model)._can_set_experts_implementation():
        model.set_experts_implementation(cit.BACKEND)
    cit.apply(model)
    _switched_on["models"] += 1


def install() -> None:
    """Wrap ``transformers.PreTrainedModel.post_init`` (idempotent)."""
    global _original_post_init
    import transformers

    if _original_post_init is not None:
        return
    cls = transformers.PreTrainedModel
    original = cls.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        switch_on(self)
        return result

    _original_post_init = original
    cls.post_init = post_init


def uninstall() -> None:
    global _original_post_init
    if _original_post_init is None:
        return
    import transformers

    transformers.PreTrainedModel.post_init = _original_post_init
    _original_post_init = None


def pytest_configure(config):
    install()


def pytest_unconfigure(config):
    uninstall()


def pytest_report_header(config):
    import compileops

    import torch

    from compileops import backends

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = next(b for b in backends.PRIORITY[backends.device_kind(device)]
                   if backends.available(b, device))
    return (f"compileops {compileops.__version__}: experts backend 'compileops' and "
            "compileops.integrations.transformers.apply() on every model built; "
            f"ops on the {backend!r} backend ({device})")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"compileops switched on in {_switched_on['models']} model constructions")
