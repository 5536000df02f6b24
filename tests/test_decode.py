"""Prefill + decode through the caches equals the full forward pass (teacher forcing), for every kind."""

import collections
import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import decode, kinds, memory, ops
from fsjax.cache import BoundedCache, init_cache
from fsjax.config import model_preset
from fsjax.decode import extend, generate, prefill, sample
from fsjax.loading import with_tau
from fsjax.model import Transformer

from helpers import assert_close, jitted_init, stack_layers, tiny_model

KINDS = list(kinds.names())  # every registered kind has a decode cache
SEQ, PROMPT = 150, 70  # crosses four 32-token query blocks in the prompt and more while decoding
# Tests below prefill batches of 2 into caches of SEQ slots in 32-token chunks where their property allows it:
# a chunk program of one shape is compiled once and serves them all.


def _distinct_tokens(rng, vocab_size, batch, seq):
  """Random tokens without repeats in a row. A repeated token has the same layer-0 key, so two cells can tie
  exactly on max key norm; the full forward keeps the tie bit-exact (lower index wins) but a key computed in a
  one-token decode step may differ in the last bit and flip it. docs/notes.md records this open point."""
  return jnp.asarray(np.stack([rng.permutation(vocab_size)[:seq] for _ in range(batch)]))


def _teacher_forced(model, variables, tokens, prompt_len, chunk):
  batch, seq = tokens.shape
  cache = init_cache(model.config, batch, seq)
  logits, cache = prefill(model, variables, tokens[:, :prompt_len], jnp.full((batch,), prompt_len), cache, chunk)
  steps = [logits]
  for t in range(prompt_len, seq):
    step_logits, cache, _ = extend(
      model, variables, tokens[:, t : t + 1], cache, jnp.full((batch, 1), t), jnp.ones((batch, 1), bool)
    )
    steps.append(step_logits)
  return np.asarray(jnp.concatenate(steps, axis=1))


@pytest.mark.parametrize(
  "kind,scan_layers",
  [
    *((kind, False) for kind in KINDS if kind != "fsb"),
    ("fsl", True),
    ("fs", True),
    ("fsb", True),
    ("tfpp", True),
    ("swa", True),
    ("zha", True),
  ],
)
def test_prefill_and_decode_equal_the_full_forward(rng, kind, scan_layers):
  """Also through a `scan_layers` model, whose stacked cache the layer scan carries and each layer updates in
  place (`fsjax.cache.layered`). FS-B decodes through the streaming forest cache, scanned only: its compile is
  the suite's slowest (about a minute per case on CPU), and the scanned case runs every cache function the
  unrolled one does, through the layer views as well. Unrolled FS-B decode is checked against one row at a time
  below, and against the full forward through the kernels on a GPU."""
  config, model, variables = tiny_model(kind, scan_layers)
  tokens = _distinct_tokens(rng, config.vocab_size, 2, SEQ)
  full = np.asarray(jax.jit(model.apply)(variables, tokens))
  assert_close(_teacher_forced(model, variables, tokens, PROMPT, chunk=32), full, np.float32, scale=5)


def _primitives(jaxpr):
  """Every primitive's name in `jaxpr` and the jaxprs in its equations' parameters, recursively, except a Pallas
  kernel's body: its loops run on the device, within one launch."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    if eqn.primitive.name == "pallas_call":
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
          names += _primitives(getattr(sub, "jaxpr", sub))
  return names


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_an_fsb_token_steps_layers_hold_no_data_dependent_control_flow(impl):
  """A one-token FS-B step advances every layer's forests before the layers (`fsjax.cache.advance_forests`), so
  the scan over the layers holds no loop or conditional on data: on a GPU each one's predicate is read back to
  the host, a round trip per layer at every token. The advance itself sits under one conditional (and the
  equality of decode with the full forward above fails if it is skipped). With the kernels (`pallas`), the beam
  search's loop runs inside its launch."""
  config, _, variables = tiny_model("fsb", scan_layers=True)
  model = _with_impl(config, impl)
  cache = init_cache(config, 2, SEQ)
  token, positions = jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 96)
  jaxpr = jax.make_jaxpr(lambda v, c: model.apply(v, token, c, positions, positions >= 0))(variables, cache).jaxpr
  top = [eqn for eqn in jaxpr.eqns if eqn.primitive.name in ("scan", "cond", "while")]
  layers = [eqn for eqn in top if eqn.primitive.name == "scan" and eqn.params["length"] == config.num_layers]
  assert len(layers) == 1 and [eqn.primitive.name for eqn in top].count("cond") == 1
  body = _primitives(layers[0].params["jaxpr"].jaxpr)
  assert "while" not in body and "cond" not in body


