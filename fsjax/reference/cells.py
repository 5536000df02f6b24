"""FreeSolo cells: summaries, causal availability, FS-L retention, scoring and top-K (FS Eq. 5-8).

Conventions (docs/design.md §3-4): cell `c` holds positions `[c*s, (c+1)*s)`; query `i` sits in the block starting
at `b_i = B*floor(i/B)`; block `n` sees the `m_n = n*B/s` cells before it. Only complete cells exist: a trailing
partial cell can never be eligible (its end lies past every query's block start).
"""

import math

import jax
import jax.numpy as jnp

from fsjax.reference.common import PRECISION
from fsjax.reference.grouped import per_query_head


def cell_summaries(k, cell):
  """Mean key, max key norm and center of every complete cell (FS Eq. 5).

  Args:
    k: `[batch, seq, kv_heads, head_dim]` unrotated keys (a summary per key/value head, whatever reads it).
    cell: cell size `s`.

  Returns:
    mean_keys `[batch, M, kv_heads, head_dim]`, max_norms `[batch, M, kv_heads]`, centers `[M]` with
    `M = seq // s`.
  """
  batch, seq, heads, head_dim = k.shape
  num_cells = seq // cell
  k_cells = k[:, : num_cells * cell].reshape(batch, num_cells, cell, heads, head_dim)
  mean_keys = jnp.mean(k_cells, axis=2)
  max_norms = jnp.max(jnp.linalg.norm(k_cells, axis=-1), axis=2)
  centers = (jnp.arange(num_cells) + 0.5) * cell
  return mean_keys, max_norms, centers


def first_eligible_block(cell_index, *, cell, block):
  """Index of the first query block whose prefix contains the cell: smallest n with (c+1)s <= nB (Eq. 6)."""
  return ((cell_index + 1) * cell + block - 1) // block


def retention_death_block(max_norms, *, cell, block, retain_top):
  """First block at which each cell is no longer among the top-P eligible cells by max key norm (FS Eq. 8).

  A cell is in block n's pool `TopP_{C_n}(a)` while fewer than P eligible cells outrank it (larger `a`, or equal
  `a` and lower index). Cells only arrive, so that count never falls: once out, a cell never returns. Its death
  block is the eligibility block of its P-th lowest-index outranker, computed once per sequence.

  The ranking reads only `a_c`, a key statistic, so with grouped-query attention each key/value head has one
  pool, shared by the query heads that read it.

  Args:
    max_norms: `[batch, M, kv_heads]` priorities `a_c`.
    cell, block, retain_top: `s`, `B`, `P`.

  Returns:
    `[batch, M, kv_heads]` int32 death blocks; a cell with fewer than P outrankers never dies (int32 max).
  """
  num_cells = max_norms.shape[1]
  idx = jnp.arange(num_cells)
  a = jnp.moveaxis(max_norms, 1, -1)  # [batch, heads, M]
  a_other, a_self = a[..., :, None], a[..., None, :]
  outranks = (a_other > a_self) | ((a_other == a_self) & (idx[:, None] < idx[None, :]))  # [.., c', c]
  reached = jnp.cumsum(outranks, axis=-2, dtype=jnp.int32) >= retain_top
  pth_outranker = jnp.argmax(reached, axis=-2)
  death = jnp.where(
    jnp.any(reached, axis=-2), first_eligible_block(pth_outranker, cell=cell, block=block), jnp.iinfo(jnp.int32).max
  )
  return jnp.moveaxis(death, -1, 1).astype(jnp.int32)


