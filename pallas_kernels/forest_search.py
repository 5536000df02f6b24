"""FS-B beam search (FS Eq. 11) over a decode step's streaming forests, one program per (batch, head, tile of
queries). `fsjax.reference.forest.beam_search` is its jnp specification.

The node table is one `[N]` row per field (μ `[N, d]`, ρ, a_max, p_min, first cell, leaf cell, two children);
each beam step gathers the rows of its 2W pool entries, scores them by the bound U_v of Eq. 11 and refills the
W slots in the reference's order without a sort (see `_beam_kernel`).

The table's layout is the streaming cache's (`fsjax.cache.forest`): level k's tree in heap order at
`level_offset(k)`, then one join slot per level, the joins chaining the chunks of the admitted count M from the
smallest up. So a node's children, whether it is a leaf, and the forest's root follow from its id and M
(`_structure`), and a beam step waits on one gather (the children's summaries) instead of two (their ids, then
their summaries): the search is a chain of dependent gathers, one per level.

Grouped-query attention: the programs of query head h read the node table of forest entry `h // group` through
their BlockSpec index maps, with h's own λ_h, σ_h; the table is never copied per query head.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
  check_power_of_two,
  default_interpret,
  erf,
  group_size,
  layer_stack,
  pad_axis,
  pad_head_dim,
)

NO_NODE = -1


def _count_ahead(rank_x, first_x, rank_y, first_y):
  """`[BQ, n]`: for each entry y, how many entries x order before it by (rank desc, first asc).

  Live entries cover disjoint cells, so equal first cells mean the same entry, which is never ahead of itself.
  Testing that, rather than relying on `rx > ry` being false for x = y, keeps the count right where XLA computes
  the two operands' ranks in separate fusions that round differently (interpret mode on a CPU)."""
  rx, fx = rank_x[:, :, None], first_x[:, :, None]
  ry, fy = rank_y[:, None, :], first_y[:, None, :]
  return jnp.sum(((fx != fy) & ((rx > ry) | ((rx == ry) & (fx < fy)))).astype(jnp.int32), axis=1)


def _place(node, rank, slot_of, beam):
  """`[BQ, beam]`: slot s holds the live entry whose `slot_of` is s, NO_NODE where none does."""
  hit = (slot_of[:, None, :] == jnp.arange(beam)[None, :, None]) & (rank[:, None, :] > -jnp.inf)
  return jnp.max(jnp.where(hit, node[:, None, :], NO_NODE), axis=2)


def _static_level_offset(k):
  """`fsjax.cache.forest.level_offset` of a Python int."""
  return 2 ** (k + 1) - 2 - k


def _level_offset(k):
  """`fsjax.cache.forest.level_offset` of int32 levels `k`: the first node id of level k's tree."""
  return jax.lax.shift_left(jnp.int32(2), k) - 2 - k


def _highest_bit(x, levels):
  """The index of the highest set bit of each `x` < 2^levels, -1 where x = 0 (comparisons: no clz in Triton)."""
  return sum(((x >> b) > 0).astype(jnp.int32) for b in range(levels)) - 1


def _structure(node, count, levels):
  """(child0, child1, leaf) of node ids `node` `[BQ, W]` in streaming forests of `count` `[BQ, 1]` admitted cells
  (int32): level-tree nodes by heap arithmetic, level k's leaves are heap ids from 2^k on; the join of level j
  (id `level_offset(levels) + j`) joins the level-j chunk's root (child0) with the join, or the lowest chunk's
  root, of M's next lower set bit (child1), as `fsjax.reference.forest.join_chains` links them. Ids of nodes
  absent from the forest give anything; the beam never holds them."""
  first_join = _static_level_offset(levels)
  k = sum((node >= _static_level_offset(j)).astype(jnp.int32) for j in range(1, levels))
  heap = node - _level_offset(k) + 1
  is_join = node >= first_join
  join = jnp.maximum(node - first_join, 0)
  below = count & (jax.lax.shift_left(jnp.int32(1), join) - 1)  # M's chunks smaller than the join's
  lower = jnp.maximum(_highest_bit(below, levels), 0)
  lowest = (count & -count) == jax.lax.shift_left(jnp.int32(1), lower)  # that chunk is M's smallest: no join
  child0 = jnp.where(is_join, _level_offset(join), node + heap)
  child1 = jnp.where(is_join, jnp.where(lowest, _level_offset(lower), first_join + lower), node + heap + 1)
  leaf = ~is_join & (heap >= jax.lax.shift_left(jnp.int32(1), k))
  return child0, child1, leaf


def _root(count, levels):
  """The root of a streaming forest of `count` admitted cells: the join of M's highest set bit, or that chunk's
  root where M is a power of two, NO_NODE where M = 0 (`fsjax.cache.forest`'s `_rejoin`)."""
  top = _highest_bit(count, levels)
  single = (count & (count - 1)) == 0
  node = jnp.where(single, _level_offset(jnp.maximum(top, 0)), _static_level_offset(levels) + top)
  return jnp.where(count > 0, node, NO_NODE)