@pytest.mark.parametrize("kind", ["fsl", "fs", "tfpp"])
def test_a_token_steps_rotations_share_one_table_made_before_the_layers(kind):
  """A one-token step makes RoPE's sines and cosines once (`fsjax.reference.rope.rotary_table`) and every layer
  rotates its q and k with them: inside the scan over the layers XLA would compute them again per layer (its
  loop-invariant code motion leaves ops that outgrow their operands in the loop). The equality of decode with
  the full forward above covers the rotations themselves."""
  config, model, variables = tiny_model(kind, scan_layers=True)
  cache = init_cache(config, 2, SEQ)
  token, positions = jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), 70)
  jaxpr = jax.make_jaxpr(lambda v, c: model.apply(v, token, c, positions, positions >= 0))(variables, cache).jaxpr
  (layers,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan" and eqn.params["length"] == config.num_layers]
  body = _primitives(layers.params["jaxpr"].jaxpr)
  outside = [eqn.primitive.name for eqn in jaxpr.eqns]
  assert "cos" not in body and "sin" not in body
  assert "cos" in outside and "sin" in outside


def _with_impl(config, impl):
  return Transformer(dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl)))


_GPU_ONLY = pytest.mark.skipif(
  jax.default_backend() != "gpu",
  reason="interpreted, the FS-B beam kernel per decode "
  "step is too slow for CI; tests/test_kernel_forest_search.py checks it against the "
  "reference",
)


@pytest.mark.parametrize(
  "kind,scan_layers",
  [("fs", False), pytest.param("fsb", False, marks=_GPU_ONLY), pytest.param("fsb", True, marks=_GPU_ONLY)],
)
def test_prefill_and_decode_through_the_kernels_equal_the_reference_forward(rng, kind, scan_layers):
  """The FS archive path with impl="pallas" (interpreted on CPU): selection from cached summaries at each row's
  positions and the readout over the archived keys (a kernel for prefill chunks, XLA's gather for one-token
  steps), against the reference full forward; FS-B through the streaming forest cache and the beam-search
  kernel, which in a scanned model reads its layer of the stacked node tables."""
  config, _, variables = tiny_model(kind, scan_layers, cell=16)
  tokens = _distinct_tokens(rng, config.vocab_size, 2, 110)
  full = np.asarray(jax.jit(_with_impl(config, "reference").apply)(variables, tokens))
  assert_close(
    _teacher_forced(_with_impl(config, "pallas"), variables, tokens, PROMPT, chunk=32), full, np.float32, scale=5
  )


def _chunk_by_chunk(model, variables, tokens, lengths, cache, chunk):
  """Prefill with every chunk, the first included, through the caches' own attention (no `first_chunk`)."""
  batch, prompt_len = tokens.shape
  outputs = []
  for start in range(0, prompt_len, chunk):
    positions = jnp.broadcast_to(start + jnp.arange(chunk), (batch, chunk))
    piece = jnp.pad(tokens[:, start : start + chunk], ((0, 0), (0, chunk - tokens[:, start : start + chunk].shape[1])))
    logits, cache, _ = extend(model, variables, piece, cache, positions, positions < lengths[:, None])
    outputs.append(logits)
  return jnp.concatenate(outputs, axis=1)[:, :prompt_len], cache


