"""The ZHA decode cache: a dense KV store (RoPE-rotated keys, slot = position) plus every tree level's node
tangents, grown as chunks arrive (ZHA III-A: a level-ℓ node is added every C^ℓ tokens, from the keys or child
tangents already in the cache). The attention that reads it is ZHA's decode step (`fsjax.attention.zha_step`).

In a scanned model every array here is a view into the stacked cache (`fsjax.cache.layered`): fields are read
with `read` and written with `scatter`, so a decode step writes only the nodes it completes.
"""

import flax.struct
import jax.numpy as jnp

from fsjax.cache import store as kv
from fsjax.cache.layered import read, scatter
from fsjax.cache.store import KVStore, empty_store
from fsjax.reference import zha
from fsjax.reference.zha import ZHATree


@flax.struct.dataclass
class ZHACache:
  """store: the dense KV store; keys[ℓ-1] `[batch, N_ℓ, kv_heads, R, d]`, bias[ℓ-1] `[batch, N_ℓ, kv_heads, R]`:
  the tangents of level ℓ's nodes, `N_ℓ = node_count(capacity, C, ℓ)` (a node is written once complete). One
  tree per key/value head (ZHA III-A), as the store holds `kv_heads` heads."""

  store: KVStore
  keys: tuple
  bias: tuple


def empty_zha(batch, capacity, heads, head_dim, tree: ZHATree, dtype=jnp.float32):
  """An empty cache of `capacity` token slots for the tree's geometry (`tree.refs`, `.chunk`, `.levels`); `heads`
  are the model's key/value heads."""
  counts = [zha.node_count(capacity, tree.chunk, level) for level in range(1, tree.levels + 1)]
  return ZHACache(
    store=empty_store(batch, capacity, heads, head_dim, dtype),
    keys=tuple(jnp.zeros((batch, n, heads, tree.refs, head_dim), dtype) for n in counts),
    bias=tuple(jnp.zeros((batch, n, heads, tree.refs), dtype) for n in counts),
  )


def _completed_nodes(positions, valid, chunk, level, count):
  """Level-`level` nodes whose last key arrives in this chunk: indices `[batch, S]` and a write mask.

  A chunk of n tokens starting at position p completes at most ⌈n / C^ℓ⌉ nodes, the first being
  max(⌈p / C^ℓ⌉ − 1, 0) (node m's last key is (m + 1) C^ℓ, so at p = 0 the first candidate is node 0, not -1:
  starting at -1 would spend a slot on no node and, with the slots capped at `count`, drop the last one).
  """
  span = chunk**level
  slots = min(-(-positions.shape[1] // span), count)
  first = jnp.maximum(-(-positions[:, :1] // span) - 1, 0)
  index = first + jnp.arange(slots)  # [batch, S]
  last_valid = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)
  last_key = zha.node_last_key(index, chunk, level)
  done = (index >= 0) & (index < count) & (last_key >= positions[:, :1]) & (last_key <= last_valid)
  return jnp.clip(index, 0, count - 1), done


def _write_level(keys, bias, index, done, new_keys, new_bias):
  rows = jnp.arange(index.shape[0])[:, None]
  target = jnp.where(done, index, keys.shape[1])  # out of range: dropped
  return (
    scatter(keys, (rows, target), new_keys.astype(keys.dtype), mode="drop"),
    scatter(bias, (rows, target), new_bias.astype(bias.dtype), mode="drop"),
  )


def extend(cache: ZHACache, k_rot, v, positions, valid, ref_queries, *, tree: ZHATree, rope_theta):
  """Writes a chunk's keys and values, then summarizes every node it completes, level by level (ZHA III-A).

  Args:
    k_rot: `[batch, n, kv_heads, d]` keys as attention sees them (rotated); v alike.
    positions: `[batch, n]` consecutive positions per row; valid: `[batch, n]` (right padding is not cached).
    ref_queries: `[kv_heads, R, d]`.
    tree: the geometry (the cache's arrays fix the levels); rope_theta: RoPE base θ or a `RoPE`, None for NoPE.

  Returns:
    the updated cache.
  """
  chunk = tree.chunk
  store = kv.write(cache.store, k_rot, v, positions, valid)
  rows = jnp.arange(store.k.shape[0])[:, None, None]
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
    keys[level - 1], bias[level - 1] = _write_level(
      keys[level - 1], bias[level - 1], index, done, *zha.summarize(refs, children, child_bias)
    )
  return ZHACache(store=store, keys=tuple(keys), bias=tuple(bias))
