"""Rotary position embedding, rotate-half convention (LLaMA / HF), FS Eq. 3."""

import jax.numpy as jnp


def rope_angles(positions, head_dim, theta=10000.0, dtype=jnp.float32):
  """Rotation angles for each position and frequency.

  Args:
    positions: integer array of positions, any shape `P`.
    head_dim: even head width `d`.
    theta: RoPE base.
    dtype: floating dtype of the result.

  Returns:
    `[*P, d/2]` angles `pos * theta^(-2f/d)` for `f = 0..d/2-1`.
  """
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=dtype) / head_dim)
  return positions.astype(dtype)[..., None] * inv_freq


def apply_rope(x, positions, theta=10000.0):
  """Rotates `x` to its positions: `R(pos) x` (FS Eq. 3), rotate-half convention.

  Args:
    x: `[batch, seq, heads, head_dim]`, head_dim even.
    positions: `[seq]` or `[batch, seq]` integer positions.
    theta: RoPE base.

  Returns:
    Rotated array, same shape and dtype as `x`.
  """
  head_dim = x.shape[-1]
  angles = rope_angles(positions, head_dim, theta, dtype=jnp.promote_types(x.dtype, jnp.float32))
  if angles.ndim == 2:  # [seq, d/2] -> broadcast over batch
    angles = angles[None]
  angles = angles[:, :, None, :]  # [batch|1, seq, 1, d/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)
  sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)
  x_c = x.astype(cos.dtype)
  x1, x2 = jnp.split(x_c, 2, axis=-1)
  rotated_half = jnp.concatenate([-x2, x1], axis=-1)
  return (x_c * cos + rotated_half * sin).astype(x.dtype)
