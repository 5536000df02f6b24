"""Causal sliding-window RoPE attention: FreeSolo's local branch (FS Eq. 3-4), SWA and TF++; with grouped-query
attention (`fsjax.reference.grouped`) for the baselines of Hugging Face checkpoints."""

import math

import jax.numpy as jnp

from fsjax.reference.common import compute_dtype
from fsjax.reference.grouped import check_grouped_qkv, grouped_logits, grouped_readout
from fsjax.reference.rope import apply_rope
from fsjax.reference.softmax import masked_softmax

# Queries are processed in chunks of this many positions; each chunk reads `window + QUERY_CHUNK` keys, so
# memory is O(T * window), never [T, T] unless the window covers the sequence.
QUERY_CHUNK = 128


def local_attention(q, k, v, *, window, rope_theta=10000.0):
  """Causal attention over `L_i = {j : 0 <= j <= i, i - j <= window}` with RoPE (FS Eq. 3-4).

  A full window holds `window + 1` tokens. `window >= seq - 1` is full causal attention (TF++).

  Args:
    q: `[batch, seq, heads, head_dim]`, unrotated; head_dim even.
    k, v: `[batch, seq, kv_heads, head_dim]`, unrotated; kv_heads divides heads (query head h reads key/value
      head `h // (heads // kv_heads)`; equal heads is multi-head attention).
    window: look-back radius `w >= 0`.
    rope_theta: RoPE base θ, or a `fsjax.reference.rope.RoPE`.

  Returns:
    `o_sr`: `[batch, seq, heads, head_dim]` in the dtype of `q`.
  """
  check_grouped_qkv(q, k, v)
  if window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  if q.shape[-1] % 2:
    raise ValueError(f"head_dim must be even for RoPE, got {q.shape[-1]}")
  batch, seq, heads, head_dim = q.shape
  dtype = compute_dtype(q.dtype)
  positions = jnp.arange(seq)
  q_rot = apply_rope(q.astype(dtype), positions, rope_theta)
  k_rot = apply_rope(k.astype(dtype), positions, rope_theta)
  v = v.astype(dtype)

  window = min(window, seq - 1)
  chunk = min(seq, QUERY_CHUNK)
  num_chunks = -(-seq // chunk)
  padded = num_chunks * chunk
  q_rot = jnp.pad(q_rot, ((0, 0), (0, padded - seq), (0, 0), (0, 0)))
  q_chunks = q_rot.reshape(batch, num_chunks, chunk, heads, head_dim)

  # Chunk n reads key positions [n*chunk - window, n*chunk + chunk).
  starts = jnp.arange(num_chunks) * chunk
  query_pos = starts[:, None] + jnp.arange(chunk)  # [n, chunk]
  key_pos = starts[:, None] - window + jnp.arange(window + chunk)  # [n, window + chunk]
  offset = query_pos[:, :, None] - key_pos[:, None, :]
  mask = (key_pos[:, None, :] >= 0) & (offset >= 0) & (offset <= window)  # [n, chunk, span]
  safe_pos = jnp.clip(key_pos, 0, seq - 1)
  k_span = k_rot[:, safe_pos]  # [batch, n, span, heads, d]
  v_span = v[:, safe_pos]

  logits = grouped_logits(q_chunks, k_span) / math.sqrt(head_dim)  # [batch, n, heads, chunk, span]
  probs = masked_softmax(logits, mask[None, :, None])
  out = grouped_readout(probs, v_span)
  return out.reshape(batch, padded, heads, head_dim)[:, :seq].astype(q.dtype)
