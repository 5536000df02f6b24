"""FS-B streaming forest cache (fsjax.cache.forest) against the prefill formulation (fsjax.reference.forest): the same
forests, the same selections, and an update whose work per block does not grow with the number of cells."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.attention.freesolo_step import forest_select, fsb_archive_select
from fsjax.cache import archive as archive_lib
from fsjax.cache import forest as forest_cache
from fsjax.cache import layer_of, write_back
from fsjax.ops import dispatch
from fsjax.reference import forest as forest_ref
from fsjax.reference.routing import Routing

CELL, BLOCK = 4, 16  # 4 cells admitted per block
BATCH, HEADS, DIM = 2, 2, 6


def _filled_cache(rng, seq, dtype=jnp.float64, heads=HEADS):
  """A forest cache whose archive holds `seq` random tokens (written in uneven chunks); forests still empty."""
  cache = forest_cache.empty_forest_cache(BATCH, seq, heads, DIM, CELL, window=16, dtype=dtype)
  k = jnp.asarray(rng.standard_normal((BATCH, seq, heads, DIM)) * rng.uniform(0.5, 2.0, (BATCH, seq, heads, 1)))
  archive = cache.archive
  for start, stop in ((0, 37), (37, 38), (38, seq)):
    pos = jnp.broadcast_to(jnp.arange(start, stop, dtype=jnp.int32), (BATCH, stop - start))
    chunk = k[:, start:stop]  # as keys, rotated keys (the ring, which no forest reads) and values
    archive = archive_lib.extend(archive, chunk, chunk, chunk, pos, jnp.ones(pos.shape, bool), CELL)
  tau = jnp.asarray(np.median(np.asarray(archive.max_norms).reshape(-1, heads), axis=0))
  return cache.replace(archive=archive), tau


def _walk(nodes, node):
  """A forest below `node` as nested tuples: (mu, rho, amax, pmin, first, leaf, children)."""
  if node < 0:
    return None
  children = tuple(_walk(nodes, int(nodes[c][node])) for c in ("child0", "child1") if nodes[c][node] >= 0)
  return (
    np.asarray(nodes["mu"][node]),
    *(float(nodes[f][node]) for f in ("rho", "amax", "pmin")),
    int(nodes["first"][node]),
    int(nodes["leaf"][node]),
    children,
  )


def _assert_same_tree(a, b):
  assert (a is None) == (b is None)
  if a is None:
    return
  np.testing.assert_allclose(a[0], b[0], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(a[1:4], b[1:4], rtol=1e-12, atol=1e-12)
  assert a[4:6] == b[4:6]
  assert len(a[6]) == len(b[6])
  for x, y in zip(a[6], b[6]):
    _assert_same_tree(x, y)


@jax.jit
def _prefill_forest(means, norms, admitted):
  """The prefill formulation's forest over the admitted cells (all of them complete): (node table, root)."""
  order = jnp.argsort(~admitted, stable=True).astype(jnp.int32)
  table, roots = forest_ref._chunk_nodes(means[order], norms[order], (order + 0.5) * CELL, order)
  return forest_ref.block_forests(table, roots, jnp.sum(admitted, dtype=jnp.int32)[None])


