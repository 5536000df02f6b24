"""ZHA with grouped key/value heads (ZHA III-A..C): one tree and one set of reference queries per key/value head,
shared by the query heads that read it (query head h reads key/value head `h // (heads // kv_heads)`); routing
and attention stay per query head."""

import dataclasses
import functools
import json

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO_CONFIG

from fsjax import ops
from fsjax.cache import init_cache
from fsjax.config import load_config, model_preset
from fsjax.model import Transformer
from fsjax.ops import zha as zha_ops
from fsjax.reference import zha as zha_ref
from fsjax.reference import zha_decode
from fsjax.reference.common import PRECISION
from fsjax.reference.softmax import masked_softmax
from fsjax.reference.zha import ZHATree
from fsjax.train import checkpoint as ckpt_lib
from fsjax.train import loop
from pallas_kernels import zha_routing

import brute_force
from helpers import DISTILL, ZHA_MICRO, assert_close, jitted_init, kernel_modes, ragged_teacher_forced, random_qkv


def _grouped_qkv(rng, batch, seq, heads, kv_heads, dim, dtype=np.float64):
  q = rng.standard_normal((batch, seq, heads, dim)).astype(dtype)
  k, v = random_qkv(rng, (batch, seq, kv_heads, dim), dtype)[:2]
  return q, k, v


@pytest.mark.parametrize("theta", [10000.0, None], ids=["rope", "nope"])
@pytest.mark.parametrize(
  "heads,kv_heads,top_p,max_nodes",
  [(4, 2, (0.7,), None), (4, 1, (0.6, 0.9), None), (6, 2, (0.7,), 3)],
  ids=["group2", "group4-per-level-p", "group3-capped"],
)
def test_grouped_attention_matches_brute_force(rng, theta, heads, kv_heads, top_p, max_nodes):
  """Against a float64 loop that builds each key/value head's tree once and routes every query head of its group
  through it on its own (`brute_force.zha`)."""
  q, k, v = _grouped_qkv(rng, 2, 45, heads, kv_heads, 8)
  ref_queries = rng.standard_normal((kv_heads, 2, 8))
  expected, expected_fraction = brute_force.zha(
    q, k, v, ref_queries, chunk=3, levels=2, top_p=zha_ref.level_top_p(top_p, 2), theta=theta, max_nodes=max_nodes
  )
  attention = functools.partial(  # jitted: op by op was slower
    ops.zha_attention, chunk=3, levels=2, top_p=top_p, rope_theta=theta, max_nodes=max_nodes, return_fraction=True
  )
  with jax.enable_x64(True):
    out, fraction = jax.jit(attention)(q, k, v, ref_queries)
  assert_close(out, expected, jnp.float64)
  np.testing.assert_allclose(np.asarray(fraction), expected_fraction, rtol=1e-12)
  assert np.min(expected_fraction) < 1.0  # the routing prunes
  grouped = expected_fraction.reshape(*expected_fraction.shape[:2], kv_heads, heads // kv_heads)
  assert np.any(grouped != grouped[..., :1])  # query heads sharing a tree route differently


def test_grouped_heads_equal_multi_head_over_repeated_trees(rng):
  """Repeating each key/value head, its values and its reference queries for its query heads gives a multi-head
  ZHA whose trees are copies, so outputs, fractions and the distillation loss equal the grouped ones; the grouped
  gradient of each reference-query set is the sum over its group's copies."""
  heads, kv_heads, group = 6, 2, 3
  q, k, v = _grouped_qkv(rng, 2, 40, heads, kv_heads, 8)
  ref_queries = rng.standard_normal((kv_heads, 3, 8))
  repeat = lambda x, axis: np.repeat(x, group, axis=axis)
  kwargs = dict(chunk=3, levels=2, rope_theta=10000.0)
  # Jitted: op by op, the float64 tree, routing and loss compiled a program per operation and shape.
  attention = jax.jit(functools.partial(ops.zha_attention, top_p=0.8, max_nodes=3, return_fraction=True, **kwargs))
  kl_and_grad = jax.jit(jax.value_and_grad(functools.partial(ops.zha_kl_loss, **kwargs), argnums=2))
  with jax.enable_x64(True):
    grouped = attention(q, k, v, ref_queries)
    copied = attention(q, repeat(k, 2), repeat(v, 2), repeat(ref_queries, 0))
    for got, want in zip(grouped, copied):
      assert_close(got, want, jnp.float64)
    kl, grad = kl_and_grad(q, k, jnp.asarray(ref_queries))
    kl_copied, grad_copied = kl_and_grad(q, repeat(k, 2), jnp.asarray(repeat(ref_queries, 0)))
  np.testing.assert_allclose(kl, kl_copied, rtol=1e-12)
  assert_close(grad, np.asarray(grad_copied).reshape(kv_heads, group, 3, 8).sum(1), jnp.float64)


def test_one_key_value_head_per_query_head_runs_the_multi_head_products(rng):
  """With `kv_heads == heads` the fold is the identity: node scores and the routed attention are the multi-head
  einsums of before grouped heads, bit for bit (float32, where a changed product would show)."""
  q, k, v = (jnp.asarray(x, jnp.float32) for x in random_qkv(rng, (2, 50, 3, 8)))
  ref_queries = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
  nodes = zha_ref.build_tree(k, ref_queries, chunk=3, levels=2)
  for keys, bias in nodes:
    tangents = jnp.einsum("bthd,bnhrd->bhtnr", q, keys, precision=PRECISION) / np.sqrt(8)
    expected = jnp.max(tangents + jnp.moveaxis(bias, 1, 2)[:, :, None], axis=-1)
    np.testing.assert_array_equal(zha_ref.node_scores(q, keys, bias), expected)
  pos = jnp.broadcast_to(jnp.arange(50), (2, 50))
  out, _ = zha_ref.routed_attention(q, pos, nodes, k, v, pos, chunk=3, top_p=(0.8, 0.8))
  leaves = zha_ref.route([zha_ref.node_scores(q, *n) for n in nodes], pos, chunk=3, top_p=(0.8, 0.8))
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=PRECISION) / np.sqrt(8)
  probs = masked_softmax(logits, zha_ref.key_mask(leaves, pos, pos, 3))
  np.testing.assert_array_equal(out, jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=PRECISION))


