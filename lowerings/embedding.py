"""Inductor lowering of ``compileops::embedding`` into pointwise IR.

The gather becomes an ``ir.Pointwise`` whose loader reads ``weight[ids[i], d]`` through
indirect indexing, so producers of ``ids`` and pointwise consumers of the rows (scale, cast,
add) fuse into the same kernel: one C++ loop on CPU, one Triton kernel on GPU. Bounds are
checked in the kernel (``TORCH_CHECK`` / ``tl.device_assert``); negative ids are rejected,
not wrapped.

The backward op (``compileops::embedding_backward``) is deliberately not lowered: it stays an
extern call to our deterministic sort + ordered-sum kernel, so Inductor never substitutes its
own atomic scatter-add.
"""
from __future__ import annotations

import torch

from lowerings import _compat


def lower_embedding(ids, weight, out_dtype=None, padding_idx=None):
    """ids ``[*]`` int, weight ``[V, D]`` -> Pointwise ``[*, D]``; padding_idx is backward-only."""
    num_embeddings, dim = weight.get_size()
    n_id_dims = len(ids.get_size())
    weight_dtype = weight.get_dtype()
    dtype = out_dtype or weight_dtype
    load_id = ids.make_loader()
    load_weight = weight.make_loader()
    ops = _compat.ops()

    def gather(index):
        row = _compat.indirect_index(load_id(index[:n_id_dims]), num_embeddings)
        value = load_weight([row, index[n_id_dims]])
        if dtype != weight_dtype:
            value = ops.to_dtype(value, dtype)
        return value

    return _compat.pointwise(
        device=weight.get_device(),
        dtype=dtype,
        inner_fn=gather,
        ranges=[*ids.get_size(), dim],
    )


def register() -> None:
    import compileops.embedding.op  # noqa: F401  (the op must exist before it is lowered)

    _compat.register_lowering(torch.ops.compileops.embedding.default, lower_embedding)