def _beam_kernel(
  q_ref,
  pos_ref,
  count_ref,
  lam_ref,
  sigma_ref,
  layer_ref,
  mu_ref,
  rho_ref,
  amax_ref,
  pmin_ref,
  first_ref,
  leaf_ref,
  out_ref,
  *,
  beam,
  steps,
  bound_c,
  scale,
  levels,
):
  """FS-B Eq. 11 for a tile of queries over one (batch, head)'s node table. q_ref `[BQ, d]`, pos_ref `[BQ]`,
  count_ref `[L]` (the forest's admitted cells per layer), lam_ref / sigma_ref / layer_ref `[1]`, node refs `[L,
  N(, d)]`, all read at layer `layer_ref[0]` → out_ref `[BQ, W]` the final beam's leaf cells.

  A beam step expands each slot into two pool entries (a kept leaf and nothing, or the two children of an inner
  node), scores them by U (gathered rows of μ, no tensor cores: a query's 2W rows are its own), and refills the
  W slots in the order `lax.sort` gives the reference (rank, then the lower first cell), each entry's slot
  counted from all pairs at once: `[BQ, 2W, 2W]` comparisons instead of W dependent extractions."""
  q = q_ref[...].astype(jnp.float32)
  pos = pos_ref[...].astype(jnp.float32)
  q_norm = jnp.sqrt(jnp.sum(q * q, axis=1))
  lam, sigma, layer = lam_ref[0], sigma_ref[0], layer_ref[0]
  field = lambda ref, node: ref[layer, node]  # one indexer: Triton lowers no chain of `ref.at` views
  slots = jnp.arange(beam)[None, :]
  never = jnp.iinfo(jnp.int32).max
  count = jnp.full((q.shape[0], 1), count_ref[layer], jnp.int32)  # every query of the tile searches one forest

  def rank(node):  # U of pool entries `[BQ, W]`; −inf where NO_NODE
    safe = jnp.maximum(node, 0)
    mu = mu_ref[layer, safe, :].astype(jnp.float32)  # [BQ, W, d]
    content = (jnp.sum(mu * q[:, None, :], axis=2) + bound_c * q_norm[:, None] * field(rho_ref, safe)) * scale
    prior = field(amax_ref, safe) * lam * erf((pos[:, None] - field(pmin_ref, safe)) / (2.0 * sigma))
    return jnp.where(node >= 0, content + prior, -jnp.inf)

  def step(_, current):
    valid = current >= 0
    child0, child1, leaf = _structure(current, count, levels)
    kept = valid & leaf
    inner = valid & ~kept
    node_a = jnp.where(kept, current, jnp.where(inner, child0, NO_NODE))
    node_b = jnp.where(inner, child1, NO_NODE)
    rank_a = jnp.where(kept, jnp.inf, rank(node_a))  # leaves keep their slots
    rank_b = rank(node_b)
    first_a = jnp.where(node_a >= 0, field(first_ref, jnp.maximum(node_a, 0)), never)
    first_b = jnp.where(node_b >= 0, field(first_ref, jnp.maximum(node_b, 0)), never)

    # Each live entry's slot is the number of entries ahead of it by (rank desc, first asc): distinct nodes
    # cover disjoint cells, so their first cells differ and the order is strict. Dead entries (−inf, never)
    # are ahead of nothing and fill no slot.
    ahead_of_a = _count_ahead(rank_a, first_a, rank_a, first_a) + _count_ahead(rank_b, first_b, rank_a, first_a)
    ahead_of_b = _count_ahead(rank_a, first_a, rank_b, first_b) + _count_ahead(rank_b, first_b, rank_b, first_b)
    return jnp.maximum(_place(node_a, rank_a, ahead_of_a, beam), _place(node_b, rank_b, ahead_of_b, beam))

  start = jnp.where(slots == 0, _root(count, levels), NO_NODE)
  current = jax.lax.fori_loop(0, steps, step, start)
  out_ref[...] = jnp.where(current >= 0, field(leaf_ref, jnp.maximum(current, 0)), NO_NODE)


