"""The model options of Hugging Face Llama 3 / Qwen2.5 / Qwen3 checkpoints (grouped-query attention, q/k RMSNorm,
q/k/v biases, partial and Llama 3-scaled RoPE): the parameter layout converters write, one layer against a
float64 forward written by hand, prefill + decode against the full forward, and defaults that change nothing."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import kinds
from fsjax.cache import init_cache
from fsjax.config import AttentionConfig, RoPEScalingConfig, model_preset
from fsjax.model import Transformer, init_variables

from brute_force import hf_apply_rope
from helpers import assert_close, jitted_init, ragged_teacher_forced, tiny_model

# Rotating 8 of 16 features with θ = 10^4 gives wavelengths of 6, 63, 628 and 6283 tokens: against an original
# context of 1,024 (bands at 256 and 1,024 tokens) one frequency keeps its value, one is blended, one divided.
SCALING = RoPEScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=1024)  # fmt: skip


def _options(config, num_kv_heads=2):
  """`config` (the tiny preset: 4 heads of 16) with every option: 2 key/value heads (the kinds that take them),
  q/k RMSNorm, q/k/v biases, half the features rotated with Llama 3 scaling."""
  attention = dataclasses.replace(config.attention, rope_fraction=0.5, rope_scaling=SCALING)
  kv_heads = num_kv_heads if kinds.get(config.attention.kind).grouped_kv else None
  return dataclasses.replace(config, num_kv_heads=kv_heads, qk_norm=True, qkv_bias=True, attention=attention)


def _perturbed(variables, seed=1):
  """Biases and q/k norm gains away from their initial 0 and 1, so a path that skipped them would show."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = []
  for (path, leaf), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    noise = jax.random.normal(key, leaf.shape, leaf.dtype)
    if name.endswith("['bias']"):
      leaf = leaf + 0.5 * noise
    elif "_norm']['scale']" in name and ("q_norm" in name or "k_norm" in name):
      leaf = leaf + 0.3 * noise
    out.append(leaf)
  return jax.tree_util.tree_unflatten(tree, out)


@functools.lru_cache(maxsize=None)
def _model(kind, scan_layers=False):
  config, _, _ = tiny_model(kind)
  config = _options(dataclasses.replace(config, scan_layers=scan_layers))
  return config, Transformer(config), _perturbed(jitted_init(config))


def _attention_params(variables):
  return jax.tree_util.tree_map(lambda x: x.shape, variables["params"]["layer_0"]["attention"])


def test_the_attention_parameters_have_the_layout_converters_write():
  config, _, variables = _model("tfpp")
  assert _attention_params(variables) == {
    "q_proj": {"kernel": (64, 4, 16), "bias": (4, 16)},
    "k_proj": {"kernel": (64, 2, 16), "bias": (2, 16)},
    "v_proj": {"kernel": (64, 2, 16), "bias": (2, 16)},
    "o_proj": {"kernel": (4, 16, 64)},
    "q_norm": {"scale": (16,)},
    "k_norm": {"scale": (16,)},
  }
  config = model_preset("tiny", kind="fs", qk_norm=True, qkv_bias=True)
  fs = _attention_params(jax.eval_shape(lambda: init_variables(config, jax.random.PRNGKey(0))))
  assert fs["k_proj"] == {"kernel": (64, 4, 16), "bias": (4, 16)} and fs["k_norm"] == {"scale": (16,)}


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def _one_layer_by_hand(params, tokens, config):
  """The float64 forward of a one-layer TF++ model with every option, written from the Llama / Qwen3 recipe."""
  p = jax.tree_util.tree_map(np.asarray, params)
  layer, att, eps = p["layer_0"], p["layer_0"]["attention"], config.norm_eps
  seq, heads, kv_heads, dim = tokens.shape[1], config.num_heads, config.num_kv_heads, config.head_dim
  x = p["embed"]["embedding"][tokens]  # [batch, seq, d_model]
  h = _rms(x, layer["attention_norm"]["scale"], eps)
  q, k, v = (np.einsum("btm,mhd->bthd", h, att[n]["kernel"]) + att[n]["bias"] for n in ("q_proj", "k_proj", "v_proj"))
  q, k = _rms(q, att["q_norm"]["scale"], eps), _rms(k, att["k_norm"]["scale"], eps)
  rope = dict(theta=config.attention.rope_theta, rotary_dim=dim // 2, scaling=SCALING)
  positions = np.arange(seq, dtype=np.float64)
  q, k = hf_apply_rope(q, positions, **rope), hf_apply_rope(k, positions, **rope)
  o = np.zeros_like(q)
  for head in range(heads):
    kv = head // (heads // kv_heads)  # Hugging Face's repeat_kv
    logits = np.einsum("bid,bjd->bij", q[:, :, head], k[:, :, kv]) / math.sqrt(dim)
    logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    o[:, :, head] = np.einsum("bij,bjd->bid", weights / weights.sum(-1, keepdims=True), v[:, :, kv])
  x = x + np.einsum("bthd,hdm->btm", o, att["o_proj"]["kernel"])
  m = _rms(x, layer["mlp_norm"]["scale"], eps)
  gate, up = m @ layer["mlp"]["gate"]["kernel"], m @ layer["mlp"]["up"]["kernel"]
  x = x + (gate / (1 + np.exp(-gate)) * up) @ layer["mlp"]["down"]["kernel"]
  return _rms(x, p["final_norm"]["scale"], eps) @ p["embed"]["embedding"].T


def test_one_layer_with_every_option_equals_a_float64_forward_by_hand(rng):
  config = _options(
    model_preset("tiny", kind="tfpp", num_layers=1, dtype="float64", param_dtype="float64", norm_eps=1e-5)
  )
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 40)))
  with jax.enable_x64(True):
    variables = _perturbed(jitted_init(config, 40))  # init and forward jitted: op by op was slower
    logits = np.asarray(jax.jit(Transformer(config).apply)(variables, tokens), np.float64)
    expected = _one_layer_by_hand(variables["params"], np.asarray(tokens), config)
  # The model returns float32 logits (fsjax.model.Transformer): a float32 tolerance on float64 maths.
  assert_close(logits, expected, np.float32)


