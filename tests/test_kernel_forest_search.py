"""pallas_kernels.forest_search (FS-B's beam search, FS Eq. 11) against the reference beam search
(fsjax.reference.forest.beam_search) on streaming forests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.cache import archive as archive_lib
from fsjax.cache import forest as forest_cache
from fsjax.reference import forest as forest_ref
from pallas_kernels import forest_search

from helpers import kernel_modes


def _reference_search(forest, q, positions, *, lam, sigma, beam, steps):
  """`forest_ref.beam_search` of every (batch, head) over its own node table: `[batch, T, heads, beam]`."""

  def one(q, pos, nodes, root, lam, sigma):
    return forest_ref.beam_search(
      q, pos, nodes, jnp.full(q.shape[:1], root), beam=beam, bound_c=8.0, lam=lam, sigma=sigma, steps=steps
    )

  per_head = jax.vmap(one, in_axes=(1, None, 0, 0, 0, 0), out_axes=1)
  return jax.vmap(per_head, in_axes=(0, 0, 0, 0, None, None))(q, positions, forest.nodes, forest.root, lam, sigma)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("beam,dim,seq,queries", [(4, 16, 640, 5), (16, 64, 2048, 16), (2, 24, 128, 1)])
def test_fsb_beam_search(rng, interpret, beam, dim, seq, queries):
  """Both forests of a streaming cache (row 1 one block behind row 0; row 1's forest τ may be empty), queries of
  the current block with keys of many scales so U spreads: the kernel's final beams equal the reference's, slot
  for slot (leaves reached early keep rank +inf, so their order is the first-cell tie rule's), for each forest
  alone, for both as two sets in one launch (FS-B's step), and when it reads one layer of stacked tables."""
  batch, heads, cell, block = 2, 3, 16, 64
  cache = forest_cache.empty_forest_cache(batch, seq, heads, dim, cell, window=16)
  k = jnp.asarray(
    rng.standard_normal((batch, seq, heads, dim)) * rng.uniform(0.2, 3.0, (batch, seq, heads, 1)), jnp.float32
  )
  pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  archive = archive_lib.extend(cache.archive, k, k, k, pos, jnp.ones(pos.shape, bool), cell)  # k as every input
  tau = jnp.asarray(np.quantile(np.asarray(archive.max_norms).reshape(-1, heads), 0.7, axis=0), jnp.float32)
  last_block = (seq - 1) // block
  target = jnp.array([last_block, last_block - 1]) * (block // cell)
  cache = jax.jit(lambda c: forest_cache.advance(c, target, tau, cell=cell, block=block))(
    cache.replace(archive=archive)
  )
  q = jnp.asarray(rng.standard_normal((batch, queries, heads, dim)) * 2, jnp.float32)
  positions = jnp.asarray(target[:, None] * cell + rng.integers(0, block, (batch, queries)), jnp.int32)
  lam, sigma = jnp.asarray(rng.uniform(0.3, 2.0, heads)), jnp.asarray(rng.uniform(1.0, 8.0, heads))
  steps = forest_cache.num_levels_of(cache.forests)
  search = lambda forest: _reference_search(forest, q, positions, lam=lam, sigma=sigma, beam=beam, steps=steps)
  kernel = lambda counts, nodes, **kw: forest_search.beam_search(
    q, positions, counts, nodes, lam, sigma, beam=beam, steps=steps, bound_c=8.0, interpret=interpret, **kw
  )
  expected = [search(cache.forest(which)) for which in (0, 1)]
  for which in (0, 1):
    forest = cache.forest(which)
    np.testing.assert_array_equal(kernel(forest.count, forest.nodes), expected[which])  # slot order too
    assert np.any(np.asarray(expected[which]) >= 0)
  both = kernel(cache.forests.count, cache.forests.nodes, forest_sets=2)
  np.testing.assert_array_equal(both, jnp.concatenate(expected, axis=-1))
  # A scanned model's stacked tables: layer 1 holds forest 0, layer 0 the other forest, which beams differently.
  stack = lambda x, y: jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), x, y)
  stacked = stack(cache.forest(1), cache.forest(0))
  np.testing.assert_array_equal(kernel(stacked.count, stacked.nodes, layer=jnp.int32(1)), expected[0])


def test_a_table_of_another_layout_is_refused():
  """The kernel derives children and roots from the streaming cache's layout (N = 2^(levels+1) - 2 nodes)."""
  table = {name: jnp.zeros((1, 1, 31, 16) if name == "mu" else (1, 1, 31), jnp.float32) for name in ("mu", "rho")}
  table.update({name: jnp.zeros((1, 1, 31), jnp.float32) for name in ("amax", "pmin", "first", "leaf")})
  with pytest.raises(ValueError, match="2\\^\\(levels\\+1\\) - 2 nodes, got 31"):
    forest_search.beam_search(
      jnp.zeros((1, 1, 1, 16)),
      jnp.zeros((1, 1), jnp.int32),
      jnp.ones((1, 1), jnp.int32),
      table,
      jnp.ones(1),
      jnp.ones(1),
      beam=2,
      steps=4,
      bound_c=8.0,
      interpret=True,
    )
