"""FS-B streaming forest cache (FS Sec. 3.4, App. E.1-E.2): the FS archive plus both causal forests, kept up to
date as cells are admitted instead of rebuilt per step.

A forest's admitted cells, in arrival order, form the aligned chunks of the binary digits of their count M
(Eq. 18). Admitting cells is a binary-counter increment: only the chunks whose digits changed are built (the
size-2^k chunk is new exactly when M >> k changes while bit k of the new M is set); every other chunk tree stays
where it is. Each level k owns fixed storage for one perfect tree of 2^k leaves in heap order, so a forest is one
preallocated node table per (batch row, head) — level k at `level_offset(k)`, the join nodes (Eq. 21, recomputed
on every admission) at the end — and no admission reallocates, repacks or rereads the rest of it.

Per block, a forest admits at most `block // cell` cells; each level that changes is built in its own conditional,
for every (row, head) at once (masked), on operands the size of that level's tree: about one tree build per block
whatever M (amortized), of log₂ M cells per admitted cell on average, where the archive path rebuilds every forest
at every step (`fsjax.reference.forest.fsb_select_from_summaries`, the prefill formulation). Both forests of every head
live in one table of `2·heads` entries, so one update and one search serve both. A `vmap` over heads would turn a
data-dependent conditional into a select that evaluates both branches, so the cache is written batched over
(row, head) by hand.

The forests hold the cells eligible for the block of the last admission target (`advance`); a single-token step
advances to its own block and beam-searches the cached forests (`fsjax.attention.freesolo_step`). A multi-token
chunk goes block by block: the forests advance to each block it touches and beam-search that block's queries,
then to the block of the token after its last valid one (`eligible_after`), so the next step finds them current
and building a prompt's forests counts as prefill work, not as the first decode step's.

In a scanned model a `Forest`'s arrays are views into the stacked cache (`fsjax.cache.layered`): admissions write
their levels, joins, counts and arrivals into the stack with `scatter`, and the beam-search kernel reads its
layer's rows where they lie, so a decode step moves no whole node table (150 MB per layer at 128k, 341M shape).
"""

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fsjax.cache import archive as archive_lib
from fsjax.cache.layered import after, read, scatter, update_slice
from fsjax.reference import forest as forest_ref

NO_NODE = forest_ref.NO_NODE
# Chunk levels from this one up build their leaf order in a loop (`looped_leaf_order`): one compiled split per
# level instead of k. Unrolled splits run faster, and the small levels are the ones built at almost every block;
# a level k >= 6 is rebuilt once per 2^k admissions, so its slower loop costs little per block.
LOOPED_FROM = 6
# Pairs (row, forest head) built together when a level from LOOPED_FROM up changes: a forest-τ carry changes one
# head, forest 0's carries change all `heads` of its heads at once (a few rounds of SLOTS).
SLOTS = 4


def num_levels(max_cells):
  """Chunk levels k = 0 … ⌊log₂ max_cells⌋."""
  return max(int(max_cells).bit_length(), 1)


def level_offset(k):
  """First node id of level k's tree: levels below hold 2^(j+1) − 1 nodes each."""
  return 2 ** (k + 1) - 2 - k


@flax.struct.dataclass
class Forest:
  """One causal forest per (batch row, head) over its admitted cells.

  arrivals: `[batch, heads, max_cells]` int32 admitted cell indices in arrival order (NO_NODE past `count`).
  count: `[batch, heads]` int32 admitted cells M.
  root: `[batch, heads]` int32 node id of the forest's root, NO_NODE while M = 0.
  nodes: node table `[batch, heads, N(, d)]`: mu, rho, amax, pmin (Eq. 20 summaries; float), first (smallest
    cell index below), leaf (cell index, NO_NODE at inner nodes), child0, child1 (node ids, NO_NODE at leaves).
    N = level_offset(levels) + levels: every level's tree, then one join slot per level.
  """

  arrivals: jax.Array
  count: jax.Array
  root: jax.Array
  nodes: dict


