"""ZHA inside the model: decode fractions, TF++ -> ZHA conversion by KL distillation, and the CLIs on the result."""

import dataclasses
import functools
import json

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MICRO_CONFIG

from fsjax import generate, ops
from fsjax.attention import zha_step
from fsjax.cache import init_cache
from fsjax.cache import zha as zha_cache
from fsjax.config import ConfigError, load_config, model_preset
from fsjax.decode import extend, prefill
from fsjax.eval import ruler
from fsjax.model import Transformer
from fsjax.reference import zha as zha_ref
from fsjax.reference.rope import apply_rope
from fsjax.reference.zha import ZHATree
from fsjax.train import checkpoint as ckpt_lib
from fsjax.train import loop

from helpers import DISTILL, ZHA_MICRO, jitted_init

_extend = jax.jit(zha_cache.extend, static_argnames=("tree", "rope_theta"))
_attend = jax.jit(zha_step.attend, static_argnames=("tree", "impl"))


def _zha(config, **changes):
  """`config` (a ModelConfig) with its attention's ZHA section changed."""
  attention = config.attention
  return dataclasses.replace(
    config, attention=dataclasses.replace(attention, zha=dataclasses.replace(attention.zha, **changes))
  )


def test_decode_reports_the_fraction_of_keys_each_query_read(rng):
  config = _zha(model_preset("tiny", kind="zha"), refs=2, chunk=4, top_p=(0.6,))
  model = Transformer(config)
  variables = jitted_init(config, 32)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, 96)))
  _, cache = prefill(model, variables, tokens[:, :95], jnp.array([95]), init_cache(config, 1, 96), chunk=32)
  _, _, intermediates = extend(model, variables, tokens[:, 95:], cache, jnp.array([[95]]), jnp.ones((1, 1), bool))
  fraction = intermediates["layer_0"]["attention"]["attended_fraction"][0]  # [1, 1, heads]
  assert fraction.shape == (1, 1, config.num_heads)
  assert np.all((np.asarray(fraction) > 0) & (np.asarray(fraction) < 1))


@pytest.fixture(scope="module")
def tfpp_workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("micro_tfpp")
  loop.train(
    load_config(MICRO_CONFIG, ["model.attention.kind=tfpp", "train.steps=2", "checkpoint.async_save=false"]), str(path)
  )
  return path


@pytest.fixture(scope="module")
def zha_workdir(tfpp_workdir, tmp_path_factory):
  path = tmp_path_factory.mktemp("micro_zha")
  loop.train(
    load_config(MICRO_CONFIG, [*ZHA_MICRO, *DISTILL, f"train.init_from={tfpp_workdir}", "log.every=1"]), str(path)
  )
  return path


def test_distillation_trains_only_the_reference_queries_and_lowers_the_kl(tfpp_workdir, zha_workdir):
  with open(zha_workdir / "metrics.jsonl") as f:
    logged = [json.loads(line) for line in f]
  assert [r["step"] for r in logged] == list(range(1, 13))
  assert all(abs(r["loss"] - r["kl_level_1"] - r["kl_level_2"]) < 1e-5 for r in logged)
  assert logged[-1]["loss"] < 0.8 * logged[0]["loss"]
  _, parent, _, _ = ckpt_lib.load(str(tfpp_workdir))
  config, child, _, step = ckpt_lib.load(str(zha_workdir))
  assert step == 12 and config.model.attention.kind == "zha"
  parent, child = flax.traverse_util.flatten_dict(parent), flax.traverse_util.flatten_dict(child)
  assert set(child) - set(parent) == {k for k in child if k[-1] == "ref_queries"} != set()
  for name, value in parent.items():
    np.testing.assert_array_equal(child[name], value, err_msg=str(name))
  with open(zha_workdir / "eval.json") as f:
    assert np.isfinite(json.load(f)["heldout_loss"])  # measured through the ZHA tree


def test_the_converted_checkpoint_generates_and_is_evaluated_at_several_thresholds(zha_workdir, tmp_path, capsys):
  assert generate.main(["--checkpoint", str(zha_workdir), "--prompt", "The sea was", "--max-new-tokens", "4"]) == 0
  assert capsys.readouterr().out.startswith("The sea was")
  out = tmp_path / "ruler"
  for p in ("0.8", "1.0"):
    assert (
      ruler.main(
        [
          "--checkpoint",
          str(zha_workdir),
          "--tasks",
          "niah_single_1",
          "--lengths",
          "384",
          "--num-samples",
          "2",
          "--batch-size",
          "2",
          "--out",
          str(out),
          "--set",
          f"attention.zha.top_p={p}",
        ]
      )
      == 0
    )
  assert f"{zha_workdir.name}@12[top_p=1.0]" in capsys.readouterr().out


def test_only_a_tfpp_checkpoint_converts_to_zha(micro_workdir, tmp_path):
  config = load_config(MICRO_CONFIG, [*ZHA_MICRO, *DISTILL, f"train.init_from={micro_workdir}"])
  with pytest.raises(ConfigError, match="converts a TF\\+\\+ checkpoint"):
    loop.train(config, str(tmp_path / "run"))


