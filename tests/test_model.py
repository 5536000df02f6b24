"""The LLaMA-style decoder: every attention type runs, is causal, counts parameters, and learns."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsjax.config import MoBAConfig, model_preset
from fsjax.model import Transformer, init_variables, param_counts

from helpers import assert_close, stack_layers

KINDS = ["fs", "fsl", "tfpp", "swa", "moba"]
SEQ = 96


def _tiny(kind):
  config = model_preset("tiny", kind=kind)
  # SWA and MoBA geometry scaled to the tiny sequence, so every path (window edge, block routing) is hit.
  return dataclasses.replace(
    config, attention=dataclasses.replace(config.attention, window=40, moba=MoBAConfig(block=32, top_k=2))
  )


@pytest.mark.parametrize("kind", KINDS)
def test_every_attention_type_is_causal_end_to_end(rng, kind):
  config = _tiny(kind)
  variables = init_variables(config, jax.random.PRNGKey(0), SEQ)
  tokens = rng.integers(0, config.vocab_size, (2, SEQ))
  changed = tokens.copy()
  changed[:, 50:] = rng.integers(0, config.vocab_size, (2, SEQ - 50))
  apply = jax.jit(Transformer(config).apply)
  logits, logits_changed = np.asarray(apply(variables, tokens)), np.asarray(apply(variables, changed))
  assert logits.shape == (2, SEQ, config.vocab_size) and np.all(np.isfinite(logits))
  np.testing.assert_array_equal(logits_changed[:, :50], logits[:, :50])
  assert not np.allclose(logits_changed[:, 50:], logits[:, 50:])


def test_paper_shapes_parameter_counts():
  small, large = param_counts(model_preset("fs_341m")), param_counts(model_preset("fs_743m"))
  # 341M: 32k x 1024 tied embedding + 24 x (4 x 1024² attention + 3 x 1024 x 2816 SwiGLU) + norms.
  assert small["embedding"] == 32000 * 1024
  assert small["attention"] == 24 * (4 * 1024 * 1024 + 16 + 64)  # + α [heads] + readout gain [head_dim]
  assert small["mlp"] == 24 * 3 * 1024 * 2816
  assert small["norm"] == (2 * 24 + 1) * 1024
  assert 340e6 < small["total"] < 342e6
  assert large["mlp"] == 24 * 3 * 1536 * 4096 and large["attention"] == 24 * (4 * 1536**2 + 16 + 96)
  untied = param_counts(dataclasses.replace(model_preset("fs_341m"), tie_embeddings=False))
  assert untied["total"] - small["total"] == untied["lm_head"] == 32000 * 1024


@pytest.mark.parametrize("kind", ["fs", "tfpp"])
def test_tiny_model_overfits_a_repeated_batch(rng, kind):
  config = _tiny(kind)
  model = Transformer(config)
  variables = init_variables(config, jax.random.PRNGKey(0), SEQ)
  params, frozen = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, SEQ + 1)))
  optimizer = optax.adam(3e-3)

  @jax.jit
  def step(params, opt_state):
    def loss_fn(p):
      logits = model.apply({"params": p, **frozen}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for _ in range(40):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("kind", ["fsl", "tfpp"])
def test_scanned_layers_equal_unrolled_layers(rng, kind):
  config = dataclasses.replace(_tiny(kind), remat=True)
  scanned = dataclasses.replace(config, scan_layers=True)
  variables = init_variables(config, jax.random.PRNGKey(0), SEQ)
  stacked = stack_layers(variables, config.num_layers)
  assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
    jax.eval_shape(lambda: init_variables(scanned, jax.random.PRNGKey(0), SEQ))
  )
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, SEQ)))
  loss = lambda model, params, others: jnp.mean(model.apply({"params": params, **others}, tokens) ** 2)
  split = lambda v: (v["params"], {k: x for k, x in v.items() if k != "params"})
  # Jitted: run op by op, the unrolled model's backward pass compiled hundreds of single-op programs.
  value, grads = jax.jit(jax.value_and_grad(functools.partial(loss, Transformer(config))))(*split(variables))
  value_scan, grads_scan = jax.jit(jax.value_and_grad(functools.partial(loss, Transformer(scanned))))(*split(stacked))
  assert_close(value_scan, value, np.float32)
  for got, want in zip(
    jax.tree_util.tree_leaves(grads_scan),
    jax.tree_util.tree_leaves(stack_layers({"params": grads}, config.num_layers)["params"]),
  ):
    assert_close(got, want, np.float32)