@flax.struct.dataclass
class ForestCache:
  """archive: raw keys/values and cell summaries (`fsjax.cache.archive`); forests: both forests of every head as
  one `Forest` of `2·heads` "heads" — entry h < heads is head h's forest 0 (every eligible cell), entry
  heads + h its forest τ (eligible cells with a_c ≥ τ, Eq. 10) — so one update and one search serve both;
  admitted: `[batch]` int32 cells considered so far (the forests reflect exactly the cells below it)."""

  archive: archive_lib.Archive
  forests: Forest
  admitted: jax.Array
  # Static: the forests are already current for this one-token step's block (`fsjax.cache.advance_forests` ran
  # for every layer before the layers), so the step beam-searches them as they are.
  advanced: bool = flax.struct.field(pytree_node=False, default=False)

  def forest(self, which):
    """Forest 0 (`which=0`) or forest τ (`which=1`) of every head, as a `Forest` of `heads` entries."""
    heads = self.archive.max_norms.shape[2]
    return jax.tree_util.tree_map(lambda x: x[:, which * heads : (which + 1) * heads], self.forests)


def _static_children(levels):
  """child0, child1 `[N]` of the chunk levels (heap arithmetic within each level); join slots NO_NODE."""
  child0 = []
  for k in range(levels):
    heap = np.arange(1, 2 ** (k + 1))
    child0.append(np.where(heap < 2**k, level_offset(k) + 2 * heap - 1, NO_NODE))
  child0 = np.concatenate(child0 + [np.full(levels, NO_NODE)])
  return child0, np.where(child0 >= 0, child0 + 1, NO_NODE)


def empty_forest(batch, heads, head_dim, max_cells, dtype):
  levels = num_levels(max_cells)
  size = level_offset(levels) + levels
  child0, child1 = _static_children(levels)
  shape = (batch, heads, size)
  nodes = dict(
    mu=jnp.zeros((*shape, head_dim), dtype),
    rho=jnp.zeros(shape, dtype),
    amax=jnp.zeros(shape, dtype),
    pmin=jnp.zeros(shape, dtype),
    first=jnp.zeros(shape, jnp.int32),
    leaf=jnp.full(shape, NO_NODE, jnp.int32),
    child0=jnp.broadcast_to(jnp.asarray(child0, jnp.int32), shape),
    child1=jnp.broadcast_to(jnp.asarray(child1, jnp.int32), shape),
  )
  return Forest(
    arrivals=jnp.full((batch, heads, max_cells), NO_NODE, jnp.int32),
    count=jnp.zeros((batch, heads), jnp.int32),
    root=jnp.full((batch, heads), NO_NODE, jnp.int32),
    nodes=nodes,
  )


