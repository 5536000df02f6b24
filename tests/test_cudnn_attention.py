"""cuDNN TF++/SWA against the reference (where the dispatch table picks cuDNN: a GPU; skipped elsewhere)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.cache import init_cache
from fsjax.config import RoPEScalingConfig, model_preset
from fsjax.decode import extend, prefill
from fsjax.model import Transformer, init_variables
from fsjax.ops import dispatch
from fsjax.ops.cudnn import causal_rope_attention_cudnn
from fsjax.reference.rope import Llama3Scaling, RoPE

from helpers import assert_close, random_qkv

pytestmark = pytest.mark.skipif(
  dispatch.resolve("local_attention", "auto", dtype=jnp.bfloat16) != "cudnn", reason="cuDNN attention needs a GPU"
)


@pytest.mark.parametrize("window", [None, 64], ids=["tfpp", "swa"])
def test_cudnn_matches_reference_in_bf16(rng, window):
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, (2, 384, 4, 64), np.float32))
  fast = causal_rope_attention_cudnn(q, k, v, window=window)
  reference = ops.tfpp_attention(q, k, v) if window is None else ops.swa_attention(q, k, v, window=window)
  assert fast.dtype == jnp.bfloat16
  assert_close(np.asarray(fast, np.float32), np.asarray(reference, np.float32), jnp.bfloat16)
  dispatched = (
    ops.tfpp_attention(q, k, v, impl="auto")
    if window is None
    else ops.swa_attention(q, k, v, window=window, impl="auto")
  )
  np.testing.assert_array_equal(np.asarray(dispatched, np.float32), np.asarray(fast, np.float32))  # "auto": cuDNN


@pytest.mark.parametrize("window", [None, 64], ids=["tfpp", "swa"])
def test_cudnn_gradients_match_the_reference(rng, window):
  """Training runs through cuDNN's backward on GPU: dq, dk, dv against the float32 reference's VJP."""
  q, k, v, cotangent = (
    jnp.asarray(x, jnp.bfloat16)
    for x in random_qkv(rng, (2, 384, 4, 64), np.float32) + (rng.standard_normal((2, 384, 4, 64)),)
  )
  reference = ops.tfpp_attention if window is None else lambda *x: ops.swa_attention(*x, window=window)
  as_f32 = lambda *x: tuple(a.astype(jnp.float32) for a in x)
  _, fast_vjp = jax.vjp(lambda *x: causal_rope_attention_cudnn(*x, window=window).astype(jnp.float32), q, k, v)
  _, reference_vjp = jax.vjp(lambda *x: reference(*as_f32(*x)), q, k, v)
  for fast, exact in zip(fast_vjp(cotangent.astype(jnp.float32)), reference_vjp(cotangent.astype(jnp.float32))):
    assert_close(np.asarray(fast, np.float32), np.asarray(exact, np.float32), jnp.bfloat16)


@pytest.mark.parametrize("window", [None, 64], ids=["tfpp", "swa"])
def test_cudnn_reads_fewer_kv_heads_and_any_rope_as_the_reference_does(rng, window):
  """Grouped-query attention (8 query heads over 2 key/value heads) with partial, Llama 3-scaled RoPE."""
  q = jnp.asarray(rng.standard_normal((2, 384, 8, 64)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((2, 384, 2, 64)), jnp.bfloat16) for _ in range(2))
  rope = RoPE(theta=500000.0, fraction=0.5, scaling=Llama3Scaling(original_max_position_embeddings=256))
  fast = causal_rope_attention_cudnn(q, k, v, window=window, rope_theta=rope)
  reference = (
    ops.tfpp_attention(q, k, v, rope_theta=rope)
    if window is None
    else ops.swa_attention(q, k, v, window=window, rope_theta=rope)
  )
  assert_close(np.asarray(fast, np.float32), np.asarray(reference, np.float32), jnp.bfloat16)


@pytest.mark.parametrize("options", [False, True], ids=["mha", "gqa-qknorm-bias-rope"])
def test_tfpp_cache_on_cudnn_matches_the_reference_cache_path(rng, options):
  """Chunked prefill through cuDNN and a one-token step through `store.attend_one`, over the bf16 dense cache,
  against impl="reference" (the jnp chunk path for both); also with the Hugging Face options (2 key/value heads
  for 4 query heads, q/k RMSNorm, biases, partial Llama 3-scaled RoPE)."""
  config = dataclasses.replace(model_preset("tiny", kind="tfpp"), dtype="bfloat16", param_dtype="bfloat16")
  if options:
    attention = dataclasses.replace(
      config.attention,
      rope_fraction=0.5,
      rope_scaling=RoPEScalingConfig(type="llama3", original_max_position_embeddings=64),
    )
    config = dataclasses.replace(config, num_kv_heads=2, qk_norm=True, qkv_bias=True, attention=attention)
  variables = init_variables(config, jax.random.PRNGKey(0), 64)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 100)))
  lengths = jnp.array([96, 57])

  def run(impl):
    model = Transformer(dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl)))
    cache = init_cache(config, 2, 100, dtype=jnp.bfloat16)
    logits, cache = prefill(model, variables, tokens[:, :96], lengths, cache, chunk=32)
    step, _, _ = extend(model, variables, tokens[:, 96:97], cache, lengths[:, None], jnp.ones((2, 1), bool))
    logits, step = np.asarray(logits, np.float32), np.asarray(step, np.float32)
    return np.concatenate([logits[0, :96], logits[1, :57], step[:, 0]])

  assert_close(run("auto"), run("reference"), jnp.bfloat16)
