"""ZHA's distillation loss over blocks of queries (fsjax.ops.zha_kl) against the reference's, whose dense
`[batch, heads, T, T]` attention it never holds whole."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.config import model_preset
from fsjax.model import Transformer
from fsjax.ops import dispatch, query_blocks, zha_kl
from fsjax.reference import zha
from fsjax.train import objectives

from helpers import gradient_temporaries, jitted_init, random_qkv, spy

# (batch, seq, heads, kv_heads, dim, refs, chunk, levels, query_block, rope_theta)
CASES = [
  pytest.param(2, 45, 4, 2, 8, 3, 4, 2, 16, 10000.0, id="grouped-rope-padded-last-block"),
  pytest.param(1, 37, 2, 2, 8, 2, 3, 3, 8, None, id="three-levels-nope-block-8"),
  pytest.param(2, 64, 2, 1, 8, 2, 4, 2, 32, 10000.0, id="one-kv-head-even-blocks"),
  pytest.param(1, 20, 2, 2, 8, 2, 8, 2, 32, None, id="top-level-empty-one-block-past-the-end"),
]


def _inputs(rng, batch, seq, heads, kv_heads, dim, refs, dtype):
  q, _, _ = random_qkv(rng, (batch, seq, heads, dim), dtype)
  k, _, _ = random_qkv(rng, (batch, seq, kv_heads, dim), dtype)
  return q, k, rng.standard_normal((kv_heads, refs, dim)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("loss", "chunk", "levels", "rope_theta"))
def _weighted(q, k, ref_queries, *, loss, chunk, levels, rope_theta):
  """Each level's loss, and the gradient (with respect to the reference queries) of their sum weighted 1, 2, ...,
  so that one level's error cannot hide in another's."""
  per_level = loss(q, k, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta)
  weights = jnp.arange(1, levels + 1)
  total = lambda r: jnp.sum(weights * loss(q, k, r, chunk=chunk, levels=levels, rope_theta=rope_theta))
  return per_level, jax.grad(total)(ref_queries)


@pytest.mark.parametrize("batch,seq,heads,kv_heads,dim,refs,chunk,levels,query_block,rope_theta", CASES)
def test_blocked_loss_and_gradient_equal_the_reference(
  rng, batch, seq, heads, kv_heads, dim, refs, chunk, levels, query_block, rope_theta
):
  """Float64: each level's loss and the gradient equal the reference's to 1e-12 relative."""
  tree = dict(chunk=chunk, levels=levels, rope_theta=rope_theta)
  blocked = functools.partial(zha_kl.zha_kl_per_level, query_block=query_block)
  with jax.enable_x64(True):
    q, k, ref_queries = _inputs(rng, batch, seq, heads, kv_heads, dim, refs, np.float64)
    expected = _weighted(q, k, ref_queries, loss=zha.zha_kl_per_level, **tree)
    actual = _weighted(q, k, ref_queries, loss=blocked, **tree)
    for a, e in zip(actual, expected):
      assert a.dtype == jnp.float64 and float(jnp.max(jnp.abs(e))) > 0
      assert float(jnp.max(jnp.abs(a - e))) <= 1e-12 * float(jnp.max(jnp.abs(e)))


def test_float32_blocks_agree_with_the_reference_to_rounding(rng):
  q, k, ref_queries = _inputs(rng, 2, 45, 4, 2, 8, 3, np.float32)
  tree = dict(chunk=4, levels=2, rope_theta=10000.0)
  expected = _weighted(q, k, ref_queries, loss=zha.zha_kl_per_level, **tree)
  actual = _weighted(q, k, ref_queries, loss=functools.partial(zha_kl.zha_kl_per_level, query_block=16), **tree)
  for a, e in zip(actual, expected):
    assert a.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(a - e))) <= 2e-6 * float(jnp.max(jnp.abs(e)))


def test_auto_takes_the_blocked_loss_only_past_one_block(rng, monkeypatch):
  """The dispatch: "auto" keeps the reference where all queries fit one block and takes the blocked form past it (with a
  budget shrunk to make 24 queries two blocks of 16); "pallas", which this op lacks, reaches it as "auto"."""
  block = query_blocks.query_block_for(2, 4, 4096)
  assert 2 * 4 * block * 4096 * 4 <= query_blocks.BLOCK_BYTES < 2 * 4 * (2 * block) * 4096 * 4  # the largest that fits
  assert dispatch.resolve("zha_kl_loss", "auto", batch=2, heads=4, tokens=4096) == "blocked"
  assert dispatch.resolve("zha_kl_loss", "auto", batch=1, heads=2, tokens=64) == "reference"
  assert dispatch.for_op("zha_kl_loss", "pallas") == "auto"
  q, k, ref_queries = _inputs(rng, 1, 24, 2, 2, 8, 2, np.float32)
  monkeypatch.setattr(query_blocks, "BLOCK_BYTES", 1 * 2 * 16 * 24 * 4)
  assert dispatch.resolve("zha_kl_loss", "auto", batch=1, heads=2, tokens=24) == "blocked"
  calls = []
  monkeypatch.setattr(zha_kl, "zha_kl_per_level", lambda *a, **kw: calls.append(1) or zha.zha_kl_per_level(*a, **kw))
  ops.zha_kl_loss(q, k, ref_queries, chunk=4, levels=2, impl="auto")
  assert calls == [1]


def test_blocked_gradient_holds_a_fraction_of_the_reference_memory():
  """Compiled for 8 rows of 1,024 tokens (not run): the value-and-gradient program of the blocked loss needs
  under half the temporary memory of the reference's, which holds `[batch, heads, T, T]` arrays whole."""
  q = jax.ShapeDtypeStruct((8, 1024, 2, 16), jnp.float32)
  r = jax.ShapeDtypeStruct((2, 4, 16), jnp.float32)
  tree = dict(chunk=8, levels=2, rope_theta=10000.0)

  temporaries = lambda loss: gradient_temporaries(loss, q, q, r, argnums=2)
  blocked = temporaries(lambda q, k, r: zha_kl.zha_kl_per_level(q, k, r, query_block=64, **tree))
  reference = temporaries(lambda q, k, r: zha.zha_kl_per_level(q, k, r, **tree))
  assert blocked < 0.5 * reference, (blocked, reference)


