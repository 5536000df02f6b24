"""Attention of queries at positions over cached keys at positions: the maths every decode step shares (the dense
cache and SWA ring of the baselines, FreeSolo's local branch, ZHA's reached keys).

Masks come from positions, never from slot order, so a ring and a full buffer give the same result whenever the
ring holds the window. Caches may hold fewer key/value heads than there are query heads (grouped-query attention,
`fsjax.reference.grouped`): query head h reads key/value head `h // group`.
"""

import math

import jax
import jax.numpy as jnp

from fsjax.cache.layered import read
from fsjax.reference.grouped import group_size, grouped_logits, grouped_readout
from fsjax.reference.softmax import masked_softmax


def visible(q_pos, k_pos, window=None):
  """`[batch, C, N]` bool: key slot n is filled and `0 <= q_pos - k_pos <= window` (no bound for None)."""
  offset = q_pos[:, :, None] - k_pos[:, None, :]
  mask = (k_pos[:, None, :] >= 0) & (offset >= 0)
  return mask if window is None else mask & (offset <= window)


def attend(q, q_pos, k, v, k_pos, window=None, extra_mask=None):
  """Softmax attention of queries at positions over keys at positions: `j <= i` and `i - j <= window`.

  Args:
    q: `[batch, C, heads, d]`; q_pos: `[batch, C]`.
    k, v: `[batch, N, kv_heads, d]`; k_pos: `[batch, N]` (-1 = empty slot).
    window: look-back radius, None for unbounded.
    extra_mask: optional `[batch, heads, C, N]` bool, and-ed into the mask (MoBA's block selection).

  Returns:
    `[batch, C, heads, d]` float32 (or wider), zero for a query that sees nothing.
  """
  mask = visible(q_pos, k_pos, window)[:, None]
  if extra_mask is not None:
    mask &= extra_mask
  logits = grouped_logits(q, k) / math.sqrt(q.shape[-1])
  return grouped_readout(masked_softmax(logits, mask), v)


def attend_one(q, q_pos, k, v, k_pos, window=None):
  """`attend` for one query per row, as elementwise products and sums that XLA fuses with reading the keys and
  values once, in their storage dtype. A matrix product would be handed a copy of a scanned model's layer
  (`fsjax.cache.layered`), converted to float32 at the reference's precision.

  Args: as `attend`, with q `[batch, 1, heads, d]` and q_pos `[batch, 1]`.

  Returns:
    `[batch, 1, heads, d]` in q's dtype promoted to at least float32.
  """
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  batch, _, heads, dim = q.shape
  kv_heads = k.shape[2]
  group = group_size(heads, kv_heads)
  q = q.astype(dtype)
  mask = visible(q_pos, k_pos, window)[:, 0, :, None]  # [batch, N, 1]
  if group > 1:  # a key/value head's queries on an axis of their own; multi-head shapes (and XLA's fusions) stay
    q, k, v, mask = q.reshape(batch, 1, kv_heads, group, dim), k[:, :, :, None], v[:, :, :, None], mask[..., None]
  logits = jnp.sum(q * k, axis=-1, dtype=dtype) / math.sqrt(dim)  # [batch, N, kv_heads(, group)]
  probs = masked_softmax(logits, mask, axis=1)
  out = jnp.sum(probs[..., None] * v, axis=1, keepdims=True, dtype=dtype)
  return out.reshape(batch, 1, heads, dim)


def by_head_groups(attend_heads, groups, q, k, v, *per_head):
  """`attend_heads(q, k, v, *per_head)` (`[batch, T, h, ...]` arrays → `[batch, T, h, d]`) run on `groups` equal
  groups of heads in turn and joined: the same result when heads do not interact, with one group's keys and
  values read at a time. A library call or kernel is handed its own copy of a scanned model's cache layer
  (`fsjax.cache.layered`), so this bounds that copy by the group's share (`fsjax.ops.dispatch.cache_head_groups`).

  q and each of `per_head` (e.g. selected cells `[batch, T, heads, K]`): heads on axis 2; k, v: `[batch, N,
  kv_heads, d]` arrays or `LayerSlice`s of a scanned model's cache, `groups` dividing kv_heads; a group of
  key/value heads goes with the query heads that read them. Each group's slices wait for the previous group's
  output, so XLA cannot read every group at once (it merges independent slices of one array into one fusion,
  whose outputs would all be live together).
  """
  kv_heads = k.shape[2]
  if kv_heads % groups:
    raise ValueError(f"groups must divide the {kv_heads} key/value heads, got {groups}")
  if groups == 1:
    return attend_heads(q, read(k), read(v), *per_head)
  size = kv_heads // groups
  per_kv = group_size(q.shape[2], kv_heads)  # query heads per key/value head
  outputs = []
  for start in range(0, kv_heads, size):
    if outputs:
      k, v, _ = jax.lax.optimization_barrier((k, v, outputs[-1]))
    part, q_part = slice(start, start + size), slice(start * per_kv, (start + size) * per_kv)
    outputs.append(
      attend_heads(q[:, :, q_part], read(k)[:, :, part], read(v)[:, :, part], *(x[:, :, q_part] for x in per_head))
    )
  return jnp.concatenate(outputs, axis=2)
