"""FreeSolo attention as a Flax linen module (FS Sec. 3)."""

import flax.linen as nn
import jax.numpy as jnp

from fsjax import ops
from fsjax.attention.projections import project_heads, project_out
from fsjax.cache import archive as archive_lib
from fsjax.cache import bounded as bounded_lib
from fsjax.cache import forest as forest_lib
from fsjax.ops.cells import cell_summaries
from fsjax.ops.common import compute_dtype
from fsjax.ops.freesolo import use_kernels

ROUTING = "routing"  # collection of λ, σ (and FS-B's τ): buffers with no gradient (FS Sec. 3.3 "Training")


class FreeSoloAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]` through FS/FS-L/FS-B attention.

  Variables: params `q_proj`, `k_proj`, `v_proj` (`[d_model, heads, head_dim]`), `o_proj`, `alpha` `[heads]`
  (Eq. 2, init 1), `lr_gain` `[head_dim]` (readout RMSNorm gain, init 1); collection "routing": `lam`, `sigma`
  `[heads]` (Eq. 7, init λ and σ) and for FS-B `tau` `[heads]` (Eq. 10, from `fsjax.calibrate`; +inf until
  calibrated, which leaves the τ forest empty), which no gradient reaches. FS, FS-L and FS-B share every
  parameter, so one checkpoint serves all three.

  With a `cache` (an FS `Archive` for FS and FS-B, or for FS-L a `BoundedCache`), `x` is a chunk at `positions`
  `[batch, C]` with `valid` `[batch, C]`; the call returns `(y, new_cache)` and sows the selected cells
  `[batch, C, heads, K]` as intermediates/selected_cells for routing probes. A chunk for the bounded cache is one
  token or whole query blocks starting at a block boundary.
  """
  num_heads: int
  head_dim: int
  variant: str = "fs"
  window: int = 512
  cell: int = 32
  block: int = 128
  top_k: int = 4
  retain_top: int = 64
  retain_recent: int = 8
  beam: int = 16
  bound_c: float = 8.0
  lam: float = 1.0
  sigma: float = 4.0
  rope_theta: float = 10000.0
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, cache=None, positions=None, valid=None):
    heads, dim = self.num_heads, self.head_dim
    q, k, v = (project_heads(x, heads, dim, name, self.dtype, self.param_dtype)
               for name in ("q_proj", "k_proj", "v_proj"))
    alpha = self.param("alpha", nn.initializers.ones, (heads,), self.param_dtype)
    lr_gain = self.param("lr_gain", nn.initializers.ones, (dim,), self.param_dtype)
    lam = self.variable(ROUTING, "lam", lambda: jnp.full((heads,), self.lam, jnp.float32)).value
    sigma = self.variable(ROUTING, "sigma", lambda: jnp.full((heads,), self.sigma, jnp.float32)).value
    forests = {}
    if self.variant == "fsb":  # τ per head, set by `python -m fsjax.calibrate` (inf until then: forest τ empty)
      tau = self.variable(ROUTING, "tau", lambda: jnp.full((heads,), jnp.inf, jnp.float32)).value
      forests = dict(tau=tau, beam=self.beam, bound_c=self.bound_c)
    if cache is None:
      self.sow("intermediates", "cell_norms", cell_summaries(k, self.cell)[1])  # for τ calibration (FS-B)
      o = ops.freesolo_attention(q, k, v, variant=self.variant, alpha=alpha, lam=lam, sigma=sigma,
                                 lr_gain=lr_gain, window=self.window, cell=self.cell, block=self.block,
                                 top_k=self.top_k, retain_top=self.retain_top,
                                 retain_recent=self.retain_recent, rope_theta=self.rope_theta, impl=self.impl,
                                 **forests)
      return project_out(o, x.shape[-1], self.dtype, self.param_dtype)

    dtype = compute_dtype(q.dtype)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    if isinstance(cache, bounded_lib.BoundedCache):
      local, long_range, cell_idx, cache = self._extend_bounded(cache, q, k, v, positions, valid,
                                                                lr_gain.astype(dtype), lam, sigma)
    else:
      streaming = isinstance(cache, forest_lib.ForestCache)
      archive = archive_lib.extend(cache.archive if streaming else cache, k, v, positions, valid, self.cell)
      local = archive_lib.local_branch(archive, q, positions, window=self.window, rope_theta=self.rope_theta)
      selected = None
      if streaming:
        cache, selected = self._select_streaming(cache.replace(archive=archive), q, positions, valid, lam, sigma,
                                                 forests["tau"])
      else:
        cache = archive
      long_range, cell_idx = archive_lib.long_range_branch(
          archive, q, positions, lr_gain=lr_gain.astype(dtype), variant=self.variant, lam=lam, sigma=sigma,
          cell=self.cell, block=self.block, top_k=self.top_k, retain_top=self.retain_top,
          retain_recent=self.retain_recent, impl=self.impl, selected=selected, **forests)
    self.sow("intermediates", "selected_cells", cell_idx)
    o = local + alpha.astype(dtype)[:, None] * long_range
    return project_out(o.astype(x.dtype), x.shape[-1], self.dtype, self.param_dtype), cache

  def _select_streaming(self, cache, q, positions, valid, lam, sigma, tau):
    """FS-B through the forest cache. A longer chunk (queries in several blocks) leaves selection to the
    archive's prefill formulation (None) and advances the forests past its last token; a single-token step
    advances them to its own block and beam-searches them."""
    if q.shape[1] > 1:
      target = forest_lib.eligible_after(positions, valid, cache.admitted, cell=self.cell, block=self.block)
      return forest_lib.advance(cache, target, tau, cell=self.cell, block=self.block), None
    target = forest_lib.eligible_target(positions, valid, cache.admitted, cell=self.cell, block=self.block)
    cache = forest_lib.advance(cache, target, tau, cell=self.cell, block=self.block)
    kernels = use_kernels(self.impl, cell=self.cell, head_dim=self.head_dim) and self.beam & (self.beam - 1) == 0
    return cache, forest_lib.select(cache, q, positions, lam=lam, sigma=sigma, cell=self.cell, top_k=self.top_k,
                                    beam=self.beam, bound_c=self.bound_c, kernels=kernels)

  def _extend_bounded(self, cache, q, k, v, positions, valid, lr_gain, lam, sigma):
    """Runs the chunk block by block through the bounded cache (availability changes at block boundaries)."""
    chunk = q.shape[1]
    if chunk > 1 and chunk % self.block:
      raise ValueError(f"a chunk for the FS-L bounded cache must be 1 token or whole blocks, got {chunk} tokens "
                       f"with block={self.block}")
    outputs = []
    for start in range(0, chunk, self.block):
      segment = slice(start, start + self.block)
      *branches, cache = bounded_lib.extend_segment(
          cache, q[:, segment], k[:, segment], v[:, segment], positions[:, segment], valid[:, segment],
          window=self.window, rope_theta=self.rope_theta, lam=lam, sigma=sigma, lr_gain=lr_gain, cell=self.cell,
          top_k=self.top_k, retain_top=self.retain_top)
      outputs.append(branches)
    local, long_range, cell_idx = (jnp.concatenate(parts, axis=1) for parts in zip(*outputs))
    return local, long_range, cell_idx, cache
