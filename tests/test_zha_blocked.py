"""ZHA's training-form attention over blocks of queries (fsjax.ops.zha_blocked) against the reference
(fsjax.reference.zha.zha_attention), whose routed `[batch, heads, T, T]` mask it never holds whole."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.config import model_preset
from fsjax.ops import dispatch, query_blocks, zha_blocked
from fsjax.reference import zha

from helpers import assert_blocked_model_equals_reference, gradient_temporaries, spy

# (batch, seq, heads, kv_heads, dim, refs, chunk, levels, top_p, max_nodes, query_block, rope_theta)
CASES = [
  pytest.param(2, 45, 4, 2, 8, 3, 4, 2, 0.9, None, 16, 10000.0, id="grouped-rope-padded-last-block"),
  pytest.param(1, 37, 2, 2, 8, 2, 3, 3, (0.8, 0.95, 0.7), 2, 8, None, id="three-levels-per-level-p-capped-nope"),
  pytest.param(2, 50, 4, 1, 8, 2, 4, 2, 0.6, 3, 24, 10000.0, id="one-kv-head-unaligned-blocks-capped"),
  pytest.param(1, 20, 2, 2, 8, 2, 8, 2, 0.9, None, 32, None, id="top-level-empty-one-block-past-the-end"),
]


@functools.partial(jax.jit, static_argnames=("attention", "tree"))
def _run(q, k, v, ref_queries, weights, *, attention, tree):
  """Output, attended fraction, and the gradients of `Σ weights · output` with respect to q, k and v."""
  tree = dict(tree)
  out, fraction = attention(q, k, v, ref_queries, return_fraction=True, **tree)
  loss = lambda q, k, v: jnp.sum(weights * attention(q, k, v, ref_queries, **tree))
  return out, fraction, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _inputs(rng, batch, seq, heads, kv_heads, dim, refs, dtype):
  normal = lambda *shape: rng.standard_normal(shape).astype(dtype)
  return (
    normal(batch, seq, heads, dim),
    normal(batch, seq, kv_heads, dim),
    normal(batch, seq, kv_heads, dim),
    normal(kv_heads, refs, dim),
    normal(batch, seq, heads, dim),
  )


def _tree(chunk, levels, top_p, max_nodes, rope_theta):
  return tuple(dict(chunk=chunk, levels=levels, top_p=top_p, max_nodes=max_nodes, rope_theta=rope_theta).items())


@pytest.mark.parametrize("batch,seq,heads,kv_heads,dim,refs,chunk,levels,top_p,max_nodes,query_block,rope_theta", CASES)
def test_blocked_attention_its_fraction_and_gradients_equal_the_reference(
  rng, batch, seq, heads, kv_heads, dim, refs, chunk, levels, top_p, max_nodes, query_block, rope_theta
):
  """Float64: the output, the attended fraction and the gradients with respect to q, k and v equal the
  reference's to 1e-12 relative."""
  tree = _tree(chunk, levels, top_p, max_nodes, rope_theta)
  blocked = functools.partial(zha_blocked.zha_attention, query_block=query_block)
  with jax.enable_x64(True):
    inputs = _inputs(rng, batch, seq, heads, kv_heads, dim, refs, np.float64)
    expected = jax.tree_util.tree_leaves(_run(*inputs, attention=zha.zha_attention, tree=tree))
    actual = jax.tree_util.tree_leaves(_run(*inputs, attention=blocked, tree=tree))
    for a, e in zip(actual, expected):
      assert a.dtype == e.dtype and a.shape == e.shape and float(jnp.max(jnp.abs(e))) > 0
      assert float(jnp.max(jnp.abs(a - e))) <= 1e-12 * float(jnp.max(jnp.abs(e)))


def test_float32_blocks_agree_with_the_reference_to_rounding(rng):
  inputs = _inputs(rng, 2, 45, 4, 2, 8, 3, np.float32)
  tree = _tree(4, 2, 0.9, None, 10000.0)
  blocked = functools.partial(zha_blocked.zha_attention, query_block=16)
  expected = jax.tree_util.tree_leaves(_run(*inputs, attention=zha.zha_attention, tree=tree))
  actual = jax.tree_util.tree_leaves(_run(*inputs, attention=blocked, tree=tree))
  for a, e in zip(actual, expected):
    assert a.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - e))) <= 2e-6 * float(jnp.max(jnp.abs(e)))


def test_auto_takes_the_blocked_form_only_past_one_block(rng, monkeypatch):
  """The dispatch: "auto" keeps the reference where the queries fit one block and takes the blocked form past it;
  "pallas", which this op lacks, is refused by the op and reaches it from a module as "auto"."""
  resolve = lambda impl, tokens: dispatch.resolve("zha_attention", impl, batch=2, heads=4, tokens=tokens)
  assert resolve("auto", 8192) == "blocked" and resolve("auto", 16) == "reference"
  assert resolve("reference", 8192) == "reference"
  with pytest.raises(dispatch.UnsupportedImpl, match="zha_attention has no 'pallas'"):
    resolve("pallas", 16)
  assert dispatch.for_op("zha_attention", "pallas") == "auto"
  calls = spy(monkeypatch, zha_blocked, "zha_attention")
  monkeypatch.setattr(query_blocks, "BLOCK_BYTES", 2 * 2 * 16 * 24 * 4)  # 24 queries: two blocks of 16
  q, k, v, ref_queries, _ = _inputs(rng, 2, 24, 2, 2, 8, 2, np.float32)
  ops.zha_attention(q, k, v, ref_queries, chunk=4, levels=2, top_p=0.9, impl="auto")
  assert calls


def test_blocked_form_needs_a_fraction_of_the_references_memory():
  """Compiled for 8 rows of 1,024 tokens (not run): the value-and-gradient program of the blocked form needs under
  half the temporary memory of the reference's, which routes and masks every query at once."""
  q = jax.ShapeDtypeStruct((8, 1024, 4, 32), jnp.float32)
  r = jax.ShapeDtypeStruct((4, 4, 32), jnp.float32)
  tree = dict(chunk=8, levels=2, top_p=0.9, rope_theta=10000.0)

  temporaries = lambda attention: gradient_temporaries(
    functools.partial(attention, **tree), q, q, q, r, argnums=(0, 1, 2)
  )
  blocked = temporaries(functools.partial(zha_blocked.zha_attention, query_block=128))
  reference = temporaries(zha.zha_attention)
  assert blocked < 0.5 * reference, (blocked, reference)


def test_a_zha_model_under_auto_takes_the_blocked_form(rng, monkeypatch):
  """The ZHA module hands its `impl` to the op: a tiny model (scanned layers) configured "auto" runs the blocked
  form once its queries span two blocks, and its loss and gradient equal the "reference" model's."""
  config = model_preset("tiny", kind="zha", scan_layers=True)
  zha_config = dataclasses.replace(config.attention.zha, refs=2, chunk=4, top_p=(0.8,))
  config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, zha=zha_config))
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 40)))
  assert_blocked_model_equals_reference(monkeypatch, config, tokens, zha_blocked, "zha_attention")
