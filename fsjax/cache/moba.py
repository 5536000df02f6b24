"""MoBA block selection for queries at positions over a dense KV store (matches `fsjax.ops.dense`)."""

import jax
import jax.numpy as jnp

from fsjax.cache.layered import read
from fsjax.cache.store import KVStore
from fsjax.ops.common import PRECISION


def block_mask(q_rot, q_pos, store: KVStore, *, moba_block, moba_top_k):
  """`[batch, heads, C, capacity]` bool: a key is readable when its block is the query's own or one of the
  top `moba_top_k - 1` fully past blocks by `q · mean(k_rot over block)` (lower index wins ties).

  The store must be a dense one (slot = position) whose capacity is a multiple of `moba_block`.
  """
  batch, capacity, heads, head_dim = store.k.shape
  num_blocks = capacity // moba_block
  mean_keys = read(store.k).reshape(batch, num_blocks, moba_block, heads, head_dim).mean(axis=2)
  gate = jnp.einsum("bqhd,bnhd->bhqn", q_rot, mean_keys, precision=PRECISION)
  own = q_pos // moba_block  # [batch, C]
  blocks = jnp.arange(num_blocks)
  past = (blocks < own[..., None])[:, None]  # [batch, 1, C, num_blocks]
  chosen = jnp.zeros(gate.shape, bool)
  num_past = min(moba_top_k - 1, num_blocks)
  if num_past > 0:
    _, top = jax.lax.top_k(jnp.where(past, gate, -jnp.inf), num_past)
    chosen = jnp.any(jax.nn.one_hot(top, num_blocks, dtype=bool), axis=-2) & past
  chosen |= (blocks == own[..., None])[:, None]
  key_block = jnp.arange(capacity) // moba_block
  return jnp.take(chosen, key_block, axis=-1)
