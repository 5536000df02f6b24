"""Grouped-query attention (fewer key/value heads than query heads) in the dense baselines: the references against
a float64 loop over query heads, each reading its key/value head `h // group`; the references, the cache maths
and the module against multi-head attention with K and V repeated per group (Hugging Face's `repeat_kv`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.attention import DenseAttention
from fsjax.attention.cached import attend, attend_one, by_head_groups
from fsjax.attention.projections import Projection

import brute_force
from helpers import assert_close

HEADS, KV_HEADS = 6, 2  # group 3: query heads 0-2 read key/value head 0, 3-5 head 1
GROUP = HEADS // KV_HEADS

OPS = {
  "tfpp": (ops.tfpp_attention, lambda q, k, v: brute_force.local(q, k, v, window=q.shape[1] - 1)),
  "swa": (functools.partial(ops.swa_attention, window=13), functools.partial(brute_force.local, window=13)),
  "moba": (
    functools.partial(ops.moba_attention, moba_block=16, moba_top_k=2),
    functools.partial(brute_force.moba, moba_block=16, moba_top_k=2),
  ),
}


def _grouped_qkv(rng, seq, dtype=np.float64, batch=2, dim=8):
  q = rng.standard_normal((batch, seq, HEADS, dim)).astype(dtype)
  k, v = (rng.standard_normal((batch, seq, KV_HEADS, dim)).astype(dtype) for _ in range(2))
  return q, k, v


def _repeated(x):
  """K or V `[.., kv_heads, d]` repeated per group: `[.., heads, d]`, head h a copy of head h // group."""
  return jnp.repeat(x, GROUP, axis=2)


@pytest.mark.parametrize("kind", list(OPS))
def test_grouped_references_equal_a_loop_over_query_heads_reading_their_kv_head(rng, kind):
  op, loop = OPS[kind]
  q, k, v = _grouped_qkv(rng, 48)
  with jax.enable_x64(True):
    out = np.asarray(jax.jit(op)(q, k, v))
  expected = np.concatenate(
    [loop(q[:, :, [h]], k[:, :, [h // GROUP]], v[:, :, [h // GROUP]]) for h in range(HEADS)], axis=2
  )
  assert_close(out, expected, np.float64)


@pytest.mark.parametrize("kind", list(OPS))
def test_grouped_references_equal_multi_head_attention_over_repeated_kv(rng, kind):
  op, _ = OPS[kind]
  q, k, v = _grouped_qkv(rng, 80, np.float32)
  assert_close(jax.jit(op)(q, k, v), jax.jit(op)(q, _repeated(k), _repeated(v)), np.float32)


def test_cache_attention_over_fewer_kv_heads_equals_it_over_repeated_ones(rng):
  """The decode maths (`attend` for a chunk, `attend_one` for one token, with a window) over a cache of
  key/value heads, with empty slots (position -1)."""
  q, k, v = _grouped_qkv(rng, 40, np.float32)
  k_pos = jnp.broadcast_to(jnp.where(jnp.arange(40) < 33, jnp.arange(40), -1), (2, 40))
  q_pos = jnp.broadcast_to(25 + jnp.arange(8), (2, 8))
  chunk = q[:, :8]
  # Jitted: op by op, every operation compiled on its own.
  attend_chunk = jax.jit(lambda k, v: attend(chunk, q_pos, k, v, k_pos, window=20))
  attend_token = jax.jit(lambda k, v: attend_one(chunk[:, :1], q_pos[:, :1], k, v, k_pos, window=20))
  grouped = attend_chunk(k, v)
  assert_close(grouped, attend_chunk(_repeated(k), _repeated(v)), np.float32)
  one = attend_token(k, v)
  assert_close(one, attend_token(_repeated(k), _repeated(v)), np.float32)
  assert_close(one, grouped[:, :1], np.float32)


def test_groups_of_kv_heads_take_the_query_heads_that_read_them(rng):
  """A chunk over a large scanned cache attends one group of key/value heads at a time (`by_head_groups`)."""
  q, k, v = _grouped_qkv(rng, 24, np.float32)
  positions = jnp.broadcast_to(jnp.arange(24), (2, 24))
  attend_heads = lambda q, k, v: attend(q, positions, k, v, positions)
  by_groups = jax.jit(lambda q, k, v: by_head_groups(attend_heads, KV_HEADS, q, k, v))  # op by op: slow
  assert_close(by_groups(q, k, v), jax.jit(attend_heads)(q, k, v), np.float32)


def test_a_grouped_module_projects_fewer_kv_heads_and_reads_them_per_group(rng):
  module = DenseAttention(num_heads=HEADS, head_dim=8, kind="tfpp", projection=Projection(num_kv_heads=KV_HEADS))
  x = jnp.asarray(rng.standard_normal((2, 24, 16)), jnp.float32)
  params = jax.jit(module.init)(jax.random.PRNGKey(0), x)["params"]  # op by op: slow
  assert {name: params[name]["kernel"].shape for name in params} == {
    "q_proj": (16, HEADS, 8),
    "k_proj": (16, KV_HEADS, 8),
    "v_proj": (16, KV_HEADS, 8),
    "o_proj": (HEADS, 8, 16),
  }
  q, k, v = (jnp.einsum("btm,mhd->bthd", x, params[n]["kernel"]) for n in ("q_proj", "k_proj", "v_proj"))
  o = jax.jit(ops.tfpp_attention)(q, _repeated(k), _repeated(v))
  assert_close(
    jax.jit(module.apply)({"params": params}, x),
    jnp.einsum("bthd,hdm->btm", o, params["o_proj"]["kernel"]),
    np.float32,
  )


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused(rng):
  q, k, v = _grouped_qkv(rng, 8)
  with pytest.raises(ValueError, match="must divide"):
    ops.tfpp_attention(q, jnp.tile(k, (1, 1, 2, 1)), jnp.tile(v, (1, 1, 2, 1)))  # 4 key/value heads, 6 query heads
  with pytest.raises(ValueError, match="must be positive and divide"):
    Projection(num_kv_heads=4).kv_heads(HEADS)
