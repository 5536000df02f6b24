"""Training-system units: schedules, decay mask, weighted loss, skipped non-finite steps, sharding rules."""

import dataclasses

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsjax.config import OBJECTIVES, Config, ConfigError, MeshConfig, TrainConfig, model_preset
from fsjax.model import Transformer, init_variables
from fsjax.train import objectives, sharding
from fsjax.train.objectives import loss_weights, weighted_loss
from fsjax.train.optim import decay_mask, learning_rate_schedule, make_optimizer
from fsjax.train.step import create_state, make_train_step


def test_cosine_schedule_warms_up_decays_and_floors():
  f = learning_rate_schedule(TrainConfig(steps=100, warmup_steps=10, learning_rate=1.0, lr_floor=0.1))
  np.testing.assert_allclose([f(0), f(5), f(10), f(55), f(100), f(500)], [0, 0.5, 1.0, 0.55, 0.1, 0.1], atol=1e-6)


def test_wsd_schedule_is_flat_then_decays_linearly_over_the_last_fifth():
  f = learning_rate_schedule(
    TrainConfig(steps=100, warmup_steps=20, learning_rate=1.0, lr_floor=0.01, schedule="wsd", decay_fraction=0.2)
  )
  np.testing.assert_allclose(
    [f(10), f(20), f(79), f(80), f(90), f(100), f(200)], [0.5, 1.0, 1.0, 1.0, 0.505, 0.01, 0.01], atol=1e-6
  )


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_no_weight_decay_on_norms_gains_and_alpha(scan_layers):
  """Scanned layers stack every parameter on a layer axis (norm scales become 2-D): the mask must not change."""
  config = dataclasses.replace(model_preset("tiny"), scan_layers=scan_layers)
  mask = decay_mask(init_variables(config, jax.random.PRNGKey(0))["params"])
  layer = mask["layers"]["layer"] if scan_layers else mask["layer_0"]
  attention = layer["attention"]
  assert attention["q_proj"]["kernel"] and layer["mlp"]["down"]["kernel"] and mask["embed"]["embedding"]
  assert not attention["alpha"] and not attention["lr_gain"]
  assert not layer["attention_norm"]["scale"] and not layer["mlp_norm"]["scale"] and not mask["final_norm"]["scale"]


def test_recall_weighted_loss_matches_eq_13(rng):
  config = model_preset("tiny")
  variables = init_variables(config, jax.random.PRNGKey(0), 64)
  tokens = rng.integers(0, config.vocab_size, (2, 65))
  recall, switch = (rng.integers(0, 2, (2, 65)).astype(np.float32) for _ in range(2))
  batch = dict(tokens=jnp.asarray(tokens), recall=jnp.asarray(recall), switch=jnp.asarray(switch))
  model = Transformer(config)
  logits = jax.jit(model.apply)(variables, tokens[:, :-1])
  nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))
  w = 1 + 9 * recall[:, 1:] + 49 * switch[:, 1:]
  frozen = {"routing": variables["routing"]}
  loss_fn = jax.jit(weighted_loss, static_argnums=(0, 4, 5))  # op by op, the forward compiled per operation
  loss = loss_fn(model, variables["params"], frozen, batch, 9.0, 49.0)
  np.testing.assert_allclose(loss, np.sum(w * nll) / np.sum(w), rtol=1e-5)
  np.testing.assert_allclose(loss_fn(model, variables["params"], frozen, batch), nll.mean(), rtol=1e-5)
  np.testing.assert_array_equal(loss_weights(batch, 0.0, 0.0), np.ones((2, 64)))