def test_distillation_needs_a_zha_model():
  with pytest.raises(ConfigError, match="train.objective zha_kl needs model.attention.kind zha"):
    load_config(MICRO_CONFIG, ["train.objective=zha_kl"])
  with pytest.raises(ConfigError, match="attention.zha.top_p must hold one value or one per level"):
    load_config(MICRO_CONFIG, [*ZHA_MICRO, "model.attention.zha.top_p=[0.5, 0.6, 0.7]"])
  config = load_config(MICRO_CONFIG, [*ZHA_MICRO, "model.attention.zha.top_p=[0.5, 0.9]"])
  assert config.model.attention.zha.top_p == (0.5, 0.9)


@pytest.mark.parametrize("max_nodes", [None, 2])
def test_cache_routing_equals_the_reference(rng, max_nodes):
  """A 40-token prefill then single tokens through the cache give the reference's outputs and key counts; with a
  cap, single tokens take the gathered path (candidate lists only)."""
  q, k, v = (jnp.asarray(rng.standard_normal((2, 70, 2, 8)), jnp.float32) for _ in range(3))
  ref_queries = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
  tree = ZHATree(refs=3, chunk=3, levels=2, top_p=(0.9,), max_nodes=max_nodes)
  attention = jax.jit(  # op by op, the reference compiled a program per operation
    functools.partial(ops.zha_attention, chunk=3, levels=2, top_p=0.9, rope_theta=10000.0, return_fraction=True),
    static_argnames="max_nodes",
  )
  expected, expected_fraction = attention(q, k, v, ref_queries, max_nodes=max_nodes)
  cache = zha_cache.empty_zha(2, 72, 2, 8, tree)
  outputs, fractions = [], []
  for start, size in ((0, 40), *((t, 1) for t in range(40, 70))):
    pos = jnp.broadcast_to(jnp.arange(start, start + size), (2, size))
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
    out, fraction = _attend(cache, rot(q), pos, tree=tree, impl="reference")  # capped single tokens: gathered
    outputs.append(out)
    fractions.append(fraction)
  np.testing.assert_allclose(np.concatenate(fractions, axis=1), expected_fraction, rtol=1e-6)
  np.testing.assert_allclose(np.concatenate(outputs, axis=1), expected, rtol=1e-4, atol=1e-5)
  assert np.min(expected_fraction[:, 40:]) < 0.5  # routing prunes where the decode steps run
  if max_nodes:
    _, uncapped = attention(q, k, v, ref_queries, max_nodes=None)
    assert np.any(np.asarray(expected_fraction) < np.asarray(uncapped))  # the cap binds


@pytest.mark.parametrize("impl,scan_layers", [("reference", False), ("pallas", False), ("pallas", True)])
def test_capped_model_decodes_like_its_full_forward(rng, impl, scan_layers):
  """Decode steps take the gathered path (through the kernels with impl="pallas", which read a scanned model's
  stacked cache in place); the full forward is the reference operator with the same cap."""
  config = _zha(model_preset("tiny", kind="zha", scan_layers=scan_layers), refs=2, chunk=4, top_p=(0.95,), max_nodes=2)
  config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl))
  model = Transformer(config)
  variables = jitted_init(config, 32)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 100)))
  full = np.asarray(jax.jit(model.apply)(variables, tokens))
  logits, cache = prefill(model, variables, tokens[:, :64], jnp.array([64, 64]), init_cache(config, 2, 100), 32)
  steps = [logits]
  for t in range(64, 100):
    step, cache, _ = extend(model, variables, tokens[:, t : t + 1], cache, jnp.full((2, 1), t), jnp.ones((2, 1), bool))
    steps.append(step)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("start_length", [(0, 46), (8, 37), (8, 36)])
def test_a_chunk_writes_every_node_it_completes_and_none_from_padding(rng, start_length):
  """A 48-token chunk into a 48-slot cache (11 level-1 nodes of 4 keys): the slots for the nodes a chunk
  completes are capped at the node count, so a chunk from position 0 must not spend one on node -1. Padding
  after each row's length writes no node: the cache's complete nodes equal `build_tree` over the valid keys, and
  the slots past them stay empty. At length 36 the next node's last key is the first padded position."""
  start, length = start_length
  tree = ZHATree(refs=2, chunk=4, levels=2, top_p=(0.9,))
  k = jnp.asarray(rng.standard_normal((1, 48, 2, 8)), jnp.float32)
  ref_queries = jnp.asarray(rng.standard_normal((2, 2, 8)), jnp.float32)
  cache = zha_cache.empty_zha(1, 48, 2, 8, tree)
  if start:
    pos = jnp.arange(start)[None]
    cache = _extend(cache, k[:, :start], k[:, :start], pos, pos >= 0, ref_queries, tree=tree, rope_theta=None)
  pos = jnp.arange(start, start + 48)[None]
  chunk = jnp.pad(k[:, start:], ((0, 0), (0, start), (0, 0), (0, 0)), constant_values=9.0)  # padding: not keys
  cache = _extend(cache, chunk, chunk, pos, pos < length, ref_queries, tree=tree, rope_theta=None)
  expected = zha_ref.build_tree(k[:, :length], ref_queries, chunk=4, levels=2)
  for level, (keys, bias) in enumerate(expected):
    count = keys.shape[1]
    np.testing.assert_allclose(cache.keys[level][:, :count], keys, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache.bias[level][:, :count], bias, rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(cache.keys[level][:, count:])), f"level {level + 1}: a node past the prompt"
    assert not np.any(np.asarray(cache.bias[level][:, count:])), f"level {level + 1}: a node past the prompt"