def test_top_p_one_is_dense_grouped_attention(rng):
  q, k, v = (jnp.asarray(x, jnp.float32) for x in _grouped_qkv(rng, 2, 70, 4, 2, 8))
  ref_queries = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
  out = jax.jit(functools.partial(ops.zha_attention, chunk=3, levels=3, top_p=1.0, rope_theta=10000.0))(
    q, k, v, ref_queries
  )
  assert_close(out, jax.jit(ops.tfpp_attention)(q, k, v), jnp.float32)


def test_reference_queries_must_be_one_set_per_key_value_head(rng):
  q, k, v = _grouped_qkv(rng, 1, 20, 4, 2, 8)
  with pytest.raises(ValueError, match=r"ref_queries must be \[kv_heads=2, R, head_dim=8\]"):
    ops.zha_attention(q, k, v, rng.standard_normal((4, 2, 8)), chunk=3, levels=2, top_p=0.8)
  with pytest.raises(ValueError, match="must divide the query heads"):
    ops.zha_attention(q, *_grouped_qkv(rng, 1, 20, 4, 3, 8)[1:], rng.standard_normal((3, 2, 8)), chunk=3, levels=2,
                      top_p=0.8)  # fmt: skip


def _grouped_decode_inputs(rng, tree, heads, kv_heads, dim, seq=60):
  """A tree over `seq` keys of `kv_heads` heads, its dense cache and one decode query per (row, query head)."""
  k, v = (jnp.asarray(rng.standard_normal((2, seq, kv_heads, dim)), jnp.float32) for _ in range(2))
  ref_queries = jnp.asarray(rng.standard_normal((kv_heads, tree.refs, dim)), jnp.float32)
  nodes = zha_ref.build_tree(k, ref_queries, chunk=tree.chunk, levels=tree.levels)
  q = jnp.asarray(rng.standard_normal((2, heads, dim)) * 2, jnp.float32)
  keys, bias = tuple(n[0] for n in nodes), tuple(n[1] for n in nodes)
  return q, jnp.asarray([seq - 1, 37], jnp.int32), keys, bias, k, v


