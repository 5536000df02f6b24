"""`pallas_kernels.bounded_decode` (FS-L's one-token step in one kernel) against its jnp specification, the
reference path of `fsjax.attention.freesolo_step.bounded_segment`: local branch, long-range branch, selected
cells and the cache it leaves, on fresh random caches (interpreted on CPU, compiled on a GPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.attention import freesolo_step
from fsjax.cache import bounded
from fsjax.cache.layered import LayerSlice, read
from fsjax.reference.rope import apply_rope
from fsjax.reference.routing import Routing
from pallas_kernels import bounded_decode

from helpers import assert_close, decode_with_both_impls, kernel_modes, tiny_model


def _filled_cache(rng, routing, *, batch, kv_heads, dim, prompt, steps, dtype):
  """A bounded cache after a `prompt`-token first chunk (`fill`) and `steps` one-token writes per row, over random
  keys and values: a ring that has wrapped, a pool that evicted cells, recent cells from bulk and token writes."""
  cache = bounded.empty_bounded(batch, kv_heads, dim, routing, dtype)
  chunk = -(-prompt // routing.block) * routing.block
  k = jnp.asarray(rng.standard_normal((batch, chunk, kv_heads, dim)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((batch, chunk, kv_heads, dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(chunk), (batch, chunk))
  cache = jax.jit(bounded.fill)(cache, apply_rope(k, pos, 10000.0), k, v, pos, pos < prompt)
  write = jax.jit(lambda cache, k, v, at: bounded.write_segment(cache, apply_rope(k, at, 10000.0), k, v, at, at >= 0))
  for t in range(prompt, prompt + steps):
    k = jnp.asarray(rng.standard_normal((batch, 1, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, 1, kv_heads, dim)), jnp.float32)
    cache = write(cache, k, v, jnp.full((batch, 1), t))
  return cache


def _step(cache, routing, *, heads, positions, impl, seed=7, valid=None, **given):
  """One token per row at `positions` `[batch]` (`valid` `[batch]`, default all) through `bounded_segment`: its
  mixed output (Eq. 2), cells and cache. The token, λ, σ, α and the readout gain are drawn from `seed`, so two
  implementations see the same step; `given` (lam, sigma, alpha, lr_gain) replaces the drawn ones."""
  shape = read(cache.pool_k).shape
  batch, kv_heads, dim = shape[0], shape[1], shape[-1]
  draw = np.random.default_rng(seed)
  q = jnp.asarray(draw.standard_normal((batch, 1, heads, dim)), jnp.float32)
  k, v = (jnp.asarray(draw.standard_normal((batch, 1, kv_heads, dim)), jnp.float32) for _ in range(2))
  weights = dict(
    lam=jnp.asarray(draw.uniform(0.5, 2.0, heads), jnp.float32),
    sigma=jnp.asarray(draw.uniform(2.0, 8.0, heads), jnp.float32),
    lr_gain=jnp.asarray(draw.uniform(0.5, 1.5, dim), jnp.float32),
    alpha=jnp.asarray(draw.uniform(0.5, 1.5, heads), jnp.float32),
  )
  weights.update(given)
  valid = jnp.ones((batch, 1), bool) if valid is None else jnp.asarray(valid)[:, None]
  segment = jax.jit(functools.partial(freesolo_step.bounded_segment, routing=routing, impl=impl, rope_theta=10000.0))
  return segment(cache, q, k, v, positions[:, None], valid, **weights)


def _assert_steps_agree(kernel, reference, dtype):
  o, cells, cache = kernel
  o_ref, cells_ref, cache_ref = reference
  assert_close(o, o_ref, dtype)
  np.testing.assert_array_equal(np.asarray(cells), np.asarray(cells_ref))
  for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(cache_ref)):
    if a.size == 0:  # no recent cells
      continue
    if jnp.issubdtype(a.dtype, jnp.integer):  # slots, positions, cell ids: exactly
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:  # the ring's keys are rotated in two compiled programs, which may round RoPE's last bit differently
      assert_close(a, b, dtype)


CASES = {
  # name: routing, batch, heads, kv_heads, dim, prompt, steps, positions of the step
  "mha-ring-wrapped": (
    dict(window=40, cell=8, block=32, top_k=3, retain_top=5, retain_recent=3),
    2,
    2,
    2,
    16,
    100,
    7,
    [107, 107],
  ),
  "grouped-no-recent": (
    dict(window=24, cell=4, block=16, top_k=4, retain_top=3, retain_recent=0),
    2,
    4,
    2,
    16,
    70,
    3,
    [73, 73],
  ),
  "early-few-cells": (
    dict(window=40, cell=8, block=32, top_k=4, retain_top=6, retain_recent=2),
    1,
    2,
    1,
    16,
    33,
    0,
    [33],
  ),
  "ends-a-block": (
    dict(window=40, cell=8, block=32, top_k=2, retain_top=4, retain_recent=5),
    2,
    2,
    2,
    32,
    60,
    3,
    [63, 63],
  ),
}


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_step_equals_the_reference_step(rng, interpret, case, monkeypatch):
  """The mixed branches, the K cells in order and the cache after the step (merge included at a block's end)."""
  spec, batch, heads, kv_heads, dim, prompt, steps, positions = CASES[case]
  routing = Routing(variant="fsl", **spec)
  cache = _filled_cache(
    rng, routing, batch=batch, kv_heads=kv_heads, dim=dim, prompt=prompt, steps=steps, dtype=jnp.float32
  )
  seed = int(rng.integers(1 << 30))
  run = lambda impl: _step(cache, routing, heads=heads, positions=jnp.asarray(positions), impl=impl, seed=seed)
  _force_interpret(monkeypatch, interpret)
  kernel, reference = run("pallas"), run("reference")
  _assert_steps_agree(kernel, reference, np.float32)
  assert np.all(np.asarray(kernel[1]) >= -1) and np.any(np.asarray(kernel[1]) >= 0)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_a_row_whose_token_is_not_valid_writes_nothing(rng, interpret, monkeypatch):
  """A padded row of a batch step: its token enters neither the ring nor the block buffer, and is no key of its
  local branch, as in the reference; the valid row beside it (same position, slot and block slot) is written."""
  spec, batch, heads, kv_heads, dim, prompt, steps, positions = CASES["mha-ring-wrapped"]
  routing = Routing(variant="fsl", **spec)
  cache = _filled_cache(
    rng, routing, batch=batch, kv_heads=kv_heads, dim=dim, prompt=prompt, steps=steps, dtype=jnp.float32
  )
  run = lambda impl: _step(
    cache, routing, heads=heads, positions=jnp.asarray(positions), impl=impl, valid=jnp.array([True, False])
  )
  _force_interpret(monkeypatch, interpret)
  kernel, reference = run("pallas"), run("reference")
  _assert_steps_agree(kernel, reference, np.float32)
  written, slot = kernel[2], positions[0] % (routing.window + 1)
  np.testing.assert_array_equal(
    np.asarray(written.ring.pos)[:, slot], [positions[0], np.asarray(cache.ring.pos)[1, slot]]
  )


@pytest.mark.parametrize("interpret", kernel_modes())
def test_the_kernel_breaks_exact_score_ties_toward_the_lower_cell(rng, interpret, monkeypatch):
  """λ = 0 leaves the content score only; two pool cells with the same mean key tie exactly, and the lower cell
  index must win, as `lax.top_k` over cells sorted by index decides in the reference."""
  routing = Routing(variant="fsl", window=16, cell=4, block=16, top_k=1, retain_top=4, retain_recent=0)
  cache = _filled_cache(rng, routing, batch=1, kv_heads=1, dim=16, prompt=64, steps=0, dtype=jnp.float32)
  ids = np.asarray(cache.pool_ids[0, 0])
  q_dir = np.random.default_rng(7).standard_normal(16)  # the step's query (head 0): make two cells its best match
  mean = np.asarray(cache.pool_mean).copy()
  low, high = np.argsort(ids)[:2]
  mean[0, 0, low] = mean[0, 0, high] = 5.0 * q_dir / np.linalg.norm(q_dir)
  cache = cache.replace(pool_mean=jnp.asarray(mean))
  _force_interpret(monkeypatch, interpret)
  zeros = jnp.zeros((1,), jnp.float32)
  run = lambda impl: _step(cache, routing, heads=1, positions=jnp.array([64]), impl=impl, lam=zeros, sigma=zeros + 4)
  kernel, reference = run("pallas"), run("reference")
  assert int(kernel[1][0, 0, 0, 0]) == int(ids[low]) == int(reference[1][0, 0, 0, 0])


@pytest.mark.parametrize("interpret", kernel_modes())
def test_the_kernel_reads_a_scanned_models_layer_where_it_lies(rng, interpret, monkeypatch):
  """Caches, λ, σ, α and the readout gain as views into `[layers, ...]` stacks (a scanned model's decode step):
  the kernels read layer 1 and the step writes only layer 1, equal to the step over that layer alone."""
  routing = Routing(variant="fsl", window=40, cell=8, block=32, top_k=3, retain_top=5, retain_recent=3)
  layers = [
    _filled_cache(rng, routing, batch=2, kv_heads=2, dim=16, prompt=90, steps=2, dtype=jnp.bfloat16) for _ in range(3)
  ]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  view = jax.tree_util.tree_map(lambda x: LayerSlice(x, jnp.int32(1)), stacked)
  # [layers, heads]: layer 1's λ lets the distance prior rank the cells, the others' leave it to the content
  lam = jnp.asarray(rng.uniform(0.5, 2.0, (3, 2)) * np.array([[0.01], [30.0], [0.01]]), jnp.float32)
  stacks = dict(
    lam=lam,
    sigma=jnp.asarray(rng.uniform(2.0, 8.0, (3, 2)), jnp.float32),
    alpha=jnp.asarray(rng.uniform(0.5, 1.5, (3, 2)), jnp.bfloat16),  # in the parameters' dtype, as a model's
    lr_gain=jnp.asarray(rng.uniform(0.5, 1.5, (3, 16)), jnp.bfloat16),
  )
  _force_interpret(monkeypatch, interpret)
  positions = jnp.array([92, 92])
  views = {name: LayerSlice(x, jnp.int32(1)) for name, x in stacks.items()}
  o, cells, written = _step(view, routing, heads=2, positions=positions, impl="pallas", **views)
  written = jax.tree_util.tree_map(lambda x: x.stack, written, is_leaf=lambda x: isinstance(x, LayerSlice))
  at = lambda layer: {name: x[layer] for name, x in stacks.items()}
  alone = _step(layers[1], routing, heads=2, positions=positions, impl="reference", **at(1))
  other = _step(layers[1], routing, heads=2, positions=positions, impl="reference", **at(0))
  assert not np.array_equal(np.asarray(alone[1]), np.asarray(other[1]))  # another layer's λ, σ would show
  _assert_steps_agree((o, cells, jax.tree_util.tree_map(lambda x: x[1], written)), alone, np.float32)
  for a, b in zip(jax.tree_util.tree_leaves(written), jax.tree_util.tree_leaves(stacked)):
    np.testing.assert_array_equal(np.asarray(a)[::2], np.asarray(b)[::2])  # layers 0 and 2 untouched


def _force_interpret(monkeypatch, interpret):
  """The kernel compiled (a GPU) or interpreted: `impl="pallas"` picks the kernel on any platform."""
  original = bounded_decode.bounded_decode
  monkeypatch.setattr(
    bounded_decode, "bounded_decode", lambda *args, **kwargs: original(*args, **kwargs, interpret=interpret)
  )


@pytest.mark.parametrize("interpret", kernel_modes())
def test_a_scanned_model_decodes_through_the_kernel_as_through_the_reference(rng, interpret, monkeypatch):
  """The tiny FS-L model, scanned, two rows at different positions: from one prefilled cache, 12 one-token steps
  (crossing a block end, whose merge the model runs after its last layer) with `impl="pallas"` give the
  reference's logits and cells at every step. (Only the decode steps differ: the tiny model's 8-token cells are
  below what the compiled training kernels of a Pallas prefill tile.)"""
  config, model, variables = tiny_model("fsl", scan_layers=True)
  _force_interpret(monkeypatch, interpret)
  results = decode_with_both_impls(config, variables, rng)
  for (logits, cells), (logits_ref, cells_ref) in zip(results["pallas"], results["reference"]):
    assert_close(logits, logits_ref, np.float32)
    np.testing.assert_array_equal(np.asarray(cells), np.asarray(cells_ref))
