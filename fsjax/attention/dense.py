"""Baseline attentions (TF++, SWA, MoBA) as a Flax linen module."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from fsjax import ops
from fsjax.attention.projections import project_heads, project_out
from fsjax.cache import moba as moba_cache
from fsjax.cache import store as kv
from fsjax.cache.layered import read
from fsjax.ops.common import compute_dtype
from fsjax.ops.cudnn import causal_rope_attention_cudnn, cudnn_usable
from fsjax.ops.rope import apply_rope

KINDS = ("tfpp", "swa", "moba")


def causal_attention(q, k, v, *, window, rope_theta, impl):
  """TF++ (`window` None) or SWA attention without a cache: cuDNN on GPU in half precision unless
  `impl="reference"`, else `fsjax.ops`. q, k, v `[batch, T, heads, d]` unrotated → `[batch, T, heads, d]`."""
  if impl != "reference" and cudnn_usable(q.dtype):
    return causal_rope_attention_cudnn(q, k, v, window=window, rope_theta=rope_theta)
  if window is None:
    return ops.tfpp_attention(q, k, v, rope_theta=rope_theta)
  return ops.swa_attention(q, k, v, window=window, rope_theta=rope_theta)


class DenseAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]` through a RoPE baseline attention.

  `kind`: "tfpp" (full causal), "swa" (radius `window`) or "moba" (`moba_block`, `moba_top_k`; see
  `fsjax.ops.dense` for MoBA's documented choices). Params: `q_proj`, `k_proj`, `v_proj`, `o_proj`.
  `impl`: "reference" always runs `fsjax.ops`; otherwise TF++ and SWA use cuDNN on GPU in bf16/fp16.

  With a `cache` (a `KVStore`: dense for TF++/MoBA, a ring of window + 1 for SWA), `x` is a chunk at
  `positions` `[batch, C]` with `valid` `[batch, C]`, and the call returns `(y, new_cache)`. TF++ with a
  half-precision cache on GPU attends a chunk through cuDNN; a one-token TF++ step (unless `impl="reference"`)
  attends through `store.attend_one`, which reads the cache in place.
  """
  num_heads: int
  head_dim: int
  kind: str = "tfpp"
  window: int = 512
  moba_block: int = 512
  moba_top_k: int = 3
  rope_theta: float = 10000.0
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None):
    if self.kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
    q, k, v = (project_heads(x, self.num_heads, self.head_dim, name, self.dtype, self.param_dtype)
               for name in ("q_proj", "k_proj", "v_proj"))
    if cache is not None:
      o, cache = self._extend(q, k, v, cache, positions, valid)
      return project_out(o.astype(x.dtype), x.shape[-1], self.dtype, self.param_dtype), cache
    if self.kind in ("tfpp", "swa"):
      o = causal_attention(q, k, v, window=self.window if self.kind == "swa" else None,
                           rope_theta=self.rope_theta, impl=self.impl)
    else:
      o = ops.moba_attention(q, k, v, moba_block=self.moba_block, moba_top_k=self.moba_top_k,
                             rope_theta=self.rope_theta)
    return project_out(o, x.shape[-1], self.dtype, self.param_dtype)

  def _extend(self, q, k, v, cache, positions, valid):
    if (self.kind == "tfpp" and q.shape[1] > 1 and self.impl != "reference" and cudnn_usable(q.dtype)
        and cudnn_usable(cache.k.dtype)):
      return self._extend_cudnn(q, k, v, cache, positions, valid)
    dtype = compute_dtype(q.dtype)
    q_rot = apply_rope(q.astype(dtype), positions, self.rope_theta)
    k_rot = apply_rope(k.astype(dtype), positions, self.rope_theta)
    v = v.astype(dtype)
    if self.kind == "swa":  # the ring holds only the past window: attend over ring + chunk, then write
      keys = kv.concat(cache, k_rot, v, positions, valid)
      return kv.attend(q_rot, positions, *keys, window=self.window), kv.write(cache, k_rot, v, positions, valid)
    cache = kv.write(cache, k_rot, v, positions, valid)
    keys = (read(cache.k), read(cache.v), read(cache.pos))
    if self.kind == "tfpp" and q.shape[1] == 1 and self.impl != "reference":
      return kv.attend_one(q_rot, positions, *keys), cache
    extra = None
    if self.kind == "moba":
      extra = moba_cache.block_mask(q_rot, positions, cache, moba_block=self.moba_block,
                                    moba_top_k=self.moba_top_k)
    return kv.attend(q_rot, positions, *keys, extra_mask=extra), cache

  def _extend_cudnn(self, q, k, v, cache, positions, valid):
    """TF++ prefill/decode on cuDNN's fused kernel: the chunk attends the half-precision dense cache through a
    position mask (the chunk is written first), so a 2048-token chunk at 256k never materializes its logits."""
    q_rot = apply_rope(q, positions, self.rope_theta).astype(cache.k.dtype)
    cache = kv.write(cache, apply_rope(k, positions, self.rope_theta), v, positions, valid)
    mask = kv.visible(positions, read(cache.pos))[:, None]  # [batch, 1, C, N]
    o = jax.nn.dot_product_attention(q_rot, read(cache.k), read(cache.v), mask=mask, implementation="cudnn")
    return o, cache
