"""FS-L bounded cache (FS Sec. 3.3 "Inference", App. C "Bounded cache", Eq. 15): constant memory at any length.

Per layer, sequence and head it keeps
  - the local ring: the last w + 1 RoPE-rotated keys and values (Eq. 3-4);
  - the block buffer: the raw keys and values of the query block in progress;
  - the recent cells: the W most recent eligible cells (shared by the heads, stored per head);
  - the pool: the P eligible cells of largest max key norm (per head).
When a block completes, its B/s cells become eligible: they enter the recent cells (the oldest leave), and the
pool becomes `TopP(pool ∪ new cells)` by (max norm desc, index asc), which equals TopP over every eligible cell
(Eq. 15) because a cell outside the top P never re-enters it. A query scores `pool ∪ recent` (Eq. 8) with Eq. 7,
ties to the lower cell index, exactly as the masked operator (`fsjax.attention.freesolo_step` reads it). Array
sizes depend on (P, W, s, w, B, d) only.
"""

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache import store as kv
from fsjax.reference.routing import Routing

NO_CELL = -1


@flax.struct.dataclass
class BoundedCache:
  """ring: KVStore of w + 1 rotated keys; block_k, block_v `[batch, B, heads, d]` (slot = position mod B);
  recent_ids `[batch, W]`, recent_k/v `[batch, heads, W, s, d]`, recent_mean `[batch, heads, W, d]`,
  recent_norm `[batch, heads, W]`; pool_ids `[batch, heads, P]`, pool_k/v `[batch, heads, P, s, d]`,
  pool_mean `[batch, heads, P, d]`, pool_norm `[batch, heads, P]`. Ids are cell indices, -1 = empty."""

  ring: kv.KVStore
  block_k: jax.Array
  block_v: jax.Array
  recent_ids: jax.Array
  recent_k: jax.Array
  recent_v: jax.Array
  recent_mean: jax.Array
  recent_norm: jax.Array
  pool_ids: jax.Array
  pool_k: jax.Array
  pool_v: jax.Array
  pool_mean: jax.Array
  pool_norm: jax.Array


def empty_bounded(batch, heads, head_dim, routing: Routing, dtype=jnp.float32):
  """An empty bounded cache for `routing`'s window w, cell s, block B, pool P and recent cells W."""
  window, cell, block = routing.window, routing.cell, routing.block
  cells = lambda n: dict(
    ids=jnp.full((batch, heads, n), NO_CELL, jnp.int32),
    k=jnp.zeros((batch, heads, n, cell, head_dim), dtype),
    v=jnp.zeros((batch, heads, n, cell, head_dim), dtype),
    mean=jnp.zeros((batch, heads, n, head_dim), dtype),
    norm=jnp.zeros((batch, heads, n), dtype),
  )
  recent, pool = cells(routing.retain_recent), cells(routing.retain_top)
  return BoundedCache(
    ring=kv.empty_store(batch, window + 1, heads, head_dim, dtype),
    block_k=jnp.zeros((batch, block, heads, head_dim), dtype),
    block_v=jnp.zeros((batch, block, heads, head_dim), dtype),
    recent_ids=recent["ids"][:, 0],
    recent_k=recent["k"],
    recent_v=recent["v"],
    recent_mean=recent["mean"],
    recent_norm=recent["norm"],
    pool_ids=pool["ids"],
    pool_k=pool["k"],
    pool_v=pool["v"],
    pool_mean=pool["mean"],
    pool_norm=pool["norm"],
  )


