"""Layer views of a stacked cache (`fsjax.cache.layered`) against per-layer slicing, and the one-query attention
a decode step reads the cache with against the chunk attention."""

import jax
import jax.numpy as jnp
import numpy as np

from fsjax.attention.cached import attend, attend_one
from fsjax.cache import layer_of, write_back
from fsjax.cache import store as kv
from fsjax.cache.layered import LayerSlice, kernel_arrays, read, rewritten, row_major, scatter
from fsjax.cache.store import KVStore

from helpers import assert_close

LAYERS, BATCH, CAPACITY, HEADS, DIM = 3, 2, 12, 2, 4


def _stacked(rng):
  k, v = (jnp.asarray(rng.standard_normal((LAYERS, BATCH, CAPACITY, HEADS, DIM)), jnp.float32) for _ in range(2))
  pos = jnp.asarray(rng.integers(-1, 9, (LAYERS, BATCH, CAPACITY)), jnp.int32)
  other = jnp.asarray(rng.standard_normal((LAYERS, BATCH, 5)), jnp.float32)
  return {"store": KVStore(k=k, v=v, pos=pos), "other": other}


def test_a_layer_view_writes_its_layer_in_place_and_slices_the_rest(rng):
  stacked = _stacked(rng)
  layer = jnp.int32(1)
  view = layer_of(stacked, layer)
  assert isinstance(view["store"].k, LayerSlice) and view["store"].k.shape == (BATCH, CAPACITY, HEADS, DIM)
  np.testing.assert_array_equal(read(view["store"].k), stacked["store"].k[1])
  np.testing.assert_array_equal(view["other"], stacked["other"][1])

  k, v = (jnp.asarray(rng.standard_normal((BATCH, 2, HEADS, DIM)), jnp.float32) for _ in range(2))
  pos = jnp.asarray([[9, 10], [4, 5]], jnp.int32)
  valid = jnp.asarray([[True, True], [True, False]])
  view = {"store": kv.write(view["store"], k, v, pos, valid), "other": view["other"] + 1.0}
  updated = write_back(stacked, view, layer)

  per_layer = kv.write(jax.tree_util.tree_map(lambda x: x[1], stacked["store"]), k, v, pos, valid)
  for name in ("k", "v", "pos"):
    got, old = getattr(updated["store"], name), getattr(stacked["store"], name)
    np.testing.assert_array_equal(got[1], getattr(per_layer, name))
    np.testing.assert_array_equal(got[0], old[0])  # other layers untouched
    np.testing.assert_array_equal(got[2], old[2])
  np.testing.assert_array_equal(updated["other"][1], stacked["other"][1] + 1.0)
  np.testing.assert_array_equal(updated["other"][2], stacked["other"][2])


def test_scatter_on_a_plain_array_is_at_set(rng):
  x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
  np.testing.assert_array_equal(scatter(x, (jnp.asarray([0, 9]),), jnp.ones((2, 3)), mode="drop"), x.at[0].set(1.0))


def test_a_kernel_is_handed_whole_stacks_and_their_layer_and_its_outputs_keep_the_view():
  """`kernel_arrays` hands views' stacks with their layer (arrays as they are, with no layer), and `rewritten`
  puts a kernel's new stack back under the same layer."""
  stack, layer = jnp.arange(24.0).reshape(3, 2, 4), jnp.int32(2)
  arrays, at = kernel_arrays(dict(a=LayerSlice(stack, layer), b=LayerSlice(stack + 1, layer)))
  assert at is layer and arrays["a"] is stack and arrays["b"].shape == (3, 2, 4)
  first = stack[0]
  plain, none = kernel_arrays(dict(a=first))
  assert none is None and plain["a"] is first
  view = rewritten(LayerSlice(stack, layer), stack * 2)
  assert isinstance(view, LayerSlice) and view.layer is layer
  np.testing.assert_array_equal(np.asarray(read(view)), np.asarray(stack[2] * 2))
  replacement = stack[1]
  assert rewritten(first, replacement) is replacement


def test_one_query_attention_equals_the_chunk_attention(rng):
  store = jax.tree_util.tree_map(lambda x: x[0], _stacked(rng)["store"])
  q = jnp.asarray(rng.standard_normal((BATCH, 1, HEADS, DIM)), jnp.float32)
  q_pos = jnp.asarray([[8], [0]], jnp.int32)
  for window in (None, 3):
    expected = attend(q, q_pos, store.k, store.v, store.pos, window=window)
    assert_close(attend_one(q, q_pos, store.k, store.v, store.pos, window=window), expected, np.float32)
  nothing = jnp.full_like(store.pos, -1)  # a row that sees no key reads zero, as `attend`
  np.testing.assert_array_equal(attend_one(q, q_pos, store.k, store.v, nothing), 0.0)


def test_a_layer_read_is_pinned_to_the_row_major_layout_on_a_gpu_only(rng, monkeypatch):
  """On a GPU `read` constrains the layer it indexes to row-major, so XLA cannot carry a matrix product's
  preferred layout up to the stack and transpose the whole cache around the scan (the GPU test in
  test_serving_batches.py checks the compiled programs); elsewhere it is a plain index."""
  stack = _stacked(rng)["store"].k
  lowered = lambda: jax.jit(lambda s, i: read(LayerSlice(s, i)) * 2.0).lower(stack, jnp.int32(2)).as_text()
  assert ("LayoutConstraint" in lowered()) == (jax.default_backend() == "gpu")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert "LayoutConstraint" in lowered()
  fn = jax.jit(lambda s, i: row_major(s[i]) * 2.0)
  np.testing.assert_array_equal(fn(stack, jnp.int32(2)), stack[2] * 2.0)