@pytest.mark.parametrize("looped_from", [forest_cache.LOOPED_FROM, 1], ids=["default", "every-level-looped"])
def test_streaming_forests_equal_the_prefill_forests_after_every_block(rng, looped_from):
  """Both forests, every (row, head), after each block's admissions (rows one block apart), node for node;
  chunk levels whose digits did not change are not touched. With `looped_from=1` every chunk tree's leaf order
  comes from `looped_leaf_order`."""
  seq = 160  # 40 cells: counts 0 … 40 cross every binary carry up to 32
  with jax.enable_x64(True):
    cache, tau = _filled_cache(rng, seq)
    advance = jax.jit(lambda c, t: forest_cache.advance(c, t, tau, cell=CELL, block=BLOCK, looped_from=looped_from))
    means, norms = np.asarray(cache.archive.mean_keys), np.asarray(cache.archive.max_norms)
    for n in range(seq // BLOCK + 1):
      target = jnp.array([n, max(n - 1, 0)]) * (BLOCK // CELL)
      previous = cache
      cache = advance(cache, target)
      for which in (0, 1):
        streamed = cache.forest(which)
        for b in range(BATCH):
          for h in range(HEADS):
            cells = np.arange(means.shape[1]) < int(target[b])
            admitted = cells & (norms[b, :, h] >= float(tau[h])) if which else cells
            table, root = _prefill_forest(means[b, :, h], norms[b, :, h], admitted)
            table, root = {f: np.asarray(v) for f, v in table.items()}, int(root[0])
            nodes = {f: np.asarray(v[b, h]) for f, v in streamed.nodes.items()}
            assert int(streamed.count[b, h]) == admitted.sum()
            _assert_same_tree(_walk(nodes, int(streamed.root[b, h])), _walk(table, root))
      _assert_untouched_levels_kept(previous.forests, cache.forests)


def _assert_untouched_levels_kept(before, after):
  """Chunk levels whose digits did not change keep their storage bit for bit (no repacking)."""
  levels = forest_cache.num_levels_of(before)
  changed = np.asarray(forest_cache.changed_levels(before.count, after.count, levels))
  for k in range(levels):
    where = slice(forest_cache.level_offset(k), forest_cache.level_offset(k + 1))
    keep = ~changed[..., k]
    for name, value in after.nodes.items():
      kept_before = np.asarray(before.nodes[name][:, :, where])[keep]
      np.testing.assert_array_equal(np.asarray(value[:, :, where])[keep], kept_before)


def test_advancing_a_layer_of_a_stacked_cache_writes_that_layer_as_the_plain_cache_would(rng):
  """A scanned model advances its layer's forests through views into the stacked cache (`fsjax.cache.layer_of`):
  with every level built per changed (row, head) inside its conditional and written into the stack, the layer ends
  as the unstacked cache's advance leaves it and the other layer is untouched."""
  with jax.enable_x64(True):
    cache, tau = _filled_cache(rng, 160)
    other, _ = _filled_cache(rng, 160)
    advance = lambda c, t: forest_cache.advance(c, t, tau, cell=CELL, block=BLOCK, looped_from=1)
    target = jnp.array([40, 36])
    other = jax.jit(advance)(other, jnp.array([20, 28]))  # forests of its own, so that a stray write shows
    stacked = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), other, cache)

    @jax.jit
    def advance_layer_1(stacked):
      view = layer_of(stacked, jnp.int32(1))
      return write_back(stacked, advance(view, target), jnp.int32(1))

    expected = jax.jit(advance)(cache, target)
    for got, want, kept in zip(
      jax.tree_util.tree_leaves(advance_layer_1(stacked)),
      jax.tree_util.tree_leaves(expected),
      jax.tree_util.tree_leaves(other),
    ):
      np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want))
      np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(kept))


def test_looped_leaf_order_equals_the_reference_splits_including_ties(rng):
  """`looped_leaf_order` against `chunk_leaf_orders` on 64 cells: random means, means with repeated rows (ties
  in the farthest cell and in the projection sort, broken by cell index) and all-equal means (zero direction)."""
  size = 64
  ids = jnp.asarray(rng.permutation(200)[:size].astype(np.int32))
  random = rng.standard_normal((size, DIM)) * rng.uniform(0.5, 2.0, (size, 1))
  repeated = random[rng.integers(0, 5, size)]
  equal = np.ones((size, DIM))
  looped = jax.jit(forest_cache.looped_leaf_order)
  reference = jax.jit(lambda m, i: forest_ref.chunk_leaf_orders(m, i, [size])[0][0])
  with jax.enable_x64(True):
    for means in (random, repeated, equal):
      np.testing.assert_array_equal(looped(jnp.asarray(means), ids), reference(jnp.asarray(means), ids))


