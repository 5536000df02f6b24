"""`pallas_kernels.archive_decode` (FS's and FS-B's one-token step over the archive, given the selected cells)
against its jnp specification, the reference path of `fsjax.attention.freesolo_step.archive_chunk`: the mixed
branches, the selected cells and the archive it leaves, on fresh random archives (interpreted on CPU, compiled on
a GPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.attention import freesolo_step
from fsjax.cache import archive as archive_cache
from fsjax.cache import forest as forest_cache
from fsjax.cache.layered import LayerSlice
from fsjax.reference.rope import apply_rope
from fsjax.reference.routing import Routing
from pallas_kernels import archive_decode, cell_scoring

from helpers import assert_close, decode_with_both_impls, kernel_modes, tiny_model

ROPE_THETA = 10000.0


def _filled_archive(rng, routing, *, lengths, capacity, kv_heads, dim, dtype):
  """An archive holding `lengths[b]` random tokens in row b (one bulk write, then two one-token writes per row,
  so the ring has wrapped where a row is longer than the window)."""
  batch = len(lengths)
  archive = archive_cache.empty_archive(batch, capacity, kv_heads, dim, routing.cell, routing.window, dtype)
  write = jax.jit(
    lambda archive, k, v, pos, valid: archive_cache.extend(
      archive, k, apply_rope(k, pos, ROPE_THETA), v, pos, valid, routing.cell
    )
  )
  lengths = np.asarray(lengths)
  bulk = int(lengths.max()) - 2
  draw = lambda n: jnp.asarray(rng.standard_normal((batch, n, kv_heads, dim)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(bulk), (batch, bulk))
  archive = write(archive, draw(bulk), draw(bulk), pos, pos < jnp.asarray(lengths - 2)[:, None])
  for t in range(2):
    at = jnp.asarray(lengths - 2 + t)[:, None]
    archive = write(archive, draw(1), draw(1), at, jnp.ones((batch, 1), bool))
  return archive


def _token(rng_seed, *, batch, heads, kv_heads, dim, layers=None):
  """The step's query, key and value and the layer's λ, σ, α and readout gain, drawn from `rng_seed` so that two
  implementations see the same step; with `layers`, α and the gain as `[layers, ...]` stacks in bf16 (a model's
  parameter dtype)."""
  draw = np.random.default_rng(rng_seed)
  q = jnp.asarray(draw.standard_normal((batch, 1, heads, dim)), jnp.float32)
  k, v = (jnp.asarray(draw.standard_normal((batch, 1, kv_heads, dim)), jnp.float32) for _ in range(2))
  lead = () if layers is None else (layers,)
  dtype = jnp.float32 if layers is None else jnp.bfloat16
  weights = dict(
    lam=jnp.asarray(draw.uniform(0.5, 2.0, heads), jnp.float32),
    sigma=jnp.asarray(draw.uniform(2.0, 8.0, heads), jnp.float32),
    lr_gain=jnp.asarray(draw.uniform(0.5, 1.5, (*lead, dim)), dtype),
    alpha=jnp.asarray(draw.uniform(0.5, 1.5, (*lead, heads)), dtype),
  )
  return (q, k, v), weights


def _step(cache, routing, token, weights, positions, *, impl, valid=None, tau=None):
  """One token per row at `positions` `[batch]` through `archive_chunk`: (o, cells, cache)."""
  q, k, v = token
  valid = jnp.ones((q.shape[0], 1), bool) if valid is None else jnp.asarray(valid)[:, None]
  chunk = functools.partial(freesolo_step.archive_chunk, routing=routing, rope_theta=ROPE_THETA, impl=impl, tau=tau)
  return jax.jit(chunk)(cache, q, k, v, positions[:, None], valid, **weights)


def _assert_steps_agree(kernel, reference, dtype):
  o, cells, cache = kernel
  o_ref, cells_ref, cache_ref = reference
  assert_close(o, o_ref, dtype)
  np.testing.assert_array_equal(np.asarray(cells), np.asarray(cells_ref))
  for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(cache_ref), strict=True):
    if jnp.issubdtype(a.dtype, jnp.integer):  # positions: exactly
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:  # the ring's keys are rotated in two compiled programs, which may round RoPE's last bit differently
      assert_close(a, b, dtype)


def _force_interpret(monkeypatch, interpret):
  """The kernel compiled (a GPU) or interpreted: `impl="pallas"` picks the kernel on any platform."""
  original = archive_decode.archive_decode
  monkeypatch.setattr(
    archive_decode, "archive_decode", lambda *args, **kwargs: original(*args, **kwargs, interpret=interpret)
  )


CASES = {
  # name: routing, heads, kv_heads, dim, row lengths before the step, archive capacity
  "mha-ring-wrapped-ragged": (dict(window=40, cell=16, block=32, top_k=3), 2, 2, 16, [150, 97], 192),
  "grouped-mid-cell": (dict(window=24, cell=16, block=32, top_k=4), 4, 2, 32, [121, 121], 160),
  "fewer-cells-than-k": (dict(window=40, cell=16, block=32, top_k=4), 2, 1, 16, [40, 70], 96),
  "ends-a-cell": (dict(window=40, cell=16, block=32, top_k=2), 2, 2, 16, [143, 79], 160),
}


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_step_equals_the_reference_step(rng, interpret, case, monkeypatch):
  """The mixed branches, the K cells in order and the archive after the step (the token in the tokens and the
  ring, the summary of its cell, complete where the token ends it)."""
  spec, heads, kv_heads, dim, lengths, capacity = CASES[case]
  routing = Routing(variant="fs", **spec)
  archive = _filled_archive(
    rng, routing, lengths=lengths, capacity=capacity, kv_heads=kv_heads, dim=dim, dtype=jnp.float32
  )
  token, weights = _token(int(rng.integers(1 << 30)), batch=len(lengths), heads=heads, kv_heads=kv_heads, dim=dim)
  _force_interpret(monkeypatch, interpret)
  run = lambda impl: _step(archive, routing, token, weights, jnp.asarray(lengths), impl=impl)
  kernel, reference = run("pallas"), run("reference")
  _assert_steps_agree(kernel, reference, np.float32)
  assert np.any(np.asarray(kernel[1]) >= 0)
  if case == "fewer-cells-than-k":
    assert np.any(np.asarray(kernel[1]) == -1)


def test_the_kernels_ranking_of_candidates_is_the_merges_order(rng):
  """`_ranked` orders candidates as `cell_scoring.merge_ranges` (`lax.top_k`) does: by score, the lower position
  first among equal scores, −inf last; drawn from few values so that most scores tie."""
  for _ in range(20):
    n = int(rng.integers(2, 40))
    scores = jnp.asarray(rng.choice([-np.inf, 0.0, 0.5, 1.0, 2.5], size=n), jnp.float32)
    cells = jnp.asarray(rng.permutation(n), jnp.int32)
    rank = np.asarray(archive_decode._ranked(scores))
    assert sorted(rank) == list(range(n))
    merged = np.asarray(cell_scoring.merge_ranges(cells, scores, n))
    np.testing.assert_array_equal(np.asarray(cells)[np.argsort(rank)], merged)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_the_kernel_ranks_the_scorings_unmerged_cell_ranges(rng, interpret, monkeypatch):
  """FS's scoring split into three cell ranges (as at a decode step of a long archive): the kernel reads the
  ranges' candidates and takes the K best itself; its branches, the cells the step returns (merged in XLA) and
  the archive equal the reference step's. K = 3 leaves a padding slot in every range's list."""
  routing = Routing(variant="fs", window=40, cell=16, block=32, top_k=3)
  lengths = [600, 377]
  archive = _filled_archive(rng, routing, lengths=lengths, capacity=640, kv_heads=2, dim=16, dtype=jnp.float32)
  token, weights = _token(int(rng.integers(1 << 30)), batch=2, heads=4, kv_heads=2, dim=16)
  sizes = cell_scoring.BlockSizes(queries=16, cells=16, splits=3)
  monkeypatch.setattr(cell_scoring.BlockSizes, "get_default", classmethod(lambda cls: sizes))
  _force_interpret(monkeypatch, interpret)
  seen = []
  launch = archive_decode.archive_decode

  def recorded(*args, **kwargs):
    seen.append(kwargs["scores"].shape)
    return launch(*args, **kwargs)

  monkeypatch.setattr(archive_decode, "archive_decode", recorded)
  run = lambda impl: _step(archive, routing, token, weights, jnp.asarray(lengths), impl=impl)
  kernel = run("pallas")
  assert seen == [(2, 4, 3 * 4)]  # three ranges of K' = 4 candidates reached the kernel
  _assert_steps_agree(kernel, run("reference"), np.float32)


def test_candidates_that_do_not_fit_are_refused_before_launching(rng):
  """Scored candidates and FS-B's reranked ones exclude each other, scores must match the cells, and top_k must
  name how many of the candidates to read."""
  routing = Routing(variant="fs", window=40, cell=16, block=32, top_k=3)
  archive = _filled_archive(rng, routing, lengths=[50], capacity=64, kv_heads=1, dim=16, dtype=jnp.float32)
  fields = dict(ring_k=archive.ring.k, ring_v=archive.ring.v, ring_pos=archive.ring.pos)
  fields.update(tokens_k=archive.tokens.k, tokens_v=archive.tokens.v, tokens_pos=archive.tokens.pos)
  fields.update(mean_keys=archive.mean_keys, max_norms=archive.max_norms)
  (q, k, v), weights = _token(1, batch=1, heads=1, kv_heads=1, dim=16)
  token = (q[:, 0], q[:, 0], k[:, 0], k[:, 0], v[:, 0], jnp.asarray([50]), jnp.asarray([True]))
  cells = jnp.zeros((1, 1, 8), jnp.int32)
  step = lambda **kw: archive_decode.archive_decode(
    *token, cells, weights["alpha"], weights["lr_gain"], fields, window=40, cell=16, eps=1e-6, interpret=True, **kw
  )
  prior = (weights["lam"], weights["sigma"])
  with pytest.raises(ValueError, match="not both"):
    step(scores=jnp.zeros((1, 1, 8)), rerank_prior=prior, top_k=2)
  with pytest.raises(ValueError, match="scores must match cells"):
    step(scores=jnp.zeros((1, 1, 4)), top_k=2)
  with pytest.raises(ValueError, match="top_k must lie in 1..8"):
    step(rerank_prior=prior, top_k=9)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_a_row_whose_token_is_not_valid_writes_nothing(rng, interpret, monkeypatch):
  """A padded row of a batch step: its token enters neither the tokens nor the ring and is no key of its local
  branch, as in the reference; the valid row beside it, at the same position and slots, is written."""
  routing = Routing(variant="fs", window=40, cell=16, block=32, top_k=3)
  lengths = [130, 130]
  archive = _filled_archive(rng, routing, lengths=lengths, capacity=160, kv_heads=2, dim=16, dtype=jnp.float32)
  token, weights = _token(3, batch=2, heads=2, kv_heads=2, dim=16)
  _force_interpret(monkeypatch, interpret)
  run = lambda impl: _step(archive, routing, token, weights, jnp.asarray(lengths), impl=impl, valid=[True, False])
  kernel, reference = run("pallas"), run("reference")
  _assert_steps_agree(kernel, reference, np.float32)
  written, slot = kernel[2], lengths[0] % (routing.window + 1)
  np.testing.assert_array_equal(np.asarray(written.ring.pos)[:, slot], [lengths[0], archive.ring.pos[1, slot]])
  np.testing.assert_array_equal(np.asarray(written.tokens.pos)[:, lengths[0]], [lengths[0], -1])


@pytest.mark.parametrize("interpret", kernel_modes())
def test_the_kernel_reads_a_scanned_models_layer_where_it_lies(rng, interpret, monkeypatch):
  """Archives, α and the readout gain as views into `[layers, ...]` stacks (a scanned model's decode step) in
  bf16: the kernels read layer 1 and the step writes only layer 1, equal to the step over that layer alone."""
  routing = Routing(variant="fs", window=40, cell=16, block=32, top_k=3)
  lengths = [150, 97]
  layers = [
    _filled_archive(rng, routing, lengths=lengths, capacity=192, kv_heads=2, dim=16, dtype=jnp.bfloat16)
    for _ in range(3)
  ]
  stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
  view = jax.tree_util.tree_map(lambda x: LayerSlice(x, jnp.int32(1)), stacked)
  token, weights = _token(5, batch=2, heads=2, kv_heads=2, dim=16, layers=3)
  stacks = {name: weights[name] for name in ("alpha", "lr_gain")}
  _force_interpret(monkeypatch, interpret)
  views = {**weights, **{name: LayerSlice(x, jnp.int32(1)) for name, x in stacks.items()}}
  o, cells, written = _step(view, routing, token, views, jnp.asarray(lengths), impl="pallas")
  written = jax.tree_util.tree_map(lambda x: x.stack, written, is_leaf=lambda x: isinstance(x, LayerSlice))
  at = lambda layer: {**weights, **{name: x[layer] for name, x in stacks.items()}}
  alone = _step(layers[1], routing, token, at(1), jnp.asarray(lengths), impl="reference")
  other = _step(layers[1], routing, token, at(0), jnp.asarray(lengths), impl="reference")
  assert not np.allclose(np.asarray(alone[0]), np.asarray(other[0]), atol=1e-2)  # another layer's α would show
  _assert_steps_agree((o, cells, jax.tree_util.tree_map(lambda x: x[1], written)), alone, np.float32)
  for a, b in zip(jax.tree_util.tree_leaves(written), jax.tree_util.tree_leaves(stacked), strict=True):
    np.testing.assert_array_equal(np.asarray(a)[::2], np.asarray(b)[::2])  # layers 0 and 2 untouched


@pytest.mark.parametrize("interpret", kernel_modes())
def test_fsb_streaming_forests_select_the_cells_the_kernel_reads(rng, interpret, monkeypatch):
  """FS-B's one-token step over its forest cache: the forests (searched by the reference here) choose the cells,
  and the kernel's branches, cells, archive and forests equal `archive_chunk`'s reference step."""
  routing = Routing(variant="fsb", window=40, cell=16, block=32, top_k=3, beam=4)
  lengths = [150, 97]
  archive = _filled_archive(rng, routing, lengths=lengths, capacity=192, kv_heads=2, dim=16, dtype=jnp.float32)
  cache = forest_cache.empty_forest_cache(2, 192, 2, 16, routing.cell, routing.window).replace(archive=archive)
  tau = jnp.asarray(np.quantile(np.asarray(archive.max_norms[:, :5]).reshape(-1, 2), 0.5, axis=0), jnp.float32)
  target = forest_cache.eligible_after(
    jnp.asarray(lengths)[:, None] - 1, jnp.ones((2, 1), bool), cache.admitted, cell=16, block=32
  )
  cache = forest_cache.advance(cache, target, tau, cell=16, block=32)
  (q, k, v), weights = _token(9, batch=2, heads=2, kv_heads=2, dim=16)
  positions = jnp.asarray(lengths)[:, None]
  valid = jnp.ones((2, 1), bool)
  q_rot, k_rot = apply_rope(q, positions, ROPE_THETA), apply_rope(k, positions, ROPE_THETA)
  _force_interpret(monkeypatch, interpret)
  kernel = jax.jit(
    functools.partial(freesolo_step.archive_token_kernel, routing=routing, out_dtype=jnp.float32, impl="reference")
  )(cache, q, q_rot, k, k_rot, v, positions, valid, weights=dict(weights, tau=tau))
  reference = _step(cache, routing, (q, k, v), weights, jnp.asarray(lengths), impl="reference", tau=tau)
  _assert_steps_agree(kernel, reference, np.float32)
  assert np.any(np.asarray(kernel[1]) >= 0)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_a_scanned_model_decodes_through_the_kernel_as_through_the_reference(rng, interpret, monkeypatch):
  """The tiny FS model, scanned, with 16-token cells (a geometry the compiled scoring kernel tiles), two rows at
  different positions: from one prefilled cache, 12 one-token steps with `impl="pallas"` (the scoring kernel,
  then this one) give the reference's logits and cells at every step, α and the gain drawn per layer and head."""
  config, model, variables = tiny_model("fs", scan_layers=True, cell=16)
  _force_interpret(monkeypatch, interpret)
  results = decode_with_both_impls(config, variables, rng)
  for (logits, cells), (logits_ref, cells_ref) in zip(results["pallas"], results["reference"], strict=True):
    assert_close(logits, logits_ref, np.float32)
    np.testing.assert_array_equal(np.asarray(cells), np.asarray(cells_ref))
  assert np.any(np.asarray(results["pallas"][-1][1]) >= 0)
