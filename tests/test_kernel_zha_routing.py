"""pallas_kernels.zha_routing against NumPy on random trees and caches and against its specification
(fsjax.reference.zha_decode), and wired into the capped ZHA decode step (fsjax.ops.zha, fsjax.attention.zha_step)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.attention import zha_step
from fsjax.cache import zha as zha_cache
from fsjax.ops import zha as zha_ops
from fsjax.reference import zha as zha_ref
from fsjax.reference import zha_decode
from fsjax.reference.rope import apply_rope
from fsjax.reference.zha import ZHATree
from pallas_kernels import zha_routing

from helpers import assert_close, kernel_modes

_extend = jax.jit(zha_cache.extend, static_argnames=("tree", "rope_theta"))
_attend = jax.jit(zha_step.attend, static_argnames=("tree", "impl"))
_route = jax.jit(zha_ops.zha_route, static_argnames=("tree", "impl"))


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("refs,dim,count,span", [(4, 64, 37, None), (1, 96, 16, 4), (16, 32, 5, None)])
def test_score_candidates(rng, interpret, dtype, refs, dim, count, span):
  """Scores of listed nodes against NumPy; NO_NODE, and with a span the nodes not complete at each row's
  position, score −inf."""
  batch, nodes, heads = 2, 50, 3
  q = rng.standard_normal((batch, heads, dim))
  keys = rng.standard_normal((batch, nodes, heads, refs, dim))
  bias = rng.standard_normal((batch, nodes, heads, refs))
  index = rng.integers(0, nodes, (batch, heads, count))
  index[rng.random(index.shape) < 0.2] = zha_routing.NO_NODE
  position = np.array([4 * nodes - 1, 80])  # at span 4: 49 and 20 complete nodes, node 19 exactly at 80
  index[1, :, 0] = 19
  cast = lambda x: jnp.asarray(x, dtype)
  complete_only = {} if span is None else dict(position=jnp.asarray(position), span=span)
  scores = zha_routing.score_candidates(
    cast(q), cast(keys), cast(bias), jnp.asarray(index), interpret=interpret, **complete_only
  )
  q, keys, bias = (np.asarray(cast(x), np.float64) for x in (q, keys, bias))
  b, h = np.arange(batch)[:, None, None], np.arange(heads)[None, :, None]
  gathered = keys[b, np.maximum(index, 0), h]  # [batch, heads, count, R, d]
  expected = np.max(
    np.einsum("bhd,bhkrd->bhkr", q, gathered) / math.sqrt(dim) + bias[b, np.maximum(index, 0), h], axis=-1
  )
  valid = index >= 0
  if span is not None:
    valid &= (index + 1) * span <= position[:, None, None]
    assert np.any(valid) and np.any((index >= 0) & ~valid)
  assert np.all(np.isneginf(np.asarray(scores)[~valid]))
  assert_close(np.asarray(scores)[valid], expected[valid], jnp.float32)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_zha_kernels_read_one_layer_of_a_stack(rng, interpret):
  """Given a scanned model's stacks and a layer, both ZHA decode kernels return what they return for that layer's
  arrays alone (the attention to float32 rounding: interpreted, XLA may order its gathered sums differently for
  the two programs); a stack without a layer (or the reverse) is refused."""
  layers, batch, nodes, heads, refs, dim, chunk, seq = 3, 2, 12, 2, 4, 32, 4, 64
  keys = jnp.asarray(rng.standard_normal((layers, batch, nodes, heads, refs, dim)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((layers, batch, nodes, heads, refs)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((layers, batch, seq, heads, dim)), jnp.bfloat16) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((batch, heads, dim)), jnp.float32)
  index = jnp.asarray(rng.integers(-1, nodes, (batch, heads, 20)), jnp.int32)
  leaves = jnp.asarray(rng.integers(-1, (seq - 1) // chunk - 1, (batch, heads, 6)), jnp.int32)
  position = jnp.asarray([seq - 1, 30], jnp.int32)
  layer = jnp.int32(1)
  np.testing.assert_array_equal(
    zha_routing.score_candidates(q, keys, bias, index, layer=layer, interpret=interpret),
    zha_routing.score_candidates(q, keys[1], bias[1], index, interpret=interpret),
  )
  np.testing.assert_allclose(
    zha_routing.leaf_attention(q, k, v, leaves, position, chunk=chunk, layer=layer, interpret=interpret),
    zha_routing.leaf_attention(q, k[1], v[1], leaves, position, chunk=chunk, interpret=interpret),
    rtol=1e-6,
    atol=1e-6,
  )
  with pytest.raises(ValueError, match="position and span go together"):
    zha_routing.score_candidates(q, keys[1], bias[1], index, span=4, interpret=interpret)
  with pytest.raises(ValueError, match="a stack of 6 dims"):
    zha_routing.score_candidates(q, keys[1], bias[1], index, layer=layer, interpret=interpret)
  with pytest.raises(ValueError, match="an array of 4 dims"):
    zha_routing.leaf_attention(q, k, v, leaves, position, chunk=chunk, interpret=interpret)


def _kept_by_walking(scores, index, p, max_nodes):
  """Brute force: walk the candidates by (score desc, position asc), keeping while fewer than `max_nodes` are kept
  and (p < 1) the kept mass is below p·total; the kept nodes in list order, then NO_NODE."""
  finite = np.flatnonzero(np.isfinite(scores))
  kept, mass = [], 0.0
  if finite.size:
    weights = np.exp(scores.astype(np.float64) - scores[finite].max())
    total = weights[finite].sum()
    for j in sorted(finite, key=lambda j: (-scores[j], j)):
      if len(kept) == max_nodes or (p < 1 and mass >= p * total):
        break
      kept.append(j)
      mass += weights[j]
  width = min(max_nodes, scores.size)
  return np.asarray([index[j] for j in sorted(kept)] + [zha_routing.NO_NODE] * (width - len(kept)))


KEEP_CASES = [
  (37, 0.9, 64),  # top-p binds, the cap is wider than the list
  (300, 1.0, 16),  # the cap alone
  (519, 0.6, 64),  # a lower level's list at C=8
  (4096, 0.9, 64),  # a top level at 256k tokens, C=8, L=2
]


def _selection_rows(rng, count):
  """Scores `[2, 3, count]` of both signs and many scales, exact ties (drawn from a few values in row (0, 1), whose
  rare top value leaves the cap inside the next tie), missing candidates (−inf), row (1, 2) with none at all;
  and distinct node indices in random order."""
  batch, heads = 2, 3
  scores = rng.standard_normal((batch, heads, count)) * rng.choice([0.3, 3.0, 30.0], (batch, heads, 1))
  scores[0, 1] = rng.choice([-1.5, 0.25, 2.0, 5.0], count, p=[0.3, 0.3, 0.35, 0.05])  # the cap falls in a tie
  scores[rng.random(scores.shape) < 0.2] = -np.inf
  scores[1, 2] = -np.inf
  index = rng.permutation(10 * count)[:count].astype(np.int32) + np.zeros((batch, heads, 1), np.int32)
  return scores.astype(np.float32), index


def _assert_kept_by_walking(kept, scores, index, p, max_nodes):
  kept = np.asarray(kept)
  for b in range(scores.shape[0]):
    for h in range(scores.shape[1]):
      np.testing.assert_array_equal(
        kept[b, h], _kept_by_walking(scores[b, h], index[b, h], p, max_nodes), err_msg=f"row {b}, head {h}"
      )
  assert np.all(kept[1, 2] == zha_routing.NO_NODE) and np.any(kept[0, 1] >= 0)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("count,p,max_nodes", KEEP_CASES)
def test_keep_top_p(rng, interpret, count, p, max_nodes):
  """The kernel keeps the brute-force walk's nodes, in list order (`_selection_rows`' scores: ties, missing
  candidates, an empty row)."""
  scores, index = _selection_rows(rng, count)
  kept = zha_routing.keep_top_p(jnp.asarray(scores), jnp.asarray(index), p=p, max_nodes=max_nodes, interpret=interpret)
  _assert_kept_by_walking(kept, scores, index, p, max_nodes)


@pytest.mark.parametrize("count,p,max_nodes", KEEP_CASES)
def test_reference_keep_top_p_walks_like_the_kernel(rng, count, p, max_nodes):
  """The kernel's specification (`fsjax.reference.zha_decode.keep_top_p`) keeps the same nodes in the same order."""
  scores, index = _selection_rows(rng, count)
  _assert_kept_by_walking(
    zha_decode.keep_top_p(jnp.asarray(scores), jnp.asarray(index), p=p, max_nodes=max_nodes),
    scores,
    index,
    p,
    max_nodes,
  )


