"""FS-B's beam search over a decode step's streaming forests (FS Eq. 11) with its implementation chosen by
`fsjax.ops.dispatch`: the reference (`fsjax.reference.forest.beam_search`, per row and head) or the Pallas kernel
(`pallas_kernels.forest_search`)."""

import jax

from fsjax.ops import dispatch
from fsjax.reference import forest as reference
from fsjax.reference.grouped import fold_group, unfold_group
from pallas_kernels import forest_search


def forest_beam_search(
  q, positions, roots, nodes, lam, sigma, *, counts, beam, steps, bound_c, cell, layer=None, impl="reference"
):
  """Beam search of every query over its (batch, head)'s forest node table.

  Args:
    q: `[batch, T, heads, d]` unrotated queries at `positions` `[batch, T]`; roots: `[batch, T, heads]` int32 node
      id of each query's forest root (-1 for an empty forest); counts: `[batch, T, heads]` int32 cells admitted
      into that forest (`Forest.count`), from which the kernel derives the root and the children of a streaming
      forest's nodes (the reference reads them from the table).
    nodes: node table of `[batch, forests, N(, d)]` arrays (`fsjax.cache.forest.Forest.nodes`), or a scanned
      model's stacks `[layers, batch, forests, N(, d)]` with `layer` (int32 scalar): the kernel reads that layer
      where it lies. `forests` divides heads: query head h searches forest `h // (heads // forests)` (a
      key/value head's, with grouped-query attention), never a copy of it.
    lam, sigma: `[heads]`; beam: W; steps: beam steps (>= the forest height); bound_c: c of Eq. 11; cell: the
      cell size (for the dispatch).

  Returns:
    `[batch, T, heads, beam]` int32 cells of the final beam's leaves, -1 in unused slots.
  """
  facts = dict(cell=cell, head_dim=q.shape[-1], beam=beam)
  if dispatch.resolve("forest_search", impl, **facts) == "pallas":
    return forest_search.beam_search(
      q, positions, counts, nodes, lam, sigma, beam=beam, steps=steps, bound_c=bound_c, layer=layer
    )
  if layer is not None:
    nodes = {name: x[layer] for name, x in nodes.items()}
  heads, forests = q.shape[2], nodes["mu"].shape[1]
  # A forest's query heads are folded into its query axis: one search per forest reads its table once.
  q, positions, lam, sigma = reference.folded_queries(q, positions, lam, sigma, forests)

  def one(q, pos, nodes, roots, lam, sigma):
    return reference.beam_search(q, pos, nodes, roots, beam=beam, bound_c=bound_c, lam=lam, sigma=sigma, steps=steps)

  per_head = jax.vmap(one, in_axes=(1, None, 0, 1, 0, 0), out_axes=1)
  found = jax.vmap(per_head, in_axes=(0, 0, 0, 0, None, None))(
    q, positions, nodes, fold_group(roots, forests), lam, sigma
  )
  return unfold_group(found, heads)
