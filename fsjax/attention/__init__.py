"""Flax linen attention modules over `fsjax.ops`, and each kind's attention over its decode cache
(`freesolo_step`, `cached`)."""

from fsjax.attention.dense import DenseAttention
from fsjax.attention.freesolo import ROUTING, FreeSoloAttention
from fsjax.attention.zha import ZHAAttention

__all__ = ["DenseAttention", "FreeSoloAttention", "ROUTING", "ZHAAttention"]
