"""Every compileops ``nn.Module``, one import away: ``compileops.nn.Embedding``, ..."""
from compileops.embedding.module import Embedding

__all__ = ["Embedding"]
