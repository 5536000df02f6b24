"""FS archive cache: every raw key/value (unrotated) plus cell summaries completed as tokens arrive, and a ring of
the last w + 1 RoPE-rotated keys for the local branch (Eq. 3-4), as FS-L's bounded cache keeps it: a step's local
branch reads its window where it lies instead of rotating it again at every token, and the one-token kernel
(`pallas_kernels.archive_decode`) reads the ring as FS-L's reads its own.

Exact for FS and FS-L (FS-L availability is evaluated with the same death blocks as the masked operator) and
for FS-B (each step rebuilds the forests from the cached summaries with the prefill formulation, O(M log M) per
step: the reference for `fsjax.cache.forest`, which keeps them instead); its memory grows with the sequence.
FS-L's bounded cache replaces it where constant memory matters. The attention that reads it is
`fsjax.attention.freesolo_step`.
"""

import flax.struct
import jax
import jax.numpy as jnp

from fsjax.cache import store as kv
from fsjax.cache.layered import read, scatter


@flax.struct.dataclass
class Archive:
  """tokens: a KVStore of unrotated keys with capacity = max length (slot = position); ring: a KVStore of the last
  w + 1 rotated keys (slot = position mod (w + 1)); mean_keys `[batch, M, heads, d]` and max_norms `[batch, M,
  heads]` of cells (Eq. 5), M = capacity / s. In a scanned model's decode step each array is a
  `layered.LayerSlice`: read them with `layered.read`."""

  tokens: kv.KVStore
  ring: kv.KVStore
  mean_keys: jax.Array
  max_norms: jax.Array


def empty_archive(batch, capacity, heads, head_dim, cell, window, dtype=jnp.float32):
  if capacity % cell:
    raise ValueError(f"archive capacity ({capacity}) must be a multiple of cell ({cell})")
  num_cells = capacity // cell
  return Archive(
    tokens=kv.empty_store(batch, capacity, heads, head_dim, dtype),
    ring=kv.empty_store(batch, window + 1, heads, head_dim, dtype),
    mean_keys=jnp.zeros((batch, num_cells, heads, head_dim), dtype),
    max_norms=jnp.zeros((batch, num_cells, heads), dtype),
  )


def extend(archive: Archive, k, k_rot, v, pos, valid, cell):
  """Writes a chunk (raw keys into the tokens, rotated ones into the ring) and recomputes the summaries of the
  cells it touched.

  A cell's summary is complete once its last token is written; an incomplete one is never eligible (Eq. 6),
  and is recomputed when its last token arrives.

  Args:
    k, k_rot, v: `[batch, C, heads, d]` (k_rot RoPE-rotated at `pos`); pos, valid: `[batch, C]`.
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
  return Archive(
    tokens=tokens,
    ring=kv.write(archive.ring, k_rot, v, pos, valid),
    mean_keys=scatter(archive.mean_keys, (rows, touched), jnp.mean(keys, axis=2)),
    max_norms=scatter(archive.max_norms, (rows, touched), jnp.max(jnp.linalg.norm(keys, axis=-1), axis=2)),
  )
