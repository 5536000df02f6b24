"""Baselines the papers compare against: TF++ (full causal RoPE), SWA (RoPE window) and MoBA.

MoBA (Lu et al., 2025) leaves freedom that FS does not pin down; our choices:
- the sequence is cut into blocks of `moba_block` tokens (default 512 with `moba_top_k=3`, MoBA's own
  small-scale setting);
- the current (query's own) block is always read, causally, and counts as one of the `moba_top_k` blocks;
  the other `moba_top_k - 1` are the fully past blocks with the largest gate `q_i · mean(k over block)`;
- the gate uses the RoPE-rotated q and k, as MoBA's implementation gates inside attention after RoPE;
- ties go to the lower block index; the softmax runs jointly over all selected tokens.

Every baseline takes fewer key/value heads than query heads (grouped-query attention, `fsjax.reference.grouped`):
a MoBA query head gates with the mean keys of the key/value head it reads.
"""

import math

import jax
import jax.numpy as jnp

from fsjax.reference.common import compute_dtype
from fsjax.reference.grouped import check_grouped_qkv, grouped_logits, grouped_readout
from fsjax.reference.local import local_attention
from fsjax.reference.rope import apply_rope
from fsjax.reference.softmax import masked_softmax

SWA_WINDOW = 512


def tfpp_attention(q, k, v, *, rope_theta=10000.0):
  """TF++: full causal RoPE attention. q `[batch, T, heads, d]`, k, v `[batch, T, kv_heads, d]` →
  `[batch, T, heads, d]`."""
  return local_attention(q, k, v, window=max(q.shape[1] - 1, 0), rope_theta=rope_theta)


def swa_attention(q, k, v, *, window=SWA_WINDOW, rope_theta=10000.0):
  """Sliding-window RoPE attention over `i - window <= j <= i`. Shapes as `tfpp_attention`."""
  return local_attention(q, k, v, window=window, rope_theta=rope_theta)


def moba_mean_keys(k_rot, moba_block):
  """Each key block's mean key, the gate's key side: `[batch, T, kv_heads, d]` → `[batch, ⌈T / moba_block⌉,
  kv_heads, d]`. The last block is averaged with zero padding; it is never fully past for any query, so never
  gated."""
  batch, seq, kv_heads, head_dim = k_rot.shape
  num_blocks = -(-seq // moba_block)
  k_pad = jnp.pad(k_rot, ((0, 0), (0, num_blocks * moba_block - seq), (0, 0), (0, 0)))
  return k_pad.reshape(batch, num_blocks, moba_block, kv_heads, head_dim).mean(axis=2)


def moba_chosen_blocks(q_rot, q_pos, mean_keys, *, moba_block, moba_top_k):
  """The key blocks each query reads: its own block plus the top `moba_top_k - 1` fully past blocks by the gate
  `q_rot · mean_keys` (lower index wins ties).

  Args:
    q_rot: `[batch, C, heads, d]` rotated queries at positions `q_pos` (`[C]` or `[batch, C]`).
    mean_keys: `[batch, num_blocks, kv_heads, d]` (`moba_mean_keys`).

  Returns:
    `[batch, heads, C, num_blocks]` boolean.
  """
  num_blocks = mean_keys.shape[1]
  gate = grouped_logits(q_rot, mean_keys)  # [batch, heads, C, num_blocks]
  own = (q_pos // moba_block)[..., None]  # [(batch,) C, 1]
  if own.ndim == 3:
    own = own[:, None]  # [batch, 1, C, 1]
  blocks = jnp.arange(num_blocks)
  past = blocks < own
  chosen = jnp.zeros(gate.shape, bool)
  num_past = min(moba_top_k - 1, num_blocks)
  if num_past > 0:
    _, top = jax.lax.top_k(jnp.where(past, gate, -jnp.inf), num_past)  # lower index wins ties
    chosen = jnp.any(jax.nn.one_hot(top, num_blocks, dtype=bool), axis=-2) & past
  return chosen | (blocks == own)


def moba_block_mask(q_rot, k_rot, *, moba_block, moba_top_k):
  """Which key blocks each query reads (`moba_chosen_blocks`), queries and keys at positions 0..T-1.

  Args:
    q_rot: `[batch, T, heads, d]`, k_rot: `[batch, T, kv_heads, d]`, RoPE-rotated queries and keys.

  Returns:
    `[batch, heads, T, num_blocks]` boolean.
  """
  mean_keys = moba_mean_keys(k_rot, moba_block)
  positions = jnp.arange(k_rot.shape[1])
  return moba_chosen_blocks(q_rot, positions, mean_keys, moba_block=moba_block, moba_top_k=moba_top_k)


def moba_inputs(q, k, v, *, moba_block, moba_top_k, rope_theta):
  """MoBA's arguments checked (shapes as `moba_attention`'s), then `(q_rot, k_rot, v)` in the compute dtype,
  queries and keys rotated to positions 0..T-1."""
  check_grouped_qkv(q, k, v)
  if moba_block < 1 or moba_top_k < 1:
    raise ValueError(f"moba_block and moba_top_k must be >= 1, got {moba_block}, {moba_top_k}")
  dtype = compute_dtype(q.dtype)
  positions = jnp.arange(q.shape[1])
  return (
    apply_rope(q.astype(dtype), positions, rope_theta),
    apply_rope(k.astype(dtype), positions, rope_theta),
    v.astype(dtype),
  )


def moba_attention(q, k, v, *, moba_block=512, moba_top_k=3, rope_theta=10000.0):
  """MoBA: causal RoPE attention restricted to the selected key blocks (choices in the module docstring).

  Args:
    q: `[batch, T, heads, d]`, k, v: `[batch, T, kv_heads, d]`, unrotated.
    moba_block: block size in tokens.
    moba_top_k: blocks read per query, the current block included (>= 1).
    rope_theta: RoPE base θ, or a `fsjax.reference.rope.RoPE`.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`.
  """
  q_rot, k_rot, v = moba_inputs(q, k, v, moba_block=moba_block, moba_top_k=moba_top_k, rope_theta=rope_theta)
  positions = jnp.arange(q.shape[1])
  blocks = moba_block_mask(q_rot, k_rot, moba_block=moba_block, moba_top_k=moba_top_k)
  key_block = positions // moba_block
  causal = positions[None, :] <= positions[:, None]  # [T, T]
  mask = jnp.take(blocks, key_block, axis=-1) & causal  # [batch, heads, T, T]
  logits = grouped_logits(q_rot, k_rot) / math.sqrt(q.shape[-1])
  probs = masked_softmax(logits, mask)
  return grouped_readout(probs, v).astype(q.dtype)
