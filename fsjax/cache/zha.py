"""The ZHA decode cache: a dense KV store (RoPE-rotated keys, slot = position) plus every tree level's node
tangents, grown as chunks arrive (ZHA III-A: a level-ℓ node is added every C^ℓ tokens, from the keys or child
tangents already in the cache). Routing and attention match `fsjax.ops.zha` exactly.

In a scanned model every array here is a view into the stacked cache (`fsjax.cache.layered`): fields are read
with `read` and written with `scatter`, so a decode step writes only the nodes it completes. The Pallas kernels
are handed `read(x)`, a copy of the level or of the keys they read.
"""

import math

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache import store as kv
from fsjax.cache.layered import LayerSlice, read, scatter
from fsjax.cache.store import KVStore, empty_store
from fsjax.ops import zha
from fsjax.ops.common import PRECISION
from fsjax.ops.softmax import masked_softmax
from pallas_kernels import tree_routing


@flax.struct.dataclass
class ZHACache:
  """store: the dense KV store; keys[ℓ-1] `[batch, N_ℓ, heads, R, d]`, bias[ℓ-1] `[batch, N_ℓ, heads, R]`:
  the tangents of level ℓ's nodes, `N_ℓ = node_count(capacity, C, ℓ)` (a node is written once complete)."""
  store: KVStore
  keys: tuple
  bias: tuple


def empty_zha(batch, capacity, heads, head_dim, *, refs, chunk, levels, dtype=jnp.float32):
  counts = [zha.node_count(capacity, chunk, level) for level in range(1, levels + 1)]
  return ZHACache(store=empty_store(batch, capacity, heads, head_dim, dtype),
                  keys=tuple(jnp.zeros((batch, n, heads, refs, head_dim), dtype) for n in counts),
                  bias=tuple(jnp.zeros((batch, n, heads, refs), dtype) for n in counts))


