"""FS-L bounded cache (FS Sec. 3.3 "Inference", App. C "Bounded cache", Eq. 15): constant memory at any length.

Per layer, sequence and key/value head it keeps
  - the local ring: the last w + 1 RoPE-rotated keys and values (Eq. 3-4);
  - the block buffer: the raw keys and values of the query block in progress;
  - the recent cells: the W most recent eligible cells (shared by the heads, stored per head);
  - the pool: the P eligible cells of largest max key norm (per head).
When a block completes, its B/s cells become eligible: they enter the recent cells (the oldest leave), and the
pool becomes `TopP(pool ∪ new cells)` by (max norm desc, index asc), which equals TopP over every eligible cell
(Eq. 15) because a cell outside the top P never re-enters it. A query scores `pool ∪ recent` (Eq. 8) with Eq. 7,
ties to the lower cell index, exactly as the masked operator (`fsjax.attention.freesolo_step` reads it). Array
sizes depend on (P, W, s, w, B, d) only.

Slots, so that a step touches only what it reads and what it adds: the recent cells are a ring (cell c in slot
c mod W) and a pool cell keeps its slot until a better cell evicts it, the new cells taking the freed slots. A
completed block thus writes its own B/s cells and nothing else, and a query's step reads the candidates'
summaries and gathers only its K selected cells. In a scanned model's decode step every field is a
`layered.LayerSlice` of the stacked cache (read with `read`, written with `scatter`), so these writes land in the
stack in place: moving whole cell arrays per token (a sorted pool, a shifted recent list, a layer's cache sliced
out and written back) was several passes over a batch's whole cache per token.
"""

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache import store as kv
from fsjax.cache.layered import read, scatter
from fsjax.reference.routing import Routing

NO_CELL = -1


@flax.struct.dataclass
class BoundedCache:
  """ring: KVStore of w + 1 rotated keys; block_k, block_v `[batch, B, heads, d]` (slot = position mod B);
  recent_ids `[batch, W]` (cell c in slot c mod W), recent_k/v `[batch, heads, W, s, d]`, recent_mean `[batch,
  heads, W, d]`, recent_norm `[batch, heads, W]`; pool_ids `[batch, heads, P]` (in no particular order),
  pool_k/v `[batch, heads, P, s, d]`, pool_mean `[batch, heads, P, d]`, pool_norm `[batch, heads, P]`. Ids are
  cell indices, -1 = empty. `heads` are key/value heads.

  `defer_merge` (static): a segment's write leaves a completed block's merge (Eq. 15) to `merge_completed`. A
  one-token decode step sets it for every layer and merges all layers at once after the last one
  (`fsjax.cache.merge_deferred_blocks`): the merge is a sort and a dozen scatters, launched once per token
  instead of once per layer. A query never reads the merge of its own token's block, so the order is free."""

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
  defer_merge: bool = flax.struct.field(pytree_node=False, default=False)


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
  """`pool ∪ recent` per key/value head, sorted by cell id (empties last), duplicates removed: (ids, mean, norm,
  source), each `[batch, heads, N]` (mean `[.., N, d]`), N = P + W. `source` is where a candidate's keys and
  values lie, pool slots `0..P-1` then recent slots `P..P+W-1`: `cell_keys_values` gathers the selected ones,
  so the candidates' cells are never copied."""
  pool_ids = read(cache.pool_ids)
  batch, heads, _ = pool_ids.shape
  recent_ids = read(cache.recent_ids)
  recent_ids = jnp.broadcast_to(recent_ids[:, None], (batch, heads, recent_ids.shape[1]))
  in_pool = jnp.any(recent_ids[..., None] == pool_ids[:, :, None, :], axis=-1) & (recent_ids >= 0)
  ids = jnp.concatenate([pool_ids, jnp.where(in_pool, NO_CELL, recent_ids)], axis=-1)  # [batch, heads, N]
  order = jnp.argsort(jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max), axis=-1, stable=True)
  take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)
  return (
    take(ids),
    take(jnp.concatenate([read(cache.pool_mean), read(cache.recent_mean)], 2)),
    take(jnp.concatenate([read(cache.pool_norm), read(cache.recent_norm)], 2)),
    order.astype(jnp.int32),
  )


def cell_keys_values(cache: BoundedCache, source, kv_head):
  """The keys and values of candidates `source` (from `candidates`) `[batch, C, heads, K]` of key/value heads
  `kv_head` `[heads]`: two `[batch, C, heads, K, s, d]` arrays, gathered from where the cells lie."""
  retain_top, width = cache.pool_ids.shape[2], cache.recent_ids.shape[1]
  rows, head = jnp.arange(source.shape[0])[:, None, None, None], kv_head[None, None, :, None]
  in_pool = (source < retain_top)[..., None, None]

  def gather(pool, recent):
    from_pool = read(pool)[rows, head, jnp.minimum(source, retain_top - 1)]
    if width == 0:
      return from_pool
    return jnp.where(in_pool, from_pool, read(recent)[rows, head, jnp.clip(source - retain_top, 0, width - 1)])

  return gather(cache.pool_k, cache.recent_k), gather(cache.pool_v, cache.recent_v)


