"""Baseline attentions (TF++, SWA, MoBA) as a Flax linen module."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from fsjax import ops
from fsjax.attention.cached import attend, attend_one, by_head_groups, visible
from fsjax.attention.projections import Projection, project_out, project_qkv
from fsjax.cache import store as kv
from fsjax.cache.layered import LayerSlice, after, kernel_arrays, read, rewritten
from fsjax.ops import dispatch
from fsjax.reference.common import compute_dtype
from fsjax.reference.dense import moba_chosen_blocks, moba_mean_keys
from fsjax.reference.rope import RoPE, apply_rope
from pallas_kernels import store_decode

KINDS = ("tfpp", "swa", "moba")


def causal_attention(q, k, v, *, window, rope_theta, impl):
  """TF++ (`window` None) or SWA attention without a cache, through `fsjax.ops` (cuDNN on a GPU in half precision
  unless `impl="reference"`). q, k, v `[batch, T, heads, d]` unrotated → `[batch, T, heads, d]`."""
  if window is None:
    return ops.tfpp_attention(q, k, v, rope_theta=rope_theta, impl=dispatch.for_op("tfpp_attention", impl))
  return ops.swa_attention(q, k, v, window=window, rope_theta=rope_theta, impl=dispatch.for_op("swa_attention", impl))


def moba_block_mask(q_rot, q_pos, keys, *, moba_block, moba_top_k):
  """MoBA's block selection (`fsjax.reference.dense.moba_chosen_blocks`) for queries at positions over a dense
  cache's keys (slot = position): `[batch, heads, C, capacity]` bool, a key readable when its block is chosen.
  The capacity must be a multiple of `moba_block`.

  Args:
    q_rot: `[batch, C, heads, d]` at `q_pos` `[batch, C]`; keys: `[batch, capacity, kv_heads, d]` rotated.
  """
  chosen = moba_chosen_blocks(
    q_rot, q_pos, moba_mean_keys(keys, moba_block), moba_block=moba_block, moba_top_k=moba_top_k
  )
  return jnp.take(chosen, jnp.arange(keys.shape[1]) // moba_block, axis=-1)


class DenseAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]` through a RoPE baseline attention.

  `kind`: "tfpp" (full causal), "swa" (radius `window`) or "moba" (`moba_block`, `moba_top_k`; see
  `fsjax.reference.dense` for MoBA's documented choices). Params: `q_proj`, `k_proj`, `v_proj`, `o_proj`, and
  what `projection` adds (`fsjax.attention.projections`: grouped-query attention with fewer key/value heads,
  which the cache then holds; q/k/v biases; q/k RMSNorm). `rope_theta`: θ or a `fsjax.reference.rope.RoPE`.
  `impl` ("reference" | "auto" | "pallas", `fsjax.ops.dispatch`): "reference" always runs the references;
  otherwise TF++ and SWA use cuDNN on a GPU in bf16/fp16.

  With a `cache` (a `KVStore`: dense for TF++/MoBA, a ring of window + 1 for SWA), `x` is a chunk at
  `positions` `[batch, C]` with `valid` `[batch, C]`, and the call returns `(y, new_cache)`. A prompt's
  `first_chunk` (empty cache, positions from 0) runs the training operator and writes the cache once. Unless
  `impl="reference"`, TF++ attends a chunk over a half-precision cache on a GPU through cuDNN; a one-token step of
  TF++ or SWA runs `pallas_kernels.store_decode` on a GPU (the token's write and its attention in one launch that
  reads the store in place), and elsewhere TF++'s runs `fsjax.attention.cached.attend_one`. `rope_table`: a
  one-token step's `fsjax.reference.rope.RotaryTable` for `positions`, made once for every layer; None: made here.
  """

  num_heads: int
  head_dim: int
  kind: str = "tfpp"
  window: int = 512
  moba_block: int = 512
  moba_top_k: int = 3
  rope_theta: float | RoPE = 10000.0
  projection: Projection = Projection()
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None, first_chunk=False, weights=None, rope_table=None):
    if self.kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
    q, k, v = project_qkv(x, self.num_heads, self.head_dim, self.projection, self.dtype, self.param_dtype, weights)
    if cache is None:
      return project_out(self._causal(q, k, v), x.shape[-1], self.dtype, self.param_dtype, weights)
    if first_chunk:  # an empty cache and positions 0..C-1: the training operator, then one bulk write
      o = self._causal(q, k, v)
      dtype = compute_dtype(k.dtype)
      k_rot = apply_rope(k.astype(dtype), positions, self.rope_theta)
      cache = kv.write(cache, k_rot, v.astype(dtype), positions, valid)
    else:
      o, cache = self._extend(q, k, v, cache, positions, valid, rope_table)
    return project_out(o.astype(x.dtype), x.shape[-1], self.dtype, self.param_dtype, weights), cache

  def _causal(self, q, k, v):
    """The training operator over a whole sequence from position 0: `[batch, T, heads, d]` in q's dtype."""
    if self.kind in ("tfpp", "swa"):
      return causal_attention(
        q, k, v, window=self.window if self.kind == "swa" else None, rope_theta=self.rope_theta, impl=self.impl
      )
    return ops.moba_attention(
      q,
      k,
      v,
      moba_block=self.moba_block,
      moba_top_k=self.moba_top_k,
      rope_theta=self.rope_theta,
      impl=dispatch.for_op("moba_attention", self.impl),
    )

  def _extend(self, q, k, v, cache, positions, valid, rope_table=None):
    path = "reference"
    if self.kind in ("tfpp", "swa"):
      impl = dispatch.for_op("cache_attention", self.impl)
      if impl == "pallas" and q.shape[1] > 1:  # the kernel steps one token; a chunk takes the fastest other path
        impl = "auto"
      path = dispatch.resolve(
        "cache_attention",
        impl,
        dtype=q.dtype,
        cache_dtype=cache.k.dtype,
        tokens=q.shape[1],
        head_dim=q.shape[-1],
      )
    if path == "cudnn" and self.kind == "tfpp":
      return self._extend_cudnn(q, k, v, cache, positions, valid, rope_table)
    dtype = compute_dtype(q.dtype)
    q_rot = apply_rope(q.astype(dtype), positions, self.rope_theta, rope_table)
    k_rot = apply_rope(k.astype(dtype), positions, self.rope_theta, rope_table)
    v = v.astype(dtype)
    if path == "pallas":
      return self._extend_kernel(q_rot, k_rot, v, cache, positions, valid)
    if self.kind == "swa":  # the ring holds only the past window: attend over ring + chunk, then write
      out = attend(q_rot, positions, *kv.concat(cache, k_rot, v, positions, valid), window=self.window)
      return out, kv.write(cache, k_rot, v, after(positions, out), valid)  # in place: after the ring's read
    cache = kv.write(cache, k_rot, v, positions, valid)
    keys = (read(cache.k), read(cache.v), read(cache.pos))
    if path == "one_token":
      return attend_one(q_rot, positions, *keys), cache
    extra = None
    if self.kind == "moba":
      extra = moba_block_mask(q_rot, positions, keys[0], moba_block=self.moba_block, moba_top_k=self.moba_top_k)
    return attend(q_rot, positions, *keys, extra_mask=extra), cache

  def _extend_kernel(self, q_rot, k_rot, v, cache, positions, valid):
    """One token per row through `pallas_kernels.store_decode`: the token's write and its attention over the
    store (TF++'s dense cache, SWA's ring) in one launch that reads the store where it lies, then the merge of its
    parts. The same result as the reference path: `attend_one` after `kv.write` (TF++), `attend` over the ring and
    the token (SWA)."""
    fields, layer = kernel_arrays(dict(k=cache.k, v=cache.v, pos=cache.pos))
    o, written = store_decode.store_decode(
      q_rot[:, 0],
      k_rot[:, 0],
      v[:, 0],
      positions[:, 0],
      valid[:, 0],
      fields,
      window=self.window if self.kind == "swa" else None,
      out_dtype=jnp.dtype(q_rot.dtype),
      layer=layer,
    )
    return o[:, None], cache.replace(**{name: rewritten(getattr(cache, name), written[name]) for name in fields})

  def _extend_cudnn(self, q, k, v, cache, positions, valid, rope_table=None):
    """TF++ prefill/decode on cuDNN's fused kernel: the chunk attends the half-precision dense cache through a
    position mask (the chunk is written first), so a 2048-token chunk at 256k never materializes its logits. A
    scanned model's layer is copied for cuDNN, a group of heads at a time (`dispatch.cache_head_groups`). cuDNN
    takes fewer key/value heads than query heads as they come (grouped-query attention)."""
    q_rot = apply_rope(q, positions, self.rope_theta, rope_table).astype(cache.k.dtype)
    cache = kv.write(cache, apply_rope(k, positions, self.rope_theta, rope_table), v, positions, valid)
    mask = visible(positions, read(cache.pos))[:, None]  # [batch, 1, C, N]
    batch, capacity, kv_heads, head_dim = cache.k.shape
    groups = dispatch.cache_head_groups(
      batch, capacity, kv_heads, head_dim, cache.k.dtype, copied=isinstance(cache.k, LayerSlice)
    )
    attend_heads = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
    return by_head_groups(attend_heads, groups, q_rot, cache.k, cache.v), cache