@pytest.mark.parametrize("interpret", kernel_modes())
def test_the_grouped_decode_kernels_equal_the_reference(rng, interpret):
  """Interpreted on the CPU, compiled too on a GPU: node scoring over a given list, the children's list built in
  the kernel, the whole capped descent and the leaf attention, each query head reading its key/value head's tree
  and cache through the kernels' index maps; each equals `fsjax.reference.zha_decode` (which gathers by
  `h // group`)."""
  tree = ZHATree(refs=2, chunk=4, levels=2, top_p=(0.9,), max_nodes=3)
  q, position, keys, bias, k, v = _grouped_decode_inputs(rng, tree, heads=6, kv_heads=2, dim=16)
  index = jnp.asarray(rng.integers(-1, keys[0].shape[1], (2, 6, 16)), jnp.int32)
  scores = zha_routing.score_candidates(q, keys[0], bias[0], index, interpret=interpret)
  close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # NO_NODE: -inf in both
  close(scores, zha_decode.listed_scores(q, keys[0], bias[0], index))
  top = index % keys[1].shape[1]  # level-2 nodes
  kept = zha_decode.keep_top_p(zha_decode.listed_scores(q, keys[1], bias[1], top), top, p=0.9, max_nodes=3)
  row = jnp.pad(kept, ((0, 0), (0, 0), (0, 1)), constant_values=zha_decode.NO_NODE)  # the kernels' power-of-two row
  scores, listed = zha_routing.score_children(
    q, keys[0], bias[0], row, position, parents_kept=3, chunk=4, span=4, interpret=interpret
  )
  expected_list = zha_decode.candidates_below(kept, position, chunk=4, level=2)
  np.testing.assert_array_equal(listed[..., : expected_list.shape[-1]], expected_list)
  close(scores[..., : expected_list.shape[-1]], zha_decode.listed_scores(q, keys[0], bias[0], expected_list))

  leaves = zha_ops.zha_route(q, position, keys, bias, tree=tree, impl="pallas")
  expected = zha_ops.zha_route(q, position, keys, bias, tree=tree, impl="reference")
  np.testing.assert_array_equal(np.sort(np.asarray(leaves), -1), np.sort(np.asarray(expected), -1))
  grouped = np.sort(np.asarray(expected), -1).reshape(2, 2, 3, -1)
  assert np.any(grouped != grouped[:, :, :1])  # query heads sharing a tree reach different leaves
  out = zha_routing.leaf_attention(q, k, v, expected, position, chunk=4, interpret=interpret)
  assert_close(out, zha_decode.leaf_attention(q, k, v, expected, position, chunk=4), jnp.float32)
  (got, got_fraction), (want, want_fraction) = (
    zha_ops.zha_decode(q, position, keys, bias, k, v, tree=tree, impl=impl) for impl in ("pallas", "reference")
  )
  assert_close(got, want, jnp.float32)
  np.testing.assert_array_equal(got_fraction, want_fraction)


def test_the_grouped_capped_decode_step_routes_like_the_training_form(rng):
  """The reference decode descent (candidate lists, gathered by `h // group`) keeps the leaves the training
  form's routing keeps for the same query over the same grouped tree."""
  tree = ZHATree(refs=2, chunk=3, levels=2, top_p=(0.8,), max_nodes=2)
  q, position, keys, bias, k, v = _grouped_decode_inputs(rng, tree, heads=4, kv_heads=2, dim=8)
  leaves = zha_decode.route_gathered(q, position, keys, bias, tree)
  scores = [zha_ref.node_scores(q[:, None], key, b) for key, b in zip(keys, bias)]
  mask = zha_ref.route(scores, position[:, None], chunk=3, top_p=tree.level_top_p, max_nodes=2)[:, :, 0]
  leaves, reached = np.asarray(leaves), np.zeros(mask.shape, bool)
  b, h, j = np.nonzero(leaves >= 0)
  reached[b, h, leaves[b, h, j]] = True
  np.testing.assert_array_equal(reached, mask)


