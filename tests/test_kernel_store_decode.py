"""`pallas_kernels.store_decode` (the baselines' one-token step over a key/value store: TF++'s dense cache, SWA's
ring) against its jnp specification: the store after `fsjax.cache.store.write` of the token, and `attend` over it,
on fresh random stores (interpreted on CPU, compiled on a GPU); and the tiny TF++ and SWA models decoding through
it as through the reference path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.attention.cached import attend
from fsjax.cache import init_cache
from fsjax.cache import store as kv
from fsjax.decode import extend, prefill
from fsjax.model import Transformer
from pallas_kernels import store_decode

from helpers import assert_close, kernel_modes, pallas_call_input_shapes, tiny_model


def _filled_store(rng, *, lengths, capacity, kv_heads, dim, dtype):
  """A store holding `lengths[b]` random tokens (positions 0 .. length-1) in row b, written in one chunk: a ring
  (capacity < length) keeps the last `capacity` of them."""
  batch, longest = len(lengths), max(max(lengths), 1)
  draw = lambda: jnp.asarray(rng.standard_normal((batch, longest, kv_heads, dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(longest), (batch, longest))
  store = kv.empty_store(batch, capacity, kv_heads, dim, dtype)
  return kv.write(store, draw(), draw(), pos, pos < jnp.asarray(lengths)[:, None])


def _token(rng, batch, heads, kv_heads, dim):
  draw = lambda *shape: jnp.asarray(rng.standard_normal((batch, *shape, dim)), jnp.float32)
  return draw(heads), draw(kv_heads), draw(kv_heads)


def _reference(store, q, k, v, pos, valid, window):
  """The specification: the token written into its slot, then `attend` of its query over the store."""
  written = kv.write(store, k[:, None], v[:, None], pos[:, None], valid[:, None])
  return attend(q[:, None], pos[:, None], written.k, written.v, written.pos, window=window)[:, 0], written


def _kernel(store, q, k, v, pos, valid, window, interpret, **split):
  fields = dict(k=store.k, v=store.v, pos=store.pos)
  o, written = store_decode.store_decode(q, k, v, pos, valid, fields, window=window, interpret=interpret, **split)
  return o, kv.KVStore(**written)


def _assert_equal_stores(actual, expected):
  np.testing.assert_array_equal(np.asarray(actual.pos), np.asarray(expected.pos))
  for name in ("k", "v"):
    np.testing.assert_array_equal(
      np.asarray(getattr(actual, name).astype(jnp.float32)), np.asarray(getattr(expected, name).astype(jnp.float32))
    )


CASES = {
  # name: heads, kv_heads, dim, row lengths before the step, capacity, window, valid rows, tile, max_parts
  # 300 slots in tiles of 16 (the last holds 12), four parts of five tiles; a row at the last slot, one mid-part,
  # an empty one, and two padded rows that must write nothing (the second, empty, sees no key at all).
  "dense-ragged": (2, 2, 16, [299, 131, 0, 77, 0], 300, None, [True, True, True, False, False], 16, 4),
  "dense-grouped": (4, 2, 32, [200, 37], 256, None, [True, True], 16, 8),
  # SWA's ring of w + 1 slots: one row has wrapped (every tile live), one has not, and a padded row whose token's
  # slot still holds position pos - w - 1, outside the window.
  "ring-wrapped": (2, 2, 16, [150, 23, 150], 41, 40, [True, True, False], 16, 2),
  # The default split at d = 64: 1,100 slots in tiles of 128, one tile per part.
  "dense-default-split": (2, 1, 64, [1099, 600], 1100, None, [True, True], None, store_decode.TARGET_PARTS),
}


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_kernel_step_equals_the_reference_step(rng, interpret, case, dtype):
  """The attention output and the store after the step (the token in its slot, exactly)."""
  heads, kv_heads, dim, lengths, capacity, window, valid, tile, max_parts = CASES[case]
  store = _filled_store(rng, lengths=lengths, capacity=capacity, kv_heads=kv_heads, dim=dim, dtype=dtype)
  q, k, v = _token(rng, len(lengths), heads, kv_heads, dim)
  pos, valid = jnp.asarray(lengths, jnp.int32), jnp.asarray(valid)
  o, written = _kernel(store, q, k, v, pos, valid, window, interpret, tile=tile, max_parts=max_parts)
  o_ref, written_ref = jax.jit(_reference, static_argnums=6)(store, q, k, v, pos, valid, window)
  assert_close(o, o_ref, np.float32)
  _assert_equal_stores(written, written_ref)
  if case == "dense-ragged":
    assert np.all(np.asarray(o)[4] == 0)  # the padded row of an empty store sees no key


@pytest.mark.parametrize("interpret", kernel_modes())
def test_the_kernel_reads_and_writes_a_scanned_models_layer_where_it_lies(rng, interpret):
  """A store as a `[layers, ...]` stack in bf16 (a scanned model's step): the kernel is handed the stacks
  themselves, reads layer 1 and writes only layer 1, equal to the step over that layer alone."""
  lengths, valid = [90, 45], jnp.array([True, True])
  layers = [_filled_store(rng, lengths=lengths, capacity=96, kv_heads=2, dim=16, dtype=jnp.bfloat16) for _ in range(3)]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  q, k, v = _token(rng, 2, 2, 2, 16)
  pos = jnp.asarray(lengths, jnp.int32)
  fields = dict(k=stacked.k, v=stacked.v, pos=stacked.pos)
  run = lambda fields, layer: store_decode.store_decode(
    q, k, v, pos, valid, fields, layer=layer, tile=16, max_parts=4, interpret=interpret
  )
  o, written = run(fields, jnp.int32(1))
  o_ref, written_ref = _reference(layers[1], q, k, v, pos, valid, None)
  other, _ = _reference(layers[0], q, k, v, pos, valid, None)
  assert not np.allclose(np.asarray(o_ref), np.asarray(other), atol=1e-2)  # another layer's keys would show
  assert_close(o, o_ref, np.float32)
  _assert_equal_stores(kv.KVStore(**{name: x[1] for name, x in written.items()}), written_ref)
  for name, x in written.items():
    np.testing.assert_array_equal(np.asarray(x[::2]), np.asarray(fields[name][::2]))  # layers 0 and 2 untouched
  handed = pallas_call_input_shapes(jax.make_jaxpr(run)(fields, jnp.int32(1)).jaxpr)
  assert stacked.k.shape in handed and stacked.pos.shape in handed


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("kind", ["tfpp", "swa"])
def test_a_scanned_model_decodes_through_the_kernel_as_through_the_reference(rng, interpret, kind, monkeypatch):
  """The tiny scanned TF++ and SWA (window 40) models, two rows at different positions, from one prefilled cache:
  12 one-token steps with `impl="pallas"` give the reference path's logits at every step, and the same cache."""
  config, _, variables = tiny_model(kind, scan_layers=True)
  original, calls = store_decode.store_decode, []
  monkeypatch.setattr(
    store_decode,
    "store_decode",
    lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs, tile=16, max_parts=4, interpret=interpret),
  )
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 100)), jnp.int32)
  lengths = jnp.array([86, 45])
  model_of = lambda impl: Transformer(
    dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl))
  )
  _, prefilled = prefill(model_of("reference"), variables, tokens, lengths, init_cache(config, 2, 128), chunk=32)
  outputs = {}
  for impl in ("reference", "pallas"):
    model = model_of(impl)
    cache, outputs[impl] = jax.tree_util.tree_map(jnp.copy, prefilled), []
    for t in range(12):
      at = lengths[:, None] + t
      token = jnp.take_along_axis(tokens, at, axis=1)
      logits, cache, _ = extend(model, variables, token, cache, at, jnp.ones((2, 1), bool))
      outputs[impl].append(logits)
    outputs[impl].append(cache)
  assert calls  # the pallas model's steps ran the kernel
  *steps, cache = outputs["pallas"]
  *steps_ref, cache_ref = outputs["reference"]
  for logits, logits_ref in zip(steps, steps_ref, strict=True):
    assert_close(logits, logits_ref, np.float32)
  for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(cache_ref), strict=True):
    assert_close(a, b, np.float32)