def _completed_nodes(positions, valid, chunk, level, count):
  """Level-`level` nodes whose last key arrives in this chunk: indices `[batch, S]` and a write mask.

  A chunk of n tokens starting at position p completes at most ⌈n / C^ℓ⌉ nodes, the first being
  ⌈p / C^ℓ⌉ − 1.
  """
  span = chunk**level
  slots = min(-(-positions.shape[1] // span), count)
  first = -(-positions[:, :1] // span) - 1
  index = first + jnp.arange(slots)  # [batch, S]
  last_valid = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
  last_key = zha.node_last_key(index, chunk, level)
  done = (index >= 0) & (index < count) & (last_key >= positions[:, :1]) & (last_key <= last_valid)
  return jnp.clip(index, 0, count - 1), done


def _write_level(keys, bias, index, done, new_keys, new_bias):
  rows = jnp.arange(index.shape[0])[:, None]
  target = jnp.where(done, index, keys.shape[1])  # out of range: dropped
  return (scatter(keys, (rows, target), new_keys.astype(keys.dtype), mode="drop"),
          scatter(bias, (rows, target), new_bias.astype(bias.dtype), mode="drop"))


def extend(cache: ZHACache, k_rot, v, positions, valid, ref_queries, *, chunk, rope_theta):
  """Writes a chunk's keys and values, then summarizes every node it completes, level by level.

  Args:
    k_rot: `[batch, n, heads, d]` keys as attention sees them (rotated); v alike.
    positions: `[batch, n]` consecutive positions per row; valid: `[batch, n]` (right padding is not cached).
    ref_queries: `[heads, R, d]`.
  """
  store = kv.write(cache.store, k_rot, v, positions, valid)
  batch, _, heads, dim = store.k.shape
  rows = jnp.arange(batch)[:, None, None]
  keys, bias = list(cache.keys), list(cache.bias)
  for level in range(1, len(keys) + 1):
    count = keys[level - 1].shape[1]
    if count == 0:
      continue
    index, done = _completed_nodes(positions, valid, chunk, level, count)
    child = index[..., None] * chunk + jnp.arange(chunk)  # [batch, S, C]
    if level == 1:
      children = read(store.k)[rows, 1 + child].astype(k_rot.dtype)  # slot = position
      child_bias = None
    else:
      children = read(keys[level - 2])[rows, child].astype(k_rot.dtype)
      child_bias = read(bias[level - 2])[rows, child].astype(k_rot.dtype)
    refs = zha.rotated_refs(ref_queries, zha.node_last_key(index, chunk, level), rope_theta, k_rot.dtype)
    keys[level - 1], bias[level - 1] = _write_level(keys[level - 1], bias[level - 1], index, done,
                                                    *zha.summarize(refs, children, child_bias))
  return ZHACache(store=store, keys=tuple(keys), bias=tuple(bias))


def attend(cache: ZHACache, q_rot, positions, *, chunk, top_p, max_nodes=None):
  """ZHA attention of a chunk of queries over the cache (after `extend` wrote the chunk).

  Args:
    q_rot: `[batch, n, heads, d]` rotated queries at `positions` `[batch, n]`.
    top_p: one threshold per level (`zha.level_top_p`); max_nodes: per-level cap (None = none).

  Returns:
    outputs `[batch, n, heads, d]` and the fraction of visible keys each query read, `[batch, n, heads]`.
  """
  scores = [zha.node_scores(q_rot, read(keys).astype(q_rot.dtype), read(bias).astype(q_rot.dtype))
            for keys, bias in zip(cache.keys, cache.bias)]
  leaves = zha.route(scores, positions, chunk=chunk, top_p=top_p, max_nodes=max_nodes)
  k, v, k_pos = (read(x) for x in (cache.store.k, cache.store.v, cache.store.pos))
  mask = zha.key_mask(leaves, positions, k_pos, chunk)
  out = kv.attend(q_rot, positions, k.astype(q_rot.dtype), v.astype(q_rot.dtype), k_pos, extra_mask=mask)
  fraction = jnp.sum(mask, axis=-1) / (positions[:, None] + 1)
  return out, jnp.moveaxis(fraction, 1, 2)


def _gather_nodes(array, index):
  """`array` `[batch, N, heads, ...]` at per-head node indices `index` `[batch, heads, K]`
  → `[batch, heads, K, ...]`."""
  rows = jnp.arange(index.shape[0])[:, None, None]
  heads = jnp.arange(index.shape[1])[None, :, None]
  return array[rows, jnp.clip(index, 0, array.shape[1] - 1), heads]


def _keep_top(scores, index, valid, p, max_nodes):
  """Top-p with at most `max_nodes` kept, over a candidate list (`zha.top_p_select`'s rule).

  The valid candidates must come in node order (invalid ones may sit anywhere), so that `lax.top_k`'s
  lower-position-first tie rule is the lower-node rule; `route_gathered` builds its lists that way instead of
  sorting every candidate list. Returns the kept nodes' indices `[batch, heads, M]` (M = min(max_nodes, K)), best
  first, and their keep mask.
  """
  if scores.shape[-1] == 0:
    return index, valid
  scores = jnp.where(valid, scores, -jnp.inf)
  top_scores, position = jax.lax.top_k(scores, min(max_nodes, scores.shape[-1]))
  best = jnp.max(scores, axis=-1, keepdims=True)
  shift = jnp.where(jnp.isfinite(best), best, 0.0)
  weights = jnp.where(jnp.isfinite(top_scores), jnp.exp(top_scores - shift), 0.0)
  keep = jnp.isfinite(top_scores)
  if p < 1:
    total = jnp.sum(jnp.where(valid, jnp.exp(scores - shift), 0.0), axis=-1, keepdims=True)
    keep &= jnp.cumsum(weights, axis=-1) - weights < p * total
  return jnp.take_along_axis(index, position, axis=-1), keep


def _in_place(x):
  """A kernel's view of a cache field: a scanned model's stack and layer, which the kernel indexes where the
  layer lies (`read` would copy it), or the plain array and None."""
  return (x.stack, x.layer) if isinstance(x, LayerSlice) else (x, None)


def use_kernels(impl, *, chunk, refs):
  """Whether a capped decode step runs `pallas_kernels.tree_routing`: "pallas" always (interpreted off GPU),
  "auto" on a GPU when Triton can tile the tree, "reference" never."""
  if impl == "auto":
    return jax.default_backend() == "gpu" and tree_routing.compilable(chunk=chunk, refs=refs)
  return impl == "pallas"


def route_gathered(cache: ZHACache, q, position, *, chunk, top_p, max_nodes, kernels=False):
  """Capped top-p descent for one query per (row, head), over candidate lists (ZHA III-C).

  Args:
    q: `[batch, heads, d]` rotated queries at `position` `[batch]`; top_p: one threshold per level.
    kernels: score and select candidates with `pallas_kernels.tree_routing` (same results).

  Returns:
    kept leaves `[batch, heads, M]` (M = min(max_nodes, candidates)), their keep mask, and the fraction of
    visible keys read, `[batch, heads]`.
  """
  if kernels:
    return _route_with_kernels(cache, q, position, chunk=chunk, top_p=top_p, max_nodes=max_nodes)
  batch, heads, dim = q.shape
  i = position[:, None, None]
  levels = len(cache.keys)

  def scores_of(level, index):
    level_keys, level_bias = read(cache.keys[level - 1]), read(cache.bias[level - 1])
    dtype = jnp.promote_types(q.dtype, jnp.float32)  # as the kernel: half-precision scores tie and reorder nodes
    keys = _gather_nodes(level_keys, index).astype(dtype)  # [batch, heads, K, R, d]
    bias = _gather_nodes(level_bias, index).astype(dtype)
    return jnp.max(jnp.einsum("bhd,bhkrd->bhkr", q.astype(dtype), keys, precision=PRECISION) / math.sqrt(dim)
                   + bias, -1)

  top = cache.keys[-1].shape[1]
  index = jnp.broadcast_to(jnp.arange(top), (batch, heads, top))
  valid = zha.node_last_key(index, chunk, levels) <= i
  for level in range(levels, 0, -1):
    kept, keep = _keep_top(scores_of(level, index), index, valid, top_p[level - 1], max_nodes)
    if level == 1:
      break
    # The next list is the kept nodes' children, then the complete nodes whose parent is not. Putting the ≤
    # max_nodes kept nodes in node order (dropped ones last) keeps every valid candidate of that list in order.
    kept = jnp.sort(jnp.where(keep, kept, jnp.iinfo(jnp.int32).max), axis=-1)
    keep = kept != jnp.iinfo(jnp.int32).max
    kept = jnp.where(keep, kept, 0)
    children = (kept[..., None] * chunk + jnp.arange(chunk)).reshape(batch, heads, -1)
    parentless = chunk * (i // chunk**level) + jnp.arange(chunk - 1)
    index = jnp.concatenate([children, jnp.broadcast_to(parentless, (batch, heads, chunk - 1))], axis=-1)
    valid = jnp.concatenate([jnp.repeat(keep, chunk, axis=-1),
                             jnp.broadcast_to(zha.node_last_key(parentless, chunk, level - 1) <= i,
                                              (batch, heads, chunk - 1))], axis=-1)
  return kept, keep, _fraction_read(keep, position, chunk)


def _fraction_read(keep, position, chunk):
  """Share of the visible keys a query at `position` `[batch]` reads with kept leaves `keep` `[batch, heads, M]`:
  key 0, the kept leaves' chunks, and 1 + C⌊i/C⌋ … i."""
  i = position[:, None]
  return (jnp.sum(keep, axis=-1) * chunk + 1 + i % chunk) / (i + 1)


def _route_with_kernels(cache: ZHACache, q, position, *, chunk, top_p, max_nodes):
  """`route_gathered` on `pallas_kernels.tree_routing`, two launches per level: the top level scores one
  constant list for every row and head (the kernel drops nodes not complete at the position), each level below
  the list `score_children` builds in the kernel from the kept row above, and `keep_top_p` keeps each level's
  nodes in list order, which is node order, so the children's list is in node order too. (The leaves are a
  set; they stay in list order.)"""
  top = cache.keys[-1].shape[1]
  nodes = jnp.arange(tree_routing.list_width(top))
  index, kept, count = jnp.where(nodes < top, nodes, tree_routing.NO_NODE), None, top
  for level in range(len(cache.keys), 0, -1):
    (level_keys, layer), (level_bias, _) = _in_place(cache.keys[level - 1]), _in_place(cache.bias[level - 1])
    if kept is None:
      scores = tree_routing.score_candidates(q, level_keys, level_bias, index, position=position,
                                             span=chunk**level, layer=layer)
    else:
      scores, index = tree_routing.score_children(q, level_keys, level_bias, kept, position, parents_kept=cap,
                                                  chunk=chunk, span=chunk**level, layer=layer)
      count = cap * chunk + chunk - 1
    cap = min(max_nodes, count)
    kept = tree_routing.keep_top_p(scores, index, p=top_p[level - 1], max_nodes=cap, full_row=level > 1)
  keep = kept != tree_routing.NO_NODE
  return jnp.maximum(kept, 0), keep, _fraction_read(keep, position, chunk)


def attend_gathered(cache: ZHACache, q_rot, positions, *, chunk, top_p, max_nodes, kernels=False):
  """`attend` for one token per row with routing capped at `max_nodes` per level: the same result, reading only
  each level's candidate list (every top-level node, then ≤ max_nodes·C children plus < C parentless nodes)
  and the ≤ max_nodes·C + C + 1 reached keys, instead of scoring every node and masking the whole cache.

  Args:
    q_rot: `[batch, 1, heads, d]` at `positions` `[batch, 1]`; top_p: one threshold per level.
    kernels: score and select candidates and attend with `pallas_kernels.tree_routing` (same results).

  Returns:
    outputs `[batch, 1, heads, d]` and the attended fraction `[batch, 1, heads]`.
  """
  q, position = q_rot[:, 0], positions[:, 0]
  kept, keep, fraction = route_gathered(cache, q, position, chunk=chunk, top_p=top_p, max_nodes=max_nodes,
                                        kernels=kernels)
  if kernels:
    (keys, layer), (values, _) = _in_place(cache.store.k), _in_place(cache.store.v)
    out = tree_routing.leaf_attention(q, keys, values, jnp.where(keep, kept, tree_routing.NO_NODE), position,
                                      chunk=chunk, layer=layer)
    return out[:, None].astype(q.dtype), fraction[:, None]
  keys, values = read(cache.store.k), read(cache.store.v)
  batch, heads, dim = q.shape
  i = position[:, None, None]
  leaf_keys = (1 + kept[..., None] * chunk + jnp.arange(chunk)).reshape(batch, heads, -1)
  current = 1 + chunk * (i // chunk) + jnp.arange(chunk)
  key_pos = jnp.concatenate([jnp.zeros((batch, heads, 1), jnp.int32), leaf_keys,
                             jnp.broadcast_to(current, (batch, heads, chunk))], axis=-1)
  key_valid = jnp.concatenate([jnp.ones((batch, heads, 1), bool), jnp.repeat(keep, chunk, axis=-1),
                               jnp.broadcast_to(current <= i, (batch, heads, chunk))], axis=-1)
  k = _gather_nodes(keys, key_pos).astype(q.dtype)  # slot = position: [batch, heads, K, d]
  v = _gather_nodes(values, key_pos).astype(q.dtype)
  logits = jnp.einsum("bhd,bhkd->bhk", q, k, precision=PRECISION) / math.sqrt(dim)
  probs = masked_softmax(logits, key_valid)
  return jnp.einsum("bhk,bhkd->bhd", probs, v, precision=PRECISION)[:, None], fraction[:, None]
