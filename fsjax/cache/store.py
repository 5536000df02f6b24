"""A positional key/value store: the dense KV cache (capacity = max length) and the SWA ring (capacity w + 1).

Each slot holds one token's key, value and absolute position (-1 = empty); position p lives in slot p % capacity.
Rows of a batch advance independently, so a batch may hold prompts of different lengths. Attention masks by
positions, never by slot order, so a ring and a full buffer give the same result whenever the ring holds the
window.
"""

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache.layered import read, scatter


@flax.struct.dataclass
class KVStore:
  """k, v: `[batch, capacity, heads, head_dim]`; pos: `[batch, capacity]` int32, -1 where empty. In a scanned
  model's decode step each field is a `layered.LayerSlice`: read them with `layered.read`."""

  k: jax.Array
  v: jax.Array
  pos: jax.Array

  @property
  def capacity(self):
    return self.pos.shape[1]


def empty_store(batch, capacity, heads, head_dim, dtype=jnp.float32):
  shape = (batch, capacity, heads, head_dim)
  # Separate buffers: decode donates the cache, and one buffer cannot be donated twice.
  return KVStore(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), pos=jnp.full((batch, capacity), -1, jnp.int32))


def write(store: KVStore, k, v, pos, valid):
  """Stores the valid tokens of a chunk at slot `pos % capacity`.

  Args:
    k, v: `[batch, C, heads, d]`; pos: `[batch, C]` int32 absolute positions; valid: `[batch, C]` bool.

  Only the last `capacity` valid positions of each row are written (earlier ones would be overwritten within
  the same chunk); invalid tokens (right padding) write nothing.
  """
  last = jnp.max(jnp.where(valid, pos, -1), axis=1, keepdims=True)
  keep = valid & (pos > last - store.capacity)
  slot = jnp.where(keep, pos % store.capacity, store.capacity)  # out of range: dropped
  rows = jnp.arange(pos.shape[0])[:, None]
  return KVStore(
    k=scatter(store.k, (rows, slot), k.astype(store.k.dtype), mode="drop"),
    v=scatter(store.v, (rows, slot), v.astype(store.v.dtype), mode="drop"),
    pos=scatter(store.pos, (rows, slot), pos.astype(store.pos.dtype), mode="drop"),
  )


def concat(store: KVStore, k, v, pos, valid):
  """The store's tokens followed by a chunk's, as (k, v, pos) for `fsjax.attention.cached.attend`; invalid chunk
  tokens get pos -1."""
  return (
    jnp.concatenate([read(store.k), k.astype(store.k.dtype)], axis=1),
    jnp.concatenate([read(store.v), v.astype(store.v.dtype)], axis=1),
    jnp.concatenate([read(store.pos), jnp.where(valid, pos, -1)], axis=1),
  )
