"""`pallas_kernels.matvec` (a decode step's projections, weights read where they lie) against its jnp
specification `matvec_reference`, on fresh random inputs (interpreted on CPU, compiled on a GPU), and a model's
decode steps through it against the same steps through `nn.Dense`."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import partial_eval

from fsjax.cache import init_cache
from fsjax.decode import extend, prefill
from fsjax.model import Transformer
from pallas_kernels import matvec

from helpers import assert_close, jitted_init, kernel_modes, tiny_model

# (rows, K, widths of the weights sharing x, tiles or None for `tiling`'s): one row and a few (elementwise), 4 and
# 16 (tl.dot over 16 padded rows), K of 22 tiles of 16 (2816 / 128, the 341M shape's W_down scaled down), several
# weights of different widths in one launch, contraction splits with more than one step each.
CASES = [
  (1, 352, (128,), None),
  (3, 96, (48, 80, 16), None),
  (1, 256, (64, 32), (32, 32, 2)),
  (4, 160, (96,), (32, 32, 1)),
  (16, 64, (16, 48), (16, 16, 2)),
  (7, 512, (32,), (64, 32, 4)),
]


def _inputs(rng, rows, k, widths, dtype, layers=3):
  x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
  stacks = [jnp.asarray(rng.standard_normal((layers, k, n)) / np.sqrt(k), dtype) for n in widths]
  return x, stacks


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("rows,k,widths,tiles", CASES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_products_equal_the_reference_at_a_layer_of_the_stacks(rng, interpret, rows, k, widths, tiles, dtype):
  x, stacks = _inputs(rng, rows, k, widths, dtype)
  layer = jnp.int32(rng.integers(0, 3))
  got = jax.jit(lambda x, w, i: matvec.matvec(x, w, layer=i, tiles=tiles, interpret=interpret))(x, stacks, layer)
  want = matvec.matvec_reference(x, stacks, layer=layer)
  assert len(got) == len(widths)
  for g, w, n in zip(got, want, widths):
    assert g.shape == (rows, n) and g.dtype == jnp.float32
    assert_close(g, w, np.float32)  # bfloat16 products are exact in float32: only the order of the sums differs


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("rows,k,widths,tiles", [CASES[0], CASES[1], CASES[3], CASES[5]])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_an_rms_norm_in_the_prologue_equals_flaxs_before_the_products(rng, interpret, rows, k, widths, tiles, dtype):
  """`norm_scale`: each row RMS-normed over all K features (every split reads its rows whole) with the layer's
  scale, as `nn.RMSNorm` computes it from the float32 input, then multiplied in `dtype`."""
  x, stacks = _inputs(rng, rows, k, widths, dtype)
  x = x.astype(np.float32) * jnp.asarray(rng.uniform(0.1, 10.0, (rows, 1)), np.float32)  # rows of other scales
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (3, k)), jnp.bfloat16)
  layer = jnp.int32(rng.integers(0, 3))
  run = lambda x, w, s, i: matvec.matvec(
    x, w, layer=i, dtype=dtype, norm_scale=s, norm_eps=1e-5, tiles=tiles, interpret=interpret
  )
  got = jax.jit(run)(x, stacks, scale, layer)
  normed = nn.RMSNorm(epsilon=1e-5, dtype=dtype).apply({"params": {"scale": scale[layer]}}, x)
  want = matvec.matvec_reference(normed, stacks, layer=layer, dtype=dtype)
  for g, w in zip(got, want):
    assert_close(g, w, dtype)  # the norm's sums run in another order: bfloat16 inputs may round differently


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_swiglus_down_projection_reads_the_gate_up_launchs_partial_sums(rng, interpret, rows, dtype):
  """A gate/up launch with `partial_sums` returns the unsummed splits (their sum is its products), and a `gated`
  down launch multiplies `nn.silu(gate) * up` formed from them: the MLP of a decode step in two launches. The
  gate/up contraction is split in 4 and the down one in 3 (of two steps each), so each down program reads its own
  features of the hidden vector from every split; 1 and 3 rows take the elementwise path, 5 the tl.dot one."""
  d, hidden = 64, 96
  x, (gate, up) = _inputs(rng, rows, d, (hidden, hidden), dtype)
  (down,) = _inputs(rng, rows, hidden, (d,), dtype)[1]
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (3, d)), jnp.bfloat16)
  layer = jnp.int32(rng.integers(0, 3))

  def mlp(x, gate, up, down, scale, layer):
    common = dict(layer=layer, dtype=dtype, interpret=interpret)
    partials = matvec.matvec(x, [gate, up], norm_scale=scale, tiles=(16, 32, 4), partial_sums=True, **common)
    return partials, matvec.matvec(partials, [down], gated=True, tiles=(16, 16, 3), **common)[0]

  partials, got = jax.jit(mlp)(x, gate, up, down, scale, layer)
  assert partials.shape == (4, rows, 2 * hidden) and partials.dtype == jnp.float32
  sums = matvec.matvec_reference(x, [gate, up], layer=layer, dtype=dtype, norm_scale=scale)
  assert_close(jnp.sum(partials, axis=0), jnp.concatenate(sums, axis=-1), dtype)
  gate_sum, up_sum = (s.astype(dtype) for s in sums)
  (want,) = matvec.matvec_reference(jax.nn.silu(gate_sum) * up_sum, [down], layer=layer, dtype=dtype)
  assert_close(got, want, dtype)
  (spec,) = matvec.matvec_reference(partials, [down], layer=layer, dtype=dtype, gated=True)
  assert_close(got, spec, dtype)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_plain_matrices_and_a_product_dtype_below_the_inputs(rng, interpret):
  """Without a layer the weights are plain matrices; `dtype` rounds float32 inputs to bfloat16 first, as
  `nn.Dense(dtype=bfloat16)` does with float32 parameters."""
  x, (w,) = _inputs(rng, 2, 128, (64,), np.float32, layers=1)
  (got,) = matvec.matvec(x, [w[0]], dtype=jnp.bfloat16, interpret=interpret)
  (want,) = matvec.matvec_reference(x, [w[0]], dtype=jnp.bfloat16)
  assert_close(got, want, np.float32)
  assert not np.allclose(np.asarray(got), np.asarray(x @ w[0]), rtol=1e-5, atol=0)  # the rounding happened


def test_tiling_splits_the_contraction_until_the_grid_fills_the_gpu():
  block_k, block_n, splits = matvec.tiling(1, 2816, (1024,))
  assert (block_k, block_n) == (128, 64) and 2816 % (block_k * splits) == 0
  assert 1024 // block_n * splits >= matvec.TARGET_PROGRAMS
  assert matvec.tiling(16, 1024, (1024, 256, 256))[0] == 256  # the tl.dot path's deeper tiles
  assert matvec.tiling(1, 48, (80,)) == (16, 16, 3)  # every split where even all are too few programs


@pytest.mark.parametrize(
  "rows,k,widths,tiles,message",
  [
    (17, 64, (32,), None, "1..16 rows"),
    (1, 72, (32,), None, "multiples of 16"),
    (1, 64, (40,), None, "multiples of 16"),
    (1, 64, (32,), (32, 32, 4), "must divide"),
  ],
)
def test_rejects_what_it_cannot_tile(rng, rows, k, widths, tiles, message):
  x, stacks = _inputs(rng, rows, k, widths, np.float32)
  with pytest.raises(ValueError, match=message):
    matvec.matvec(x, stacks, layer=0, tiles=tiles, interpret=True)


def test_a_gated_input_is_a_gate_up_launchs_partial_sums(rng):
  x, stacks = _inputs(rng, 1, 64, (32,), np.float32)
  with pytest.raises(ValueError, match="partial sums"):
    matvec.matvec(x, stacks, layer=0, gated=True, interpret=True)  # [rows, K], not [S, rows, 2K]
  partials = jnp.zeros((2, 1, 128), jnp.float32)
  with pytest.raises(ValueError, match="without a norm"):
    matvec.matvec(partials, stacks, layer=0, gated=True, norm_scale=jnp.ones((3, 64)), interpret=True)


def test_weights_must_share_the_contraction(rng):
  x, stacks = _inputs(rng, 1, 64, (32,), np.float32)
  with pytest.raises(ValueError, match="x's 64 rows"):
    matvec.matvec(x, [stacks[0], jnp.zeros((3, 32, 32))], layer=0, interpret=True)


def test_a_call_whose_outputs_are_unused_is_dead_code(rng):
  """Inside `nn.scan`, flax's constancy check traces the body and eliminates dead code. Any kernel call left over
  counts as a dependence of the broadcast outputs on the carry (the GPU machine's flax raises "broadcasted variable
  has a data dependency on the scan body"). A bare `pallas_call` is never eliminated; the jitted launcher is."""
  x, (w,) = _inputs(rng, 1, 64, (32,), np.float32)
  jaxpr = jax.make_jaxpr(lambda x, w: (matvec.matvec(x, [w], layer=0, interpret=True), x.sum())[1])(x, w).jaxpr
  live, _ = partial_eval.dce_jaxpr(jaxpr, [True])
  assert len(jaxpr.eqns) > 1  # the kernel's call was traced
  assert [e.primitive.name for e in live.eqns] == ["reduce_sum"]


def _with_impl(config, impl):
  return dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl))