def empty_forest_cache(batch, capacity, heads, head_dim, cell, window, dtype=jnp.float32):
  """An empty archive of `capacity` tokens (its ring of `window + 1`) and two empty forests over its `capacity //
  cell` cells (nodes in `dtype` promoted to at least float32, the precision the reference builds them in)."""
  archive = archive_lib.empty_archive(batch, capacity, heads, head_dim, cell, window, dtype)
  forests = empty_forest(batch, 2 * heads, head_dim, capacity // cell, jnp.promote_types(dtype, jnp.float32))
  return ForestCache(archive=archive, forests=forests, admitted=jnp.zeros((batch,), jnp.int32))


def changed_levels(old_count, new_count, levels):
  """`[..., levels]` bool: the levels whose chunk is new after M goes from `old_count` to `new_count` — bit k of
  the new count is set and the digits from k up changed. The binary counter's work: the test counts it."""
  k = jnp.arange(levels)
  new, old = new_count[..., None], old_count[..., None]
  return ((new >> k) & 1 == 1) & ((new >> k) != (old >> k))


def looped_leaf_order(means, cell_ids):
  """The leaf order of one chunk, `forest_ref.chunk_leaf_orders(means, cell_ids, [S])[0][0]`, with one loop body
  for every depth: means `[S, d]` (S a power of two), cell_ids `[S]` → `[S]` positions into `means`.

  The reference splits the `[2^j, S / 2^j]` nodes of depth j as a reshape, one traced split per depth; here the
  node of each position is `position >> log₂ width` and the Eq. 19 reductions are segment sums, so the width
  is a loop variable and a size-2^k chunk compiles one split instead of k. Same splits and tie rules; the sums
  run in another order, so summaries agree to rounding.
  """
  size = means.shape[0]
  positions = jnp.arange(size, dtype=jnp.int32)
  largest = jnp.iinfo(jnp.int32).max

  def split(depth, order):
    shift = (size.bit_length() - 1) - depth  # log₂ of the node width at this depth
    width = 1 << shift
    node = positions >> shift
    per_node = lambda reduce, v: reduce(v, node, num_segments=size, indices_are_sorted=True)
    x_all, ids = means[order], cell_ids[order]
    x = x_all - (per_node(jax.ops.segment_sum, x_all) / width.astype(means.dtype))[node]
    norms = jnp.linalg.norm(x, axis=-1)
    farthest = per_node(
      jax.ops.segment_min, jnp.where(norms == per_node(jax.ops.segment_max, norms)[node], ids, largest)
    )
    u = forest_ref.normalize(per_node(jax.ops.segment_sum, jnp.where((ids == farthest[node])[:, None], x, 0.0)))
    for _ in range(2):
      u = forest_ref.normalize(per_node(jax.ops.segment_sum, x * jnp.sum(x * u[node], axis=-1, keepdims=True)))
    projection = jnp.sum(x * u[node], axis=-1)
    *_, within = jax.lax.sort((node, projection, ids, positions), num_keys=3)  # nodes stay contiguous
    sorted_ids = ids[within]
    first_half = (positions & (width - 1)) < width // 2
    lowest = lambda half: per_node(jax.ops.segment_min, jnp.where(half, sorted_ids, largest))
    swap = lowest(first_half) > lowest(~first_half)  # the half holding the lower cell index goes left
    within = jnp.where(swap[node], within[positions ^ (width // 2)], within)
    return order[within]

  return jax.lax.fori_loop(0, size.bit_length() - 1, split, positions)


def level_slice(k):
  """Node ids of level k's tree in the node table."""
  return slice(level_offset(k), level_offset(k) + 2 ** (k + 1) - 1)


def level_trees(forest: Forest, archive, k, rows=None, heads=None, *, cell, looped):
  """The size-2^k chunk tree over the current level-k chunk of each selected (row, forest head) pair (forest head
  h reads the archive's head h mod heads): dict of `[*P, 2^(k+1) − 1(, d)]` node fields, in heap order, in the
  node table's dtypes. `rows`, `heads`: int32 arrays of one shape P naming the pairs (default: every pair,
  P = [batch, heads]). `looped`: leaf order by `looped_leaf_order`."""
  size = 2**k
  if rows is None:
    rows, heads = (
      x.astype(jnp.int32)
      for x in jnp.meshgrid(jnp.arange(forest.count.shape[0]), jnp.arange(forest.count.shape[1]), indexing="ij")
    )
  start = (read(forest.count)[rows, heads] >> (k + 1)) << (k + 1)
  ids = read(forest.arrivals)[rows[..., None], heads[..., None], start[..., None] + jnp.arange(size)]
  safe = jnp.maximum(ids, 0)  # [*P, size]
  archive_heads = (heads % archive.max_norms.shape[2])[..., None]
  dtype = forest.nodes["mu"].dtype
  means = read(archive.mean_keys)[rows[..., None], safe, archive_heads].astype(dtype)  # [*P, size, d]
  norms = read(archive.max_norms)[rows[..., None], safe, archive_heads].astype(dtype)
  centers = ((safe + 0.5) * cell).astype(dtype)

  def build(m, n, c, i):
    order = looped_leaf_order(m, i)[None] if looped else None
    return {name: x[0] for name, x in forest_ref.chunk_trees(m, n, c, i, size, order=order).items()}

  flat = lambda x: x.reshape(-1, *x.shape[rows.ndim :])
  trees = jax.vmap(build)(flat(means), flat(norms), flat(centers), flat(safe))
  return {
    name: tree.reshape(*rows.shape, *tree.shape[1:]).astype(forest.nodes[name].dtype) for name, tree in trees.items()
  }


def _changed_trees(old, forest: Forest, archive, changed, k, *, cell):
  """Level k's node fields `old` (`[batch, heads, 2^(k+1) − 1(, d)]`) with the tree of every (row, head) where
  `changed[..., k]` is set rebuilt (looped leaf order), `SLOTS` pairs at a time: a forest-τ head's carry needs
  one head's tree, where a build batched over every head (masked) would build 2·heads of them."""
  pending = changed[..., k].reshape(-1)
  num_heads = changed.shape[1]

  def build_some(state):
    old, pending = state
    pair = jnp.argsort(~pending, stable=True)[:SLOTS].astype(jnp.int32)  # the first pending pairs
    rows, heads = pair // num_heads, pair % num_heads
    trees = level_trees(forest, archive, k, rows, heads, cell=cell, looped=True)
    rows = jnp.where(pending[pair], rows, changed.shape[0])  # slots past the pending pairs write nothing
    old = {name: value.at[rows, heads].set(trees[name], mode="drop") for name, value in old.items()}
    return old, pending.at[pair].set(False)

  return jax.lax.while_loop(lambda state: jnp.any(state[1]), build_some, (old, pending))[0]


def _rejoin(forest: Forest):
  """Recomputes every (row, head)'s join chain (Eq. 21) from its level roots into the join slots."""
  nodes = forest.nodes
  levels = num_levels_of(forest)
  first_join = level_offset(levels)
  roots = [jnp.asarray([level_offset(k)]) for k in range(levels)]

  def one(table, count):
    joins, root = forest_ref.join_chains(table, roots, count[None], first_join)
    return {name: value[0] for name, value in joins.items()}, root[0]

  joins, root = jax.vmap(jax.vmap(one))({name: read(x) for name, x in nodes.items()}, read(forest.count))
  # Each field's join slots are written in place into the table its chains just read (in a scanned model, the
  # stack), and XLA orders a read before an in-place write only through data (`layered.after`); a write it cannot
  # order gets a copy of the whole table. Each summary's joins depend on the reads of its own table (child and
  # leaf joins read none), but rho's also read mu's (Eq. 21), so mu's joins go last, at a position computed from
  # rho's join slots as written. They are read back from the table rather than taken from `joins`: a second use of
  # that computation lets XLA fuse it differently, which can move a join's rho by its last bit.
  where = (slice(None), slice(None), slice(first_join, None))
  nodes = {
    name: scatter(value, where, joins[name].astype(value.dtype)) if name in joins and name != "mu" else value
    for name, value in nodes.items()
  }
  start = after(jnp.int32(first_join), read(nodes["rho"])[where])
  nodes["mu"] = update_slice(nodes["mu"], (0, 0, start, 0), joins["mu"].astype(nodes["mu"].dtype))
  return forest.replace(nodes=nodes, root=scatter(forest.root, (Ellipsis,), root.astype(forest.root.dtype)))


def num_levels_of(forest: Forest):
  return num_levels(forest.arrivals.shape[-1])


def admit(forest: Forest, archive, cells, accept, *, cell, looped_from=LOOPED_FROM):
  """Appends the accepted cells to each (row, head)'s arrival order and rebuilds what changed.

  Args:
    cells: `[batch, n]` int32 cell indices, increasing along n; accept: `[batch, n, heads]` bool.
    looped_from: levels k >= this build their leaf order with `looped_leaf_order` (see LOOPED_FROM).

  Returns:
    the forest with the changed chunk levels (`changed_levels`) rebuilt and its joins recomputed.
  """
  levels = num_levels_of(forest)
  accept = jnp.moveaxis(accept, 1, 2)  # [batch, heads, n]
  count = read(forest.count)
  slot = jnp.where(
    accept, count[..., None] + jnp.cumsum(accept, axis=-1, dtype=jnp.int32) - 1, forest.arrivals.shape[-1]
  )
  rows = jnp.arange(cells.shape[0])[:, None, None]
  heads = jnp.arange(accept.shape[1])[None, :, None]
  arrivals = scatter(forest.arrivals, (rows, heads, slot), jnp.broadcast_to(cells[:, None], slot.shape), mode="drop")
  new_count = count + jnp.sum(accept, axis=-1, dtype=jnp.int32)
  changed = changed_levels(count, new_count, levels)
  forest = forest.replace(arrivals=arrivals, count=scatter(forest.count, (Ellipsis,), new_count))
  nodes = dict(forest.nodes)
  for k in range(levels):
    # One conditional per level, on level-k-sized operands, and the slice written back outside it: a conditional
    # (or a switch over levels) that returned the whole node table would copy the table, O(M), at every build.
    # Reading each slice out and writing it back costs O(M) bytes per block (the update's growth from 16k to 128k,
    # ~1.25×); scattering only the changed pairs' trees into the stack instead grew 1.14× but slowed the scanned
    # 341M model's decode tenfold at 128k on an H200 (docs/notes.md, FS-B).
    where = (slice(None), slice(None), level_slice(k))
    old = {name: read(nodes[name])[where] for name in forest_ref.TREE_FIELDS}

    def rebuilt(old, forest=forest, k=k):
      if k >= looped_from:  # built once per 2^k admissions of a head, each head on its own
        return _changed_trees(old, forest, archive, changed, k, cell=cell)
      mask = changed[..., k]  # small levels change in most heads at most blocks: all heads at once, masked
      trees = level_trees(forest, archive, k, cell=cell, looped=False)
      return {
        name: jnp.where(mask.reshape(*mask.shape, *([1] * (v.ndim - 2))), trees[name], v) for name, v in old.items()
      }

    new = jax.lax.cond(jnp.any(changed[..., k]), rebuilt, lambda old: old, old)
    nodes.update({name: scatter(nodes[name], where, value) for name, value in new.items()})
  forest = forest.replace(nodes=nodes)
  return _rejoin(forest)


def advance(cache: ForestCache, target, tau, *, cell, block, looped_from=LOOPED_FROM):
  """Admits every cell below `target` `[batch]` (cells eligible for a block start), `block // cell` cells at a
  time, into forest 0 and (where a_c ≥ τ `[heads]`) forest τ of every head (`looped_from`: see `admit`)."""
  per_block = block // cell
  target = target.astype(jnp.int32)
  archive = cache.archive  # read, never written, inside the loop: not part of its carry

  def one_block(state):
    forests, lo = state
    cells = lo[:, None] + jnp.arange(per_block, dtype=jnp.int32)  # [batch, n]
    fresh = cells < target[:, None]
    last_cell = archive.max_norms.shape[1] - 1
    norms = jnp.take_along_axis(
      read(archive.max_norms), jnp.minimum(cells, last_cell)[:, :, None], axis=1
    )  # [batch, n, heads]
    every = jnp.broadcast_to(fresh[:, :, None], norms.shape)
    accept = jnp.concatenate([every, every & (norms >= tau)], axis=2)  # [batch, n, 2·heads]
    forests = admit(forests, archive, cells, accept, cell=cell, looped_from=looped_from)
    return forests, jnp.maximum(lo, jnp.minimum(lo + per_block, target))

  forests, admitted = jax.lax.while_loop(
    lambda state: jnp.any(state[1] < target), one_block, (cache.forests, cache.admitted)
  )
  return cache.replace(forests=forests, admitted=admitted)


def advance_for_token(cache: ForestCache, positions, valid, tau, *, cell, block):
  """A one-token step's advance of a layer's forests to the block of its positions `[batch, 1]` (`eligible_target`):
  by the step itself, or for every layer before the layers (`fsjax.cache.advance_forests`)."""
  target = eligible_target(positions, valid, read(cache.admitted), cell=cell, block=block)
  return advance(cache, target, tau, cell=cell, block=block)


def eligible_target(pos, valid, admitted, *, cell, block):
  """Cells eligible for the block of each row's first valid position `[batch]` (rows without one stay put)."""
  first = jnp.min(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max), axis=1)
  return jnp.where(jnp.any(valid, axis=1), first // block * (block // cell), admitted).astype(jnp.int32)


def eligible_after(pos, valid, admitted, *, cell, block):
  """Cells eligible for the block of the token after each row's last valid position `[batch]` (rows without one
  stay put): every cell of a block that the chunk completed."""
  last = jnp.max(jnp.where(valid, pos, -1), axis=1)
  return jnp.where(jnp.any(valid, axis=1), (last + 1) // block * (block // cell), admitted).astype(jnp.int32)
