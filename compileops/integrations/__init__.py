"""Integrations of compileops with other libraries, each in its own module, imported on demand.

* :mod:`compileops.integrations.transformers`: Hugging Face transformers (the ``[hf]`` extra):
  an experts backend ``"compileops"`` for ``from_pretrained(..., experts_implementation=...)``
  and :func:`compileops.integrations.transformers.apply` for models that do not route their
  experts through transformers' experts interface.
* ``integrations/torchtitan.py``: torchtitan (the ``[titan]`` extra): a model converter
  (``CompileopsMoEConverter``) and ``apply()`` that run its MoE experts on compileops grouped
  GEMMs, keeping its parallelisms (imports torchtitan).

Nothing here is imported by ``import compileops``: this package imports no third-party library,
and each integration module imports its library only when it is imported itself.
"""
