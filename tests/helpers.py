"""Shared by all tests: the one tolerance table, the closeness helper, random inputs and the tiny model."""

import dataclasses
import functools
import zlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import calibrate, compaction, loading
from fsjax.cache import init_cache
from fsjax.config import MoBAConfig, ZHAConfig, model_preset
from fsjax.decode import extend, prefill
from fsjax.model import Transformer, init_variables
from fsjax.ops import query_blocks

# RMS-relative tolerance per dtype of the computation under test.
TOLERANCE = {
  jnp.dtype(jnp.float64): 1e-10,
  jnp.dtype(jnp.float32): 2e-5,
  jnp.dtype(jnp.bfloat16): 2e-2,
}


# The micro ZHA of the distillation tests (conftest's MICRO_CONFIG with these overrides) and its KL schedule.
ZHA_MICRO = [
  "model.attention.kind=zha",
  "model.attention.zha.refs=4",
  "model.attention.zha.chunk=4",
  "model.attention.zha.levels=2",
  "model.attention.zha.top_p=0.8",
]
DISTILL = [
  "train.objective=zha_kl",
  "train.steps=12",
  "train.learning_rate=3.2e-2",
  "train.lr_floor=3.2e-4",
  "train.warmup_steps=2",
  "train.schedule=wsd",
  "train.decay_steps=12",
  "train.weight_decay=0.0",
  "checkpoint.every=12",
  "checkpoint.async_save=false",
]


def assert_close(actual, expected, dtype, scale=1.0):
  """Asserts `rms(actual - expected) <= tol * rms(expected)` and `max|diff| <= 10 tol max|expected|`.

  `dtype` picks the tolerance; `scale` widens it (a reviewed decision, keep it rare).
  """
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), "non-finite values"
  tol = TOLERANCE[jnp.dtype(dtype)] * scale
  diff = actual - expected
  rms_ref = max(np.sqrt(np.mean(expected**2)), 1e-30)
  rms_err = np.sqrt(np.mean(diff**2))
  assert rms_err <= tol * rms_ref, f"RMS error {rms_err:.3g} > {tol:.1g} * RMS {rms_ref:.3g}"
  max_err = np.max(np.abs(diff)) if diff.size else 0.0
  max_ref = max(np.max(np.abs(expected)) if diff.size else 0.0, 1e-30)
  assert max_err <= 10 * tol * max_ref, f"max error {max_err:.3g} > {10 * tol:.1g} * max {max_ref:.3g}"


def seeded_rng(name):
  """A NumPy generator with a fixed seed derived from `name` (stable across processes)."""
  return np.random.default_rng(zlib.crc32(name.encode()))


def random_qkv(rng, shape, dtype=np.float64):
  """Three independent standard-normal arrays of `shape` [batch, seq, heads, head_dim]."""
  return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def kernel_modes():
  """Pallas run modes for kernel tests: interpreted everywhere (CI), compiled only where a GPU exists."""
  compiled = pytest.param(
    False, id="compiled", marks=pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
  )
  return [pytest.param(True, id="interpret"), compiled]


def assert_same_cells(actual, expected, scores, atol):
  """Selected-cell sets per query are equal, forgiving only swaps between cells whose reference scores tie
  within `atol` (float rounding of one score formula computed in two orders).

  Args:
    actual, expected: `[batch, T, heads, K]` int cell indices, -1 for none.
    scores: `[batch, T, heads, M]` reference scores (masked cells arbitrary).
  """
  actual, expected, scores = np.asarray(actual), np.asarray(expected), np.asarray(scores, np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  np.testing.assert_array_equal(actual >= 0, expected >= 0, err_msg="different numbers of selected cells")
  for where in zip(*np.nonzero(np.any(np.sort(actual, -1) != np.sort(expected, -1), axis=-1))):
    got, want = set(actual[where]) - {-1}, set(expected[where]) - {-1}
    extra = np.array(sorted(got - want))
    missing = np.array(sorted(want - got))
    gap = np.max(np.abs(scores[where][extra][:, None] - scores[where][missing][None, :]))
    assert gap <= atol, f"query {where}: got {sorted(got)}, want {sorted(want)} (score gap {gap:.3g})"


def stack_layers(variables, num_layers):
  """Unrolled variables (`layer_i`) in the `scan_layers` layout (`layers/layer`, stacked on axis 0)."""
  stacked = {}
  for collection, tree in variables.items():
    rest = {name: value for name, value in tree.items() if not name.startswith("layer_")}
    layers = [tree[f"layer_{i}"] for i in range(num_layers)]
    stacked[collection] = {**rest, "layers": {"layer": jax.tree_util.tree_map(lambda *x: jnp.stack(x), *layers)}}
  return stacked


@functools.lru_cache(maxsize=None)
def tiny_model(kind, scan_layers=False, cell=8):
  """The tiny model; `cell=16` gives a geometry the compiled kernels accept (Triton tiles need cell >= 16).
  Shared by the tests that ask for the same one (nothing here mutates it)."""
  config = model_preset("tiny", kind=kind, scan_layers=scan_layers)
  config = dataclasses.replace(
    config,
    attention=dataclasses.replace(
      config.attention,
      window=40,
      cell=cell,
      retain_top=2,
      retain_recent=1,
      moba=MoBAConfig(block=32, top_k=2),
      zha=ZHAConfig(refs=4, chunk=4, top_p=(0.8,)),
    ),
  )
  if kind == "fsb":
    # The FS model's variables are FS-B's bit for bit but τ (`init` would run FS-B's forest search eagerly just to
    # build the same arrays); τ as `python -m fsjax.calibrate` finds it, from the FS model's cell norms: both
    # forests hold cells.
    _, fs, variables = tiny_model("fs", scan_layers, cell)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 128), 0, config.vocab_size)
    variables = loading.with_tau(config, variables, calibrate.calibrate(fs, variables, [tokens]))
  else:
    variables = jitted_init(config)
  return config, Transformer(config), variables


