"""FS-B selection (FS Sec. 3.4, App. E.1): two causal forests over cell mean keys, beam search, token rerank.

Per head and query block n (block-boundary availability, as in training): forest 0 admits every eligible cell,
forest τ the eligible cells with `a_c >= τ` (Eq. 10, τ inclusive). A forest's M admitted cells, in arrival
(cell-index) order, form the aligned chunks of the binary digits of M (Eq. 18), each a perfect binary tree
split recursively at the median of its mean keys' projections on a principal direction (two normalized power
iterations from the farthest cell, Eq. 19), with node summaries μ, ρ, A, p_min (Eq. 20); the chunk roots are
joined smallest-first (Eq. 21). A chunk never changes once complete, so every aligned chunk of the whole
sequence's arrival order is built once, and block n's forest is the chain of chunks of its own M_n plus fresh
join nodes (the prefill formulation).

A query keeps `beam` nodes per level by U_v (Eq. 11, c = `bound_c`): leaves already in the beam stay, the
remaining slots go to the highest-U children; ranking ties go to the node whose smallest cell index is lower.
The candidates (the final beams' leaves, both forests, deduplicated) are reranked by Eq. 12 and the top K are
read as in FS (Eq. 9). With grouped-query attention the forests (and τ) are a key/value head's, built once and
searched by each query head of its group with that head's λ, σ (`fsb_select_from_summaries`). Readings
(docs/design.md §4): splits put the first ⌈n/2⌉ cells by projection in the left child;
projection ties and the farthest-cell choice go to the lower cell index; a zero direction (all cells equal)
projects every cell to 0; of the two halves, the one holding the lower cell index is the left child (the
direction's sign is arbitrary, so this makes the tree a function of the split alone).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fsjax.reference.cells import cell_summaries
from fsjax.reference.common import PRECISION
from fsjax.reference.grouped import fold_group, group_size, unfold_group

NO_NODE = -1


def _prior(distance, lam, sigma):
  """The Eq. 7 prior factor `λ erf(x / 2σ)` (times a_c or A_v by the caller)."""
  return lam * jax.scipy.special.erf(distance / (2.0 * sigma))


def normalize(u):
  norm = jnp.linalg.norm(u, axis=-1, keepdims=True)
  return jnp.where(norm > 0, u / jnp.where(norm > 0, norm, 1.0), 0.0)


def _split_level(groups, means, cell_ids):
  """One level of Eq. 19 splits. groups `[G, n]` positions into `means` `[M, d]` → the same groups reordered so
  that each half is one child, sorted by projection (ties to the lower cell index), the half holding the lower
  cell index first (the left child)."""
  x_all = means[groups]  # [G, n, d]
  x = x_all - jnp.mean(x_all, axis=1, keepdims=True)
  ids = cell_ids[groups]
  norms = jnp.linalg.norm(x, axis=-1)
  farthest = jnp.argmin(
    jnp.where(norms == jnp.max(norms, axis=1, keepdims=True), ids, jnp.iinfo(jnp.int32).max), axis=1
  )
  u = normalize(jnp.take_along_axis(x, farthest[:, None, None], axis=1)[:, 0])
  for _ in range(2):
    u = normalize(jnp.einsum("gnd,gn->gd", x, jnp.einsum("gnd,gd->gn", x, u, precision=PRECISION), precision=PRECISION))
  projection = jnp.einsum("gnd,gd->gn", x, u, precision=PRECISION)
  _, _, order = jax.lax.sort(
    (projection, ids, jnp.broadcast_to(jnp.arange(groups.shape[1]), groups.shape)), dimension=1, num_keys=2
  )
  # u's sign is arbitrary (two cells are both farthest, up to rounding), so the half holding the lower cell index
  # goes left: the split, not the direction, defines the tree.
  half = groups.shape[1] // 2
  sorted_ids = jnp.take_along_axis(ids, order, axis=1)
  swap = jnp.min(sorted_ids[:, :half], axis=1) > jnp.min(sorted_ids[:, half:], axis=1)
  order = jnp.where(swap[:, None], jnp.roll(order, half, axis=1), order)
  return jnp.take_along_axis(groups, order, axis=1)


def chunk_leaf_orders(means, cell_ids, sizes):
  """Leaf order of every aligned chunk of each size in `sizes` (powers of two): per size a `[M // size, size]`
  array of positions into `means` `[M, d]`, such that each node at depth ℓ covers a contiguous run of
  size / 2^ℓ.

  Splits are per node, so the nodes of one width from every size are split in one batch: max(sizes) split
  levels to compile instead of one per (size, depth).
  """
  orders = {size: jnp.arange(means.shape[0] // size * size).reshape(-1, size) for size in sizes}
  width = max(sizes, default=1)
  while width > 1:
    active = [size for size in sizes if size >= width and orders[size].size]
    if active:
      split = _split_level(jnp.concatenate([orders[size].reshape(-1, width) for size in active]), means, cell_ids)
      counts = [orders[size].size // width for size in active]
      for size, end, count in zip(active, np.cumsum(counts), counts):
        orders[size] = split[end - count : end].reshape(orders[size].shape)
    width //= 2
  return [orders[size] for size in sizes]


def chunk_trees(means, norms, centers, cell_ids, size, order=None):
  """Every aligned chunk of `size` (a power of two) consecutive arrival positions, as a perfect binary tree of
  Eq. 19 splits with Eq. 20 summaries, in heap order.

  Args:
    means: `[M, d]` mean keys in arrival order; norms, centers: `[M]` (a_c and the cell's center position);
    cell_ids: `[M]` int32 cell index of each arrival (the tie-break of Eq. 19 and the node's first cell).
    order: the chunks' leaf orders from `chunk_leaf_orders`, if already computed.

  Returns:
    dict of `[M // size, 2 size − 1]` arrays (mu `[.., d]`): mu, rho, amax, pmin, first (smallest cell index
    below the node), leaf (cell index at leaves, NO_NODE at inner nodes). The nodes of one depth are the aligned
    runs of the leaf order, summarized by one reshape: memory O(M·d).
  """
  if order is None:
    (order,) = chunk_leaf_orders(means, cell_ids, [size])  # [I, size] positions, each node a contiguous run
  x, a, c, ids = means[order], norms[order], centers[order], cell_ids[order]
  count = order.shape[0]
  depths = []
  width = size
  while width >= 1:  # depth j: 2^j nodes of `width` leaves, heap ids 2^j … 2^(j+1) − 1
    runs = lambda v: v.reshape(count, size // width, width, *v.shape[2:])
    mu = jnp.mean(runs(x), axis=2)
    depths.append(
      dict(
        mu=mu,
        rho=jnp.max(jnp.linalg.norm(runs(x) - mu[:, :, None], axis=-1), axis=2),
        amax=jnp.max(runs(a), axis=2),
        pmin=jnp.min(runs(c), axis=2),
        first=jnp.min(runs(ids), axis=2),
        leaf=ids if width == 1 else jnp.full((count, size // width), NO_NODE, ids.dtype),
      )
    )
    width //= 2
  return {name: jnp.concatenate([d[name] for d in depths], axis=1) for name in depths[0]}


def _chunk_nodes(means, norms, centers, cell_ids):
  """Every node of every aligned chunk tree of the arrival order `[M]`, as one flat table.

  Returns:
    dict of `[Nc]` arrays (μ `[Nc, d]`): mu, rho, amax, pmin, first (smallest cell index), child0, child1
    (node ids, NO_NODE for leaves), leaf (cell index, NO_NODE for inner nodes); and `roots[k]` `[M // 2^k]`, the
    node id of chunk m of size 2^k.
  """
  num = means.shape[0]
  sizes = [2**k for k in range(num.bit_length())]
  tables, roots, base = [], [], 0
  for size, order in zip(sizes, chunk_leaf_orders(means, cell_ids, sizes)):
    trees = chunk_trees(means, norms, centers, cell_ids, size, order)
    count, per_tree = trees["leaf"].shape
    heap = np.arange(1, per_tree + 1)  # node h at index h − 1, children 2h and 2h + 1
    is_leaf = heap >= size
    ids = base + np.arange(count)[:, None] * per_tree + (heap - 1)[None]  # [I, nodes]
    child = lambda offset: np.where(is_leaf[None], NO_NODE, ids + heap[None] + offset)  # id of heap 2h (+1)
    tables.append(dict(trees, child0=child(0), child1=child(1)))
    roots.append(base + np.arange(count) * per_tree)
    base += count * per_tree
  table = {
    name: jnp.concatenate([jnp.asarray(t[name]).reshape(-1, *jnp.shape(t[name])[2:]) for t in tables])
    for name in tables[0]
  }
  return table, [jnp.asarray(r) for r in roots]


def _join(a, b):
  """Eq. 21 join of node summaries `a`, `b` (dicts of arrays, same shapes)."""
  size = a["size"] + b["size"]
  mu = (a["size"][..., None] * a["mu"] + b["size"][..., None] * b["mu"]) / size[..., None]
  rho = jnp.maximum(
    a["rho"] + jnp.linalg.norm(a["mu"] - mu, axis=-1), b["rho"] + jnp.linalg.norm(b["mu"] - mu, axis=-1)
  )
  return dict(
    mu=mu,
    rho=rho,
    amax=jnp.maximum(a["amax"], b["amax"]),
    pmin=jnp.minimum(a["pmin"], b["pmin"]),
    first=jnp.minimum(a["first"], b["first"]),
    size=size,
  )


SUMMARY = ("mu", "rho", "amax", "pmin", "first")
TREE_FIELDS = (*SUMMARY, "leaf")  # what `chunk_trees` returns per node


def join_chains(table, roots, admitted_before, first_join_id):
  """Join chains (Eq. 18, 21) over the chunks of each admitted count, smallest chunk first.

  Args:
    table: node fields (SUMMARY, plus anything else) indexed by node id; roots: per level k a `[chunks]` array of
      chunk-root ids, chunk m of size 2^k at entry m (a single entry serves every count: the current chunk);
    admitted_before: `[n]` admitted counts M; first_join_id: the node id of the first join node.

  Returns:
    (join nodes: dict of `[n, levels]` arrays with SUMMARY, child0, child1, leaf — join (i, k) has node id
    `first_join_id + i·levels + k` and is a real node only where its children are — and the forest root of each
    count `[n]`, NO_NODE where M = 0).
  """
  count = admitted_before.shape[0]
  levels = len(roots)
  pick = lambda node: {name: table[name][jnp.maximum(node, 0)] for name in SUMMARY}
  current = jnp.full((count,), NO_NODE)
  current_sum = dict(pick(current), size=jnp.zeros((count,), table["mu"].dtype))
  joins = []
  for k in range(levels):
    present = (admitted_before >> k) & 1 == 1
    chunk_index = (admitted_before >> (k + 1)) << 1  # the size-2^k chunk after the larger ones
    chunk = jnp.where(present, roots[k][jnp.clip(chunk_index, 0, roots[k].shape[0] - 1)], NO_NODE)
    chunk_sum = dict(pick(chunk), size=jnp.full((count,), 2**k, table["mu"].dtype))
    make_join = present & (current != NO_NODE)
    joined = _join(chunk_sum, current_sum)
    joins.append(
      dict(
        {name: joined[name] for name in SUMMARY},
        child0=jnp.where(make_join, chunk, NO_NODE),
        child1=jnp.where(make_join, current, NO_NODE),
        leaf=jnp.full((count,), NO_NODE),
      )
    )
    choose = lambda a, b, c: jnp.where(
      jnp.expand_dims(make_join, tuple(range(1, a.ndim))),
      a,
      jnp.where(jnp.expand_dims(present, tuple(range(1, a.ndim))), b, c),
    )
    current_sum = {name: choose(joined[name], chunk_sum[name], v) for name, v in current_sum.items()}
    current = jnp.where(make_join, first_join_id + jnp.arange(count) * levels + k, jnp.where(present, chunk, current))
  return {name: jnp.stack([j[name] for j in joins], axis=1) for name in joins[0]}, current


def block_forests(table, roots, admitted_before):
  """Each block's join chain over the chunks of its admitted count (Eq. 18, 21), appended to `table`.

  Args:
    admitted_before: `[num_blocks]` admitted cells before each block's start (M_n).

  Returns:
    (table with the join nodes appended, root node id per block `[num_blocks]`, NO_NODE where M_n = 0).
  """
  joins, roots = join_chains(table, roots, admitted_before, table["mu"].shape[0])
  table = {
    name: jnp.concatenate([table[name], joins[name].reshape(-1, *joins[name].shape[2:]).astype(table[name].dtype)])
    if name in joins
    else table[name]
    for name in table
  }
  return table, roots


def beam_search(q, positions, table, roots, *, beam, bound_c, lam, sigma, steps):
  """Eq. 11 beam search of each query from its block's root: the final beam's leaves `[T, beam]` (NO_NODE pad).

  Args:
    q: `[T, d]` unrotated queries at `positions` `[T]`; roots: `[T]` root node id of each query's forest.
    lam, sigma: scalars, or `[T]` (each query its head's, when a key/value head's forest serves a group).
  """
  dim = q.shape[-1]
  q_norm = jnp.linalg.norm(q, axis=-1)
  lam, sigma = (jnp.broadcast_to(x, positions.shape)[:, None] for x in (lam, sigma))

  def priority(node):  # node [T, n] → U [T, n], -inf for NO_NODE
    safe = jnp.maximum(node, 0)
    content = (
      jnp.einsum("td,tnd->tn", q, table["mu"][safe], precision=PRECISION)
      + bound_c * q_norm[:, None] * table["rho"][safe]
    ) / math.sqrt(dim)
    score = content + table["amax"][safe] * _prior(positions[:, None] - table["pmin"][safe], lam, sigma)  # Eq. 11
    return jnp.where(node >= 0, score, -jnp.inf)

  def descend(_, current):  # one level: the same shapes every step, so one compiled body
    is_leaf = table["leaf"][jnp.maximum(current, 0)] >= 0
    inner = (current >= 0) & ~is_leaf
    kept = jnp.where((current >= 0) & is_leaf, current, NO_NODE)
    children = jnp.concatenate(
      [
        jnp.where(inner, table["child0"][jnp.maximum(current, 0)], NO_NODE),
        jnp.where(inner, table["child1"][jnp.maximum(current, 0)], NO_NODE),
      ],
      axis=1,
    )
    pool = jnp.concatenate([kept, children], axis=1)
    rank = jnp.where(
      jnp.concatenate([kept >= 0, jnp.zeros(children.shape, bool)], axis=1), jnp.inf, priority(pool)
    )  # leaves keep their slots
    first = jnp.where(pool >= 0, table["first"][jnp.maximum(pool, 0)], jnp.iinfo(jnp.int32).max)
    _, _, ordered = jax.lax.sort((-rank, first, pool), dimension=1, num_keys=2)
    return ordered[:, :beam]

  current = jnp.full((q.shape[0], beam), NO_NODE).at[:, 0].set(roots)
  current = jax.lax.fori_loop(0, steps, descend, current)
  return jnp.where(current >= 0, table["leaf"][jnp.maximum(current, 0)], NO_NODE)


def forest_candidates(q, positions, mean_keys, max_norms, admitted, *, lam, sigma, cell, block, beam, bound_c):
  """One head, one forest: the cells each query's beam search reaches, `[C, beam]` (NO_NODE pad).

  Args:
    q: `[C, d]` at `positions` `[C]`; mean_keys: `[M, d]`; max_norms: `[M]`; admitted: `[M]` bool (Eq. 10);
    lam, sigma: scalars or `[C]`. Only cells complete before a query's block start are ever reached.
  """
  num_cells = mean_keys.shape[0]
  if num_cells == 0:
    return jnp.full((q.shape[0], beam), NO_NODE)
  order = jnp.argsort(~admitted, stable=True)  # admitted cells first, in arrival (index) order
  centers = (order + 0.5) * cell
  table, roots = _chunk_nodes(mean_keys[order], max_norms[order], centers.astype(mean_keys.dtype), order)
  num_blocks = (num_cells + 1) * cell // block + 1  # every block a query of this sequence can sit in
  eligible_cells = jnp.arange(num_blocks) * (block // cell)  # cells before each block's start
  admitted_before = jnp.sum(admitted[None, :] & (jnp.arange(num_cells)[None, :] < eligible_cells[:, None]), axis=1)
  table, block_roots = block_forests(table, roots, admitted_before)
  return beam_search(
    q,
    positions,
    table,
    block_roots[jnp.minimum(positions // block, num_blocks - 1)],
    beam=beam,
    bound_c=bound_c,
    lam=lam,
    sigma=sigma,
    steps=len(roots),
  )


def token_rerank(q, positions, k, candidates, max_norms, *, lam, sigma, cell, top_k):
  """Eq. 12 over the deduplicated candidates, then the top K (ties to the lower cell index).

  Args:
    q: `[C, d]` at `positions` `[C]`; k: `[S, d]` keys (one head, unrotated, slot = position; any float dtype, the
      gathered cells are computed in q's); candidates: `[C, n]` cell indices (NO_NODE pad, repeats allowed);
      max_norms: `[M]`; lam, sigma: scalars or `[C]`.

  Returns:
    `[C, top_k]` int32 cells in decreasing Eq. 12 score, NO_NODE in unused slots.
  """
  count_q, dim = q.shape
  lam, sigma = (jnp.broadcast_to(x, positions.shape)[:, None] for x in (lam, sigma))
  num_cells = max_norms.shape[0]
  safe = jnp.maximum(candidates, 0)
  tokens = k[: num_cells * cell].reshape(num_cells, cell, dim)[safe].astype(q.dtype)  # [C, n, s, d]
  mass = jax.nn.logsumexp(jnp.einsum("td,tnsd->tns", q, tokens, precision=PRECISION) / math.sqrt(dim), axis=-1)
  score = mass + max_norms[safe] * _prior(positions[:, None] - (safe + 0.5) * cell, lam, sigma)
  # Deduplicate: sort by cell index and keep the first of each run.
  ids_sorted, score_sorted = jax.lax.sort(
    (jnp.where(candidates >= 0, candidates, jnp.iinfo(jnp.int32).max), score), dimension=1, num_keys=1
  )
  repeat = jnp.concatenate([jnp.zeros((count_q, 1), bool), ids_sorted[:, 1:] == ids_sorted[:, :-1]], axis=1)
  valid = (ids_sorted != jnp.iinfo(jnp.int32).max) & ~repeat
  count = min(top_k, candidates.shape[1])
  _, slot = jax.lax.top_k(jnp.where(valid, score_sorted, -jnp.inf), count)  # lower slot = lower cell on ties
  chosen = jnp.where(jnp.take_along_axis(valid, slot, axis=1), jnp.take_along_axis(ids_sorted, slot, axis=1), NO_NODE)
  return jnp.pad(chosen, ((0, 0), (0, top_k - count)), constant_values=NO_NODE).astype(jnp.int32)


def folded_queries(q, positions, lam, sigma, kv_heads):
  """Each key/value head's query heads folded into the query axis (`fsjax.reference.grouped.fold_group`), so
  one pass per key/value head reads its keys, summaries and forests once: q `[batch, C · group, kv_heads, d]`,
  positions `[batch, C · group]`, lam and sigma `[kv_heads, C · group]` (each folded query its own head's)."""
  heads, count = q.shape[2], q.shape[1]
  group = group_size(heads, kv_heads)
  per_query = lambda x: jnp.tile(x.reshape(kv_heads, group), (1, count))
  return fold_group(q, kv_heads), jnp.repeat(positions, group, axis=1), per_query(lam), per_query(sigma)


def rerank_candidates(q, positions, k, max_norms, candidates, *, lam, sigma, cell, top_k):
  """`token_rerank` of every batch row and query head, over the keys of the key/value head it reads: q
  `[batch, C, heads, d]` at `positions` `[batch, C]`, k `[batch, S, kv_heads, d]`, max_norms
  `[batch, M, kv_heads]`, candidates `[batch, C, heads, n]`, lam, sigma `[heads]` → `[batch, C, heads, top_k]`."""
  heads, kv_heads = q.shape[2], k.shape[2]
  rerank = functools.partial(token_rerank, cell=cell, top_k=top_k)
  q, positions, lam, sigma = folded_queries(q, positions, lam, sigma, kv_heads)
  per_head = jax.vmap(
    lambda q, p, k, c, m, lam, sigma: rerank(q, p, k, c, m, lam=lam, sigma=sigma),
    in_axes=(1, None, 1, 1, 1, 0, 0),
    out_axes=1,
  )
  chosen = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, None, None))(
    q, positions, k, fold_group(candidates, kv_heads), max_norms, lam, sigma
  )
  return unfold_group(chosen, heads)


@functools.partial(jax.jit, static_argnames=("cell", "block", "top_k", "beam", "bound_c"))
def fsb_select_from_summaries(
  q, positions, k, mean_keys, max_norms, *, tau, lam, sigma, cell=32, block=128, top_k=4, beam=16, bound_c=8.0
):
  """FS-B's selected cells for queries at `positions` (FS Sec. 3.4), forests built with the prefill formulation.
  No gradient.

  Args:
    q: `[batch, C, heads, d]` unrotated, at `positions` `[batch, C]`.
    k: `[batch, S, kv_heads, d]` unrotated keys, slot = position (the token rerank reads them); kv_heads divides
      heads.
    mean_keys: `[batch, M, kv_heads, d]`, max_norms: `[batch, M, kv_heads]` cell summaries (Eq. 5), M = S // cell.
    tau: `[kv_heads]` (from calibration, inclusive): it admits key/value cells into a key/value head's forest.
    lam, sigma: `[heads]`: a query's prior.

  Returns:
    `[batch, C, heads, top_k]` int32 cell indices, -1 in unused slots.
  """
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)

  def both_forests(q, positions, mean_keys, max_norms, tau, lam, sigma):
    routing = dict(lam=lam, sigma=sigma, cell=cell, block=block, beam=beam, bound_c=bound_c)
    everything = forest_candidates(q, positions, mean_keys, max_norms, jnp.ones(max_norms.shape, bool), **routing)
    high_norm = forest_candidates(q, positions, mean_keys, max_norms, max_norms >= tau, **routing)
    return jnp.concatenate([everything, high_norm], axis=1)

  # The forests are built once per key/value head and searched by its group's queries, folded (Eq. 10-11).
  folded_q, folded_positions, folded_lam, folded_sigma = folded_queries(q, positions, lam, sigma, k.shape[2])
  per_head = jax.vmap(both_forests, in_axes=(1, None, 1, 1, 0, 0, 0), out_axes=1)
  candidates = jax.vmap(per_head, in_axes=(0, 0, 0, 0, None, None, None))(
    folded_q, folded_positions, mean_keys, max_norms, tau, folded_lam, folded_sigma
  )
  candidates = unfold_group(candidates, q.shape[2])
  return rerank_candidates(q, positions, k, max_norms, candidates, lam=lam, sigma=sigma, cell=cell, top_k=top_k)


def fsb_select_cells(q, k, *, tau, lam, sigma, cell=32, block=128, top_k=4, beam=16, bound_c=8.0):
  """FS-B's selected cells of a whole sequence: q `[batch, T, heads, d]`, k `[batch, T, kv_heads, d]`, τ
  `[kv_heads]`, λ, σ `[heads]` → `[batch, T, heads, top_k]`."""
  mean_keys, max_norms, _ = cell_summaries(k, cell)
  positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  return fsb_select_from_summaries(
    q,
    positions,
    k,
    mean_keys,
    max_norms,
    tau=tau,
    lam=lam,
    sigma=sigma,
    cell=cell,
    block=block,
    top_k=top_k,
    beam=beam,
    bound_c=bound_c,
  )