def test_streaming_selection_equals_the_prefill_formulation_in_every_block(rng):
  """One query per row at a random position of each block: the cache's beam search + rerank selects exactly the
  cells the prefill formulation selects for that position."""
  seq = 192
  with jax.enable_x64(True):
    cache, tau = _filled_cache(rng, seq)
    routing = dict(lam=jnp.asarray(rng.uniform(0.3, 2.0, HEADS)), sigma=jnp.asarray(rng.uniform(1.0, 8.0, HEADS)))
    options = dict(cell=CELL, top_k=3, beam=2, bound_c=8.0)
    geometry = Routing(variant="fsb", window=BLOCK - 1, block=BLOCK, **options)
    step = jax.jit(
      lambda c, q, pos: forest_select(
        forest_cache.advance(c, pos[:, 0] // BLOCK * (BLOCK // CELL), tau, cell=CELL, block=BLOCK),
        q,
        pos,
        geometry,
        **routing,
      )
    )
    archive = cache.archive
    for n in range(1, seq // BLOCK):
      pos = jnp.asarray(n * BLOCK + rng.integers(0, BLOCK, (BATCH, 1)))
      q = jnp.asarray(rng.standard_normal((BATCH, 1, HEADS, DIM)) * 3)
      expected = forest_ref.fsb_select_from_summaries(
        q, pos, archive.tokens.k, archive.mean_keys, archive.max_norms, tau=tau, block=BLOCK, **routing, **options
      )
      actual = step(cache, q, pos)
      np.testing.assert_array_equal(np.sort(np.asarray(actual), -1), np.sort(np.asarray(expected), -1))
      assert np.all(np.asarray(actual)[..., 0] >= 0)


def test_archive_selection_by_groups_of_heads_equals_one_call_over_all_heads(rng, monkeypatch):
  """FS-B's selection from the archive runs groups of heads one after another when its forests would be large;
  the cells of a chunk (queries in several blocks, one row's prompt ending mid-cell) are those of one call."""
  heads, seq = 6, 152
  cache, tau = _filled_cache(rng, seq, jnp.float32, heads=heads)
  archive = cache.archive
  routing = dict(lam=jnp.asarray(rng.uniform(0.3, 2.0, heads)), sigma=jnp.asarray(rng.uniform(1.0, 8.0, heads)))
  options = dict(cell=CELL, top_k=3, beam=2, bound_c=8.0)
  pos = jnp.asarray([np.arange(100, 140), np.arange(110, 150)], jnp.int32)  # three blocks, the last query mid-cell
  q = jnp.asarray(rng.standard_normal((BATCH, pos.shape[1], heads, DIM)) * 3, jnp.float32)
  expected = jax.jit(
    lambda q, p: forest_ref.fsb_select_from_summaries(
      q, p, archive.tokens.k, archive.mean_keys, archive.max_norms, tau=tau, block=BLOCK, **routing, **options
    )
  )(q, pos)
  assert (np.asarray(expected)[..., 0] >= 0).all()
  geometry = Routing(variant="fsb", window=BLOCK - 1, block=BLOCK, **options)
  per_head = BATCH * dispatch.forest_nodes(archive.max_norms.shape[1]) * DIM * 4
  for groups in (2, 3):
    monkeypatch.setattr(dispatch, "FOREST_TABLE_BYTES", per_head * heads // groups)
    assert dispatch.forest_head_groups(BATCH, archive.max_norms.shape[1], heads, DIM) == groups
    actual = jax.jit(lambda a, q, p: fsb_archive_select(a, q, p, geometry, tau=tau, **routing))(archive, q, pos)
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def test_forest_head_groups_bound_the_node_table():
  assert (
    dispatch.forest_nodes(1) == 1
    and dispatch.forest_nodes(4) == 4 + 2 * 3 + 7
    and dispatch.forest_nodes(5) == 5 + 2 * 3 + 7
  )
  assert dispatch.forest_head_groups(1, 2048, 16, 64) == 1  # 1 × 128k tokens, cell 64: 176 MiB for all heads
  assert dispatch.forest_head_groups(32, 512, 16, 64) == 8  # 32 × 32k: 72 MiB a head, two heads a group
  assert dispatch.forest_head_groups(4096, 2**16, 16, 64) == 16  # one head is over the bound: one at a time


def test_tree_builds_per_block_do_not_grow_with_the_number_of_cells():
  """The binary counter's work, counted: the chunk levels built per block (one conditional each, all rows and
  heads at once) average the same small number near 2^6 cells as near 2^16, and the cells put into new trees
  per admitted cell grow only like log₂ M (each level is rebuilt once per 2^k admissions, 2^k cells each)."""
  per_block = 4
  levels = 20

  def work(first_block, blocks):
    counts = jnp.arange(first_block, first_block + blocks + 1) * per_block
    changed = np.asarray(forest_cache.changed_levels(counts[:-1], counts[1:], levels))  # [blocks, levels]
    built_cells = (changed * 2 ** np.arange(levels)).sum()
    return changed.sum(axis=1).mean(), changed.sum(axis=1).max(), built_cells / (blocks * per_block)

  small, large = work(16, 256), work(16384, 256)  # M from 64 to 1,088 cells, and from 65,536 to 66,560
  assert abs(small[0] - large[0]) <= 0.05 and small[0] <= 2.0, (small, large)
  assert small[2] <= np.log2(1088) + 1 and large[2] <= np.log2(66560) + 1