def test_non_finite_step_is_skipped_and_counted(rng):
  config = model_preset("tiny")
  model = Transformer(config)
  train = TrainConfig(steps=10, warmup_steps=0, learning_rate=1e-2, lr_floor=0.0, recall_beta=1.0)
  optimizer = make_optimizer(train)
  state = create_state(init_variables(config, jax.random.PRNGKey(0), 64), optimizer)
  step = jax.jit(
    make_train_step(objectives.get(train.objective).loss(model, train), optimizer, learning_rate_schedule(train))
  )
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 65)))
  good = dict(tokens=tokens, recall=jnp.zeros((2, 65)))
  poisoned = dict(tokens=tokens, recall=jnp.full((2, 65), jnp.nan))
  state1, m1 = step(state, good)
  state2, m2 = step(state1, poisoned)
  assert bool(m1["finite"]) and not bool(m2["finite"])
  assert int(state2.bad_steps) == 1 and int(state2.skipped) == 1 and int(state2.step) == 2
  jax.tree_util.tree_map(np.testing.assert_array_equal, state2.params, state1.params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, state2.opt_state, state1.opt_state)
  state3, m3 = step(state2, good)
  assert bool(m3["finite"]) and int(state3.bad_steps) == 0 and int(state3.skipped) == 1
  assert not np.array_equal(state3.params["embed"]["embedding"], state2.params["embed"]["embedding"])


def test_every_configurable_objective_is_registered():
  assert set(objectives.OBJECTIVES) == set(OBJECTIVES)
  lm = objectives.get("lm")
  config = model_preset("tiny")
  assert lm.model_config(config) == config and lm.trainable is None and lm.metric_names(config) == ()


def test_zha_objective_distills_trains_only_the_reference_queries_and_converts_only_tfpp():
  config = dataclasses.replace(model_preset("tiny", kind="zha"), num_layers=1)
  zha = objectives.get("zha_kl")
  assert zha.model_config(config).attention.zha.distill and not config.attention.zha.distill
  assert zha.metric_names(config) == ("kl_level_1", "kl_level_2")
  params = init_variables(config, jax.random.PRNGKey(0), 32)["params"]
  train = TrainConfig(steps=10, warmup_steps=0, learning_rate=1e-2, lr_floor=0.0, objective="zha_kl")
  optimizer = make_optimizer(train, zha.trainable)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  moved = {"/".join(map(str, path)) for path, u in flax.traverse_util.flatten_dict(updates).items() if jnp.any(u)}
  assert moved == {"layer_0/attention/ref_queries"}

  parent = lambda kind: Config(model=model_preset("tiny", kind=kind))
  assert zha.parent_params(None, parent("zha"), params, "p") is params
  converted = flax.traverse_util.flatten_dict(zha.parent_params(None, parent("tfpp"), params, "p"))
  assert set(flax.traverse_util.flatten_dict(params)) - set(converted) == {("layer_0", "attention", "ref_queries")}
  with pytest.raises(ConfigError, match="a ZHA model converts a TF\\+\\+ checkpoint .* holds a 'fs' model"):
    zha.parent_params(None, parent("fs"), params, "p")


def test_partition_rules_shard_over_fsdp_and_replicate_what_does_not_divide():
  assert sharding.param_spec("layer_0/attention/q_proj/kernel", (64, 4, 16), 2) == jax.sharding.PartitionSpec(
    "fsdp", None, None
  )
  assert sharding.param_spec("layer_0/mlp/down/kernel", (256, 64), 2) == jax.sharding.PartitionSpec(None, "fsdp")
  assert sharding.param_spec("embed/embedding", (33, 64), 2) == jax.sharding.PartitionSpec(None, None)
  assert sharding.param_spec("layer_0/attention/alpha", (4,), 2) == jax.sharding.PartitionSpec()
  # Optimizer moments carry the parameter path as a suffix, so they follow the same rule.
  assert sharding.param_spec("opt_state/1/0/mu/embed/embedding", (32, 8), 2) == jax.sharding.PartitionSpec("fsdp", None)
  # scan_layers stacks parameters [layers, ...]: the layer axis stays whole, the rest follows the rule.
  assert sharding.param_spec("layers/layer/attention/q_proj/kernel", (3, 64, 4, 16), 2) == jax.sharding.PartitionSpec(
    None, "fsdp", None, None
  )
  assert sharding.param_spec("0/mu/layers/layer/mlp/down/kernel", (3, 256, 64), 2) == jax.sharding.PartitionSpec(
    None, None, "fsdp"
  )


def test_mesh_sizes_must_cover_the_devices():
  devices = jax.devices()[:1]
  assert dict(sharding.make_mesh(MeshConfig(), devices).shape) == {"data": 1, "fsdp": 1}
  with pytest.raises(ConfigError, match="mesh.data x mesh.fsdp must equal"):
    sharding.make_mesh(MeshConfig(data=2, fsdp=1), devices)
