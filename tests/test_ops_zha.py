"""ZHA reference (fsjax.reference.zha) against brute-force loops, the properties ZHA III states, and the ZHA ops'
dispatch (fsjax.ops.zha)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsjax import ops
from fsjax.ops import dispatch
from fsjax.ops import zha as zha_ops
from fsjax.reference import zha

import brute_force
from helpers import assert_close, random_qkv

# (batch, seq, heads, dim, refs, chunk, levels, top_p, max_nodes)
GEOMETRIES = [
  pytest.param(2, 61, 2, 8, 2, 3, 2, (0.7,), None, id="C3-L2-p0.7"),
  pytest.param(1, 90, 2, 6, 3, 4, 3, (0.6, 0.8, 0.9), None, id="C4-L3-p-per-level"),
  pytest.param(1, 48, 1, 4, 1, 2, 4, (0.5,), None, id="C2-L4-R1"),
  pytest.param(1, 40, 2, 8, 2, 8, 2, (0.9,), None, id="top-level-empty"),
  pytest.param(1, 80, 2, 8, 2, 3, 2, (0.95,), 2, id="capped-at-2-nodes"),
]


def _refs(rng, heads, refs, dim):
  return rng.standard_normal((heads, refs, dim))


@pytest.mark.parametrize("theta", [10000.0, None], ids=["rope", "nope"])
@pytest.mark.parametrize("batch,seq,heads,dim,refs,chunk,levels,top_p,max_nodes", GEOMETRIES)
def test_attention_matches_brute_force(rng, theta, batch, seq, heads, dim, refs, chunk, levels, top_p, max_nodes):
  q, k, v = random_qkv(rng, (batch, seq, heads, dim))
  ref_queries = _refs(rng, heads, refs, dim)
  expected, expected_fraction = brute_force.zha(
    q,
    k,
    v,
    ref_queries,
    chunk=chunk,
    levels=levels,
    top_p=zha.level_top_p(top_p, levels),
    theta=theta,
    max_nodes=max_nodes,
  )
  with jax.enable_x64(True):
    attention = functools.partial(  # jitted: op by op was slower
      ops.zha_attention, chunk=chunk, levels=levels, top_p=top_p, rope_theta=theta, max_nodes=max_nodes
    )
    out, fraction = jax.jit(lambda *args: attention(*args, return_fraction=True))(q, k, v, ref_queries)
  assert_close(out, expected, jnp.float64)
  np.testing.assert_allclose(np.asarray(fraction), expected_fraction, rtol=1e-12)  # same key counts
  assert np.min(expected_fraction) < 1.0  # the routing really prunes in these geometries


def test_top_p_one_is_dense_attention(rng):
  q, k, v = random_qkv(rng, (2, 80, 2, 8), np.float32)
  ref_queries = _refs(rng, 2, 4, 8).astype(np.float32)
  # Jitted: op by op, the reference compiled a small program per operation.
  run = jax.jit(lambda q, k, v: ops.zha_attention(q, k, v, ref_queries, chunk=3, levels=3, top_p=1.0, rope_theta=1e4))
  out = run(q, k, v)
  assert_close(out, jax.jit(ops.tfpp_attention)(q, k, v), jnp.float32)


def test_merged_summary_equals_direct_summary_without_rope(rng):
  """ZHA III-A footnote 2: with the same reference query through a subtree, merging reproduces the summary
  computed directly from the raw keys."""
  chunk, levels, seq = 3, 3, 1 + 27 * 2
  k = rng.standard_normal((1, seq, 2, 8))
  ref_queries = _refs(rng, 2, 3, 8)
  with jax.enable_x64(True):
    tree = zha.build_tree(jnp.asarray(k), jnp.asarray(ref_queries), chunk=chunk, levels=levels)
    for level in (2, 3):
      span = chunk**level
      count = zha.node_count(seq, chunk, level)
      raw = jnp.asarray(k[:, 1 : 1 + count * span].reshape(1, count, span, 2, 8))
      refs = jnp.broadcast_to(jnp.asarray(ref_queries), (1, count, 2, 3, 8))
      direct_keys, direct_bias = zha.summarize(refs, raw)
      assert_close(tree[level - 1][0], direct_keys, jnp.float64)
      assert_close(tree[level - 1][1], direct_bias, jnp.float64)


def test_causal(rng):
  q, k, v = random_qkv(rng, (1, 64, 2, 8), np.float32)
  ref_queries = _refs(rng, 2, 2, 8).astype(np.float32)
  # Jitted: both inputs have the same shapes, so one compiled program serves them (op by op was slower).
  run = jax.jit(lambda q, k, v: ops.zha_attention(q, k, v, ref_queries, chunk=4, levels=2, top_p=0.7, rope_theta=1e4))
  cut = 37
  changed = [x.copy() for x in (q, k, v)]
  for x in changed:
    x[:, cut:] = rng.standard_normal(x[:, cut:].shape)
  np.testing.assert_array_equal(np.asarray(run(q, k, v))[:, :cut], np.asarray(run(*changed))[:, :cut])


def test_kl_is_zero_when_node_scores_are_exact(rng):
  """Keys constant over every top-level span make each tangent exact for any query (k̂ = k, b̂ = log C^ℓ), so
  the predicted chunk masses equal the dense ones; perturbing the keys makes the loss positive."""
  chunk, levels, spans = 2, 2, 12
  seq = 1 + spans * chunk**levels
  base = rng.standard_normal((1, 1 + spans, 2, 8))
  k = np.concatenate([base[:, :1], np.repeat(base[:, 1:], chunk**levels, axis=1)], axis=1)
  q = rng.standard_normal((1, seq, 2, 8))
  ref_queries = _refs(rng, 2, 2, 8)
  with jax.enable_x64(True):
    # Jitted: op by op was slower.
    per_level = jax.jit(lambda q, k: zha.zha_kl_per_level(q, k, ref_queries, chunk=chunk, levels=levels))(q, k)
    assert per_level.shape == (levels,)
    assert float(jnp.max(jnp.abs(per_level))) < 1e-12
    loss = jax.jit(lambda q, k: ops.zha_kl_loss(q, k, ref_queries, chunk=chunk, levels=levels))
    noisy = loss(q, k + 0.3 * rng.standard_normal(k.shape))
    assert float(noisy) > 1e-6


def test_kl_decreases_when_training_reference_queries(rng):
  """A few AdamW steps on the reference queries alone lower the distillation loss (the III-B training mode)."""
  q, k, _ = random_qkv(rng, (2, 96, 2, 8), np.float32)
  k[:, 1:] += 2.0 * rng.standard_normal((1, 1, 2, 8)).astype(np.float32)  # a shared direction to learn
  ref_queries = 0.02 * _refs(rng, 2, 4, 8).astype(np.float32)
  loss = jax.jit(lambda r: ops.zha_kl_loss(q, k, r, chunk=4, levels=2, rope_theta=10000.0))
  optimizer = optax.adamw(3.2e-2, b1=0.9, b2=0.95, weight_decay=0.0)
  state = optimizer.init(ref_queries)
  step = jax.jit(lambda r, s: _adam_step(optimizer, loss, r, s))
  first = float(loss(ref_queries))
  for _ in range(40):
    ref_queries, state = step(ref_queries, state)
  assert float(loss(ref_queries)) < 0.8 * first


def _adam_step(optimizer, loss, params, state):
  grads = jax.grad(loss)(params)
  updates, state = optimizer.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_kl_gives_no_gradient_to_queries_and_keys(rng):
  q, k, _ = random_qkv(rng, (1, 40, 2, 8), np.float32)
  ref_queries = _refs(rng, 2, 2, 8).astype(np.float32)
  loss = lambda q, k: ops.zha_kl_loss(q, k, ref_queries, chunk=3, levels=2)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)  # jitted: op by op was slower
  assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in grads)


def test_top_p_select_keeps_smallest_prefix_and_ties_to_lower_index():
  scores = jnp.array([[1.0, 3.0, 3.0, 0.0, 2.0]])
  candidates = jnp.array([[True, True, True, True, False]])
  # softmax over candidates (1, 3, 3, 0): masses ≈ (.060, .443, .443, .022); rank 1, 2, 0, 3.
  np.testing.assert_array_equal(zha.top_p_select(scores, candidates, 0.4), [[False, True, False, False, False]])
  np.testing.assert_array_equal(zha.top_p_select(scores, candidates, 0.5), [[False, True, True, False, False]])
  np.testing.assert_array_equal(zha.top_p_select(scores, candidates, 0.95), [[True, True, True, False, False]])
  np.testing.assert_array_equal(zha.top_p_select(scores, candidates, 1.0), candidates)
  np.testing.assert_array_equal(zha.top_p_select(scores, jnp.zeros_like(candidates), 0.5), jnp.zeros_like(candidates))


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(chunk=1), "chunk must be >= 2"),
    (dict(levels=0), "levels must be >= 1"),
    (dict(top_p=(0.5, 0.9, 0.9)), "one value or one per level"),
    (dict(top_p=0.0), "must be > 0"),
    (dict(max_nodes=0), "max_nodes must be >= 1"),
  ],
)
def test_bad_geometry_is_rejected(kwargs, message):
  q = jnp.ones((1, 8, 1, 4))
  args = dict(chunk=2, levels=2, top_p=0.9) | kwargs
  with pytest.raises(ValueError, match=message):
    ops.zha_attention(q, q, q, jnp.ones((1, 2, 4)), **args)


def test_one_table_decides_the_zha_implementations(rng):
  """The training form has no kernel: "auto" selects the reference where the queries fit one block (past it, the
  same rows over query blocks: tests/test_zha_blocked.py), "pallas" is refused with the one dispatch error, and a
  module configured with "pallas" reaches it as "auto"; the capped decode step has the kernels."""
  q, k, v = random_qkv(rng, (1, 8, 1, 4), np.float32)
  assert dispatch.resolve("zha_attention", "auto", batch=1, heads=1, tokens=8) == "reference"
  with pytest.raises(dispatch.UnsupportedImpl, match="zha_attention has no 'pallas' implementation"):
    ops.zha_attention(q, k, v, _refs(rng, 1, 2, 4), chunk=2, levels=2, top_p=0.8, impl="pallas")
  assert dispatch.for_op("zha_attention", "pallas") == "auto"
  assert dispatch.for_op("zha_route", "pallas") == "pallas"
  assert dispatch.resolve("zha_route", "pallas", chunk=3, refs=3) == "pallas"  # interpreted off a GPU


_build_tree = jax.jit(zha.build_tree, static_argnames=("chunk", "levels", "rope_theta"))


def _decode_inputs(rng, tree, layers=None):
  """A capped decode step's arrays over 50 random keys: rotated queries `[2, heads, d]` at two positions, each
  level's tangents and the dense cache (with `layers`, stacks of that many independent layers)."""
  heads, dim, seq = 2, 8, 50
  stacked = []
  for _ in range(layers or 1):
    k = jnp.asarray(rng.standard_normal((2, seq, heads, dim)), jnp.float32)
    nodes = _build_tree(
      k, jnp.asarray(_refs(rng, heads, tree.refs, dim), jnp.float32), chunk=tree.chunk, levels=tree.levels
    )
    v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    stacked.append((tuple(n[0] for n in nodes), tuple(n[1] for n in nodes), k, v))
  keys, bias, k, v = stacked[0] if layers is None else jax.tree_util.tree_map(lambda *x: jnp.stack(x), *stacked)
  q = jnp.asarray(rng.standard_normal((2, heads, dim)) * 2, jnp.float32)
  return q, jnp.asarray([seq - 1, 31], jnp.int32), keys, bias, k, v


def test_the_capped_decode_op_reads_one_layer_of_a_stack(rng):
  """`zha_decode` given a scanned model's stacks and a layer gives what it gives for that layer's arrays, on the
  reference path too (which slices the layer out), and it refuses a tree without a cap."""
  tree = zha.ZHATree(refs=2, chunk=3, levels=2, top_p=(0.8,), max_nodes=2)
  q, position, keys, bias, k, v = _decode_inputs(rng, tree, layers=2)
  decode = jax.jit(zha_ops.zha_decode, static_argnames=("tree", "impl"))
  stacked_out, stacked_fraction = decode(q, position, keys, bias, k, v, tree=tree, layer=jnp.int32(1))
  one = lambda x: jax.tree_util.tree_map(lambda a: a[1], x)
  out, fraction = decode(q, position, one(keys), one(bias), one(k), one(v), tree=tree)
  np.testing.assert_array_equal(stacked_out, out)
  np.testing.assert_array_equal(stacked_fraction, fraction)
  assert np.all(np.asarray(fraction) < 1.0)
  with pytest.raises(ValueError, match="needs tree.max_nodes"):
    zha_ops.zha_decode(q, position, one(keys), one(bias), one(k), one(v), tree=zha.ZHATree(refs=2, chunk=3))