def _with_hf_options(config, rng):
  """`config` with grouped key/value heads, q/k biases and q/k norms, and variables whose biases are random (they
  start at zero)."""
  config = dataclasses.replace(config, num_kv_heads=2, qk_norm=True, qkv_bias=True)
  randomize = lambda path, x: jnp.asarray(rng.standard_normal(x.shape), x.dtype) if path[-1].key == "bias" else x
  return config, jax.tree_util.tree_map_with_path(randomize, jitted_init(config))


def _random_norm_scales(variables, rng):
  """Every RMSNorm's scale random (they start at one), so that a norm read from the wrong module or layer shows."""
  randomize = lambda path, x: x * jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype) if path[-1].key == "scale" else x
  return jax.tree_util.tree_map_with_path(randomize, variables)


@pytest.mark.parametrize(
  "scan_layers,options",
  [(True, None), (False, "short-conv"), (True, "hf")],
  ids=["scanned", "unrolled-short-conv", "hf-options"],
)
def test_decode_steps_through_the_kernel_equal_those_through_dense(rng, monkeypatch, scan_layers, options):
  """The tiny TF++ model, two rows prefilled to different lengths: one-token steps (2 rows: elementwise) and a
  two-token chunk (4 rows: tl.dot) with `impl="pallas"` give the logits of `impl="reference"`, and every
  projection went through the kernel, a scanned model's as whole stacks read at the layer index, W_q/W_k/W_v and
  W_gate/W_up normalizing their input in the prologue. With the Hugging Face options
  (`fsjax.attention.projections`), the biases are added to the kernel's products; with a short convolution
  between the norm and W_q/W_k/W_v, the attention's norm stays in XLA."""
  config, _, variables = tiny_model("tfpp", scan_layers=scan_layers)
  if options == "hf":
    config, variables = _with_hf_options(config, rng)
  if options == "short-conv":
    config = dataclasses.replace(config, short_conv=3)
    variables = jitted_init(config)
  variables = _random_norm_scales(variables, rng)
  calls, original = [], matvec.matvec

  def record(x, w, **kw):
    rows = x.shape[1] if kw.get("gated") else x.shape[0]
    calls.append((rows, tuple(m.shape for m in w), kw["layer"], kw.get("norm_scale") is not None, kw.get("gated")))
    return original(x, w, **kw)

  monkeypatch.setattr(matvec, "matvec", record)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 48)), jnp.int32)
  lengths = jnp.array([37, 30])
  reference = Transformer(_with_impl(config, "reference"))
  _, prefilled = prefill(reference, variables, tokens, lengths, init_cache(config, 2, 64), chunk=32)
  assert not calls
  results = {}
  for impl in ("reference", "pallas"):
    model, cache, logits = Transformer(_with_impl(config, impl)), jax.tree_util.tree_map(jnp.copy, prefilled), []
    for width in (1, 1, 2):
      at = lengths[:, None] + len(logits) + jnp.arange(width)
      step, cache, _ = extend(model, variables, jnp.take_along_axis(tokens, at, 1), cache, at, at >= 0)
      logits.extend(np.moveaxis(np.asarray(step), 1, 0))
    results[impl] = logits
  for got, want in zip(results["pallas"], results["reference"]):
    assert_close(got, want, np.float32)
  d, hidden, heads = config.d_model, config.ffn_hidden_size, config.num_heads * config.head_dim
  kv = (config.num_kv_heads or config.num_heads) * config.head_dim
  qkv = ((d, heads), (d, kv), (d, kv))
  products = {  # SwiGLU's down projection reads the gate/up launch's partial sums
    (qkv, options != "short-conv", None),
    (((heads, d),), False, None),
    (((d, hidden), (d, hidden)), True, None),
    (((hidden, d),), False, True),
  }
  assert {rows for rows, *_ in calls} == {2, 4}  # the elementwise path and the tl.dot one
  assert {(tuple(shape[-2:] for shape in shapes), normed, gated) for _, shapes, _, normed, gated in calls} == products
  for _, shapes, layer, *_ in calls:  # a scanned model's weights as whole stacks, read at the layer index
    assert (layer is not None) == scan_layers
    assert all(len(shape) == 3 and shape[0] == config.num_layers for shape in shapes) == scan_layers
