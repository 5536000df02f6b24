"""Attention of queries at positions over cached keys at positions: the maths every decode step shares (the dense
cache and SWA ring of the baselines, FreeSolo's local branch, ZHA's reached keys).

Masks come from positions, never from slot order, so a ring and a full buffer give the same result whenever the
ring holds the window.
"""

import math

import jax.numpy as jnp

from fsjax.reference.common import PRECISION
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
    k, v: `[batch, N, heads, d]`; k_pos: `[batch, N]` (-1 = empty slot).
    window: look-back radius, None for unbounded.
    extra_mask: optional `[batch, heads, C, N]` bool, and-ed into the mask (MoBA's block selection).

  Returns:
    `[batch, C, heads, d]` float32 (or wider), zero for a query that sees nothing.
  """
  mask = visible(q_pos, k_pos, window)[:, None]
  if extra_mask is not None:
    mask &= extra_mask
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=PRECISION) / math.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", masked_softmax(logits, mask), v, precision=PRECISION)


def attend_one(q, q_pos, k, v, k_pos, window=None):
  """`attend` for one query per row, as elementwise products and sums that XLA fuses with reading the keys and
  values once, in their storage dtype. A matrix product would be handed a copy of a scanned model's layer
  (`fsjax.cache.layered`), converted to float32 at the reference's precision.

  Args: as `attend`, with q `[batch, 1, heads, d]` and q_pos `[batch, 1]`.

  Returns:
    `[batch, 1, heads, d]` in q's dtype promoted to at least float32.
  """
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  mask = visible(q_pos, k_pos, window)[:, 0, :, None]  # [batch, N, 1]
  logits = jnp.sum(q.astype(dtype) * k, axis=-1, dtype=dtype) / math.sqrt(q.shape[-1])  # [batch, N, heads]
  probs = masked_softmax(logits, mask, axis=1)
  return jnp.sum(probs[..., None] * v, axis=1, keepdims=True, dtype=dtype)