def _pools_in_cell_order(cache):
  """`cache` with every FS-L pool's slots in cell-id order, empties last: which slot holds a pool cell depends on
  the order cells arrived in (`fsjax.cache.bounded`), what the pool holds does not."""

  def one(layer):
    if not isinstance(layer, BoundedCache):
      return layer
    order = jnp.argsort(jnp.where(layer.pool_ids >= 0, layer.pool_ids, jnp.iinfo(jnp.int32).max), -1, stable=True)
    take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - order.ndim)), order.ndim - 1)
    return layer.replace(**{f"pool_{n}": take(getattr(layer, f"pool_{n}")) for n in ("ids", "k", "v", "mean", "norm")})

  return {name: one(layer) for name, layer in cache.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompts_first_chunk_fills_the_cache_in_bulk_as_chunk_by_chunk_does(rng, kind):
  """The first chunk runs the training operator and writes the cache at once (`first_chunk`): its logits and
  the cache it leaves equal those of 32-token chunks through the cache path, for a ragged batch whose prompts
  end mid-cell and mid-block and leave padding in the chunk (cell 8, block 32; 70 and 45 tokens in one
  96-token chunk). Padding reaches no cache field: every array, empty slots included, agrees (FS-L's pools
  compared in cell order). FS-B's forests are
  left current: each row's hold the cells eligible for its next token's block, so a decode step builds only what
  its own block adds (8 cells of 8 tokens below position 64, 4 below 32)."""
  config, model, variables = tiny_model(kind)
  tokens = _distinct_tokens(rng, config.vocab_size, 2, 70)
  lengths = jnp.array([70, 45])
  bulk_logits, bulk = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ))  # chunk: whole prompt
  logits, cache = _chunk_by_chunk(model, variables, tokens, lengths, init_cache(config, 2, SEQ), 32)
  for row, n in enumerate([70, 45]):
    assert_close(np.asarray(bulk_logits)[row, :n], np.asarray(logits)[row, :n], np.float32, scale=5)
  paths = jax.tree_util.tree_flatten_with_path(_pools_in_cell_order(cache))[0]
  for (path, expected), got in zip(paths, jax.tree_util.tree_leaves(_pools_in_cell_order(bulk))):
    name = jax.tree_util.keystr(path)
    if jnp.issubdtype(expected.dtype, jnp.integer) or expected.dtype == bool:
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=name)
    else:
      np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-5, err_msg=name)
  if kind == "fsb":
    for layer in bulk.values():
      np.testing.assert_array_equal(layer.admitted, [8, 4])
      np.testing.assert_array_equal(layer.forests.count[:, : config.num_heads], [[8] * 4, [4] * 4])


def test_prefill_chunk_grows_with_the_prompt_only_where_the_fused_operators_run():
  """On a CPU the training operators are references: chunks stay within DEFAULT_CHUNK. A prompt goes in as few
  chunks as that allows, of equal size: whole blocks, rounded up to an eighth of their power of two (at most
  12.5% padding, few compiled lengths)."""
  config = model_preset("tiny", kind="fsl")
  block = config.attention.block
  assert decode.prefill_chunk(config, 70) == -(-70 // block) * block
  on_cpu = jax.default_backend() != "gpu"
  for length in (1, 200, 3000, 4097, 70_000):
    chunk = decode.prefill_chunk(config, length)
    pieces = -(-length // chunk)
    assert chunk % block == 0 and pieces * chunk <= 1.125 * length + pieces * block, (length, chunk)
    if on_cpu:
      assert pieces == -(-length // decode.DEFAULT_CHUNK) and chunk <= decode.DEFAULT_CHUNK, (length, chunk)


@pytest.mark.parametrize("kind", ["fsl", "swa"])
def test_prefill_chunk_size_does_not_change_logits(rng, kind):
  config, model, variables = tiny_model(kind)
  tokens = _distinct_tokens(rng, config.vocab_size, 2, 96)
  lengths = jnp.array([96, 96])
  small, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=16)
  large, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=96)
  assert_close(small, large, np.float32, scale=5)


def _record_chunk_sizes(monkeypatch):
  """A list that collects the tokens per row of every chunk prefill runs from now on."""
  sizes, chunk_program = [], decode._chunk_program

  def recording(*args, **kwargs):
    size, run = chunk_program(*args, **kwargs)
    return (
      size,
      lambda variables, tokens, *rest, **kw: sizes.append(tokens.shape[1]) or run(variables, tokens, *rest, **kw),
    )

  monkeypatch.setattr(decode, "_chunk_program", recording)
  return sizes


def test_later_chunks_stay_short_unless_the_cache_path_is_bounded(rng, monkeypatch):
  """With the chunk left to prefill, a long first chunk is followed by DEFAULT_CHUNK-sized ones where the cache
  path attends to every cached slot at once (SWA), and by chunks as long as the first through FS-L's bounded
  cache; the logits equal those of even 32-token chunks."""
  monkeypatch.setattr(decode, "prefill_chunk", lambda config, prompt_len, batch: 64)
  monkeypatch.setattr(decode, "DEFAULT_CHUNK", 32)
  sizes = _record_chunk_sizes(monkeypatch)
  for kind, expected_sizes in (("swa", [64, 32, 32]), ("fsl", [64, 64])):
    config, model, variables = tiny_model(kind)
    tokens = _distinct_tokens(rng, config.vocab_size, 2, 120)
    lengths = jnp.array([120, 120])
    sizes.clear()
    chosen, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ))
    assert sizes == expected_sizes, kind
    even, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32)
    assert_close(chosen, even, np.float32, scale=5)


