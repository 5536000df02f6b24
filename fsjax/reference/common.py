"""Numerics and input checks shared by the references."""

import jax
import jax.numpy as jnp

# References multiply in full float32 (no TF32 on GPUs): they are the specification faster paths are held to.
PRECISION = jax.lax.Precision.HIGHEST


def compute_dtype(dtype):
  """The dtype reference math runs in: at least float32, float64 stays float64."""
  return jnp.promote_types(dtype, jnp.float32)


def check_qkv(q, k, v):
  """Raises ValueError unless q, k, v are equal `[batch, seq, heads, head_dim]` arrays."""
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, seq, heads, head_dim], got shape {q.shape}")
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(f"q, k, v must have equal shapes, got {q.shape}, {k.shape}, {v.shape}")
