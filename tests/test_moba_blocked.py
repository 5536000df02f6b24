"""MoBA over blocks of queries (fsjax.ops.moba) against the reference (fsjax.reference.dense.moba_attention), whose
masked `[batch, heads, T, T]` attention it never holds whole."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.config import model_preset
from fsjax.ops import dispatch, moba, query_blocks
from fsjax.reference import dense
from fsjax.reference.rope import RoPE, apply_rope

from helpers import assert_blocked_model_equals_reference, gradient_temporaries, random_qkv, spy

# (batch, seq, heads, kv_heads, dim, moba_block, moba_top_k, query_block, rope_theta)
CASES = [
  pytest.param(2, 100, 4, 2, 8, 16, 3, 32, 10000.0, id="grouped-padded-last-block"),
  pytest.param(1, 77, 2, 1, 8, 8, 5, 16, RoPE(10000.0, 0.5), id="one-kv-head-partial-rope"),
  pytest.param(2, 45, 2, 2, 8, 16, 1, 64, 10000.0, id="own-block-only-one-query-block-past-the-end"),
  pytest.param(1, 50, 4, 4, 16, 16, 9, 24, 500.0, id="more-blocks-asked-than-exist-unaligned-query-blocks"),
]


@functools.partial(jax.jit, static_argnames=("attention", "moba_block", "moba_top_k", "rope_theta"))
def _value_and_grads(q, k, v, weights, *, attention, moba_block, moba_top_k, rope_theta):
  """The output and the gradients of `Σ weights · output` with respect to q, k and v."""
  run = lambda q, k, v: attention(q, k, v, moba_block=moba_block, moba_top_k=moba_top_k, rope_theta=rope_theta)
  return run(q, k, v), jax.grad(lambda *qkv: jnp.sum(weights * run(*qkv)), argnums=(0, 1, 2))(q, k, v)


def _inputs(rng, batch, seq, heads, kv_heads, dim, dtype):
  q = rng.standard_normal((batch, seq, heads, dim)).astype(dtype)
  _, k, v = random_qkv(rng, (batch, seq, kv_heads, dim), dtype)
  return q, k, v, rng.standard_normal((batch, seq, heads, dim)).astype(dtype)


@pytest.mark.parametrize("batch,seq,heads,kv_heads,dim,moba_block,moba_top_k,query_block,rope_theta", CASES)
def test_blocked_attention_and_its_gradients_equal_the_reference(
  rng, batch, seq, heads, kv_heads, dim, moba_block, moba_top_k, query_block, rope_theta
):
  """Float64: the output and the gradients with respect to q, k and v equal the reference's to 1e-12 relative."""
  blocked = functools.partial(moba.moba_attention, query_block=query_block)
  routing = dict(moba_block=moba_block, moba_top_k=moba_top_k, rope_theta=rope_theta)
  with jax.enable_x64(True):
    inputs = _inputs(rng, batch, seq, heads, kv_heads, dim, np.float64)
    expected = jax.tree_util.tree_leaves(_value_and_grads(*inputs, attention=dense.moba_attention, **routing))
    actual = jax.tree_util.tree_leaves(_value_and_grads(*inputs, attention=blocked, **routing))
    for a, e in zip(actual, expected):
      assert a.dtype == jnp.float64 and a.shape == e.shape and float(jnp.max(jnp.abs(e))) > 0
      assert float(jnp.max(jnp.abs(a - e))) <= 1e-12 * float(jnp.max(jnp.abs(e)))


def test_float32_blocks_agree_with_the_reference_to_rounding(rng):
  inputs = _inputs(rng, 2, 100, 4, 2, 16, np.float32)
  routing = dict(moba_block=16, moba_top_k=3, rope_theta=10000.0)
  blocked = functools.partial(moba.moba_attention, query_block=16)
  expected = jax.tree_util.tree_leaves(_value_and_grads(*inputs, attention=dense.moba_attention, **routing))
  actual = jax.tree_util.tree_leaves(_value_and_grads(*inputs, attention=blocked, **routing))
  for a, e in zip(actual, expected):
    assert a.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - e))) <= 2e-6 * float(jnp.max(jnp.abs(e)))