def test_prefill_halves_a_chunk_until_its_compiled_temporaries_fit_the_free_memory(rng, monkeypatch):
  """With the device's free memory set between what XLA's buffer assignment gives a 64- and a 128-token chunk of
  MoBA's first chunk (its reference operator's temporaries grow with the square of the chunk), a 128-token chunk
  asked for runs as two of 64 with the logits of 64-token chunks; with too little for one block, prefill raises
  DeviceMemoryError naming the kind and batch, before running anything."""
  config, model, variables = tiny_model("moba")
  batch, length = 2, 128
  tokens = _distinct_tokens(rng, config.vocab_size, batch, length)
  lengths = jnp.array([length, 77])
  cache = init_cache(config, batch, length)

  def program_bytes(size):
    ints, valid = jax.ShapeDtypeStruct((batch, size), jnp.int32), jax.ShapeDtypeStruct((batch, size), bool)
    lowered = extend.lower(model, variables, ints, cache, ints, valid, first_chunk=True)
    return memory.program_bytes(lowered.compile())

  small, large = program_bytes(64), program_bytes(128)
  assert large > small
  monkeypatch.setattr(memory, "_PROGRAMS", collections.OrderedDict())
  monkeypatch.setattr(memory, "free_bytes", lambda: int(small / memory.FIT_MARGIN) + 1)
  sizes = _record_chunk_sizes(monkeypatch)
  fitted, _ = prefill(model, variables, tokens, lengths, init_cache(config, batch, length), chunk=128)
  assert sizes == [64, 64]
  assert decode.chunk_sizes(model, variables, cache, batch, length, chunk=128) == (64, 64)  # what benchmarks print
  expected, _ = prefill(model, variables, tokens, lengths, init_cache(config, batch, length), chunk=64)
  np.testing.assert_array_equal(np.asarray(fitted), np.asarray(expected))
  monkeypatch.setattr(memory, "free_bytes", lambda: 1)
  sizes.clear()
  with pytest.raises(memory.DeviceMemoryError, match="prefill of moba at batch 2"):
    prefill(model, variables, tokens, lengths, init_cache(config, batch, length), chunk=96)
  assert sizes == []


def test_generate_refuses_a_cache_larger_than_the_free_memory_before_compiling(rng, monkeypatch):
  config, model, variables = tiny_model("tfpp")
  tokens = _distinct_tokens(rng, config.vocab_size, 3, 40)
  cache_bytes = memory.tree_bytes(jax.eval_shape(lambda: init_cache(config, 3, 48)))
  monkeypatch.setattr(memory, "free_bytes", lambda: cache_bytes - 1)
  monkeypatch.setattr(decode, "_chunk_program", lambda *args: pytest.fail("compiled a chunk"))
  with pytest.raises(memory.DeviceMemoryError, match="the tfpp cache for 3 rows of 48 tokens needs"):
    generate(model, variables, tokens, [40, 40, 40], max_new_tokens=8, eos_id=0, max_len=48)


