"""FS archive cache: every raw key/value (unrotated) plus cell summaries completed as tokens arrive.

Exact for FS and FS-L (FS-L availability is evaluated with the same death blocks as the masked operator) and
for FS-B (each step rebuilds the forests from the cached summaries with the prefill formulation, O(M log M) per
step: the reference for `fsjax.cache.forest`, which keeps them instead); its memory grows with the sequence.
FS-L's bounded cache replaces it where constant memory matters.
"""

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache import store as kv
from fsjax.cache.layered import read, scatter
from fsjax.ops import cells, forest
from fsjax.ops.freesolo import rms_norm, sparse_readout, use_kernels
from fsjax.ops.rope import apply_rope


@flax.struct.dataclass
class Archive:
  """tokens: a KVStore of unrotated keys with capacity = max length (slot = position);
  mean_keys `[batch, M, heads, d]` and max_norms `[batch, M, heads]` of cells (Eq. 5), M = capacity / s. In a
  scanned model's decode step each array is a `layered.LayerSlice`: read them with `layered.read`."""
  tokens: kv.KVStore
  mean_keys: jax.Array
  max_norms: jax.Array


def empty_archive(batch, capacity, heads, head_dim, cell, dtype=jnp.float32):
  if capacity % cell:
    raise ValueError(f"archive capacity ({capacity}) must be a multiple of cell ({cell})")
  num_cells = capacity // cell
  return Archive(tokens=kv.empty_store(batch, capacity, heads, head_dim, dtype),
                 mean_keys=jnp.zeros((batch, num_cells, heads, head_dim), dtype),
                 max_norms=jnp.zeros((batch, num_cells, heads), dtype))


def extend(archive: Archive, k, v, pos, valid, cell):
  """Writes a chunk and recomputes the summaries of the cells it touched.

  A cell's summary is complete once its last token is written; an incomplete one is never eligible (Eq. 6),
  and is recomputed when its last token arrives.
  """
  tokens = kv.write(archive.tokens, k, v, pos, valid)
  batch, chunk = pos.shape
  first_cell = jnp.min(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max), axis=1) // cell  # [batch]
  num_cells = archive.max_norms.shape[1]
  touched = jnp.minimum(first_cell[:, None] + jnp.arange(chunk // cell + 2), num_cells - 1)  # [batch, n]
  slots = touched[:, :, None] * cell + jnp.arange(cell)  # [batch, n, s]
  keys = jnp.take_along_axis(read(tokens.k), slots.reshape(batch, -1)[:, :, None, None], axis=1)
  keys = keys.reshape(batch, touched.shape[1], cell, *keys.shape[2:])  # [batch, n, s, heads, d]
  rows = jnp.arange(batch)[:, None]
  return Archive(tokens=tokens,
                 mean_keys=scatter(archive.mean_keys, (rows, touched), jnp.mean(keys, axis=2)),
                 max_norms=scatter(archive.max_norms, (rows, touched),
                                   jnp.max(jnp.linalg.norm(keys, axis=-1), axis=2)))


def local_branch(archive: Archive, q, pos, *, window, rope_theta):
  """Eq. 3-4 for queries at `pos` `[batch, C]` (consecutive per row) over the archived keys (the chunk must
  already be written). Reads only the `window + C` slots each row's chunk can see, so a step costs O(w), not
  O(archive length)."""
  tokens = archive.tokens
  span = min(window + q.shape[1], tokens.capacity)
  start = jnp.clip(jnp.min(pos, axis=1) - window, 0, tokens.capacity - span)  # slot = position
  window_of = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, span, axis=0))
  k, v, k_pos = (window_of(read(x), start) for x in (tokens.k, tokens.v, tokens.pos))
  k_rot = apply_rope(k, jnp.maximum(k_pos, 0), rope_theta)
  return kv.attend(apply_rope(q, pos, rope_theta), pos, k_rot, v, k_pos, window=window)


def select_from_archive(archive: Archive, q, pos, *, variant, lam, sigma, cell, block, top_k, retain_top,
                        retain_recent, tau=None, beam=16, bound_c=8.0, kernels=False):
  """Top-K cells (Eq. 6-8; FS-B Eq. 10-12) for queries at `pos`: `[batch, C, heads, K]`, -1 for none. No
  gradient."""
  if variant == "fsb":
    return forest.fsb_select_from_summaries(q, pos, read(archive.tokens.k).astype(q.dtype),
                                            read(archive.mean_keys).astype(q.dtype),
                                            read(archive.max_norms).astype(q.dtype),
                                            tau=tau, lam=lam, sigma=sigma, cell=cell, block=block, top_k=top_k,
                                            beam=beam, bound_c=bound_c)
  routing = dict(variant=variant, lam=lam, sigma=sigma, cell=cell, block=block, top_k=top_k,
                 retain_top=retain_top, retain_recent=retain_recent)
  mean_keys, max_norms = read(archive.mean_keys), read(archive.max_norms)
  if kernels:
    from pallas_kernels import cell_scoring  # lazy: the kernels import ops
    return cell_scoring.select_from_summaries(q, pos, mean_keys, max_norms, **routing)
  num_cells = max_norms.shape[1]
  q = jax.lax.stop_gradient(q)
  centers = (jnp.arange(num_cells) + 0.5) * cell
  available = cells.available_cells(max_norms, q.shape[1], variant=variant, cell=cell, block=block,
                                    retain_top=retain_top, retain_recent=retain_recent, positions=pos)
  scores = cells.cell_scores(q, mean_keys, max_norms, centers, lam=lam, sigma=sigma, positions=pos)
  return cells.top_k_cells(scores, available, top_k)


def long_range_branch(archive: Archive, q, pos, *, lr_gain, impl="reference", selected=None, **routing):
  """Eq. 9 for queries at `pos`: `(o_lr [batch, C, heads, d], selected cells [batch, C, heads, K])`.

  `impl` as in `ops.freesolo_long_range`: with kernels, selection and readout run in Pallas, except a one-token
  step's readout: its K cells are gathered by XLA from the archive in place, where the kernel would be handed a
  copy of a scanned model's layer (`fsjax.cache.layered`). `selected`: cells already chosen
  `[batch, C, heads, K]` (by the FS-B forest cache), else chosen here.
  """
  kernels = use_kernels(impl, cell=routing["cell"], head_dim=q.shape[-1])
  cell_idx = selected
  if cell_idx is None:
    cell_idx = select_from_archive(archive, q, pos, kernels=kernels and routing["variant"] != "fsb", **routing)
  keys, values = read(archive.tokens.k), read(archive.tokens.v)
  if kernels and q.shape[1] > 1:
    from pallas_kernels import sparse_readout as readout_kernel
    u = readout_kernel.sparse_readout(q, keys, values, cell_idx, cell=routing["cell"])
  else:
    u = sparse_readout(q, keys, values, cell_idx, cell=routing["cell"])
  return rms_norm(u.astype(q.dtype), lr_gain), cell_idx
