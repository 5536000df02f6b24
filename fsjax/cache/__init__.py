"""Decode caches: a positional KV store (dense cache, SWA ring), the FS archive, the FS-L bounded cache, the FS-B
forest cache and the ZHA tree cache.

`init_cache(config, batch, max_len)` builds one cache per layer, shaped for the model's attention kind.
"""

import math

import jax
import jax.numpy as jnp

from fsjax.cache.archive import Archive, empty_archive
from fsjax.cache.bounded import BoundedCache, empty_bounded
from fsjax.cache.forest import Forest, ForestCache, empty_forest_cache
from fsjax.cache.layered import layer_view, write_back
from fsjax.cache.store import KVStore, empty_store
from fsjax.cache.zha import ZHACache, empty_zha
from fsjax.config import ModelConfig


# The caches whose arrays grow with the sequence: a scanned model's layer reads and writes them in place.
IN_PLACE = (KVStore, Archive, Forest, ZHACache)


def layer_of(stacked, layer):
  """Layer `layer` (int32 scalar) of a scanned model's stacked cache: KV stores, archives, FS-B forests and ZHA
  caches as views into the stack (`fsjax.cache.layered`), every other array sliced out."""
  return layer_view(stacked, layer, IN_PLACE)


def cache_capacity(config: ModelConfig, max_len):
  """Slots per layer: `window + 1` for the SWA ring; otherwise max_len rounded up to whole cells/blocks."""
  att = config.attention
  if att.kind == "swa":
    return att.window + 1
  unit = math.lcm(att.cell, att.block, att.moba_block) if att.kind == "moba" else math.lcm(att.cell, att.block)
  return -(-max_len // unit) * unit


def init_cache(config: ModelConfig, batch, max_len, dtype=jnp.float32, bounded=True):
  """Empty per-layer caches `{"layer_i": KVStore | Archive | BoundedCache}` for up to `max_len` tokens, or
  `{"layers": ...}` with every array stacked `[num_layers, ...]` for a `scan_layers` model.

  FS-L gets the bounded cache (its size ignores `max_len`) and FS-B the streaming forest cache unless
  `bounded=False` asks for the plain archive (FS-B then rebuilds its forests at every step: the reference).
  """
  att = config.attention
  capacity = cache_capacity(config, max_len)
  shape = (batch, capacity, config.num_heads, config.head_dim)
  if att.kind == "fsl" and bounded:
    make = lambda: empty_bounded(batch, config.num_heads, config.head_dim, window=att.window, cell=att.cell,
                                 block=att.block, retain_top=att.retain_top, retain_recent=att.retain_recent,
                                 dtype=dtype)
  elif att.kind == "fsb" and bounded:
    make = lambda: empty_forest_cache(*shape, att.cell, dtype)
  elif att.kind in ("fs", "fsl", "fsb"):
    make = lambda: empty_archive(*shape, att.cell, dtype)
  elif att.kind in ("tfpp", "swa", "moba"):
    make = lambda: empty_store(*shape, dtype)
  elif att.kind == "zha":
    make = lambda: empty_zha(*shape, refs=att.zha_refs, chunk=att.zha_chunk, levels=att.zha_levels, dtype=dtype)
  else:
    raise NotImplementedError(f"no decode cache for attention kind {att.kind!r} yet")
  if config.scan_layers:
    return {"layers": jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (config.num_layers, *x.shape)), make())}
  return {f"layer_{i}": make() for i in range(config.num_layers)}


__all__ = ["Archive", "BoundedCache", "ForestCache", "KVStore", "ZHACache", "cache_capacity", "init_cache",
           "layer_of", "write_back"]