def test_prefill_can_keep_only_each_rows_last_logits(rng):
  config, model, variables = tiny_model("fs")
  tokens = _distinct_tokens(rng, config.vocab_size, 2, 100)
  lengths = jnp.array([100, 41])
  full, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32)
  last, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32, all_logits=False)
  # One position's logits are a smaller matrix product: on a GPU its summation order may differ in the last bit.
  assert_close(last, np.asarray(full)[[0, 1], [99, 40]], np.float32)


@pytest.mark.parametrize("kind", ["fs", "fsb", "tfpp", "swa", "zha"])
def test_batch_of_different_lengths_equals_each_sequence_alone(rng, kind):
  """Rows of 70 and 45 tokens generate what each does in a batch of its own copies (the same shapes, so the same
  compiled programs: only the other row's length and tokens differ)."""
  config, model, variables = tiny_model(kind)
  lengths = [70, 45]
  tokens = np.zeros((2, 70), np.int32)
  for row, n in enumerate(lengths):
    tokens[row, :n] = rng.integers(3, config.vocab_size, n)
  run = lambda t, n: generate(model, variables, t, n, max_new_tokens=12, eos_id=2, chunk=32, max_len=90)
  batched = np.asarray(run(tokens, lengths))
  for row, n in enumerate(lengths):
    alone = np.asarray(run(tokens[[row, row]], [n, n]))
    np.testing.assert_array_equal(batched[row], alone[0])
    np.testing.assert_array_equal(alone[1], alone[0])


def test_each_row_stops_at_its_own_limit_and_the_loop_at_the_last(rng):
  """Rows capped at 1, 4 and 9 new tokens generate what the uncapped batch does up to their caps, then EOS (-1:
  an id no sample takes, so only the caps stop rows)."""
  config, model, variables = tiny_model("tfpp")
  tokens = rng.integers(3, config.vocab_size, (3, 40)).astype(np.int32)
  run = lambda limits: np.asarray(
    generate(model, variables, tokens, [40, 33, 21], max_new_tokens=12, eos_id=-1, max_len=52, limits=limits)
  )
  free, capped = run(None), run([1, 4, 9])
  for row, limit in enumerate([1, 4, 9]):
    np.testing.assert_array_equal(capped[row, :limit], free[row, :limit])
    assert (capped[row, limit:] == -1).all() and (free[row] != -1).all()


@pytest.mark.parametrize("kind,scan_layers", [("tfpp", False), ("fs", True)])
def test_the_decode_loop_updates_the_donated_cache_without_copying_it(kind, scan_layers):
  """The compiled loop aliases every cache buffer to an output: a copy into the loop's state would double the
  cache's memory, at 256k tokens 24.6 GB for the 341M shape."""
  config, model, variables = tiny_model(kind, scan_layers)
  cache = init_cache(config, 1, 96)
  compiled = decode._decode_loop.lower(
    model,
    variables,
    cache,
    jnp.zeros((1,), jnp.int32),
    jnp.full((1,), 40),
    jax.random.PRNGKey(0),
    jnp.full((1,), 4),
    max_new_tokens=4,
    eos_id=2,
    temperature=0.0,
    top_p=1.0,
    return_cells=False,
  ).compile()
  cache_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
  assert compiled.memory_analysis().alias_size_in_bytes == cache_bytes


def test_greedy_generation_follows_the_full_forward_argmax(rng):
  config, model, variables = tiny_model("fs")
  prompt = rng.integers(3, config.vocab_size, (1, 40)).astype(np.int32)
  out = np.asarray(generate(model, variables, prompt, [40], max_new_tokens=8, eos_id=-1, chunk=16))
  sequence = np.concatenate([prompt, out], axis=1)
  logits = np.asarray(jax.jit(model.apply)(variables, jnp.asarray(sequence)))
  np.testing.assert_array_equal(out[0], logits[0, 39:47].argmax(-1))


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  draws = {int(sample(logits, jax.random.PRNGKey(i), temperature=1.0, top_p=0.75)[0]) for i in range(200)}
  assert draws == {0, 1}
  assert int(sample(logits, jax.random.PRNGKey(0))[0]) == 0


def _cache_bytes(cache):
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))


