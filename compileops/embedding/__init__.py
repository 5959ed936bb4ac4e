"""Embedding lookup: a lossless row gather with a deterministic, batch-invariant backward."""
from compileops.embedding.op import embedding, set_strict_index_checks, strict_index_checks

__all__ = ["embedding", "set_strict_index_checks", "strict_index_checks"]