@pytest.mark.parametrize("interpret", kernel_modes())
def test_a_shared_list_equals_its_broadcast(rng, interpret):
  """Both kernels take one `[K]` list for every row and head (the top level's): the same as the list broadcast
  to `[batch, heads, K]`, with NO_NODE entries and the completeness test."""
  batch, nodes, heads, refs, dim, count = 2, 40, 3, 4, 32, 64
  q = jnp.asarray(rng.standard_normal((batch, heads, dim)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((batch, nodes, heads, refs, dim)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((batch, nodes, heads, refs)), jnp.float32)
  shared = np.where(np.arange(count) < nodes, np.arange(count), zha_routing.NO_NODE).astype(np.int32)
  broadcast = jnp.broadcast_to(shared, (batch, heads, count))
  complete_only = dict(position=jnp.asarray([4 * nodes - 1, 70]), span=4)
  scores = zha_routing.score_candidates(q, keys, bias, jnp.asarray(shared), interpret=interpret, **complete_only)
  np.testing.assert_array_equal(
    scores, zha_routing.score_candidates(q, keys, bias, broadcast, interpret=interpret, **complete_only)
  )
  complete = np.asarray([nodes - 1, 17])  # (node + 1)·4 <= position: nodes 0-38 at 159, 0-16 at 70
  for row, first_missing in enumerate(complete):
    assert np.isfinite(np.asarray(scores)[row, :, :first_missing]).all()
    assert np.isneginf(np.asarray(scores)[row, :, first_missing:]).all()
  kept = zha_routing.keep_top_p(scores, jnp.asarray(shared), p=0.8, max_nodes=8, interpret=interpret)
  np.testing.assert_array_equal(
    kept, zha_routing.keep_top_p(scores, broadcast, p=0.8, max_nodes=8, interpret=interpret)
  )
  assert kept.shape == (batch, heads, 8) and np.any(np.asarray(kept) >= 0)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("chunk,parents_kept", [(4, 5), (8, 3), (2, 1)])
def test_score_children_builds_the_list_below_the_kept_parents(rng, interpret, chunk, parents_kept):
  """The list a lower level scores, built in the kernel from the kept row above (kept parents first, dropped
  ones and the row's tail NO_NODE): each kept parent's C children in parent order, then the C − 1 nodes after the
  last complete parent-level node where they are complete, then NO_NODE; scores as `score_candidates` gives."""
  batch, heads, refs, dim, nodes = 2, 3, 4, 32, 64
  span = chunk  # scoring level 1; its parents are level-2 nodes of C² keys
  q = jnp.asarray(rng.standard_normal((batch, heads, dim)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((batch, nodes, heads, refs, dim)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((batch, nodes, heads, refs)), jnp.float32)
  position = np.array([chunk * chunk * 5 + 2 * chunk + 1, chunk * chunk * 3 + chunk - 1])  # 2 and 0 parentless
  complete_parents = position // chunk**2
  row = np.full((batch, heads, 16), zha_routing.NO_NODE, np.int32)
  for b in range(batch):
    for h in range(heads):
      kept = np.sort(rng.choice(complete_parents[b], min(parents_kept, complete_parents[b]), replace=False))
      kept = kept[rng.random(kept.size) < 0.8]  # some heads keep fewer than the cap
      row[b, h, : kept.size] = kept
  scores, index = zha_routing.score_children(
    q,
    keys,
    bias,
    jnp.asarray(row),
    jnp.asarray(position),
    parents_kept=parents_kept,
    chunk=chunk,
    span=span,
    interpret=interpret,
  )
  width = zha_routing.list_width(parents_kept * chunk + chunk - 1)
  assert scores.shape == index.shape == (batch, heads, width)
  for b in range(batch):
    parentless = chunk * complete_parents[b] + np.arange(chunk - 1)
    parentless = np.where((parentless + 1) * span <= position[b], parentless, zha_routing.NO_NODE)
    for h in range(heads):
      parents = row[b, h, :parents_kept]
      children = np.where(parents[:, None] >= 0, parents[:, None] * chunk + np.arange(chunk), zha_routing.NO_NODE)
      expected = np.concatenate([children.ravel(), parentless])
      expected = np.pad(expected, (0, width - expected.size), constant_values=zha_routing.NO_NODE)
      np.testing.assert_array_equal(np.asarray(index)[b, h], expected, err_msg=f"row {b}, head {h}")
  assert (np.asarray(index)[1, :, parents_kept * chunk :] == zha_routing.NO_NODE).all()  # no parentless at row 1
  np.testing.assert_array_equal(  # the specification's list, before the kernel's padding
    np.asarray(index)[..., : parents_kept * chunk + chunk - 1],
    zha_decode.candidates_below(jnp.asarray(row[..., :parents_kept]), jnp.asarray(position), chunk=chunk, level=2),
  )
  listed = zha_routing.score_candidates(q, keys, bias, index, interpret=interpret)
  np.testing.assert_array_equal(scores, listed)
  assert np.isneginf(np.asarray(scores)[np.asarray(index) < 0]).all()


def test_score_children_rejects_a_count_outside_the_parents_row():
  with pytest.raises(ValueError, match=r"parents_kept must be in \[1, 16\]"):
    zha_routing.score_children(
      jnp.zeros((1, 1, 8)),
      jnp.zeros((1, 4, 1, 2, 8)),
      jnp.zeros((1, 4, 1, 2)),
      jnp.zeros((1, 1, 16), jnp.int32),
      jnp.zeros((1,), jnp.int32),
      parents_kept=17,
      chunk=2,
      span=2,
    )


def test_keep_top_p_rejects_a_threshold_outside_0_1_and_an_empty_cap():
  with pytest.raises(ValueError, match=r"p must be in \(0, 1\], got 1.5"):
    zha_routing.keep_top_p(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1, 4), jnp.int32), p=1.5, max_nodes=2)
  with pytest.raises(ValueError, match="max_nodes must be >= 1, got 0"):
    zha_routing.keep_top_p(jnp.zeros((1, 1, 4)), jnp.zeros((1, 1, 4), jnp.int32), p=0.5, max_nodes=0)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
  "chunk,dim,leaves,splits", [(8, 64, 6, 4), (4, 96, 9, 2), (16, 32, 1, 1), (8, 64, 64, None), (4, 32, 17, 3)]
)
def test_leaf_attention(rng, interpret, dtype, chunk, dim, leaves, splits):
  """Splits with padded shares, one split, three splits (merged as four, the last never written), and the default
  (a 64-slot list at C=8: four splits of 16), against a loop over the attended keys; unused slots hold NO_NODE."""
  batch, heads, capacity = 2, 2, 160
  q = rng.standard_normal((batch, heads, dim))
  k, v = (rng.standard_normal((batch, capacity, heads, dim)) for _ in range(2))
  position = np.array([capacity - 2, 97])  # the first row's current chunk reaches the cache's end
  complete = position // chunk  # leaves (m + 1)C <= i
  kept = np.full((batch, heads, leaves), zha_routing.NO_NODE)
  for b in range(batch):
    for h in range(heads):
      chosen = rng.permutation(complete[b])[:leaves]
      chosen = chosen[rng.random(len(chosen)) < 0.8]  # some slots unused
      kept[b, h, : len(chosen)] = chosen
  cast = lambda x: jnp.asarray(x, dtype)
  out = zha_routing.leaf_attention(
    cast(q), cast(k), cast(v), jnp.asarray(kept), jnp.asarray(position), chunk=chunk, splits=splits, interpret=interpret
  )
  q, k, v = (np.asarray(cast(x), np.float64) for x in (q, k, v))
  expected = np.zeros((batch, heads, dim))
  for b in range(batch):
    i = position[b]
    for h in range(heads):
      keys = {0} | set(range(1 + chunk * (i // chunk), i + 1))
      for m in kept[b, h][kept[b, h] >= 0]:
        keys |= set(range(1 + m * chunk, 1 + (m + 1) * chunk))
      js = sorted(keys)
      logits = k[b, js, h] @ q[b, h] / math.sqrt(dim)
      w = np.exp(logits - logits.max())
      expected[b, h] = w @ v[b, js, h] / w.sum()
  assert_close(out, expected, dtype)


def test_capped_decode_through_the_kernels_equals_the_reference(rng):
  """Prefill 40 tokens, then decode one at a time through `zha_step.attend(impl="pallas")` (compiled on a GPU,
  interpreted elsewhere): the reference's outputs and key counts (RoPE, C=4, R=2, two levels, at most 2 nodes
  per level)."""
  batch, seq, heads, dim = 2, 70, 2, 16
  q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), jnp.float32) for _ in range(3))
  ref_queries = jnp.asarray(rng.standard_normal((heads, 2, dim)), jnp.float32)
  tree = ZHATree(refs=2, chunk=4, levels=2, top_p=(0.9,), max_nodes=2)
  # Jitted: op by op, the reference's routing dispatched every operation.
  expected, expected_fraction = jax.jit(
    lambda q, k, v, r: ops.zha_attention(
      q, k, v, r, chunk=4, levels=2, top_p=0.9, rope_theta=10000.0, max_nodes=2, return_fraction=True
    )
  )(q, k, v, ref_queries)
  cache = zha_cache.empty_zha(batch, 72, heads, dim, tree)
  outputs, fractions = [], []
  for start, size in ((0, 40), *((t, 1) for t in range(40, seq))):
    pos = jnp.broadcast_to(jnp.arange(start, start + size), (batch, size))
    rot = lambda x: apply_rope(x[:, start : start + size], pos)
    cache = _extend(
      cache,
      rot(k),
      v[:, start : start + size],
      pos,
      jnp.ones_like(pos, bool),
      ref_queries,
      tree=tree,
      rope_theta=10000.0,
    )
    if size == 1:
      out, fraction = _attend(cache, rot(q), pos, tree=tree, impl="pallas")
      outputs.append(out)
      fractions.append(fraction)
  np.testing.assert_allclose(np.concatenate(fractions, axis=1), expected_fraction[:, 40:], rtol=1e-6)
  assert_close(np.concatenate(outputs, axis=1), expected[:, 40:], jnp.float32, scale=5)


def _random_zha_cache(rng, batch, capacity, heads, dim, tree, dtype, tie_block=1):
  """A ZHA cache of random tangents per level (routing reads nothing else) in which every odd block of
  `tie_block` nodes repeats the block before it, so scores tie exactly and the lower-index rule decides."""
  cache = zha_cache.empty_zha(batch, capacity, heads, dim, tree, dtype=dtype)

  def tied(x):
    pairs = x.shape[1] // (2 * tie_block)
    blocks = x[:, : 2 * tie_block * pairs].reshape(x.shape[0], pairs, 2, tie_block, *x.shape[2:])
    blocks[:, :, 1] = blocks[:, :, 0]
    x[:, : 2 * tie_block * pairs] = blocks.reshape(x.shape[0], -1, *x.shape[2:])
    return jnp.asarray(x, dtype)

  keys = tuple(tied(rng.standard_normal(k.shape) * rng.uniform(0.5, 2.0, k.shape[:-1] + (1,))) for k in cache.keys)
  bias = tuple(tied(rng.standard_normal(b.shape)) for b in cache.bias)
  return cache.replace(keys=keys, bias=bias)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
  "refs,dim,chunk,levels,top_p,max_nodes",
  [
    (4, 64, 4, 2, (0.9, 0.8), 3),  # the cap binds
    (1, 96, 8, 2, (0.95, 0.95), 64),  # top-p binds
    (2, 32, 2, 3, (1.0, 0.5, 0.9), 5),  # p = 1 keeps every candidate up to the cap
  ],
)
def test_capped_routing_through_the_kernel_equals_the_jnp_descent(
  rng, dtype, refs, dim, chunk, levels, top_p, max_nodes
):
  """`zha_route` on the kernels keeps the same leaves as the reference descent
  (`fsjax.reference.zha_decode.route_gathered`), in half precision too (both score in float32), with exact ties,
  at positions with none, some and many complete top-level nodes."""
  batch, heads, capacity = 3, 2, 300
  tree = ZHATree(refs=refs, chunk=chunk, levels=levels, top_p=top_p, max_nodes=max_nodes)
  cache = _random_zha_cache(rng, batch, capacity, heads, dim, tree, dtype)
  for position in ([3, chunk**levels + 5, capacity - 1], [capacity - 2, 40, 150]):
    position = jnp.asarray(position, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, heads, dim)) * 2, dtype)
    leaves = [
      np.asarray(_route(q, position, cache.keys, cache.bias, tree=tree, impl=impl)) for impl in ("pallas", "reference")
    ]
    np.testing.assert_array_equal(np.sort(leaves[0], -1), np.sort(leaves[1], -1))
    assert np.any(leaves[1] >= 0)


