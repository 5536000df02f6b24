"""LLaMA-style decoder (FS Sec. 3.1, App. A): pre-RMSNorm, attention chosen by config, SwiGLU, optional tied
embeddings.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from fsjax import kinds, short_conv
from fsjax.attention.freesolo import ROUTING
from fsjax.attention.projections import QKV, Projection
from fsjax.cache import (
  advance_forests,
  defer_block_merges,
  layer_of,
  merge_deferred_blocks,
  release_forests,
  write_back,
)
from fsjax.config import ModelConfig
from fsjax.layer_weights import LayerWeights, Prenorm, child, dense_products, gated_products, runs_kernel
from fsjax.reference.common import compute_dtype
from fsjax.reference.rope import rotary_table

EMBED_INIT_STD = 0.02  # keeps tied-embedding logits O(1) at init (LLaMA's choice)


def make_attention(config: ModelConfig, name=None):
  """The attention module of `config.attention.kind`, built by its entry in `fsjax.kinds`."""
  att = config.attention
  projection = Projection(
    num_kv_heads=config.num_kv_heads, qk_norm=config.qk_norm, qkv_bias=config.qkv_bias, norm_eps=config.norm_eps
  )
  return kinds.get(att.kind).module(
    att,
    num_heads=config.num_heads,
    head_dim=config.head_dim,
    rope_theta=att.rope,
    projection=projection,
    dtype=jnp.dtype(config.dtype),
    param_dtype=jnp.dtype(config.param_dtype),
    name=name,
  )


GATE_UP = ("gate", "up")


class SwiGLU(nn.Module):
  """`x [.., d_model]` → `W_down(silu(W_gate x) * W_up x)`. `weights`: the module's
  `fsjax.layer_weights.LayerWeights` at a decode step (the products then read the weights where they lie; x
  arrives unnormed where they carry a prenorm)."""

  hidden: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, weights=None):
    dense = lambda features, name: nn.Dense(
      features, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name=name
    )
    fused = gated_products(weights, x, GATE_UP, "down", self.dtype)
    if fused is not None:
      return fused
    gate_up = dense_products(weights, x, GATE_UP, 1, self.dtype, normed_input=True)
    gate, up = gate_up if gate_up is not None else (dense(self.hidden, "gate")(x), dense(self.hidden, "up")(x))
    h = nn.silu(gate) * up
    down = dense_products(weights, h, ("down",), 1, self.dtype)
    return down[0] if down is not None else dense(x.shape[-1], "down")(h)


class DecoderLayer(nn.Module):
  """`x + attention(RMSNorm(x))`, then `x + SwiGLU(RMSNorm(x))`; with a cache, returns `(x, new_cache, history)`.

  With `config.short_conv` (a kernel of k ≥ 2 taps) the attention reads `fsjax.short_conv.causal_conv` of its
  normed input (parameter `short_conv` `[k, d_model]`); decoding then passes each layer's `history`
  `[batch, k - 1, d_model]`, its last inputs before the chunk, and gets the next one back (None without it).

  `first_chunk`: the cache is empty and the chunk starts at position 0 in every row (a prompt's first chunk),
  so attention runs the training operator over the chunk and writes the cache in bulk.

  `weights`: with a cache, this layer's `fsjax.layer_weights.LayerWeights` (a scanned model's parameter stacks
  and the layer's index, or an unscanned layer's own parameters), through which a step of a few rows reads each
  projection's weights where they lie. `rope_table`: a one-token step's `fsjax.reference.rope.RotaryTable`, made
  once for all layers (None: the attention makes its own).
  """

  config: ModelConfig
  first_chunk: bool = False

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None, history=None, weights=None, rope_table=None):
    c = self.config
    norm = lambda name: nn.RMSNorm(epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name=name)

    def normed(name, x, module, products):
      """`(the input of `module`, its weights)`: RMSNorm(x), or x itself where the products of a step's
      matrix-vector kernel normalize it in their prologue (`fsjax.layer_weights.Prenorm`)."""
      reader = child(weights, module)
      if reader is None or (module == "attention" and c.short_conv) or not runs_kernel(reader, x.shape, products):
        return norm(name)(x), reader
      return x, reader.replace(prenorm=Prenorm(weights.params[name]["scale"], c.norm_eps))

    attention = make_attention(c, name="attention")
    h, attention_weights = normed("attention_norm", x, "attention", QKV)
    if c.short_conv:
      init = lambda _, shape: short_conv.init_weights(*shape, c.param_dtype)
      w = self.param("short_conv", init, (c.short_conv, c.d_model))
      h, history = (
        short_conv.causal_conv(h, w, history),
        None if cache is None else short_conv.next_history(h, history, valid),
      )
    if cache is None:
      x = x + attention(h)
    else:
      y, cache = attention(
        h, cache, positions, valid, first_chunk=self.first_chunk, weights=attention_weights, rope_table=rope_table
      )
      x = x + y
    mlp = SwiGLU(c.ffn_hidden_size, dtype=c.dtype, param_dtype=c.param_dtype, name="mlp")
    x = x + mlp(*normed("mlp_norm", x, "mlp", GATE_UP))
    return x if cache is None else (x, cache, history)


class ScannedLayer(nn.Module):
  """A DecoderLayer as the body of `nn.scan` over layer indices: carry `(x, None)`, or with a cache `(x, stacked
  cache, layer index)`; the short convolution's history (None without one) is scanned in `[num_layers, ...]` and
  out as the scan's output.

  The whole stacked cache is carried, and the layer reads and writes its own layer in place
  (`fsjax.cache.layer_of`): scanning the cache as per-layer slices would copy every layer's cache out and
  back at each step. `stacks` (broadcast; with a cache) are the layers' stacks of parameters and of the "routing"
  collection (`{"params": .., ROUTING: ..}`), which the layer's products of a few rows and FS-L's decode kernel
  read at its index where they lie (`fsjax.layer_weights`).
  """

  config: ModelConfig
  first_chunk: bool = False

  @nn.compact
  def __call__(self, carry, index, history, positions, valid, stacks, rope_table):
    x, cache, *carried = carry
    layer = (nn.remat(DecoderLayer) if self.config.remat else DecoderLayer)(
      self.config, first_chunk=self.first_chunk, name="layer"
    )
    if cache is None:
      return (layer(x), None), None
    # With a cache the layer index is carried, counting up from 0, rather than sliced from the scanned `arange`:
    # the kernels take it as an operand, and a slice of the scanned array became a copy per layer on the GPU.
    (index,) = carried
    weights = None
    if stacks is not None:
      weights = LayerWeights(stacks["params"], index, self.config.attention.impl, stacks.get(ROUTING))
    x, view, history = layer(x, layer_of(cache, index), positions, valid, history, weights, rope_table)
    return (x, write_back(cache, view, index), index + 1), history


def _scanned_layers(config: ModelConfig, first_chunk=False):
  """All layers as one scanned module over the layer index: parameters, routing buffers and sown intermediates
  stacked on axis 0; x and the stacked cache carried; positions, valid, the parameter stacks and a one-token
  step's rotary table broadcast."""
  return nn.scan(
    ScannedLayer,
    variable_axes={"params": 0, ROUTING: 0, "intermediates": 0},
    split_rngs={"params": True},
    in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
    length=config.num_layers,
  )(config, first_chunk=first_chunk, name="layers")


