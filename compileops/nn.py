"""Every compileops ``nn.Module``, one import away: ``compileops.nn.Embedding``, ..."""
from compileops.embedding.module import Embedding
from compileops.grouped_linear.module import GroupedLinear
from compileops.mlstm.module import MultiHeadLayerNorm, mLSTMLayer, mLSTMLayerConfig
from compileops.xtoken.module import SparseProjection

__all__ = ["Embedding", "GroupedLinear", "MultiHeadLayerNorm", "SparseProjection", "mLSTMLayer",
           "mLSTMLayerConfig"]
