"""Decode caches: state and its update rules. A positional KV store (dense cache, SWA ring), the FS archive, the
FS-L bounded cache, the FS-B forest cache and the ZHA tree cache; the attention maths that reads them lives with
each kind's module (`fsjax.attention`).

`init_cache(config, batch, max_len)` builds one cache per layer, shaped for the model's attention kind.
"""

import jax
import jax.numpy as jnp

from fsjax import short_conv
from fsjax.cache.archive import Archive
from fsjax.cache.bounded import BoundedCache, merge_completed
from fsjax.cache.forest import Forest, ForestCache, advance_for_token, eligible_target
from fsjax.cache.layered import layer_view, write_back
from fsjax.cache.store import KVStore
from fsjax.cache.zha import ZHACache

# The caches a scanned model's layer reads and writes in place: those whose arrays grow with the sequence, and
# FS-L's, whose step writes a token's slots and a block's cells only.
IN_PLACE = (KVStore, Archive, BoundedCache, Forest, ZHACache)


def layer_of(stacked, layer):
  """Layer `layer` (int32 scalar) of a scanned model's stacked cache: KV stores, archives, FS-L's bounded caches,
  FS-B forests and ZHA caches as views into the stack (`fsjax.cache.layered`), every other array sliced out."""
  return layer_view(stacked, layer, IN_PLACE)


def _map_bounded(cache, fn):
  return jax.tree_util.tree_map(
    lambda node: fn(node) if isinstance(node, BoundedCache) else node,
    cache,
    is_leaf=lambda node: isinstance(node, BoundedCache),
  )


def defer_block_merges(cache):
  """`cache` with every FS-L bounded cache deferring its block merges (`BoundedCache.defer_merge`): for a
  one-token step, whose layers then write only their token and leave the merge to `merge_deferred_blocks`."""
  return _map_bounded(cache, lambda node: node.replace(defer_merge=True))


def merge_deferred_blocks(cache, positions, valid):
  """Merges the blocks that a step's tokens at `positions` `[batch, L]` (`valid` `[batch, L]`) completed into every
  layer's deferring bounded cache, all layers of a stack at once (vmapped: one sort and a dozen scatters per
  token for the whole model), and stops the deferral. Other caches pass unchanged."""

  def merge(node):
    if not node.defer_merge:
      return node
    node = node.replace(defer_merge=False)
    if node.block_k.ndim == 5:  # stacked `[layers, batch, B, heads, d]`
      return jax.vmap(merge_completed, in_axes=(0, None, None))(node, positions, valid)
    return merge_completed(node, positions, valid)

  return _map_bounded(cache, merge)


def advance_forests(cache, positions, valid, tau, *, cell, block):
  """A one-token step's FS-B forests advanced to its block for every layer before the layers run
  (`forest.advance_for_token`), under one conditional on whether any layer admits a cell; the layers then search
  the forests as they are (`ForestCache.advanced`). Each layer's own advance is a data-dependent loop, whose
  predicate XLA's GPU runtime reads back to the host: a round trip per layer at every token, where this is one
  per token. `tau`: each forest cache's τ `[kv_heads]` by its key in `cache` (`"layers"`: stacked `[layers,
  kv_heads]`). Other caches pass unchanged; `release_forests` ends the step."""
  # Marked before the conditional, so that both of its branches return caches of one tree structure.
  forests = {name: node.replace(advanced=True) for name, node in cache.items() if isinstance(node, ForestCache)}
  if not forests:
    return cache

  def advance_all(forests):
    out = {}
    for name, node in forests.items():
      if name != "layers":
        out[name] = advance_for_token(node, positions, valid, tau[name], cell=cell, block=block)
        continue

      def one_layer(i, node, name=name):
        view = advance_for_token(layer_of(node, i), positions, valid, tau[name][i], cell=cell, block=block)
        return write_back(node, view, i)

      out[name] = jax.lax.fori_loop(0, node.admitted.shape[0], one_layer, node)
    return out

  due = jnp.any(
    jnp.stack(
      [
        jnp.any(eligible_target(positions, valid, node.admitted, cell=cell, block=block) > node.admitted)
        for node in forests.values()
      ]
    )
  )
  return {**cache, **jax.lax.cond(due, advance_all, lambda forests: forests, forests)}


def release_forests(cache):
  """`cache` after a step that `advance_forests` began: its forest caches advance themselves again."""
  return {name: node.replace(advanced=False) if isinstance(node, ForestCache) else node for name, node in cache.items()}


def cache_rows(cache, rows):
  """The cache of a batch's rows `rows` `[n]` (int, repeats allowed), in that order. A per-layer cache's arrays
  are `[batch, ...]`; a scanned model's stacks and the convolution history are `[layers, batch, ...]`
  (`init_cache`)."""

  def take(path, x):
    axis = 1 if path[0].key in ("layers", short_conv.STATE_KEY) else 0
    return jnp.take(x, rows, axis=axis)

  return jax.tree_util.tree_map_with_path(take, cache)


def cache_capacity(config, max_len):
  """Token slots per layer for `config` (a `ModelConfig`): its kind's capacity rule (`fsjax.kinds`), e.g.
  `window + 1` for the SWA ring, max_len rounded up to whole cells and blocks otherwise."""
  from fsjax import kinds  # at call time: the kind registry imports these caches

  return kinds.get(config.attention.kind).capacity(config.attention, max_len)


def init_cache(config, batch, max_len, dtype=jnp.float32, bounded=True):
  """Empty per-layer caches `{"layer_i": cache}` for up to `max_len` tokens of a `ModelConfig`, or
  `{"layers": cache}` with every array stacked `[num_layers, ...]` for a `scan_layers` model.

  FS-L gets the bounded cache (its size ignores `max_len`) and FS-B the streaming forest cache unless
  `bounded=False` asks for the plain archive (FS-B then rebuilds its forests at every step: the reference).
  A model with `short_conv` also gets `conv`, every layer's convolution history (`fsjax.short_conv`).
  """
  from fsjax import kinds  # at call time: the kind registry imports these caches

  att = config.attention
  capacity = cache_capacity(config, max_len)
  make = lambda: kinds.get(att.kind).cache(att, batch, capacity, config.kv_heads, config.head_dim, dtype, bounded)
  if config.scan_layers:
    cache = {"layers": jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (config.num_layers, *x.shape)), make())}
  else:
    cache = {f"layer_{i}": make() for i in range(config.num_layers)}
  if config.short_conv:
    kernel = config.short_conv
    cache[short_conv.STATE_KEY] = short_conv.init_state(config.num_layers, batch, kernel, config.d_model, dtype)
  return cache


__all__ = [
  "Archive",
  "BoundedCache",
  "ForestCache",
  "KVStore",
  "ZHACache",
  "advance_forests",
  "cache_capacity",
  "cache_rows",
  "defer_block_merges",
  "init_cache",
  "layer_of",
  "merge_deferred_blocks",
  "release_forests",
  "write_back",
]
