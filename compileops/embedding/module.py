"""``compileops.nn.Embedding``: a drop-in for ``torch.nn.Embedding`` backed by compileops ops."""
from __future__ import annotations

from typing import Optional

import torch

from compileops.embedding.op import embedding


# The torch.nn.Embedding options compileops refuses: max_norm would make the lookup
# renormalise (mutate) the table rows it reads, scale_grad_by_freq and sparse would change the
# gradient's values or layout; each breaks the ops' functional, deterministic contract.
UNSUPPORTED_OPTIONS = ("max_norm", "scale_grad_by_freq", "sparse")


def _uses(name: str, value) -> bool:
    """Whether option ``name`` set to ``value`` asks for something compileops refuses (read as
    torch.nn.functional.embedding reads it: any max_norm but None, a true flag)."""
    if name not in UNSUPPORTED_OPTIONS:
        return False
    return value is not None if name == "max_norm" else bool(value)


def _refuse_unsupported(options: dict) -> None:
    bad = [name for name, value in options.items() if _uses(name, value)]
    if bad:
        raise NotImplementedError(
            f"compileops.nn.Embedding does not support {', '.join(bad)}; use torch.nn.Embedding "
            "for those options")


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` with the compileops forward and deterministic backward.

    Same constructor, parameters and state dict as ``torch.nn.Embedding`` (it is a
    subclass, so ``from_pretrained`` and checkpoints carry over). Extra: ``out_dtype`` upcasts
    the gathered rows (e.g. bf16 table, fp32 activations) without copying the table.

    Input ids ``[*]`` int32/int64 -> output ``[*, embedding_dim]``.

    Options read on every forward, as torch.nn.Embedding does, so they may be changed after
    construction: ``padding_idx`` (negative counts from the end) and ``out_dtype``.
    ``norm_type`` only matters with ``max_norm``. ``max_norm``, ``scale_grad_by_freq`` and
    ``sparse`` are refused with ``NotImplementedError``, at construction and when set later.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[torch.Tensor] = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
        *,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        _refuse_unsupported({"max_norm": max_norm, "scale_grad_by_freq": scale_grad_by_freq,
                             "sparse": sparse})
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, _weight, _freeze, device, dtype,
        )
        self.out_dtype = out_dtype

    def __setattr__(self, name: str, value) -> None:
        # torch.nn.Embedding reads these on every forward, so setting one after construction
        # must not be silently ignored here.
        _refuse_unsupported({name: value})
        super().__setattr__(name, value)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [*]`` (int32 or int64, in ``[0, num_embeddings)``) -> ``[*, embedding_dim]``
        rows of the weight, in ``out_dtype`` when it was given (only the gathered rows are
        converted), else in the weight's dtype.

        The forward is bitwise equal to indexing the weight. The backward sums each row's
        gradients in token order in fp32 (fp64 when the output, and so its gradient, is fp64:
        an fp64 table read with ``out_dtype=torch.float32`` sums its fp32 gradients in fp32),
        then casts to the weight's dtype: deterministic and bitwise batch-invariant, with
        ``padding_idx``'s row getting none. An id out of range raises ``IndexError`` on CPU;
        on a GPU it trips a device-side assert (:func:`compileops.strict_index_checks`
        checks on the host first, at a sync, and names the id).
        """
        # Also refuse options written past __setattr__ (through __dict__, say).
        _refuse_unsupported({name: getattr(self, name) for name in UNSUPPORTED_OPTIONS})
        return embedding(ids, self.weight, out_dtype=self.out_dtype, padding_idx=self.padding_idx)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s + (f", out_dtype={self.out_dtype}" if self.out_dtype is not None else "")
