"""The short convolution before attention (`model.short_conv`): the maths against a loop, a fresh model equal to
the model without it, and decoding through its history equal to the full forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import short_conv
from fsjax.cache import init_cache
from fsjax.config import ConfigError, ModelConfig
from fsjax.decode import extend, prefill
from fsjax.model import Transformer

from helpers import assert_close, jitted_init, tiny_model


def _loop_conv(h, w):
  """`y_t = sum_j w_j h_{t-j}` one position and tap at a time, float64."""
  h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
  y = np.zeros_like(h)
  for t in range(h.shape[1]):
    for j in range(w.shape[0]):
      if t - j >= 0:
        y[:, t] += w[j] * h[:, t - j]
  return y


@pytest.mark.parametrize("kernel,length", [(2, 1), (3, 13), (4, 7)])
def test_causal_conv_equals_a_loop_and_a_chunk_with_its_history_equals_the_whole(rng, kernel, length):
  h = rng.standard_normal((2, length + 5, 6)).astype(np.float32)
  w = rng.standard_normal((kernel, 6)).astype(np.float32)
  whole = short_conv.causal_conv(jnp.asarray(h), jnp.asarray(w))
  assert_close(whole, _loop_conv(h, w), np.float32)
  history = short_conv.next_history(jnp.asarray(h[:, :5]), jnp.zeros((2, kernel - 1, 6)), jnp.ones((2, 5), bool))
  np.testing.assert_array_equal(history, np.concatenate([np.zeros((2, kernel - 1, 6)), h[:, :5]], 1)[:, 5:])
  assert_close(short_conv.causal_conv(jnp.asarray(h[:, 5:]), jnp.asarray(w), history), whole[:, 5:], np.float32)


def test_the_history_stops_at_each_rows_last_valid_token(rng):
  h = jnp.asarray(rng.standard_normal((3, 4, 2)), jnp.float32)
  before = jnp.asarray(rng.standard_normal((3, 2, 2)), jnp.float32)
  valid = jnp.arange(4)[None] < jnp.array([[4], [1], [0]])
  history = short_conv.next_history(h, before, valid)
  np.testing.assert_array_equal(history[0], h[0, 2:])
  np.testing.assert_array_equal(history[1], jnp.stack([before[1, 1], h[1, 0]]))
  np.testing.assert_array_equal(history[2], before[2])  # no token consumed: the history is kept


def _conv_model(kind, scan_layers, kernel=3):
  """The tiny model of `kind` with a short convolution whose taps are random (a fresh one is the identity)."""
  config = tiny_model(kind, scan_layers)[0]
  config = dataclasses.replace(config, short_conv=kernel)
  fresh = jitted_init(config)
  params = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      jax.random.normal(jax.random.PRNGKey(len(path)), x.shape, x.dtype) * 0.5 if path[-1].key == "short_conv" else x
    ),
    fresh["params"],
  )
  return config, Transformer(config), {**fresh, "params": params}


def test_a_fresh_convolution_is_the_identity(rng):
  config, model, variables = tiny_model("tfpp")
  conv_config = dataclasses.replace(config, short_conv=3)
  fresh = jitted_init(conv_config)
  assert fresh["params"]["layer_0"]["short_conv"].shape == (3, config.d_model)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 40)))
  with_conv = Transformer(conv_config).apply(fresh, tokens)
  np.testing.assert_array_equal(with_conv, model.apply({**fresh, "params": _without_conv(fresh["params"])}, tokens))


def _without_conv(params):
  """`params` less every layer's `short_conv`."""
  return {k: _without_conv(v) if isinstance(v, dict) else v for k, v in params.items() if k != "short_conv"}


@pytest.mark.parametrize("kind,scan_layers", [("tfpp", False), ("fsl", True), ("fs", False)])
def test_prefill_of_ragged_prompts_and_decode_equal_the_full_forward(rng, kind, scan_layers):
  """Rows of 70 and 45 tokens prefilled in chunks of 32 (both end mid-chunk), then four tokens decoded at each
  row's own position: every logit equals the full forward pass over the row's tokens."""
  config, model, variables = _conv_model(kind, scan_layers)
  lengths, steps = np.array([70, 45]), 4
  tokens = rng.integers(0, config.vocab_size, (2, 70 + steps))
  full = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(tokens)))
  cache = init_cache(config, 2, 80)
  assert cache["conv"].shape == (config.num_layers, 2, 2, config.d_model)
  logits, cache = prefill(model, variables, jnp.asarray(tokens[:, :70]), jnp.asarray(lengths), cache, chunk=32)
  for row, n in enumerate(lengths):
    assert_close(logits[row, :n], full[row, :n], np.float32, scale=5)
  # Decoding continues each row where its prompt ended: row 1's next tokens are the ones after its 45.
  for i in range(steps):
    positions = jnp.asarray(lengths + i)[:, None]
    step_tokens = jnp.asarray(tokens[np.arange(2), lengths + i])[:, None]
    step_logits, cache, _ = extend(model, variables, step_tokens, cache, positions, jnp.ones((2, 1), bool))
    for row in range(2):
      assert_close(step_logits[row, 0], full[row, lengths[row] + i], np.float32, scale=5)  # causal: later tokens unseen


def test_short_conv_must_be_zero_or_at_least_two_taps():
  for bad in (1, -2):
    with pytest.raises(ConfigError, match=rf"short_conv must be 0 \(none\) or a kernel of at least 2 taps, got {bad}"):
      ModelConfig(short_conv=bad)