def test_a_distilling_model_under_auto_takes_the_blocked_loss(rng, monkeypatch):
  """The ZHA module hands its `impl` to the loss: a distilling tiny model (scanned layers) configured "auto" runs
  the blocked form once its queries span two blocks, and its training loss and gradient equal the "reference"
  model's."""
  base = model_preset("tiny", kind="zha", scan_layers=True)
  zha_config = dataclasses.replace(base.attention.zha, refs=2, chunk=4, distill=True)

  def loss_and_grad(impl):
    config = dataclasses.replace(base, attention=dataclasses.replace(base.attention, impl=impl, zha=zha_config))
    model = Transformer(config)
    variables = jitted_init(config, 32)
    params, frozen = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    loss = lambda p: objectives.zha_kl_loss(model, p, frozen, {"tokens": tokens})[0]
    return jax.jit(jax.value_and_grad(loss))(params)

  tokens = jnp.asarray(rng.integers(0, base.vocab_size, (2, 41)))
  expected = loss_and_grad("reference")
  monkeypatch.setattr(query_blocks, "BLOCK_BYTES", 2 * base.num_heads * 16 * 40 * 4)  # two blocks of 16, one of padding
  calls = spy(monkeypatch, zha_kl, "zha_kl_per_level")
  actual = loss_and_grad("auto")
  assert calls
  for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
    scale = float(jnp.max(jnp.abs(e)))
    assert float(jnp.max(jnp.abs(a - e))) <= 2e-6 * max(scale, 1e-30)
