"""What a family's self-check demo hands to ``python -m compileops`` (a leaf module).

Each family's ``selfcheck.py`` builds a :class:`Demo`; ``compileops/_selfcheck.py`` imports
those modules and runs them. This module imports nothing from compileops, so the dependency
only ever points down: report -> family demos -> this dataclass.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch


@dataclasses.dataclass
class Demo:
    family: str
    model: Callable[..., torch.Tensor]
    args: tuple
    reference: Callable[..., torch.Tensor]  # ground truth on the same args (fp32/fp64)
    ops: Sequence[str]  # op names in the compileops namespace, e.g. "embedding"
    max_relative_error: float
    resized_args: Callable[[int], tuple]  # args at another token count (recompile check)