@pytest.mark.parametrize(
  "kind,scan_layers",
  [("tfpp", False), ("tfpp", True), ("swa", False), ("moba", False), ("fsl", False), ("zha", False)],
)
def test_prefill_and_decode_with_every_option_equal_the_full_forward(rng, kind, scan_layers):
  """Ragged rows of 70 and 45 prompt tokens in 32-token chunks (both end mid-chunk), then 12 decoded tokens.
  Every kind reads 2 key/value heads per 4 query heads: its cache holds 2 (ZHA's trees, FS-L's ring)."""
  config, model, variables = _model(kind, scan_layers)
  assert kinds.get(kind).grouped_kv
  layer = init_cache(config, 1, 8)["layers" if scan_layers else "layer_0"]
  store = {"zha": lambda: layer.store, "fsl": lambda: layer.ring}.get(kind, lambda: layer)()
  assert store.k.shape[-2] == config.num_kv_heads == 2
  tokens = jnp.asarray(np.stack([rng.permutation(config.vocab_size)[:82] for _ in range(2)]))
  full = np.asarray(jax.jit(model.apply)(variables, tokens))
  for row, got in enumerate(ragged_teacher_forced(model, variables, tokens, [70, 45], 12, chunk=32)):
    assert_close(got, full[row, : len(got)], np.float32, scale=5)


# Logits of the tiny models (`helpers.tiny_model`, PRNGKey(0)) before these options existed, for the first 100
# tokens of `np.random.default_rng(0).permutation(512)` (row 0): at position 99, features 0-5.
LOGITS_BEFORE = {
  "fs": [-0.09015701711177826, 0.2601769268512726, -0.1424255520105362, -0.16183167695999146, -0.03370409086346626,
         0.045542776584625244],
  "tfpp": [0.0561043955385685, 0.2900640070438385, -0.011595688760280609, -0.17379070818424225, 0.10164076834917068,
           -0.04584939405322075],
  "zha": [-0.07106951624155045, 0.07327763736248016, 0.13567660748958588, 0.08420313894748688, 0.16064323484897614,
          0.0929652601480484],
}  # fmt: skip
# Sum of |parameter| over each model's params, before the options existed.
ABS_PARAMS_BEFORE = {"fs": 12677.091242955437, "tfpp": 12637.091242955437, "zha": 12645.195098389195}


@pytest.mark.parametrize("kind", ["fs", "tfpp", "zha"])
def test_default_models_are_unchanged(kind):
  """One kind of each family: the attention parameters are the four projections (and the family's own), no
  option adds any, and parameters and logits equal those recorded before the options existed (checked bit for
  bit on the CPU when they were added; held here to float32 rounding, which other machines may differ by)."""
  config, model, variables = tiny_model(kind)
  own = {"fs": {"alpha", "lr_gain"}, "tfpp": set(), "zha": {"ref_queries"}}[kind]
  assert set(variables["params"]["layer_0"]["attention"]) == {"q_proj", "k_proj", "v_proj", "o_proj"} | own
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    assert set(variables["params"]["layer_0"]["attention"][name]) == {"kernel"}
  total = sum(float(np.abs(np.asarray(x, np.float64)).sum()) for x in jax.tree_util.tree_leaves(variables["params"]))
  np.testing.assert_allclose(total, ABS_PARAMS_BEFORE[kind], rtol=1e-9)
  tokens = jnp.asarray(np.random.default_rng(0).permutation(config.vocab_size)[:100])[None]
  logits = np.asarray(jax.jit(model.apply)(variables, tokens))[0, -1, :6]
  np.testing.assert_allclose(logits, LOGITS_BEFORE[kind], rtol=1e-5, atol=1e-6)
  assert config.attention.rope == AttentionConfig(rope_theta=config.attention.rope_theta).rope
