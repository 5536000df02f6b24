"""ZHA attention as a Flax linen module: a TF++ attention layer read through a tree of key summaries (ZHA III)."""

import flax.linen as nn
import jax.numpy as jnp

from fsjax.attention import zha_step
from fsjax.attention.dense import causal_attention
from fsjax.attention.projections import Projection, project_out, project_qkv
from fsjax.ops import dispatch
from fsjax.ops import zha as zha_ops
from fsjax.reference.common import compute_dtype
from fsjax.reference.rope import RoPE
from fsjax.reference.zha import ZHATree

# Small random reference queries: tangents start near q = 0 (mean key, bias log C) yet differ, so the R copies
# do not receive identical gradients.
REF_INIT_STD = 0.02


class ZHAAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]`: causal RoPE attention over the keys the ZHA tree routes
  each query to (`fsjax.reference.zha`).

  Params: `q_proj`, `k_proj`, `v_proj`, `o_proj` (named as in `DenseAttention`, so a TF++ checkpoint converts by
  adding the reference queries; with `projection`'s q/k RMSNorm, biases and key/value heads too) and `ref_queries`
  `[kv_heads, tree.refs, head_dim]`, the only weights ZHA trains: one tree per key/value head, shared by the query
  heads that read it (ZHA III-A, III-B; query head h reads key/value head `h // (heads // kv_heads)`).
  `rope_theta`: θ, a `fsjax.reference.rope.RoPE`, or None (NoPE).

  `distill=True` (ZHA III-B training): the layer runs the frozen model's dense attention and sows its KL loss per
  level, `[levels]`, as intermediates/zha_kl. Otherwise it sows the fraction of visible keys each query read,
  `[batch, seq, heads]`, as intermediates/attended_fraction. With a `cache` (a `ZHACache`), `x` is a chunk at
  `positions` `[batch, C]` with `valid` `[batch, C]`, and the call returns `(y, new_cache)` (`zha_step.step`);
  with `tree.max_nodes` set, a one-token chunk reads only the routed candidates and keys.

  `impl` ("reference" | "auto" | "pallas") goes to each op through `fsjax.ops.dispatch.for_op`: the capped decode
  step has Pallas kernels, the training form is a reference, the distillation loss runs over blocks of queries
  (`fsjax.ops.zha_kl`) and its dense attention on cuDNN where `auto` allows.
  """

  num_heads: int
  head_dim: int
  tree: ZHATree = ZHATree()
  distill: bool = False
  rope_theta: float | RoPE = 10000.0
  projection: Projection = Projection()
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None, first_chunk=False, weights=None, rope_table=None):
    del rope_table  # the decoder layer's one-token table; ZHA rotates by its own rule (`zha_ref.rotate`, NoPE too)
    tree = self.tree
    kv_heads = self.projection.kv_heads(self.num_heads)
    q, k, v = project_qkv(x, self.num_heads, self.head_dim, self.projection, self.dtype, self.param_dtype, weights)
    ref_queries = self.param(
      "ref_queries", nn.initializers.normal(REF_INIT_STD), (kv_heads, tree.refs, self.head_dim), self.param_dtype
    )
    if cache is not None and first_chunk:  # empty cache, positions 0..C-1: the training form, one bulk write
      o, fraction = self._routed(q, k, v, ref_queries)
      self.sow("intermediates", "attended_fraction", fraction)
      cache = zha_step.write(cache, k, v, positions, valid, ref_queries, tree=tree, rope_theta=self.rope_theta)
      return project_out(o.astype(x.dtype), x.shape[-1], self.dtype, self.param_dtype, weights), cache
    if cache is not None:
      o, fraction, cache = zha_step.step(
        cache,
        q,
        k,
        v,
        positions,
        valid,
        ref_queries,
        tree=tree,
        rope_theta=self.rope_theta,
        impl=dispatch.for_op("zha_route", self.impl),
      )
      self.sow("intermediates", "attended_fraction", fraction)
      return project_out(o.astype(x.dtype), x.shape[-1], self.dtype, self.param_dtype, weights), cache
    if self.distill:
      self.sow(
        "intermediates",
        "zha_kl",
        zha_ops.zha_kl_per_level(
          q,
          k,
          ref_queries,
          chunk=tree.chunk,
          levels=tree.levels,
          rope_theta=self.rope_theta,
          impl=dispatch.for_op("zha_kl_loss", self.impl),
        ),
      )
      o = causal_attention(q, k, v, window=None, rope_theta=self.rope_theta, impl=self.impl)
    else:
      o, fraction = self._routed(q, k, v, ref_queries)
      self.sow("intermediates", "attended_fraction", fraction)
    return project_out(o, x.shape[-1], self.dtype, self.param_dtype, weights)

  def _routed(self, q, k, v, ref_queries):
    """The training form over a whole sequence from position 0: outputs in q's dtype and attended fractions."""
    tree = self.tree
    return zha_ops.zha_attention(
      q,
      k,
      v,
      ref_queries.astype(compute_dtype(q.dtype)),
      chunk=tree.chunk,
      levels=tree.levels,
      top_p=tree.top_p,
      rope_theta=self.rope_theta,
      max_nodes=tree.max_nodes,
      return_fraction=True,
      impl=dispatch.for_op("zha_attention", self.impl),
    )
