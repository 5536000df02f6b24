"""FreeSolo ops (FS Eq. 2, 5-9) with their implementation chosen by `fsjax.ops.dispatch`: the reference
(`fsjax.reference.freesolo`) or the Pallas kernels (`pallas_kernels.cell_scoring`, `.sparse_readout`).

Each op takes the reference's arguments plus `impl`. The kernels read q, k, v in their own dtype (bf16 on tensor
cores) and score cells in float32; results agree with the reference within the dtype's tolerance, and selected
cells exactly up to float32 near-ties.

Every op takes grouped key/value heads (k, v, summaries `[.., kv_heads, ..]`, kv_heads dividing q's heads; the
reading in `fsjax.reference.freesolo`); the kernels read each key/value head's state once for its query heads.
"""

import dataclasses

import jax
import jax.numpy as jnp

from fsjax.cache.layered import LayerSlice, read
from fsjax.ops import dispatch
from fsjax.ops.dense import local_attention
from fsjax.reference import cells as cells_ref
from fsjax.reference import freesolo as reference
from fsjax.reference.common import compute_dtype
from fsjax.reference.grouped import check_grouped_qkv
from fsjax.reference.routing import Routing
from pallas_kernels import cell_scoring
from pallas_kernels import sparse_readout as readout_kernel


def _facts(routing: Routing, head_dim):
  return dict(variant=routing.variant, cell=routing.cell, head_dim=head_dim, beam=routing.beam)


def select_from_summaries(
  q, positions, mean_keys, max_norms, *, routing: Routing, lam, sigma, impl="reference", ranges=False
):
  """FS / FS-L top-K cells from cell summaries (`fsjax.reference.cells.select_from_summaries`).

  Args:
    q: `[batch, T, heads, d]`; positions: `[batch, T]` or None for `0..T-1`; mean_keys `[batch, M, kv_heads, d]`,
      max_norms `[batch, M, kv_heads]`, or both `fsjax.cache.layered.LayerSlice`s of a scanned model's decode
      cache (the kernel reads the layer where it lies); lam, sigma: `[heads]`, or `LayerSlice`s of the scanned
      model's `[layers, heads]` stacks at the same layer (read the same way).
    ranges: return `(cells, scores)`: the kernel's candidates per cell range, unmerged
      (`pallas_kernels.cell_scoring.select_from_summaries(..., ranges=True)`), for a consumer that ranks them
      itself; on the reference path the top-K cells and None.

  Returns:
    `[batch, T, heads, K]` int32, -1 where fewer than K cells are available (see `ranges`).
  """
  if dispatch.resolve("select_from_summaries", impl, **_facts(routing, q.shape[-1])) == "reference":
    mean_keys, max_norms, lam, sigma = (read(x) for x in (mean_keys, max_norms, lam, sigma))
    cells = cells_ref.select_from_summaries(q, positions, mean_keys, max_norms, routing=routing, lam=lam, sigma=sigma)
    return (cells, None) if ranges else cells
  death = None
  if routing.variant == "fsl":  # FS-L's pool (Eq. 8) per key/value head, ranked once per sequence in float32
    death = cells_ref.retention_death_block(
      jax.lax.stop_gradient(read(max_norms)).astype(jnp.float32),
      cell=routing.cell,
      block=routing.block,
      retain_top=routing.retain_top,
    )
  layer = None
  if isinstance(max_norms, LayerSlice):  # the kernel reads the layer of the stacks where it lies
    layer, mean_keys, max_norms = max_norms.layer, mean_keys.stack, max_norms.stack
    lam, sigma = (x.stack if isinstance(x, LayerSlice) else x for x in (lam, sigma))
  else:
    lam, sigma = read(lam), read(sigma)
  return cell_scoring.select_from_summaries(
    q,
    positions,
    mean_keys,
    max_norms,
    death,
    layer=layer,
    variant=routing.variant,
    lam=lam,
    sigma=sigma,
    cell=routing.cell,
    block=routing.block,
    top_k=routing.top_k,
    retain_top=routing.retain_top,
    retain_recent=routing.retain_recent,
    ranges=ranges,
  )


def select_cells_routed(q, k, routing: Routing, *, lam=1.0, sigma=4.0, tau=None, impl="reference"):
  """`select_cells` with its geometry as one `Routing`."""
  if dispatch.resolve("select_cells", impl, **_facts(routing, q.shape[-1])) == "reference":
    return reference.select_cells_routed(q, k, routing, lam=lam, sigma=sigma, tau=tau)
  if q.shape[1] < routing.cell:
    return jnp.full(q.shape[:3] + (routing.top_k,), -1, jnp.int32)
  mean_keys, max_norms, _ = cells_ref.cell_summaries(jax.lax.stop_gradient(k).astype(jnp.float32), routing.cell)
  return select_from_summaries(q, None, mean_keys, max_norms, routing=routing, lam=lam, sigma=sigma, impl="pallas")


def select_cells(
  q,
  k,
  *,
  variant="fs",
  lam=1.0,
  sigma=4.0,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  tau=None,
  beam=16,
  bound_c=8.0,
  impl="reference",
):
  """Per query and head, the cells the long-range branch reads (FS Eq. 5-8, FS-B Eq. 10-12); the reference's
  `select_cells` plus `impl` (the kernel scores FS and FS-L). `[batch, T, heads, K]` int32, -1 for none."""
  routing = Routing(
    variant=variant,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
    beam=beam,
    bound_c=bound_c,
  )
  return select_cells_routed(q, k, routing, lam=lam, sigma=sigma, tau=tau, impl=impl)