def test_fsl_bounded_cache_size_does_not_grow_with_context():
  config, _, _ = tiny_model("fsl")
  assert _cache_bytes(init_cache(config, 1, 1024)) == _cache_bytes(init_cache(config, 1, 8192))
  # The archive (FS) does grow: the comparison above is not vacuous.
  assert _cache_bytes(init_cache(config, 1, 8192, bounded=False)) > 4 * _cache_bytes(
    init_cache(config, 1, 1024, bounded=False)
  )


@pytest.mark.parametrize("retain_top,retain_recent", [(2, 1), (3, 6)])
def test_fsl_bounded_cache_selects_the_masked_operators_cells_at_every_step(rng, retain_top, retain_recent):
  """300 tokens = 37 cells: most cells are evicted from the pool long before the end. W=6 keeps cells of two
  blocks (4 cells each) in the recent ring, whose first slots a first chunk wrote in bulk (`fill`)."""
  config, model, variables = tiny_model("fsl")
  if (retain_top, retain_recent) != (2, 1):
    attention = dataclasses.replace(config.attention, retain_top=retain_top, retain_recent=retain_recent)
    config = dataclasses.replace(config, attention=attention)
    model = Transformer(config)
  att = config.attention
  seq, prompt = 300, 100
  tokens = _distinct_tokens(rng, config.vocab_size, 2, seq)
  _, captured = jax.jit(lambda v, t: model.apply(v, t, capture_intermediates=True, mutable=["intermediates"]))(
    variables, tokens
  )
  cache = init_cache(config, 2, seq)
  logits, cache = prefill(model, variables, tokens[:, :prompt], jnp.full((2,), prompt), cache, chunk=64)
  selected = {}
  for t in range(prompt, seq):
    _, cache, inter = extend(model, variables, tokens[:, t : t + 1], cache, jnp.full((2, 1), t), jnp.ones((2, 1), bool))
    for layer in range(config.num_layers):
      selected.setdefault(layer, []).append(np.asarray(inter[f"layer_{layer}"]["attention"]["selected_cells"][0]))
  for layer in range(config.num_layers):
    module = captured["intermediates"][f"layer_{layer}"]["attention"]
    q, k = module["q_proj"]["__call__"][0], module["k_proj"]["__call__"][0]
    expected = np.asarray(
      ops.select_cells(
        q,
        k,
        variant="fsl",
        lam=att.lam,
        sigma=att.sigma,
        cell=att.cell,
        block=att.block,
        top_k=att.top_k,
        retain_top=att.retain_top,
        retain_recent=att.retain_recent,
      )
    )[:, prompt:]
    actual = np.concatenate(selected[layer], axis=1)
    as_sets = lambda a: [
      [[set(a[b, i, h][a[b, i, h] >= 0]) for h in range(a.shape[2])] for i in range(a.shape[1])]
      for b in range(a.shape[0])
    ]
    assert as_sets(actual) == as_sets(expected), layer
    assert np.all(expected[:, -1] >= 0)  # late queries really select (K cells available)


def test_generation_returns_the_cells_each_step_selected(rng):
  config, model, variables = tiny_model("fs")
  prompt = _distinct_tokens(rng, config.vocab_size, 1, 90)
  out, cells = generate(model, variables, prompt, [90], max_new_tokens=6, eos_id=-1, chunk=32, return_cells=True)
  assert cells.shape == (1, 6, config.num_layers, config.num_heads, config.attention.top_k)
  cells = np.asarray(cells)
  # Consuming generated token j (position 90 + j, block 2) may read the 8 cells before position 64.
  assert np.all((cells[:, :5] >= 0) & (cells[:, :5] < 8)) and np.all(cells[:, 5] == -1)
  _, scanned, _ = tiny_model("fs", scan_layers=True)
  _, scanned_cells = generate(
    scanned,
    stack_layers(variables, config.num_layers),
    prompt,
    [90],
    max_new_tokens=6,
    eos_id=-1,
    chunk=32,
    return_cells=True,
  )
  np.testing.assert_array_equal(np.asarray(scanned_cells), cells)
  with pytest.raises(ValueError, match="return_cells needs a FreeSolo model"):
    generate(*tiny_model("tfpp")[1:], prompt, [90], max_new_tokens=2, eos_id=-1, return_cells=True)


