"""FreeSolo attention as a Flax linen module (FS Sec. 3)."""

import flax.linen as nn
import jax.numpy as jnp

from fsjax.attention import freesolo_step
from fsjax.attention.projections import Projection, project_out, project_qkv
from fsjax.cache.bounded import BoundedCache
from fsjax.layer_weights import parameter, routing_variable
from fsjax.ops import freesolo as freesolo_ops
from fsjax.reference.cells import cell_summaries
from fsjax.reference.common import compute_dtype
from fsjax.reference.rope import RoPE
from fsjax.reference.routing import Routing

ROUTING = "routing"  # collection of λ, σ (and FS-B's τ): buffers with no gradient (FS Sec. 3.3 "Training")


class FreeSoloAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]` through FS/FS-L/FS-B attention.

  Fields: `routing` (a `Routing`: variant, window, cell, block, top_k, pool, recent cells, beam, bound c), the
  initial λ and σ of Eq. 7, the RoPE of the local branch (θ or a `fsjax.reference.rope.RoPE`), `projection`
  (`fsjax.attention.projections`: q/k RMSNorm, q/k/v biases, grouped key/value heads), `impl`
  ("reference" | "auto" | "pallas", `fsjax.ops.dispatch`) and the dtypes. The projection options act before
  anything FreeSolo computes, so the long-range branch sees the normed keys.

  Variables: params `q_proj` (`[d_model, heads, head_dim]`), `k_proj`, `v_proj` (`[d_model, kv_heads,
  head_dim]`), `o_proj`, `alpha` `[heads]` (Eq. 2, init 1), `lr_gain` `[head_dim]` (readout RMSNorm gain,
  init 1); collection "routing": `lam`, `sigma` `[heads]` (Eq. 7, init λ and σ: they weight a query's scores)
  and for FS-B `tau` `[kv_heads]` (Eq. 10, from `fsjax.calibrate`; +inf until calibrated, which leaves the τ
  forest empty: it admits a key/value head's cells into that head's forest), which no gradient reaches. FS, FS-L
  and FS-B share every parameter, so one checkpoint serves all three. With grouped-query attention
  (`projection.num_kv_heads`) cell summaries, FS-L's pool and FS-B's forests, and every decode cache, are per
  key/value head (`fsjax.reference.freesolo` states the reading).

  With a `cache` (an FS `Archive` for FS, a `ForestCache` (or the archive) for FS-B, a `BoundedCache` (or the
  archive) for FS-L), `x` is a chunk at `positions` `[batch, C]` with `valid` `[batch, C]`; the call returns
  `(y, new_cache)` and sows the selected cells `[batch, C, heads, K]` as intermediates/selected_cells for routing
  probes. A chunk for the bounded cache is one token or whole query blocks starting at a block boundary. A
  prompt's `first_chunk` (empty cache, positions from 0) runs the training operator (the fused kernels) and
  fills the cache in bulk (`freesolo_step.fill`); it sows no selected cells. `rope_table`: a one-token step's
  `fsjax.reference.rope.RotaryTable` for `positions`, made once for every layer; None: made where it is needed.
  """

  num_heads: int
  head_dim: int
  routing: Routing = Routing()
  lam: float = 1.0
  sigma: float = 4.0
  rope_theta: float | RoPE = 10000.0
  projection: Projection = Projection()
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None, first_chunk=False, weights=None, rope_table=None):
    heads, dim, routing = self.num_heads, self.head_dim, self.routing
    kv_heads = self.projection.kv_heads(heads)
    q, k, v = project_qkv(x, heads, dim, self.projection, self.dtype, self.param_dtype, weights)
    alpha = self.param("alpha", nn.initializers.ones, (heads,), self.param_dtype)
    lr_gain = self.param("lr_gain", nn.initializers.ones, (dim,), self.param_dtype)
    lam = self.variable(ROUTING, "lam", lambda: jnp.full((heads,), self.lam, jnp.float32)).value
    sigma = self.variable(ROUTING, "sigma", lambda: jnp.full((heads,), self.sigma, jnp.float32)).value
    tau = None
    if routing.variant == "fsb":  # τ per key/value head, set by `python -m fsjax.calibrate` (inf: forest τ empty)
      tau = self.variable(ROUTING, "tau", lambda: jnp.full((kv_heads,), jnp.inf, jnp.float32)).value
    if cache is None or first_chunk:
      if cache is None:
        self.sow("intermediates", "cell_norms", cell_summaries(k, routing.cell)[1])  # for τ calibration (FS-B)
      o = freesolo_ops.attention_routed(
        q,
        k,
        v,
        routing,
        alpha=alpha,
        lam=lam,
        sigma=sigma,
        lr_gain=lr_gain,
        tau=tau,
        rope_theta=self.rope_theta,
        impl=self.impl,
      )
      y = project_out(o, x.shape[-1], self.dtype, self.param_dtype, weights)
      if cache is None:
        return y
      dtype = compute_dtype(k.dtype)
      cache = freesolo_step.fill(
        cache, k.astype(dtype), v.astype(dtype), positions, valid, routing, rope_theta=self.rope_theta, tau=tau
      )
      return y, cache

    dtype = compute_dtype(q.dtype)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    step = dict(  # a scanned model's stacks at the layer, which the decode kernels read in place
      rope_theta=self.rope_theta,
      rope_table=rope_table,
      lam=routing_variable(weights, "lam", lam),
      sigma=routing_variable(weights, "sigma", sigma),
      alpha=parameter(weights, "alpha", alpha),
      lr_gain=parameter(weights, "lr_gain", lr_gain),
      out_dtype=x.dtype,
      impl=self.impl,
    )
    if isinstance(cache, BoundedCache):
      o, cell_idx, cache = freesolo_step.bounded_chunk(cache, q, k, v, positions, valid, routing, **step)
    else:
      o, cell_idx, cache = freesolo_step.archive_chunk(cache, q, k, v, positions, valid, routing, tau=tau, **step)
    self.sow("intermediates", "selected_cells", cell_idx)
    return project_out(o, x.shape[-1], self.dtype, self.param_dtype, weights), cache