def test_a_query_reads_only_its_chosen_blocks_and_its_past(rng):
  """Changing keys and values that a query cannot read changes nothing of its row: a later token's (causality),
  or a past block outside its chosen ones (the gate read from the reference's block mask)."""
  q, k, v, _ = _inputs(rng, 1, 64, 2, 2, 8, np.float32)
  routing = dict(moba_block=8, moba_top_k=2, rope_theta=10000.0)
  out = moba.moba_attention(q, k, v, query_block=16, **routing)
  row = 40  # block 5; reads block 5 up to itself and one past block
  positions = jnp.arange(64)
  q_rot, k_rot = apply_rope(jnp.asarray(q), positions), apply_rope(jnp.asarray(k), positions)
  chosen = np.asarray(dense.moba_block_mask(q_rot, k_rot, moba_block=8, moba_top_k=2))[0, :, row]  # [heads, 8]
  unread = [b for b in range(5) if not chosen[:, b].any()]
  assert unread, "every past block chosen by some head: the test reads nothing"
  changed = np.array(v)
  changed[:, row + 1 :] += 5.0
  for b in unread:
    changed[:, b * 8 : (b + 1) * 8] += 5.0
  after = moba.moba_attention(q, k, changed, query_block=16, **routing)
  np.testing.assert_array_equal(np.asarray(after)[:, row], np.asarray(out)[:, row])
  assert not np.array_equal(np.asarray(after)[:, row + 1], np.asarray(out)[:, row + 1])


def test_auto_takes_the_blocked_form_only_past_one_block(rng, monkeypatch):
  """The dispatch: "auto" keeps the reference where the queries fit one block and takes the blocked form past it;
  "pallas", which this op lacks, is refused by the op and reaches it from a module as "auto"."""
  resolve = lambda impl, tokens: dispatch.resolve("moba_attention", impl, batch=2, heads=4, tokens=tokens)
  block = query_blocks.query_block_for(2, 4, 8192)
  assert 2 * 4 * block * 8192 * 4 <= query_blocks.BLOCK_BYTES < 2 * 4 * (2 * block) * 8192 * 4  # the largest
  assert resolve("auto", 8192) == "blocked" and resolve("auto", 16) == "reference"
  assert resolve("reference", 8192) == "reference"
  with pytest.raises(dispatch.UnsupportedImpl, match="moba_attention has no 'pallas'"):
    resolve("pallas", 16)
  assert dispatch.for_op("moba_attention", "pallas") == "auto"
  calls = spy(monkeypatch, moba, "moba_attention")
  monkeypatch.setattr(query_blocks, "BLOCK_BYTES", 2 * 2 * 16 * 24 * 4)  # 24 queries: two blocks of 16
  q, k, v, _ = _inputs(rng, 2, 24, 2, 2, 8, np.float32)
  ops.moba_attention(q, k, v, moba_block=8, impl="auto")
  assert calls


def test_blocked_form_needs_a_fraction_of_the_references_memory():
  """Compiled for 8 rows of 1,024 tokens (not run): the value-and-gradient program of the blocked form needs under
  half the temporary memory of the reference's, which holds `[batch, heads, T, T]` arrays whole."""
  q = jax.ShapeDtypeStruct((8, 1024, 4, 32), jnp.float32)

  temporaries = lambda attention: gradient_temporaries(
    functools.partial(attention, moba_block=128, moba_top_k=3), q, q, q, argnums=(0, 1, 2)
  )
  blocked = temporaries(functools.partial(moba.moba_attention, query_block=128))
  reference = temporaries(dense.moba_attention)
  assert blocked < 0.5 * reference, (blocked, reference)


def test_a_moba_model_under_auto_takes_the_blocked_form(rng, monkeypatch):
  """The MoBA module hands its `impl` to the op: a tiny model (scanned layers) configured "auto" runs the blocked
  form once its queries span two blocks, and its loss and gradient equal the "reference" model's."""
  config = model_preset("tiny", kind="moba", scan_layers=True)
  moba_config = dataclasses.replace(config.attention.moba, block=8, top_k=3)  # 40 tokens: five blocks to choose from
  config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, moba=moba_config))
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 40)))
  assert_blocked_model_equals_reference(monkeypatch, config, tokens, moba, "moba_attention")