def candidates(cache: BoundedCache):
  """`pool ∪ recent` per head, sorted by cell id (empties last), duplicates removed: (ids, mean, norm, k, v)."""
  heads = cache.pool_ids.shape[1]
  recent_ids = jnp.broadcast_to(
    cache.recent_ids[:, None], (cache.recent_ids.shape[0], heads, cache.recent_ids.shape[1])
  )
  in_pool = jnp.any(recent_ids[..., None] == cache.pool_ids[:, :, None, :], axis=-1) & (recent_ids >= 0)
  ids = jnp.concatenate([cache.pool_ids, jnp.where(in_pool, NO_CELL, recent_ids)], axis=-1)  # [batch, heads, N]
  order = jnp.argsort(jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
  take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
  return (
    take(ids),
    take(jnp.concatenate([cache.pool_mean, cache.recent_mean], 2)),
    take(jnp.concatenate([cache.pool_norm, cache.recent_norm], 2)),
    take(jnp.concatenate([cache.pool_k, cache.recent_k], 2)),
    take(jnp.concatenate([cache.pool_v, cache.recent_v], 2)),
  )


def _cells_of_block(cache: BoundedCache, cell):
  """The block buffer as cells: (k, v `[batch, heads, B/s, s, d]`, mean `[batch, heads, B/s, d]`, norm)."""
  batch, block, heads, head_dim = cache.block_k.shape
  split = lambda x: jnp.transpose(x.reshape(batch, block // cell, cell, heads, head_dim), (0, 3, 1, 2, 4))
  k, v = split(cache.block_k), split(cache.block_v)
  return k, v, jnp.mean(k, axis=3), jnp.max(jnp.linalg.norm(k, axis=-1), axis=3)


def _keep_last(old, new, axis, width):
  """The last `width` entries along `axis` of `old` followed by `new`: the highest-index (most recent) cells."""
  if width == 0:
    return old
  joined = jnp.concatenate([old, new], axis=axis)
  return jax.lax.slice_in_dim(joined, joined.shape[axis] - width, joined.shape[axis], axis=axis)


def _merge(cache: BoundedCache, block_index, complete):
  """At the end of block `block_index` (per row, where `complete`): its cells join recent and the pool (Eq. 15)."""
  k, v, mean, norm = _cells_of_block(cache, cell=cache.pool_k.shape[3])
  retain_top = cache.pool_ids.shape[2]
  batch, heads, per_block = norm.shape
  new_ids = block_index[:, None] * per_block + jnp.arange(per_block)  # [batch, B/s]
  heads_ids = jnp.broadcast_to(new_ids[:, None], (batch, heads, per_block))
  keep = lambda new, old: jnp.where(complete.reshape((batch,) + (1,) * (old.ndim - 1)), new, old)

  width = cache.recent_ids.shape[1]
  last = lambda old, new, axis: _keep_last(old, new, axis, width)
  recent = dict(
    recent_ids=last(cache.recent_ids, new_ids, 1),
    recent_k=last(cache.recent_k, k, 2),
    recent_v=last(cache.recent_v, v, 2),
    recent_mean=last(cache.recent_mean, mean, 2),
    recent_norm=last(cache.recent_norm, norm, 2),
  )

  ids = jnp.concatenate([cache.pool_ids, heads_ids], axis=2)
  norms = jnp.concatenate([cache.pool_norm, norm], axis=2)
  # Rank by (max norm desc, cell id asc); empty slots last.
  primary = jnp.where(ids >= 0, -norms, jnp.inf)
  secondary = jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max)
  order = jax.lax.sort(
    (primary, secondary, jnp.broadcast_to(jnp.arange(ids.shape[2]), ids.shape)), dimension=2, num_keys=2
  )[2][:, :, :retain_top]
  take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
  pool = dict(
    pool_ids=take(ids),
    pool_norm=take(norms),
    pool_k=take(jnp.concatenate([cache.pool_k, k], 2)),
    pool_v=take(jnp.concatenate([cache.pool_v, v], 2)),
    pool_mean=take(jnp.concatenate([cache.pool_mean, mean], 2)),
  )
  return cache.replace(**{name: keep(value, getattr(cache, name)) for name, value in {**recent, **pool}.items()})


def concat_ring(cache: BoundedCache, k_rot, v, pos, valid):
  """The ring's tokens followed by a segment's, as (k, v, pos): what the segment's local branch attends."""
  return kv.concat(cache.ring, k_rot, v, pos, valid)


def write_segment(cache: BoundedCache, k_rot, k, v, pos, valid):
  """Writes a segment whose valid tokens lie in one query block, in order: the ring takes the rotated keys, the
  block buffer the raw ones, and a completed block's cells join the recent cells and the pool (Eq. 15).

  Args:
    k_rot, k, v: `[batch, L, heads, d]` (k_rot RoPE-rotated at `pos`); pos, valid: `[batch, L]`.
  """
  block = cache.block_k.shape[1]
  rows = jnp.arange(pos.shape[0])[:, None]
  slot = jnp.where(valid, pos % block, block)
  cache = cache.replace(
    ring=kv.write(cache.ring, k_rot, v, pos, valid),
    block_k=cache.block_k.at[rows, slot].set(k, mode="drop"),
    block_v=cache.block_v.at[rows, slot].set(v, mode="drop"),
  )
  complete = jnp.any(valid & (pos % block == block - 1), axis=1)
  last_pos = jnp.max(jnp.where(valid, pos, 0), axis=1)
  return _merge(cache, last_pos // block, complete)


def fill(cache: BoundedCache, k_rot, k, v, pos, valid):
  """The state an empty cache reaches after a prompt's first chunk, built at once rather than block by block
  (`write_segment` per block): the ring holds the last w + 1 tokens, the block buffer the last B, the recent
  cells are the W latest of the completed blocks, and the pool is TopP by (max norm desc, cell index asc) over
  every cell of the completed blocks (Eq. 15), in the order `_merge` keeps it.

  Args:
    k_rot, k, v: `[batch, C, heads, d]` (k_rot RoPE-rotated at `pos`); pos: `[batch, C]`, `0..C-1` in every row,
      C a multiple of the block; valid: `[batch, C]`, each row's prompt (a prefix, at least one token).
  """
  batch, length, heads, head_dim = k.shape
  block, cell = cache.block_k.shape[1], cache.pool_k.shape[3]
  retain_top, width = cache.pool_ids.shape[2], cache.recent_ids.shape[1]
  dtype = cache.pool_k.dtype
  rows = jnp.arange(batch)[:, None]
  last = jnp.max(jnp.where(valid, pos, -1), axis=1)  # [batch] each row's last prompt position
  in_buffer = valid & (pos > last[:, None] - block)  # the block buffer's slots hold the last B tokens
  slot = jnp.where(in_buffer, pos % block, block)
  cache = cache.replace(
    ring=kv.write(cache.ring, k_rot, v, pos, valid),
    block_k=cache.block_k.at[rows, slot].set(k.astype(dtype), mode="drop"),
    block_v=cache.block_v.at[rows, slot].set(v.astype(dtype), mode="drop"),
  )

  num_cells = length // cell
  as_cells = lambda x: jnp.transpose(x.astype(dtype).reshape(batch, num_cells, cell, heads, head_dim), (0, 3, 1, 2, 4))
  k_cells, v_cells = as_cells(k), as_cells(v)  # [batch, heads, n, s, d]
  mean, norm = jnp.mean(k_cells, axis=3), jnp.max(jnp.linalg.norm(k_cells, axis=-1), axis=3)
  eligible = (last + 1) // block * (block // cell)  # [batch] cells of the completed blocks
  gather = lambda x, ids: jnp.take_along_axis(x, ids.reshape(ids.shape + (1,) * (x.ndim - 3)), axis=2)

  recent = eligible[:, None] - width + jnp.arange(width)  # [batch, W], oldest first as `_keep_last` keeps them
  recent_ids = jnp.where(recent >= 0, recent, NO_CELL)
  at_recent = jnp.broadcast_to(jnp.maximum(recent, 0)[:, None], (batch, heads, width))
  present = lambda x: (recent >= 0).reshape((batch, 1, width) + (1,) * (x.ndim - 3))
  recent_fields = {
    name: jnp.where(present(empty), gather(full, at_recent), empty)
    for name, full, empty in (
      ("recent_k", k_cells, cache.recent_k),
      ("recent_v", v_cells, cache.recent_v),
      ("recent_mean", mean, cache.recent_mean),
      ("recent_norm", norm, cache.recent_norm),
    )
  }

  # The empty pool first, then every cell: ranked as `_merge` ranks them, empty slots and cells of incomplete
  # blocks last.
  ids = jnp.concatenate(
    [cache.pool_ids, jnp.broadcast_to(jnp.arange(num_cells), (batch, heads, num_cells)).astype(jnp.int32)], axis=2
  )
  ids = jnp.where(ids < eligible[:, None, None], ids, NO_CELL)
  norms = jnp.concatenate([cache.pool_norm, norm], axis=2)
  primary = jnp.where(ids >= 0, -norms, jnp.inf)
  secondary = jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max)
  order = jax.lax.sort(  # the slot index breaks ties among the unranked: the empty pool's slots fill first
    (primary, secondary, jnp.broadcast_to(jnp.arange(ids.shape[2]), ids.shape)), dimension=2, num_keys=3
  )[2][:, :, :retain_top]
  pool_fields = {
    name: gather(jnp.concatenate([empty, full], axis=2), order)
    for name, full, empty in (
      ("pool_k", k_cells, cache.pool_k),
      ("pool_v", v_cells, cache.pool_v),
      ("pool_mean", mean, cache.pool_mean),
      ("pool_norm", norm, cache.pool_norm),
    )
  }
  return cache.replace(recent_ids=recent_ids, pool_ids=gather(ids, order), **recent_fields, **pool_fields)