def test_a_prompts_first_chunk_writes_the_stacked_cache_in_place():
  """Scanned layers, a 64-token first chunk into an 8192-token cache: the compiled chunk aliases every cache
  buffer (donated, updated in place) and its temporaries stay far below one copy of the cache, so no layer's
  cache is sliced out and written back whole. (The later-chunk path of TF++ and ZHA needs temporaries larger
  than the cache here: it materializes the chunk's logits over every cached slot.)"""
  for kind in ("tfpp", "fs", "zha"):
    config, model, variables = tiny_model(kind, scan_layers=True)
    cache = init_cache(config, 1, 8192)
    positions = jnp.arange(64)[None]
    compiled = decode.extend.lower(
      model, variables, jnp.zeros((1, 64), jnp.int32), cache, positions, positions < 50, first_chunk=True
    ).compile()
    cache_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes == cache_bytes, kind
    assert memory.temp_size_in_bytes < cache_bytes / 4, (kind, memory.temp_size_in_bytes, cache_bytes)


@pytest.mark.parametrize(
  "kind,routing,bound",
  [("fsl", dict(retain_top=32, retain_recent=4), 1 / 2), ("swa", dict(window=1024), 1 / 2), ("fsb", {}, 1 / 4)],
)
def test_a_decode_step_reading_its_cache_before_writing_it_updates_the_stack_in_place(kind, routing, bound):
  """Scanned layers (4), one token for 8 rows, through the caches a step reads before it writes (FS-L's bounded
  cache, SWA's ring, FS-B's node tables, whose admission writes each level and the join slots into the tables it
  has just read): the compiled step aliases every cache buffer and its temporaries stay below `bound` of the
  cache, so no layer's stack is copied per token (XLA copies a buffer that is read, then written at indices that
  do not depend on the read; FS-L's step also no longer reorders its pool or shifts its recent cells). FS-B's
  bound is a quarter: its μ stack `[layers, batch, 2·heads, nodes, d]` is 0.28 of this cache (the archive holds
  most of the rest), so a copy of it stays below half."""
  config, _, _ = tiny_model(kind, scan_layers=True)
  config = dataclasses.replace(config, num_layers=4, attention=dataclasses.replace(config.attention, **routing))
  if kind == "fsb":  # FS's variables and a τ, as `tiny_model` builds them: FS-B's `init` runs its forest search
    fs = dataclasses.replace(config, attention=dataclasses.replace(config.attention, kind="fs"))
    variables = with_tau(config, jitted_init(fs), jnp.zeros((4, config.num_heads)))
  else:
    variables = jitted_init(config)
  model, cache = Transformer(config), init_cache(config, 8, 4096)
  compiled = decode.extend.lower(
    model, variables, jnp.zeros((8, 1), jnp.int32), cache, jnp.full((8, 1), 3000), jnp.ones((8, 1), bool)
  ).compile()
  cache_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
  memory = compiled.memory_analysis()
  assert memory.alias_size_in_bytes == cache_bytes
  assert memory.temp_size_in_bytes < cache_bytes * bound, (memory.temp_size_in_bytes, cache_bytes)


@pytest.mark.parametrize("kind", ["fs", "fsl"])
def test_prefill_can_keep_the_logits_of_chosen_positions(rng, kind):
  """`logits_at` `[batch, n]`: the logits at those prompt positions only, in any order, across chunks (what the
  recall evaluation reads at its queries), equal to the full prefill's at those positions."""
  config, model, variables = tiny_model(kind)
  tokens = _distinct_tokens(rng, config.vocab_size, 2, 100)
  lengths = jnp.array([100, 41])
  at = np.array([[99, 3, 40, 64], [0, 40, 31, 32]], np.int32)  # chunk ends, starts and middles; repeats allowed
  full, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32)
  picked, _ = prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32, logits_at=at)
  assert picked.shape == (2, 4, config.vocab_size)
  assert_close(picked, np.take_along_axis(np.asarray(full), at[..., None], axis=1), np.float32)
  with pytest.raises(ValueError, match="logits_at must be"):
    prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32, logits_at=at[0])
  with pytest.raises(ValueError, match="inside each row's prompt"):  # row 1 holds 41 tokens
    prefill(model, variables, tokens, lengths, init_cache(config, 2, SEQ), chunk=32, logits_at=at + [[0], [1]])