def available_cells(max_norms, num_queries, *, variant, cell, block, retain_top, retain_recent, positions=None):
  """Cells each query may score: `C_i` for FS (Eq. 6), `Recent_W(C_i) ∪ TopP_{C_i}(a)` for FS-L (Eq. 8).

  TopP ranges over all eligible cells, so a recent cell may also be a top-P cell and `|A_i| <= P + W`;
  Recent_W is the W highest-index eligible cells (all of them when fewer).

  Args:
    max_norms: `[batch, M, kv_heads]`.
    num_queries: sequence length `T`.
    variant: "fs" or "fsl".
    positions: `[batch, T]` query positions (decoding); None means `0..T-1`.

  Returns:
    `[batch, T, kv_heads, M]` boolean availability (a function of the keys and the position only).
  """
  batch, num_cells, heads = max_norms.shape
  if positions is None:
    positions = jnp.arange(num_queries)[None]
  query_block = positions // block  # [batch|1, T]
  num_eligible = query_block * (block // cell)  # m_n
  c = jnp.arange(num_cells)
  eligible = c < num_eligible[..., None]  # [batch|1, T, M]
  available = jnp.broadcast_to(eligible[:, :, None, :], (batch, num_queries, heads, num_cells))
  if variant == "fs":
    return available
  recent = c >= num_eligible[..., None] - retain_recent  # [batch|1, T, M]
  death = retention_death_block(max_norms, cell=cell, block=block, retain_top=retain_top)  # [batch, M, heads]
  in_pool = query_block[:, :, None, None] < jnp.moveaxis(death, 1, -1)[:, None]  # [batch, T, heads, M]
  return available & (recent[:, :, None, :] | in_pool)


def cell_scores(q, mean_keys, max_norms, centers, *, lam, sigma, positions=None):
  """Eq. 7: `r_ic = q_i·k̄_c/√d + λ_h a_c erf((i − p_c)/(2σ_h))`, with the query's own position i.

  Args:
    q: `[batch, T, heads, d]` unrotated queries.
    mean_keys: `[batch, M, heads, d]`; max_norms: `[batch, M, heads]`; centers: `[M]`.
    lam, sigma: `[heads]`.
    positions: `[batch, T]` query positions (decoding); None means `0..T-1`.

  Returns:
    `[batch, T, heads, M]` scores (unmasked).
  """
  head_dim = q.shape[-1]
  content = jnp.einsum("bthd,bmhd->bthm", q, mean_keys, precision=PRECISION) / math.sqrt(head_dim)
  if positions is None:
    positions = jnp.arange(q.shape[1])[None]
  distance = positions.astype(q.dtype)[:, :, None] - centers.astype(q.dtype)  # [batch|1, T, M]
  prior = jax.scipy.special.erf(distance[:, :, None, :] / (2.0 * sigma[:, None]))  # [batch|1, T, heads, M]
  return content + lam[:, None] * jnp.moveaxis(max_norms, 1, -1)[:, None] * prior


def top_k_cells(scores, available, top_k):
  """The `min(K, |A_i|)` highest-scoring available cells; ties go to the lower cell index.

  Args:
    scores: `[batch, T, heads, M]`.
    available: `[batch, T, heads, M]` boolean.
    top_k: K.

  Returns:
    `[batch, T, heads, K]` int32 cell indices in decreasing score order, -1 in unused slots.
  """
  num_cells = scores.shape[-1]
  k = min(top_k, num_cells)
  masked = jnp.where(available, scores, -jnp.inf)
  _, idx = jax.lax.top_k(masked, k)  # lax.top_k puts the lower index first among equal values
  valid = jnp.take_along_axis(available, idx, axis=-1)
  idx = jnp.where(valid, idx, -1).astype(jnp.int32)
  return jnp.pad(idx, ((0, 0),) * 3 + ((0, top_k - k),), constant_values=-1)


def select_from_summaries(q, positions, mean_keys, max_norms, *, routing, lam, sigma):
  """FS / FS-L selection (Eq. 6-8) from cell summaries for queries at `positions`: what a decode step or a
  prefill chunk scores against the cached summaries, and what `select_cells` scores in training.

  Grouped-query attention: the summaries and FS-L's pool are those of the key/value head `h // group` that
  query head h reads; the scores (with h's own λ_h, σ_h) and the top K are per query head.

  Args:
    q: `[batch, T, heads, d]` unrotated queries.
    positions: `[batch, T]` query positions; None means `0..T-1`.
    mean_keys: `[batch, M, kv_heads, d]`; max_norms: `[batch, M, kv_heads]` (Eq. 5); kv_heads divides heads.
    routing: a `Routing` with variant "fs" or "fsl".
    lam, sigma: `[heads]` (Eq. 7).

  Returns:
    `[batch, T, heads, K]` int32 cell indices, best first, -1 where fewer than K cells are available.
  """
  q = jax.lax.stop_gradient(q)
  heads = q.shape[2]
  centers = (jnp.arange(max_norms.shape[1]) + 0.5) * routing.cell
  available = available_cells(
    max_norms,
    q.shape[1],
    variant=routing.variant,
    cell=routing.cell,
    block=routing.block,
    retain_top=routing.retain_top,
    retain_recent=routing.retain_recent,
    positions=positions,
  )  # Eq. 6, 8
  available = per_query_head(available, heads, axis=2)
  mean_keys, max_norms = per_query_head(mean_keys, heads, axis=2), per_query_head(max_norms, heads, axis=2)
  scores = cell_scores(q, mean_keys, max_norms, centers, lam=lam, sigma=sigma, positions=positions)  # Eq. 7
  return top_k_cells(scores, available, routing.top_k)
