"""A positional key/value store: the dense KV cache (capacity = max length) and the SWA ring (capacity w + 1).

Each slot holds one token's key, value and absolute position (-1 = empty); position p lives in slot p % capacity.
Rows of a batch advance independently, so a batch may hold prompts of different lengths. Attention masks by
positions, never by slot order, so a ring and a full buffer give the same result whenever the ring holds the
window.
"""

import math

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache.layered import read, scatter
from fsjax.ops.common import PRECISION
from fsjax.ops.softmax import masked_softmax


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
  return KVStore(k=scatter(store.k, (rows, slot), k.astype(store.k.dtype), mode="drop"),
                 v=scatter(store.v, (rows, slot), v.astype(store.v.dtype), mode="drop"),
                 pos=scatter(store.pos, (rows, slot), pos.astype(store.pos.dtype), mode="drop"))


def visible(q_pos, k_pos, window=None):
  """`[batch, C, N]` bool: key slot n is filled and `0 <= q_pos - k_pos <= window` (no bound for None)."""
  offset = q_pos[:, :, None] - k_pos[:, None, :]
  mask = (k_pos[:, None, :] >= 0) & (offset >= 0)
  return mask if window is None else mask & (offset <= window)


def attend(q, q_pos, k, v, k_pos, window=None, extra_mask=None):
  """Softmax attention of queries at positions over keys at positions: `j <= i` and `i - j <= window`.

  Args:
    q: `[batch, C, heads, d]`; q_pos: `[batch, C]`.
    k, v: `[batch, N, heads, d]`; k_pos: `[batch, N]` (-1 = empty slot).
    window: look-back radius, None for unbounded.
    extra_mask: optional `[batch, heads, C, N]` bool, and-ed into the mask (MoBA's block selection).

  Returns:
    `[batch, C, heads, d]` float32 (or wider), zero for a query that sees nothing.
  """
  mask = visible(q_pos, k_pos, window)[:, None]
  if extra_mask is not None:
    mask &= extra_mask
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=PRECISION) / math.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", masked_softmax(logits, mask), v, precision=PRECISION)


def attend_one(q, q_pos, k, v, k_pos, window=None):
  """`attend` for one query per row, as elementwise products and sums that XLA fuses with reading the keys and
  values once, in their storage dtype. A matrix product would be handed a copy of a scanned model's layer
  (`fsjax.cache.layered`), converted to float32 at the reference's precision.

  Args: as `attend`, with q `[batch, 1, heads, d]` and q_pos `[batch, 1]`.

  Returns:
    `[batch, 1, heads, d]` in q's dtype promoted to at least float32.
  """
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  mask = visible(q_pos, k_pos, window)[:, 0, :, None]  # [batch, N, 1]
  logits = jnp.sum(q.astype(dtype) * k, axis=-1, dtype=dtype) / math.sqrt(q.shape[-1])  # [batch, N, heads]
  probs = masked_softmax(logits, mask, axis=1)
  return jnp.sum(probs[..., None] * v, axis=1, keepdims=True, dtype=dtype)


def concat(store: KVStore, k, v, pos, valid):
  """The store's tokens followed by a chunk's, as (k, v, pos) for `attend`; invalid chunk tokens get pos -1."""
  return (jnp.concatenate([read(store.k), k.astype(store.k.dtype)], axis=1),
          jnp.concatenate([read(store.v), v.astype(store.v.dtype)], axis=1),
          jnp.concatenate([read(store.pos), jnp.where(valid, pos, -1)], axis=1))