def decode_with_both_impls(config, variables, rng, *, steps=12):
  """The tiny scanned model `config` with its α, readout gain, λ and σ drawn per layer and head (as a trained
  model's are), prefilled by the reference from one cache (two rows at different positions), then `steps`
  one-token steps configured "reference" and "pallas": `{impl: [(logits, selected cells) per step]}`."""
  scaled = lambda tree: jax.tree_util.tree_map(lambda x: x * jnp.asarray(rng.uniform(0.5, 2.0, x.shape), x.dtype), tree)
  layer = variables["params"]["layers"]["layer"]
  attention = {**layer["attention"], **scaled({name: layer["attention"][name] for name in ("alpha", "lr_gain")})}
  params = {**variables["params"], "layers": {"layer": {**layer, "attention": attention}}}
  variables = {**variables, "params": params, "routing": scaled(variables["routing"])}
  configs = {
    impl: dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl))
    for impl in ("reference", "pallas")
  }
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 100)), jnp.int32)
  lengths = jnp.array([86, 75])
  reference = Transformer(configs["reference"])
  _, prefilled = prefill(reference, variables, tokens, lengths, init_cache(config, 2, 128), chunk=32)
  results = {}
  for impl, step_config in configs.items():
    cache, results[impl] = jax.tree_util.tree_map(jnp.copy, prefilled), []
    for t in range(steps):
      at = lengths[:, None] + t
      token = jnp.take_along_axis(tokens, at, axis=1)
      logits, cache, inter = extend(Transformer(step_config), variables, token, cache, at, jnp.ones((2, 1), bool))
      results[impl].append((logits, inter["layers"]["layer"]["attention"]["selected_cells"][0]))
  return results


def jitted_init(config, seq_len=64):
  """`init_variables(config, PRNGKey(0), seq_len)` compiled as one program: `init` runs the model's forward pass,
  which op by op took several seconds per tiny model, more than compiling it."""
  return jax.jit(init_variables, static_argnums=(0, 2))(config, jax.random.PRNGKey(0), seq_len)


def ragged_teacher_forced(model, variables, tokens, lengths, steps, chunk):
  """Each row's logits at positions `[0, length + steps)`: its prompt prefilled in chunks (the last one cut
  mid-chunk), then `steps` one-token decode steps at the row's own positions."""
  batch = tokens.shape[0]
  lengths = jnp.asarray(lengths)
  cache = init_cache(model.config, batch, tokens.shape[1])
  logits, cache = prefill(model, variables, tokens[:, : int(lengths.max())], lengths, cache, chunk)
  rows = [[np.asarray(logits[row, :n])] for row, n in enumerate(lengths.tolist())]
  for t in range(steps):
    positions = (lengths + t)[:, None]
    step, cache, _ = extend(
      model, variables, jnp.take_along_axis(tokens, positions, 1), cache, positions, jnp.ones((batch, 1), bool)
    )
    for row in range(batch):
      rows[row].append(np.asarray(step[row]))
  return [np.concatenate(parts) for parts in rows]


def gradient_temporaries(loss, *shapes, argnums=0):
  """Bytes of temporaries XLA assigns the compiled value and gradient of `jnp.sum(loss(*args))` for arguments of
  `shapes` (`jax.ShapeDtypeStruct`s; compiled, not run)."""
  grad = jax.value_and_grad(lambda *args: jnp.sum(loss(*args)), argnums=argnums)
  return jax.jit(grad).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def pallas_call_input_shapes(jaxpr):
  """The shapes of every array a `pallas_call` in `jaxpr` (or in a jaxpr it calls) is handed: a kernel reading an
  array where it lies is handed that array's shape, not a slice's or a padded copy's."""
  shapes = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      shapes += [tuple(v.aval.shape) for v in eqn.invars]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes += pallas_call_input_shapes(sub)
  return shapes


def spy(monkeypatch, module, name):
  """`module.name` replaced by a wrapper that records each call: the list the calls go to."""
  calls, original = [], getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
  return calls


def assert_blocked_model_equals_reference(monkeypatch, config, tokens, module, name):
  """A model configured "auto", with the query-block budget shrunk to blocks of 16 of `tokens`' queries, runs the
  blocked form `module.name`, and its loss (mean log-partition of the logits) and gradient equal those of the
  same model configured "reference"."""

  def loss_and_grad(impl):
    configured = dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl))
    model = Transformer(configured)
    variables = jitted_init(configured, 32)
    loss = lambda p: jnp.mean(jax.nn.logsumexp(model.apply({**variables, "params": p}, tokens), axis=-1))
    return jax.jit(jax.value_and_grad(loss))(variables["params"])

  expected = loss_and_grad("reference")
  monkeypatch.setattr(query_blocks, "BLOCK_BYTES", tokens.shape[0] * config.num_heads * 16 * tokens.shape[1] * 4)
  calls = spy(monkeypatch, module, name)
  actual = loss_and_grad("auto")
  assert calls, f"{module.__name__}.{name} was not called"
  for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
    assert float(jnp.max(jnp.abs(a - e))) <= 2e-6 * max(float(jnp.max(jnp.abs(e))), 1e-30)


def record_batch_sizes(monkeypatch):
  """The batch sizes `fsjax.compaction` runs the decode loop on, in order (a list filled as it runs)."""
  sizes, resume = [], compaction.resume
  monkeypatch.setattr(
    compaction, "resume", lambda m, v, state, *a, **k: sizes.append(len(state.token)) or resume(m, v, state, *a, **k)
  )
  return sizes
