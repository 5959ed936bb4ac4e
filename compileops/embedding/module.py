"""``compileops.nn.Embedding``: a drop-in for ``torch.nn.Embedding`` backed by compileops ops."""
from __future__ import annotations

from typing import Optional

import torch

from compileops.embedding.op import embedding


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` with the compileops forward and deterministic backward.

    Same constructor, parameters and state dict as ``torch.nn.Embedding`` (it is a
    subclass, so ``from_pretrained`` and checkpoints carry over). Extra: ``out_dtype`` upcasts
    the gathered rows (e.g. bf16 table, fp32 activations) without copying the table.

    Input ids ``[*]`` int32/int64 -> output ``[*, embedding_dim]``.
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
        # Each of these would make the op mutate the table or change the gradient's layout,
        # which breaks the functional, deterministic contract; refuse instead of ignoring.
        unsupported = {
            "max_norm": max_norm is not None,
            "scale_grad_by_freq": scale_grad_by_freq,
            "sparse": sparse,
        }
        bad = [name for name, used in unsupported.items() if used]
        if bad:
            raise NotImplementedError(
                f"compileops.nn.Embedding does not support {', '.join(bad)}; "
                "use torch.nn.Embedding for those options"
            )
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, _weight, _freeze, device, dtype,
        )
        self.out_dtype = out_dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, out_dtype=self.out_dtype, padding_idx=self.padding_idx)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s + (f", out_dtype={self.out_dtype}" if self.out_dtype is not None else "")