@pytest.mark.parametrize("impl", ["reference", "pallas"], ids=["jnp", "kernels"])
@pytest.mark.parametrize("refs,dim,chunk,levels,top_p", [(4, 16, 4, 2, (1.0, 1.0)), (2, 16, 2, 3, (1.0, 0.9, 1.0))])
def test_capped_descent_keeps_the_references_leaves_under_ties_across_parents(
  rng, impl, refs, dim, chunk, levels, top_p
):
  """The descent over candidate lists keeps the leaves of `fsjax.reference.zha.route` over every node's score
  when each node ties with the node one parent further on (blocks of `chunk` nodes repeat the block before
  them). Ties between children of different parents are resolved by the lists' node order, so this fails when a
  level's kept nodes are not in node order when their children are listed. An odd cap (p = 1 at the leaves)
  splits tied pairs. With impl="pallas", scoring and selection run in `zha_routing` (interpreted off a GPU)."""
  batch, heads, capacity, max_nodes = 4, 4, 300, 3
  tree = ZHATree(refs=refs, chunk=chunk, levels=levels, top_p=top_p, max_nodes=max_nodes)
  cache = _random_zha_cache(rng, batch, capacity, heads, dim, tree, jnp.float32, tie_block=chunk)

  @jax.jit  # op by op, every node's scores and the reference's descent dispatched every operation
  def reference_leaves(q, position, cache):
    scores = [zha_ref.node_scores(q[:, None], keys, bias) for keys, bias in zip(cache.keys, cache.bias)]
    return zha_ref.route(scores, position[:, None], chunk=chunk, top_p=top_p, max_nodes=max_nodes)[:, :, 0]

  for position in ([3, chunk**levels + 5, capacity - 1, 100], [capacity - 2, 40, 150, 221]):
    position = jnp.asarray(position, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, heads, dim)) * 2, jnp.float32)
    leaves = np.asarray(_route(q, position, cache.keys, cache.bias, tree=tree, impl=impl))
    expected = np.asarray(reference_leaves(q, position, cache))  # [batch, heads, N_1]
    reached = np.zeros_like(expected)
    b, h, slot = np.nonzero(leaves >= 0)
    reached[b, h, leaves[b, h, slot]] = True
    np.testing.assert_array_equal(reached, expected)
    assert np.any(expected)