def sparse_readout(q, k, v, cell_idx, *, cell, impl="reference"):
  """Eq. 9 before the norm over the selected cells (the reference's `sparse_readout` plus `impl`).

  Returns:
    `u` `[batch, T, heads, d]` in at least float32 (the kernel's in the dtype of `q`), zero where no cell is
    selected.
  """
  if dispatch.resolve("sparse_readout", impl, cell=cell, head_dim=q.shape[-1]) == "reference":
    dtype = compute_dtype(q.dtype)
    return reference.sparse_readout(q.astype(dtype), k.astype(dtype), v.astype(dtype), cell_idx, cell=cell)
  return readout_kernel.sparse_readout(q, k, v, cell_idx, cell=cell)


def cached_readout(q, k, v, cell_idx, *, cell, impl="reference"):
  """Eq. 9 before the norm for queries reading a decode cache's keys `k, v` `[batch, N, kv_heads, d]`: a chunk reads
  through the readout kernel where `impl` selects it; a single token gathers its K cells with XLA, which reads a
  scanned model's stacked cache in place where a kernel would be handed a copy of the layer
  (`fsjax.cache.layered`). The cache is never converted whole: only the gathered cells are.

  Returns:
    `u` `[batch, C, heads, d]`.
  """
  if cached_readout_runs_kernel(q, cell=cell, impl=impl):
    return readout_kernel.sparse_readout(q, k, v, cell_idx, cell=cell)
  return reference.sparse_readout(q, k, v, cell_idx, cell=cell)


def cached_readout_runs_kernel(q, *, cell, impl="reference"):
  """Whether `cached_readout` of queries `q` `[batch, C, heads, d]` runs the readout kernel, which is handed a
  copy of the keys and values it reads (for a scanned model, the whole layer) instead of gathering in place."""
  return q.shape[1] > 1 and dispatch.resolve("sparse_readout", impl, cell=cell, head_dim=q.shape[-1]) == "pallas"


def long_range_routed(q, k, v, routing: Routing, *, lam=1.0, sigma=4.0, lr_gain=1.0, tau=None, impl="reference"):
  """`freesolo_long_range` with its geometry as one `Routing`."""
  check_grouped_qkv(q, k, v)
  reference.check_routing(routing, tau)
  if dispatch.resolve("freesolo_long_range", impl, **_facts(routing, q.shape[-1])) == "reference":
    return reference.freesolo_long_range(
      q, k, v, lam=lam, sigma=sigma, lr_gain=lr_gain, tau=tau, **dataclasses.asdict(routing)
    )
  # FS-B selects with the reference forests; FS and FS-L with the scoring kernel. Both read with the kernel.
  select_impl = "reference" if routing.variant == "fsb" else "pallas"
  cell_idx = select_cells_routed(q, k, routing, lam=lam, sigma=sigma, tau=tau, impl=select_impl)
  dtype = compute_dtype(q.dtype)
  u = sparse_readout(q, k, v, cell_idx, cell=routing.cell, impl="pallas").astype(dtype)
  return reference.rms_norm(u, jnp.asarray(lr_gain, dtype)).astype(q.dtype)


def freesolo_long_range(
  q,
  k,
  v,
  *,
  variant="fs",
  lam=1.0,
  sigma=4.0,
  lr_gain=1.0,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  tau=None,
  beam=16,
  bound_c=8.0,
  window=512,
  impl="reference",
):
  """Long-range branch `o_lr = RMSNorm(u)` (FS Eq. 5-9): the reference's `freesolo_long_range` plus `impl`.
  With kernels, FS-B still selects with the reference forests and reads with the readout kernel.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`.
  """
  routing = Routing(
    variant=variant,
    window=window,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
    beam=beam,
    bound_c=bound_c,
  )
  return long_range_routed(q, k, v, routing, lam=lam, sigma=sigma, lr_gain=lr_gain, tau=tau, impl=impl)


def attention_routed(
  q, k, v, routing: Routing, *, alpha, lam=1.0, sigma=4.0, lr_gain=1.0, tau=None, rope_theta=10000.0, impl="reference"
):
  """`freesolo_attention` with its geometry as one `Routing`."""
  check_grouped_qkv(q, k, v)
  long_range = long_range_routed(q, k, v, routing, lam=lam, sigma=sigma, lr_gain=lr_gain, tau=tau, impl=impl)
  local = local_attention(
    q, k, v, window=routing.window, rope_theta=rope_theta, impl=dispatch.for_op("local_attention", impl)
  )
  return reference.mix_branches(local, long_range, alpha)


def freesolo_attention(
  q,
  k,
  v,
  *,
  variant="fs",
  alpha,
  lam=1.0,
  sigma=4.0,
  lr_gain=1.0,
  window=512,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  tau=None,
  beam=16,
  bound_c=8.0,
  rope_theta=10000.0,
  impl="reference",
):
  """FreeSolo attention `o = o_sr + α o_lr` (FS Eq. 2): the reference's `freesolo_attention` plus `impl`. With a
  fast `impl`, the long-range branch runs on the Pallas kernels and a half-precision local branch on a GPU on
  cuDNN.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`.
  """
  routing = Routing(
    variant=variant,
    window=window,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
    beam=beam,
    bound_c=bound_c,
  )
  return attention_routed(
    q, k, v, routing, alpha=alpha, lam=lam, sigma=sigma, lr_gain=lr_gain, tau=tau, rope_theta=rope_theta, impl=impl
  )
