"""Flax linen attention modules wrapping `fsjax.ops` (kernel dispatch joins with the kernel issue)."""

from fsjax.attention.dense import DenseAttention
from fsjax.attention.freesolo import ROUTING, FreeSoloAttention
from fsjax.attention.zha import ZHAAttention

__all__ = ["DenseAttention", "FreeSoloAttention", "ROUTING", "ZHAAttention"]
