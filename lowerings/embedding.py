"""Inductor lowering of ``compileops::embedding`` into pointwise IR.

The gather becomes an ``ir.Pointwise`` whose loader reads ``weight[ids[i], d]`` through
indirect indexing, so producers of ``ids`` and pointwise consumers of the rows (scale, cast,
add) fuse into the same kernel: one C++ loop on CPU, one Triton kernel on GPU. Bounds are
checked in the kernel (``TORCH_CHECK`` / ``tl.device_assert``); negative ids are rejected,
not wrapped.

With C++ code generation (CPU) the in-kernel check would be a ``TORCH_CHECK`` inside an
OpenMP parallel region, where a throw aborts the whole process. There the lowering instead asserts one scalar "all ids valid"
outside any loop (a Python ``RuntimeError``), and the gather clamps ids so it can never read
out of bounds even if it runs before the assert.

The backward op (``compileops::embedding_backward``) is deliberately not lowered: it stays an
extern call to our deterministic sort + ordered-sum kernel, so Inductor never substitutes its
own atomic scatter-add.

The Inductor behaviour this relies on (indirect indexing, its bounds checks, CPU code
generation) is in ``docs/inductor-notes.md``; how lowerings are installed, in
``docs/architecture.md``.
"""
from __future__ import annotations

import torch

from compileops import _log
from compileops.lowerings import _compat

logger = _log.get_logger("embedding")


def lower_embedding(ids, weight, out_dtype=None, padding_idx=None):
    """ids ``[*]`` int, weight ``[V, D]`` -> Pointwise ``[*, D]``; padding_idx is backward-only."""
    num_embeddings, dim = weight.get_size()
    n_id_dims = len(ids.get_size())
    weight_dtype = weight.get_dtype()
    dtype = out_dtype or weight_dtype
    load_id = ids.make_loader()
    load_weight = weight.make_loader()
    ops = _compat.ops()
    on_cpu = _compat.emits_cpp(weight.get_device())
    if on_cpu:
        _assert_ids_in_range(ids, num_embeddings)
    logger.info("embedding: pointwise gather for ids %s %s, weight %s %s -> %s: %s",
                _log.shape(ids.get_size()), _log.dtype(ids.get_dtype()),
                _log.shape(weight.get_size()), _log.dtype(weight_dtype), _log.dtype(dtype),
                "C++: ids checked by one assert outside the loop, the gather clamped"
                if on_cpu else "Triton: ids bounds-checked in the kernel")

    def gather(index):
        id_value = load_id(index[:n_id_dims])
        if on_cpu:
            in_range = ops.and_(
                ops.ge(id_value, ops.constant(0, ids.get_dtype())),
                ops.lt(id_value, ops.index_expr(num_embeddings, ids.get_dtype())),
            )
            id_value = ops.where(in_range, id_value, ops.constant(0, ids.get_dtype()))
        row = _compat.indirect_index(id_value, num_embeddings, check=not on_cpu)
        value = load_weight([row, index[n_id_dims]])
        if dtype != weight_dtype:
            if weight_dtype == torch.float64 and dtype in (torch.float16, torch.bfloat16):
                # torch's rounding, through fp32 (compileops.embedding.kernels.cast says why)
                value = ops.to_dtype(value, torch.float32)
            value = ops.to_dtype(value, dtype)
        return value

    return _compat.pointwise(
        device=weight.get_device(),
        dtype=dtype,
        inner_fn=gather,
        ranges=[*ids.get_size(), dim],
    )


def _assert_ids_in_range(ids, num_embeddings) -> None:
    aten = torch.ops.aten
    below = _compat.aten_lowering(aten.lt.Scalar)(ids, 0)
    above = _compat.aten_lowering(aten.ge.Scalar)(ids, num_embeddings)
    invalid = _compat.aten_lowering(aten.logical_or.default)(below, above)
    any_invalid = _compat.aten_lowering(aten.any.default)(invalid)
    all_valid = _compat.aten_lowering(aten.logical_not.default)(any_invalid)
    _compat.aten_lowering(aten._assert_async.msg)(
        all_valid, "compileops.embedding: an id in ids is out of range [0, num_embeddings)"
    )


def register() -> None:
    import compileops.embedding.op  # noqa: F401  (the op must exist before it is lowered)

    _compat.register_lowering(torch.ops.compileops.embedding.default, lower_embedding)