def _cells_of_block(cache: BoundedCache, cell):
  """The block buffer as cells: (k, v `[batch, heads, B/s, s, d]`, mean `[batch, heads, B/s, d]`, norm)."""
  batch, block, heads, head_dim = cache.block_k.shape
  split = lambda x: jnp.transpose(read(x).reshape(batch, block // cell, cell, heads, head_dim), (0, 3, 1, 2, 4))
  k, v = split(cache.block_k), split(cache.block_v)
  return k, v, jnp.mean(k, axis=3), jnp.max(jnp.linalg.norm(k, axis=-1), axis=3)


def _pool_order(ids, norms):
  """`[batch, heads, n]` positions of `ids` / `norms` in the order (max norm desc, cell id asc), empties (id < 0)
  last, the position breaking ties among them: TopP of Eq. 15 keeps the first P."""
  primary = jnp.where(ids >= 0, -norms, jnp.inf)
  secondary = jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max)
  return jax.lax.sort(
    (primary, secondary, jnp.broadcast_to(jnp.arange(ids.shape[2]), ids.shape)), dimension=2, num_keys=3
  )[2]


def _merge(cache: BoundedCache, block_index, complete):
  """At the end of block `block_index` (per row, where `complete`): its cells join recent and the pool (Eq. 15).

  Writes only the new cells: into recent slots `id mod W` (the last W of them), and into the pool slots whose
  cells TopP(pool ∪ new) drops (empty slots first: they rank last), the i-th admitted new cell into the i-th
  freed slot."""
  k, v, mean, norm = _cells_of_block(cache, cell=cache.pool_k.shape[3])
  batch, heads, per_block = norm.shape
  retain_top, width = cache.pool_ids.shape[2], cache.recent_ids.shape[1]
  new_ids = block_index[:, None] * per_block + jnp.arange(per_block)  # [batch, B/s]
  rows, head = jnp.arange(batch)[:, None, None], jnp.arange(heads)[None, :, None]
  cells = dict(k=k, v=v, mean=mean, norm=norm)
  updates = {}

  if width:
    latest = complete[:, None] & (jnp.arange(per_block) >= per_block - width)
    slot = jnp.where(latest, new_ids % width, width)[:, None]  # [batch, 1, B/s]; out of range: dropped
    updates["recent_ids"] = scatter(cache.recent_ids, (rows[:, 0], slot[:, 0]), new_ids, mode="drop")
    for name, value in cells.items():
      field = getattr(cache, f"recent_{name}")
      updates[f"recent_{name}"] = scatter(field, (rows, head, slot), value.astype(field.dtype), mode="drop")

  heads_ids = jnp.broadcast_to(new_ids[:, None], (batch, heads, per_block))
  order = _pool_order(
    jnp.concatenate([read(cache.pool_ids), heads_ids], axis=2),
    jnp.concatenate([read(cache.pool_norm), norm.astype(cache.pool_norm.dtype)], axis=2),
  )
  kept = jnp.argsort(order, axis=2) < retain_top  # each entry's rank
  admitted = kept[..., retain_top:] & complete[:, None, None]  # [batch, heads, B/s]
  freed = jnp.argsort(kept[..., :retain_top], axis=2, stable=True)  # dropped slots first, in slot order
  nth = jnp.clip(jnp.cumsum(admitted, axis=2) - 1, 0, retain_top - 1)
  slot = jnp.where(admitted, jnp.take_along_axis(freed, nth, axis=2), retain_top)
  updates["pool_ids"] = scatter(cache.pool_ids, (rows, head, slot), heads_ids, mode="drop")
  for name, value in cells.items():
    field = getattr(cache, f"pool_{name}")
    updates[f"pool_{name}"] = scatter(field, (rows, head, slot), value.astype(field.dtype), mode="drop")
  return cache.replace(**updates)


def concat_ring(cache: BoundedCache, k_rot, v, pos, valid):
  """The ring's tokens followed by a segment's, as (k, v, pos): what the segment's local branch attends."""
  return kv.concat(cache.ring, k_rot, v, pos, valid)


def write_segment(cache: BoundedCache, k_rot, k, v, pos, valid):
  """Writes a segment whose valid tokens lie in one query block, in order: the ring takes the rotated keys, the
  block buffer the raw ones, and a completed block's cells join the recent cells and the pool (Eq. 15; left to
  `merge_completed` when the cache `defer_merge`s).

  Args:
    k_rot, k, v: `[batch, L, heads, d]` (k_rot RoPE-rotated at `pos`); pos, valid: `[batch, L]`.
  """
  return write_block(write_ring(cache, k_rot, v, pos, valid), k, v, pos, valid)


def write_ring(cache: BoundedCache, k_rot, v, pos, valid):
  """The segment's rotated keys and values into the ring (the local branch's window)."""
  return cache.replace(ring=kv.write(cache.ring, k_rot, v, pos, valid))


def write_block(cache: BoundedCache, k, v, pos, valid):
  """The segment's raw keys and values into the block buffer, then a completed block's merge (Eq. 15; left to
  `merge_completed` when the cache `defer_merge`s)."""
  block = cache.block_k.shape[1]
  rows = jnp.arange(pos.shape[0])[:, None]
  slot = jnp.where(valid, pos % block, block)
  cache = cache.replace(
    block_k=scatter(cache.block_k, (rows, slot), k.astype(cache.block_k.dtype), mode="drop"),
    block_v=scatter(cache.block_v, (rows, slot), v.astype(cache.block_v.dtype), mode="drop"),
  )
  return cache if cache.defer_merge else merge_completed(cache, pos, valid)


def merge_completed(cache: BoundedCache, pos, valid):
  """The cache after a segment at `pos` `[batch, L]` (`valid` `[batch, L]`, inside one query block per row) was
  written: where the segment completed its block, the block's cells join the recent cells and the pool (Eq. 15)."""
  block = cache.block_k.shape[1]
  complete = jnp.any(valid & (pos % block == block - 1), axis=1)
  last_pos = jnp.max(jnp.where(valid, pos, 0), axis=1)
  return _merge(cache, last_pos // block, complete)


def fill(cache: BoundedCache, k_rot, k, v, pos, valid):
  """The state an empty cache reaches after a prompt's first chunk, built at once rather than block by block
  (`write_segment` per block): the ring holds the last w + 1 tokens, the block buffer the last B, the recent
  cells are the W latest of the completed blocks (cell c in slot c mod W), and the pool is TopP by (max norm
  desc, cell index asc) over every cell of the completed blocks (Eq. 15), in that order. (Block by block, the
  pool holds the same cells in other slots.)

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
    block_k=scatter(cache.block_k, (rows, slot), k.astype(dtype), mode="drop"),
    block_v=scatter(cache.block_v, (rows, slot), v.astype(dtype), mode="drop"),
  )

  num_cells = length // cell
  as_cells = lambda x: jnp.transpose(x.astype(dtype).reshape(batch, num_cells, cell, heads, head_dim), (0, 3, 1, 2, 4))
  k_cells, v_cells = as_cells(k), as_cells(v)  # [batch, heads, n, s, d]
  mean, norm = jnp.mean(k_cells, axis=3), jnp.max(jnp.linalg.norm(k_cells, axis=-1), axis=3)
  eligible = (last + 1) // block * (block // cell)  # [batch] cells of the completed blocks
  gather = lambda x, ids: jnp.take_along_axis(x, ids.reshape(ids.shape + (1,) * (x.ndim - 3)), axis=2)
  fields = {}

  oldest = eligible[:, None] - width  # [batch, 1]; slot r holds the cell in [oldest, eligible) that is r mod W
  recent = oldest + (jnp.arange(width) - oldest) % max(width, 1)  # [batch, W]
  fields["recent_ids"] = jnp.where(recent >= 0, recent, NO_CELL)
  at_recent = jnp.broadcast_to(jnp.maximum(recent, 0)[:, None], (batch, heads, width))
  present = lambda x: (recent >= 0).reshape((batch, 1, width) + (1,) * (x.ndim - 3))
  for name, full in (("k", k_cells), ("v", v_cells), ("mean", mean), ("norm", norm)):
    empty = read(getattr(cache, f"recent_{name}"))
    fields[f"recent_{name}"] = jnp.where(present(empty), gather(full, at_recent), empty)

  # The empty pool first, then every cell: ranked as `_merge` ranks them, empty slots and cells of incomplete
  # blocks last, the slot index breaking ties among the unranked (the empty pool's slots fill first).
  ids = jnp.concatenate(
    [read(cache.pool_ids), jnp.broadcast_to(jnp.arange(num_cells), (batch, heads, num_cells)).astype(jnp.int32)],
    axis=2,
  )
  ids = jnp.where(ids < eligible[:, None, None], ids, NO_CELL)
  order = _pool_order(ids, jnp.concatenate([read(cache.pool_norm), norm], axis=2))[:, :, :retain_top]
  fields["pool_ids"] = gather(ids, order)
  for name, full in (("k", k_cells), ("v", v_cells), ("mean", mean), ("norm", norm)):
    fields[f"pool_{name}"] = gather(jnp.concatenate([read(getattr(cache, f"pool_{name}")), full], axis=2), order)
  return cache.replace(**{name: scatter(getattr(cache, name), (), value) for name, value in fields.items()})