class Transformer(nn.Module):
  """Decoder-only LM: `tokens [batch, seq]` int → logits `[batch, seq, vocab]` (float32).

  Decoding: with `cache` (from `fsjax.cache.init_cache`), `tokens` is a chunk at `positions` `[batch, C]`
  (`valid` `[batch, C]` marks real tokens; right padding is not cached) and the call returns
  `(logits, new_cache)`. `first_chunk=True` (static) says the cache is empty and `positions` are `0..C-1` in
  every row: each layer then runs its training operator over the chunk (the fused kernels on a GPU) and writes
  its cache in bulk. `logits_at` `[batch]` (chunk indices) keeps only those positions' logits, `[batch, vocab]`
  (`[batch, n]` indices: `[batch, n, vocab]`): at 256k tokens and a 32k vocabulary all of them would take 32
  GiB. Layers are `layer_0..layer_{L-1}`, or one scanned `layers` (`config.scan_layers`); with `short_conv`,
  the cache's `conv` holds every layer's convolution history.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, cache=None, positions=None, valid=None, first_chunk=False, logits_at=None):
    c = self.config
    embed = nn.Embed(
      c.vocab_size,
      c.d_model,
      embedding_init=nn.initializers.normal(EMBED_INIT_STD),
      dtype=c.dtype,
      param_dtype=c.param_dtype,
      name="embed",
    )
    x = embed(tokens)
    new_cache = {}
    history = None if cache is None else cache.get(short_conv.STATE_KEY)
    # A one-token step makes RoPE's table and advances FS-B's forests before the first layer, and merges FS-L's
    # completed blocks after the last, each once for all layers.
    one_token = cache is not None and tokens.shape[1] == 1 and not first_chunk
    # A step reads each layer's projection weights where they lie (`fsjax.layer_weights`); at init there are none.
    params = self.variables.get("params", {}) if cache is not None else {}
    routing = self.variables.get(ROUTING, {}) if cache is not None else {}
    rope_table = None
    if one_token:
      cache = defer_block_merges(cache)
      rope_table = _step_rotary_table(c, positions)
      if c.attention.kind == "fsb":
        tau = {name: _attention_routing(routing, name)["tau"] for name in cache if name != short_conv.STATE_KEY}
        cache = advance_forests(cache, positions, valid, tau, cell=c.attention.cell, block=c.attention.block)
    if c.scan_layers:
      stacks = None
      if "layers" in params:
        stacks = {"params": params["layers"]["layer"], ROUTING: routing.get("layers", {}).get("layer")}
      carry = (x, None) if cache is None else (x, cache["layers"], jnp.int32(0))
      (x, new_cache["layers"], *_), history = _scanned_layers(c, first_chunk)(
        carry, jnp.arange(c.num_layers), history, positions, valid, stacks, rope_table
      )
    else:
      layer = nn.remat(DecoderLayer) if c.remat else DecoderLayer
      histories = []
      for i in range(c.num_layers):
        name = f"layer_{i}"
        if cache is None:
          x = layer(c, name=name)(x)
        else:
          layer_history = None if history is None else history[i]
          weights = None
          if name in params:
            weights = LayerWeights(params[name], None, c.attention.impl, routing.get(name))
          x, new_cache[name], layer_history = layer(c, first_chunk=first_chunk, name=name)(
            x, cache[name], positions, valid, layer_history, weights, rope_table
          )
          histories.append(layer_history)
      history = jnp.stack(histories) if c.short_conv and cache is not None else None
    if c.short_conv and cache is not None:
      new_cache[short_conv.STATE_KEY] = history
    if one_token:
      new_cache = release_forests(merge_deferred_blocks(new_cache, positions, valid))
    if logits_at is not None:
      at = jnp.asarray(logits_at)
      x = jnp.take_along_axis(x, (at[:, None] if at.ndim == 1 else at)[..., None], axis=1)
      x = x[:, 0] if at.ndim == 1 else x
    x = nn.RMSNorm(epsilon=c.norm_eps, dtype=c.dtype, param_dtype=c.param_dtype, name="final_norm")(x)
    if c.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, name="lm_head")(x)
    logits = logits.astype(jnp.float32)
    return logits if cache is None else (logits, new_cache)


def _step_rotary_table(config, positions):
  """A one-token step's `RotaryTable`, made once for every layer's rotations of q and k: inside the layer scan
  XLA recomputes the sines and cosines per layer (its loop-invariant code motion leaves ops that outgrow their
  operands in the loop), a launch per layer that also slows the rotations at long contexts. None for ZHA."""
  if config.attention.kind == "zha":  # its own rotation (`fsjax.reference.zha`), RoPE or none
    return None
  return rotary_table(positions, config.head_dim, config.attention.rope, dtype=compute_dtype(jnp.dtype(config.dtype)))


def _attention_routing(routing, cache_key):
  """The attention's "routing" variables of the layers whose cache is `cache[cache_key]` ("layers": stacked)."""
  return (routing["layers"]["layer"] if cache_key == "layers" else routing[cache_key])["attention"]


def init_variables(config: ModelConfig, rng, seq_len=None):
  """Initial variables (`params` and, for FreeSolo, `routing`) for a `[1, seq_len]` token input."""
  seq_len = seq_len or config.attention.block
  return Transformer(config).init(rng, jnp.zeros((1, seq_len), jnp.int32))


def _param_group(names):
  groups = ("attention", "attention"), ("short_conv", "attention"), ("mlp", "mlp"), ("embed", "embedding")
  for module, group in (*groups, ("lm_head", "lm_head")):
    if module in names:
      return group
  return "norm"


def param_counts(config: ModelConfig):
  """Parameter counts by group, computed from shapes only (no allocation, no compile).

  Returns:
    dict with "embedding", "attention", "mlp", "norm", "lm_head" and "total" (trainable `params` only;
    the routing buffers λ, σ are not parameters).
  """
  shapes = jax.eval_shape(lambda: init_variables(config, jax.random.PRNGKey(0)))["params"]
  counts = dict(embedding=0, attention=0, mlp=0, norm=0, lm_head=0)
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    counts[_param_group([p.key for p in path])] += math.prod(leaf.shape)
  counts["total"] = sum(counts.values())
  return counts
