"""ZHA attention as a Flax linen module: a TF++ attention layer read through a tree of key summaries (ZHA III)."""

import flax.linen as nn
import jax.numpy as jnp

from fsjax import ops
from fsjax.attention.dense import causal_attention
from fsjax.attention.projections import project_heads, project_out
from fsjax.cache import zha as zha_cache
from fsjax.ops.common import compute_dtype
from fsjax.ops.rope import apply_rope
from fsjax.ops.zha import level_top_p, zha_kl_per_level

# Small random reference queries: tangents start near q = 0 (mean key, bias log C) yet differ, so the R copies
# do not receive identical gradients.
REF_INIT_STD = 0.02


class ZHAAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]`: causal RoPE attention over the keys the ZHA tree routes
  each query to (`fsjax.ops.zha`).

  Params: `q_proj`, `k_proj`, `v_proj`, `o_proj` (named as in `DenseAttention`, so a TF++ checkpoint converts by
  adding the reference queries) and `ref_queries` `[heads, refs, head_dim]`, the only weights ZHA trains.

  `distill=True` (ZHA III-B training): the layer runs the frozen model's dense attention and sows its KL loss per
  level, `[levels]`, as intermediates/zha_kl. Otherwise it sows the fraction of visible keys each query read,
  `[batch, seq, heads]`, as intermediates/attended_fraction. With a `cache` (a `ZHACache`), `x` is a chunk at
  `positions` `[batch, C]` with `valid` `[batch, C]`, and the call returns `(y, new_cache)`; with `max_nodes` set,
  a one-token chunk reads only the routed candidates and keys (`fsjax.cache.zha.attend_gathered`).
  """
  num_heads: int
  head_dim: int
  refs: int = 16
  chunk: int = 8
  levels: int = 2
  top_p: tuple = (0.9,)
  max_nodes: int | None = None
  distill: bool = False
  rope_theta: float = 10000.0
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None):
    q, k, v = (project_heads(x, self.num_heads, self.head_dim, name, self.dtype, self.param_dtype)
               for name in ("q_proj", "k_proj", "v_proj"))
    ref_queries = self.param("ref_queries", nn.initializers.normal(REF_INIT_STD),
                             (self.num_heads, self.refs, self.head_dim), self.param_dtype)
    geometry = dict(chunk=self.chunk, levels=self.levels)
    if cache is not None:
      o, cache = self._extend(q, k, v, ref_queries, cache, positions, valid)
      return project_out(o.astype(x.dtype), x.shape[-1], self.dtype, self.param_dtype), cache
    if self.distill:
      self.sow("intermediates", "zha_kl",
               zha_kl_per_level(q, k, ref_queries, rope_theta=self.rope_theta, **geometry))
      o = causal_attention(q, k, v, window=None, rope_theta=self.rope_theta, impl=self.impl)
    else:
      o, fraction = ops.zha_attention(q, k, v, ref_queries.astype(compute_dtype(q.dtype)), top_p=self.top_p,
                                      rope_theta=self.rope_theta, max_nodes=self.max_nodes,
                                      return_fraction=True, **geometry)
      self.sow("intermediates", "attended_fraction", fraction)
    return project_out(o, x.shape[-1], self.dtype, self.param_dtype)

  def _extend(self, q, k, v, ref_queries, cache, positions, valid):
    dtype = compute_dtype(q.dtype)
    q_rot = apply_rope(q.astype(dtype), positions, self.rope_theta)
    k_rot = apply_rope(k.astype(dtype), positions, self.rope_theta)
    cache = zha_cache.extend(cache, k_rot, v.astype(dtype), positions, valid, ref_queries.astype(dtype),
                             chunk=self.chunk, rope_theta=self.rope_theta)
    routing = dict(chunk=self.chunk, top_p=level_top_p(self.top_p, self.levels), max_nodes=self.max_nodes)
    if self.max_nodes is not None and q.shape[1] == 1:  # one decode token: read only the candidate lists
      kernels = zha_cache.use_kernels(self.impl, chunk=self.chunk, refs=self.refs)
      o, fraction = zha_cache.attend_gathered(cache, q_rot, positions, kernels=kernels, **routing)
    else:
      o, fraction = zha_cache.attend(cache, q_rot, positions, **routing)
    self.sow("intermediates", "attended_fraction", fraction)
    return o, cache