def _grouped_model(scan_layers, impl, max_nodes):
  config = dataclasses.replace(model_preset("tiny", kind="zha", scan_layers=scan_layers), num_kv_heads=2)
  att = config.attention
  zha = dataclasses.replace(att.zha, refs=2, chunk=4, top_p=(0.9,), max_nodes=max_nodes)
  config = dataclasses.replace(config, attention=dataclasses.replace(att, impl=impl, zha=zha))
  return config, Transformer(config), jitted_init(config, 32)


@pytest.mark.parametrize(
  "impl,scan_layers,max_nodes",
  [("reference", False, None), ("reference", False, 2), ("pallas", False, 2), ("pallas", True, 2)],
)
def test_grouped_model_prefills_and_decodes_like_its_full_forward(rng, impl, scan_layers, max_nodes):
  """Ragged rows of 64 and 45 prompt tokens (45 ends mid-chunk) in 32-token chunks, then 8 decoded tokens, with 2
  key/value heads for 4 query heads: the cache and its trees hold 2 heads, the reference queries are one set per
  key/value head; with a cap the decode tokens take the gathered path (through the kernels with "pallas", which
  read a scanned model's stacked cache in place)."""
  config, model, variables = _grouped_model(scan_layers, impl, max_nodes)
  layer = init_cache(config, 1, 8)["layers" if scan_layers else "layer_0"]
  assert layer.store.k.shape[-2] == layer.keys[0].shape[-3] == 2
  attention = variables["params"]["layers"]["layer"] if scan_layers else variables["params"]["layer_0"]
  assert attention["attention"]["ref_queries"].shape[-3:] == (2, 2, config.head_dim)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 72)))
  full = np.asarray(jax.jit(model.apply)(variables, tokens))
  for row, got in enumerate(ragged_teacher_forced(model, variables, tokens, [64, 45], 8, chunk=32)):
    np.testing.assert_allclose(got, full[row, : len(got)], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def grouped_tfpp_workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("micro_tfpp_gqa")
  overrides = ["model.attention.kind=tfpp", "model.num_kv_heads=1", "train.steps=2", "checkpoint.async_save=false"]
  loop.train(load_config(MICRO_CONFIG, overrides), str(path))
  return path


def test_distillation_from_a_grouped_tfpp_parent(grouped_tfpp_workdir, tmp_path):
  """ZHA III-B on a parent with 1 key/value head for 2 query heads: the KL falls, only the reference queries
  (one set for the shared tree) train, every parent array is kept."""
  distill = [
    "model.num_kv_heads=1",
    *DISTILL,
    f"train.init_from={grouped_tfpp_workdir}",
    "log.every=1",
  ]
  path = tmp_path / "zha"
  loop.train(load_config(MICRO_CONFIG, [*ZHA_MICRO, *distill]), str(path))
  with open(path / "metrics.jsonl") as f:
    logged = [json.loads(line) for line in f]
  assert [r["step"] for r in logged] == list(range(1, 13))
  assert logged[-1]["loss"] < 0.8 * logged[0]["loss"]
  _, parent, _, _ = ckpt_lib.load(str(grouped_tfpp_workdir))
  config, child, _, _ = ckpt_lib.load(str(path))
  assert config.model.num_kv_heads == 1
  parent, child = flax.traverse_util.flatten_dict(parent), flax.traverse_util.flatten_dict(child)
  refs = {k for k in child if k[-1] == "ref_queries"}
  assert set(child) - set(parent) == refs != set()
  assert all(child[k].shape == (1, 4, 16) for k in refs)
  for name, value in parent.items():
    np.testing.assert_array_equal(child[name], value, err_msg=str(name))
