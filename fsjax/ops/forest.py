"""FS-B's beam search over a decode step's streaming forests (FS Eq. 11) with its implementation chosen by
`fsjax.ops.dispatch`: the reference (`fsjax.reference.forest.beam_search`, per row and head) or the Pallas kernel
(`pallas_kernels.forest_search`)."""

import jax
import jax.numpy as jnp

from fsjax.ops import dispatch
from fsjax.reference import forest as reference
from fsjax.reference.grouped import fold_group, per_query_head, unfold_group
from pallas_kernels import forest_search


def forest_beam_search(
  q,
  positions,
  roots,
  counts,
  nodes,
  lam,
  sigma,
  *,
  beam,
  steps,
  bound_c,
  cell,
  forest_sets=1,
  layer=None,
  impl="reference",
):
  """Beam search of every query over its (batch, head)'s forest node tables.

  Args:
    q: `[batch, T, heads, d]` unrotated queries at `positions` `[batch, T]`.
    roots, counts: `[batch, forests]` int32, each forest's root node id (-1 for an empty forest) and admitted
      cells (`Forest.root`, `Forest.count`); the reference starts from the roots, the kernel derives roots and
      children from the counts.
    nodes: node table of `[batch, forests, N(, d)]` arrays (`fsjax.cache.forest.Forest.nodes`), or with `layer`
      (int32 scalar) a scanned model's stacks `[layers, batch, forests, N(, d)]`, and so roots and counts `[layers,
      batch, forests]`: the kernel reads that layer where it lies.
    forest_sets: the forests form this many sets (FS-B: forest 0 of every key/value head, then forest τ), and
      query head h searches, in each set, the forest of key/value head `h // group` (group = heads / forests per
      set), never a copy of it.
    lam, sigma: `[heads]`; beam: W; steps: beam steps (>= the forest height); bound_c: c of Eq. 11; cell: the
      cell size (for the dispatch).

  Returns:
    `[batch, T, heads, forest_sets · beam]` int32 cells of the final beams' leaves, set by set, -1 in unused
    slots.
  """
  facts = dict(cell=cell, head_dim=q.shape[-1], beam=beam)
  if dispatch.resolve("forest_search", impl, **facts) == "pallas":
    return forest_search.beam_search(
      q,
      positions,
      counts,
      nodes,
      lam,
      sigma,
      beam=beam,
      steps=steps,
      bound_c=bound_c,
      forest_sets=forest_sets,
      layer=layer,
    )
  if layer is not None:
    nodes = {name: x[layer] for name, x in nodes.items()}
    roots = roots[layer]
  heads, forests = q.shape[2], nodes["mu"].shape[1]
  # Each set's forests serve the query heads in turn: the queries, λ and σ repeated once per set.
  q, lam, sigma = jnp.concatenate([q] * forest_sets, axis=2), jnp.tile(lam, forest_sets), jnp.tile(sigma, forest_sets)
  roots = jnp.broadcast_to(per_query_head(roots, q.shape[2], axis=1)[:, None], q.shape[:3])
  # A forest's query heads are folded into its query axis: one search per forest reads its table once.
  q, positions, lam, sigma = reference.folded_queries(q, positions, lam, sigma, forests)

  def one(q, pos, nodes, roots, lam, sigma):
    return reference.beam_search(q, pos, nodes, roots, beam=beam, bound_c=bound_c, lam=lam, sigma=sigma, steps=steps)

  per_head = jax.vmap(one, in_axes=(1, None, 0, 1, 0, 0), out_axes=1)
  found = jax.vmap(per_head, in_axes=(0, 0, 0, 0, None, None))(
    q, positions, nodes, fold_group(roots, forests), lam, sigma
  )
  found = unfold_group(found, forest_sets * heads)  # [batch, T, sets · heads, W]
  batch, count = found.shape[:2]
  return jnp.moveaxis(found.reshape(batch, count, forest_sets, heads, beam), 2, 3).reshape(
    batch, count, heads, forest_sets * beam
  )
