"""Grouped-query attention in FS, FS-L and FS-B (fewer key/value heads than query heads): the references against a
float64 loop over query heads, each reading the cells of its key/value head `h // group`; the references, ops,
kernels and caches against multi-head FreeSolo over K and V repeated per group (τ repeated likewise); decode
against the full forward; gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import calibrate, loading, ops
from fsjax.attention import FreeSoloAttention
from fsjax.attention.projections import Projection
from fsjax.cache import archive as archive_lib
from fsjax.cache import forest as forest_cache
from fsjax.cache import init_cache
from fsjax.config import MoBAConfig, ZHAConfig, model_preset
from fsjax.decode import extend, prefill
from fsjax.model import Transformer
from fsjax.reference import cells as cells_ref
from fsjax.reference import freesolo as ref
from pallas_kernels import cell_scoring, forest_search
from pallas_kernels import sparse_readout as readout_kernel

import brute_force
from helpers import assert_close, assert_same_cells, jitted_init, kernel_modes

HEADS, KV_HEADS = 6, 2  # group 3: query heads 0-2 read key/value head 0, 3-5 head 1
GROUP = HEADS // KV_HEADS
GEOMETRY = dict(cell=4, block=16, top_k=3, retain_top=3, retain_recent=1)
FSB = dict(beam=4, bound_c=8.0)


def _grouped_qkv(rng, seq, dtype=np.float64, batch=2, dim=8):
  q = rng.standard_normal((batch, seq, HEADS, dim)).astype(dtype)
  # Keys of several scales per cell, so key norms (FS-L's pool, FS-B's τ) differ between cells.
  scale = rng.uniform(0.3, 3.0, (batch, seq, KV_HEADS, 1))
  k = (rng.standard_normal((batch, seq, KV_HEADS, dim)) * scale).astype(dtype)
  v = rng.standard_normal((batch, seq, KV_HEADS, dim)).astype(dtype)
  return q, k, v


def _repeated(x, axis=2):
  """K, V or a per-key/value-head array repeated per group (Hugging Face's `repeat_kv`)."""
  return jnp.repeat(x, GROUP, axis=axis)


def _routing_buffers(rng, k, cell):
  lam = rng.uniform(0.3, 2.0, HEADS)
  sigma = rng.uniform(2.0, 8.0, HEADS)
  batch, seq, kv_heads, dim = k.shape
  cells = k[:, : seq // cell * cell].reshape(batch, seq // cell, cell, kv_heads, dim)
  norms = np.linalg.norm(cells, axis=-1).max(axis=2)
  tau = np.median(norms.reshape(-1, KV_HEADS), axis=0).astype(k.dtype)  # per key/value head, as calibrated
  return lam, sigma, tau


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_fs_and_fsl_references_equal_a_loop_over_query_heads_reading_their_kv_heads_cells(rng, variant):
  q, k, v = _grouped_qkv(rng, 64)
  lam, sigma, _ = _routing_buffers(rng, k, GEOMETRY["cell"])
  with jax.enable_x64(True):
    out = np.asarray(ref.freesolo_long_range(q, k, v, variant=variant, lam=lam, sigma=sigma, window=40, **GEOMETRY))
  expected = np.concatenate(
    [
      brute_force.fs_long_range(
        q[:, :, [h]],
        k[:, :, [h // GROUP]],
        v[:, :, [h // GROUP]],
        variant=variant,
        lam=lam[[h]],
        sigma=sigma[[h]],
        gain=1.0,
        **GEOMETRY,
      )[0]
      for h in range(HEADS)
    ],
    axis=2,
  )
  assert_close(out, expected, np.float64)


def test_fsb_reference_selects_a_loop_over_query_heads_cells_from_their_kv_heads_forests(rng):
  q, k, _ = _grouped_qkv(rng, 64)
  lam, sigma, tau = _routing_buffers(rng, k, GEOMETRY["cell"])
  cell, block, top_k = GEOMETRY["cell"], GEOMETRY["block"], GEOMETRY["top_k"]
  select = lambda q, k, lam, sigma, tau: ref.select_cells(
    q, k, variant="fsb", lam=lam, sigma=sigma, tau=tau, cell=cell, block=block, top_k=top_k, **FSB
  )
  with jax.enable_x64(True):
    cells = jax.jit(select)(q, k, lam, sigma, tau)  # op by op, the forest build dispatched every operation
  expected = np.concatenate(
    [
      brute_force.fsb_cells(
        q[:, :, [h]],
        k[:, :, [h // GROUP]],
        tau=tau[[h // GROUP]],
        lam=lam[[h]],
        sigma=sigma[[h]],
        cell=cell,
        block=block,
        top_k=top_k,
        **FSB,
      )
      for h in range(HEADS)
    ],
    axis=2,
  )
  np.testing.assert_array_equal(np.sort(np.asarray(cells), -1), np.sort(expected, -1))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_grouped_attention_equals_multi_head_attention_over_repeated_kv(rng, variant, impl):
  """The whole operator (local branch, selection, readout, mix), through the references or the kernels
  (interpreted here): with K, V repeated per group and τ with them, multi-head FreeSolo is the grouped one."""
  # Cells of 16: the smallest the compiled kernels take (on a GPU `impl="pallas"` compiles).
  q, k, v = _grouped_qkv(rng, 160, np.float32, dim=16)
  lam, sigma, tau = _routing_buffers(rng, k, 16)
  geometry = dict(GEOMETRY, cell=16, block=32, window=40, **FSB)
  run = lambda q, k, v, lam, sigma, tau: ops.freesolo_attention(
    q, k, v, variant=variant, alpha=0.7, lam=lam, sigma=sigma, tau=tau, impl=impl, **geometry
  )
  if variant != "fsb":  # FS and FS-L jitted; FS-B's two impls share its forest build's op-by-op programs instead
    run = jax.jit(run)
  assert_close(
    run(q, k, v, lam, sigma, tau), run(q, _repeated(k), _repeated(v), lam, sigma, _repeated(tau, 0)), np.float32
  )


@pytest.mark.parametrize("variant", ["fs", "fsl", "fsb"])
def test_a_kv_head_per_query_head_changes_nothing(rng, variant):
  """`num_kv_heads == num_heads` is the multi-head module: the same parameters, the same outputs bit for bit."""
  x = jnp.asarray(rng.standard_normal((2, 64, 16)), jnp.float32)
  make = lambda projection: FreeSoloAttention(
    num_heads=4, head_dim=8, routing=ref.Routing(variant=variant, window=40, cell=8, block=32), projection=projection
  )
  plain, grouped = make(Projection()), make(Projection(num_kv_heads=4))
  # FS and FS-L jitted; FS-B's two forwards share its forest build's op-by-op programs instead.
  jit = (lambda f: f) if variant == "fsb" else jax.jit
  variables = jit(plain.init)(jax.random.PRNGKey(0), x)
  assert jax.tree_util.tree_map(jnp.shape, variables) == jax.tree_util.tree_map(
    jnp.shape, jax.eval_shape(grouped.init, jax.random.PRNGKey(0), x)
  )
  np.testing.assert_array_equal(jit(plain.apply)(variables, x), jit(grouped.apply)(variables, x))


def test_a_grouped_module_keeps_kv_state_per_kv_head_and_buffers_by_what_they_weight(rng):
  module = FreeSoloAttention(
    num_heads=HEADS,
    head_dim=8,
    routing=ref.Routing(variant="fsb", window=40, cell=8, block=32),
    projection=Projection(num_kv_heads=KV_HEADS),
  )
  x = jnp.asarray(rng.standard_normal((2, 64, 16)), jnp.float32)
  # Shapes only: traced, not compiled.
  variables = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)
  shapes = jax.tree_util.tree_map(jnp.shape, variables)
  assert shapes["params"]["k_proj"]["kernel"] == (16, KV_HEADS, 8)
  assert shapes["params"]["alpha"] == (HEADS,)
  assert shapes["routing"] == {"lam": (HEADS,), "sigma": (HEADS,), "tau": (KV_HEADS,)}
  _, state = jax.eval_shape(lambda v: module.apply(v, x, mutable=["intermediates"]), variables)
  assert state["intermediates"]["cell_norms"][0].shape == (2, 8, KV_HEADS)  # what calibration takes τ from


# Kernel parity for grouped heads (interpreted on CPU).


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_cell_scoring_kernel_reads_each_query_heads_kv_head_summaries(rng, interpret, variant):
  q, k, _ = _grouped_qkv(rng, 160, np.float32, dim=16)
  lam, sigma, _ = _routing_buffers(rng, k, 16)
  routing = ref.Routing(variant=variant, window=63, cell=16, block=64, top_k=3, retain_top=2, retain_recent=1)
  mean_keys, max_norms, centers = cells_ref.cell_summaries(jnp.asarray(k), 16)
  positions = jnp.asarray(np.stack([np.arange(160), rng.permutation(160)]), jnp.int32)
  death = None
  if variant == "fsl":
    death = cells_ref.retention_death_block(max_norms, cell=16, block=64, retain_top=2)
  lam, sigma = jnp.asarray(lam, jnp.float32), jnp.asarray(sigma, jnp.float32)
  actual = cell_scoring.select_from_summaries(
    q, positions, mean_keys, max_norms, death, variant=variant, lam=lam, sigma=sigma, cell=16, block=64, top_k=3,
    retain_top=2, retain_recent=1, interpret=interpret,
  )  # fmt: skip
  expected = cells_ref.select_from_summaries(q, positions, mean_keys, max_norms, routing=routing, lam=lam, sigma=sigma)
  scores = cells_ref.cell_scores(
    q, _repeated(mean_keys), _repeated(max_norms), centers, lam=lam, sigma=sigma, positions=positions
  )
  assert_same_cells(actual, expected, scores, atol=1e-5)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_sparse_readout_kernel_over_kv_heads_matches_the_reference_with_gradients(rng, interpret):
  """Forward and the three gradients, over a decode-like archive longer than the queries (T_k != T)."""
  q, _, _ = _grouped_qkv(rng, 40, np.float32, dim=16)
  _, k, v = _grouped_qkv(rng, 96, np.float32, dim=16)
  cell_idx = np.stack([rng.permutation(6)[:3] for _ in range(2 * 40 * HEADS)]).reshape(2, 40, HEADS, 3)
  cell_idx = jnp.asarray(np.where(rng.random(cell_idx.shape) < 0.2, -1, cell_idx), jnp.int32)
  weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def loss(readout):
    return lambda q, k, v: jnp.sum(readout(q, k, v, cell_idx, cell=16) * weights)

  kernel = lambda *a, cell: readout_kernel.sparse_readout(*a, cell=cell, interpret=interpret)
  # Jitted: op by op, the interpreted kernels and both backward passes dispatched every operation.
  forward = lambda readout: jax.jit(lambda q, k, v: readout(q, k, v, cell_idx, cell=16))
  expected = forward(ref.sparse_readout)(q, k, v)
  assert_close(forward(kernel)(q, k, v), expected, np.float32)
  grads = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
  for got, want in zip(grads, jax.jit(jax.grad(loss(ref.sparse_readout), argnums=(0, 1, 2)))(q, k, v)):
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_forest_search_kernel_searches_each_query_heads_kv_head_forests(rng, interpret):
  """Both forests of a streaming cache over key/value heads: the kernel's final beams equal the reference's
  (`fsjax.ops.forest_beam_search`'s, which folds each forest's query heads), slot for slot."""
  batch, seq, cell, block, dim, beam, queries = 2, 320, 16, 64, 16, 4, 5
  cache = forest_cache.empty_forest_cache(batch, seq, KV_HEADS, dim, cell, window=16)
  k = jnp.asarray(_grouped_qkv(rng, seq, np.float32, dim=dim)[1])
  pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  archive = archive_lib.extend(cache.archive, k, k, k, pos, jnp.ones(pos.shape, bool), cell)  # k as every input
  tau = jnp.asarray(np.quantile(np.asarray(archive.max_norms).reshape(-1, KV_HEADS), 0.6, axis=0), jnp.float32)
  target = jnp.array([4, 3]) * (block // cell)
  cache = forest_cache.advance(cache.replace(archive=archive), target, tau, cell=cell, block=block)
  q = jnp.asarray(rng.standard_normal((batch, queries, HEADS, dim)) * 2, jnp.float32)
  positions = jnp.asarray(target[:, None] * cell + rng.integers(0, block, (batch, queries)), jnp.int32)
  lam, sigma = jnp.asarray(rng.uniform(0.3, 2.0, HEADS), jnp.float32), jnp.asarray(rng.uniform(1, 8, HEADS))
  steps = forest_cache.num_levels_of(cache.forests)
  for which in (0, 1):
    forest = cache.forest(which)
    search = dict(beam=beam, steps=steps, bound_c=8.0)
    expected = ops.forest_beam_search(
      q, positions, forest.root, forest.count, forest.nodes, lam, sigma, cell=cell, **search
    )
    actual = forest_search.beam_search(
      q, positions, forest.count, forest.nodes, lam, sigma, interpret=interpret, **search
    )
    np.testing.assert_array_equal(actual, expected)
    repeated = {name: _repeated(x, 1) for name, x in forest.nodes.items()}
    roots, counts = _repeated(forest.root, 1), _repeated(forest.count, 1)
    np.testing.assert_array_equal(
      ops.forest_beam_search(q, positions, roots, counts, repeated, lam, sigma, cell=cell, **search), expected
    )


# The model: decode, gradients.


@functools.lru_cache(maxsize=None)
def _grouped_model(kind, scan_layers=False):
  """The tiny model (4 query heads) with 2 key/value heads; FS-B's τ calibrated from the FS model. Shared by the
  tests that ask for the same one (nothing here mutates it)."""
  config = model_preset("tiny", kind=kind, scan_layers=scan_layers)
  attention = dataclasses.replace(
    config.attention,
    window=40,
    cell=8,
    retain_top=2,
    retain_recent=1,
    moba=MoBAConfig(block=32, top_k=2),
    zha=ZHAConfig(refs=4, chunk=4, top_p=(0.8,)),
  )
  config = dataclasses.replace(config, num_kv_heads=2, attention=attention)
  if kind == "fsb":
    # The FS model's variables are FS-B's bit for bit but τ (`init` would run FS-B's forest search eagerly).
    _, fs, variables = _grouped_model("fs", scan_layers)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 128), 0, config.vocab_size)
    tau = calibrate.calibrate(fs, variables, [tokens])
    assert tau.shape == (config.num_layers, 2)
    variables = loading.with_tau(config, variables, tau)
  else:
    variables = jitted_init(config)
  return config, Transformer(config), variables


@pytest.mark.parametrize(
  "kind,scan_layers",
  [
    pytest.param(kind, scan_layers, id=f"{kind}-{'scanned' if scan_layers else 'unrolled'}")
    for kind, scan_layers in [*((kind, s) for kind in ("fs", "fsl") for s in (False, True)), ("fsb", True)]
  ],
)
def test_grouped_prefill_then_decode_equals_the_full_forward(rng, kind, scan_layers):
  """A ragged batch whose prompts end mid-cell and mid-block (70 and 45 tokens; cell 8, block 32), prefilled in
  32-token chunks, then decoded token by token, each row at its own position, through the kind's cache (FS-L's
  bounded cache, FS-B's forest cache) holding 2 key/value heads for 4 query heads. FS-B scanned only (its compile
  is over a minute per case on CPU): every grouped step of its forest cache (forests per key/value head, roots and
  candidates read per query head) is the same code in both layouts, and the scanned one also reads its layer of
  the stacked tables; unrolled FS-B decode is checked in tests/test_decode.py."""
  config, model, variables = _grouped_model(kind, scan_layers)
  seq, lengths, steps = 100, np.array([70, 45]), 24
  tokens = jnp.asarray(np.stack([rng.permutation(config.vocab_size)[:seq] for _ in range(2)]))
  full = np.asarray(jax.jit(model.apply)(variables, tokens))
  cache = init_cache(config, 2, seq)
  prompt = jnp.where(jnp.arange(70) < lengths[:, None], tokens[:, :70], 0)
  logits, cache = prefill(model, variables, prompt, jnp.asarray(lengths), cache, 32)
  for row, n in enumerate(lengths):
    assert_close(np.asarray(logits)[row, :n], full[row, :n], np.float32, scale=5)
  rows = np.arange(2)
  step = jax.jit(lambda token, cache, pos: extend(model, variables, token, cache, pos, jnp.ones((2, 1), bool))[:2])
  for i in range(steps):
    pos = lengths + i
    step_logits, cache = step(tokens[rows, pos][:, None], cache, jnp.asarray(pos)[:, None])
    assert_close(np.asarray(step_logits)[:, 0], full[rows, pos], np.float32, scale=5)


def test_a_grouped_fs_training_step_gives_finite_nonzero_gradients_to_the_kv_projections(rng):
  config, model, variables = _grouped_model("fs")
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 97)))

  def loss(params):
    logits = model.apply({**variables, "params": params}, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

  grads = jax.jit(jax.grad(loss))(variables["params"])  # op by op, the backward pass compiled per operation
  for name in ("k_proj", "v_proj", "q_proj"):
    g = np.asarray(grads["layer_0"]["attention"][name]["kernel"])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name
  assert grads["layer_0"]["attention"]["k_proj"]["kernel"].shape[1] == 2