@functools.partial(jax.jit, static_argnames=("beam", "steps", "bound_c", "forest_sets", "block_q", "interpret"))
def beam_search(
  q,
  positions,
  counts,
  nodes,
  lam,
  sigma,
  *,
  beam,
  steps,
  bound_c,
  forest_sets=1,
  layer=None,
  block_q=8,
  interpret=None,
):
  """FS-B beam search (FS Eq. 11) of every query over its (batch, head)'s forest node tables.

  Args:
    q: `[batch, T, heads, d]` unrotated queries at `positions` `[batch, T]`.
    counts: `[batch, forests]` int32 cells admitted into each forest (`Forest.count`; 0 for an empty forest),
      which fix its root and its nodes' children (see the module docstring); with `layer`, a scanned model's
      stack `[layers, batch, forests]`.
    nodes: node table of `[batch, forests, N(, d)]` arrays, as `fsjax.cache.forest.Forest.nodes` lays them out
      (N = 2^(levels+1) - 2): mu, rho, amax, pmin, first and leaf are read (the children are not).
    forest_sets: the forests form this many sets of `forests / forest_sets` (FS-B's forest 0 of every key/value
      head, then its forest τ: 2), and every query head searches one forest of each set: query head h that of
      key/value head `h // group`, group = heads / (forests / forest_sets) (grouped-query attention).
    lam, sigma: `[heads]`; beam: W (a power of two when compiled); steps: beam steps (≥ the forest height).
    layer: None, or an int32 scalar when `nodes` are a scanned model's stacks `[layers, batch, forests, N(, d)]`:
      the kernel reads that layer's rows where they lie, where slicing the layer out would copy the whole table.

  Returns:
    `[batch, T, heads, forest_sets · beam]` int32 cells of the final beams' leaves, set by set, NO_NODE in
    unused slots; each set's the same as `fsjax.reference.forest.beam_search` for each (batch, head).
  """
  interpret = default_interpret() if interpret is None else interpret
  check_power_of_two("beam", beam, interpret)
  batch, count, heads, dim = q.shape
  block_q = min(block_q, pl.next_power_of_2(count))
  padded = -(-count // block_q) * block_q
  q = pad_axis(pad_head_dim(q.astype(jnp.float32)), 1, padded)
  positions = pad_axis(positions.astype(jnp.int32), 1, padded)
  counts, _ = layer_stack(counts.astype(jnp.int32), layer, 2)
  mu, layer_index = layer_stack(nodes["mu"], layer, 4)
  nodes = {name: layer_stack(x, layer, 3)[0] for name, x in nodes.items() if name != "mu"}
  layers, forests, num_nodes, width = mu.shape[0], mu.shape[2], mu.shape[3], q.shape[-1]
  levels = (num_nodes + 2).bit_length() - 2
  if num_nodes != _static_level_offset(levels) + levels:
    raise ValueError(f"a streaming forest's node table holds 2^(levels+1) - 2 nodes, got {num_nodes}")
  if forests % forest_sets or counts.shape[1:] != (batch, forests):
    raise ValueError(
      f"{forests} forests in {forest_sets} sets, with counts [batch, forests] = {(batch, forests)}; got counts "
      f"{counts.shape[1:]}"
    )
  per_set = forests // forest_sets
  group = group_size(heads, per_set)
  # Grid axis 1 runs over (set, query head) pairs e: query head e mod heads, forest (e // heads, its kv head).
  head = lambda e: e % heads
  forest = lambda e: (e // heads) * per_set + (e % heads) // group
  table_spec = pl.BlockSpec((layers, None, None, num_nodes), lambda b, e, t: (0, b, forest(e), 0))
  order = ("rho", "amax", "pmin", "first", "leaf")
  kernel = functools.partial(
    _beam_kernel, beam=beam, steps=steps, bound_c=bound_c, scale=1.0 / math.sqrt(dim), levels=levels
  )
  out = pl.pallas_call(
    kernel,
    grid=(batch, forest_sets * heads, padded // block_q),
    in_specs=[
      pl.BlockSpec((None, block_q, None, width), lambda b, e, t: (b, t, head(e), 0)),
      pl.BlockSpec((None, block_q), lambda b, e, t: (b, t)),
      pl.BlockSpec((layers, None, None), lambda b, e, t: (0, b, forest(e))),
      pl.BlockSpec((1,), lambda b, e, t: (head(e),)),
      pl.BlockSpec((1,), lambda b, e, t: (head(e),)),
      pl.BlockSpec((1,), lambda b, e, t: (0,)),
      pl.BlockSpec((layers, None, None, num_nodes, width), lambda b, e, t: (0, b, forest(e), 0, 0)),
      *([table_spec] * len(order)),
    ],
    # Set s's beams fill columns s·W .. (s+1)·W - 1 of the query head's row: the layout the rerank reads.
    out_specs=pl.BlockSpec((None, block_q, None, beam), lambda b, e, t: (b, t, head(e), e // heads)),
    out_shape=jax.ShapeDtypeStruct((batch, padded, heads, forest_sets * beam), jnp.int32),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="fsb_beam_search",
  )(
    q,
    positions,
    counts,
    lam.astype(jnp.float32),
    sigma.astype(jnp.float32),
    layer_index,
    pad_head_dim(mu.astype(jnp.float32)),
    *(nodes[name].astype(jnp.float32 if name in ("rho", "amax", "pmin") else jnp.int32) for name in order),
  )
  return out[:, :count]
