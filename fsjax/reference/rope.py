"""Rotary position embedding, rotate-half convention (LLaMA / HF), FS Eq. 3; with the two options Hugging Face
checkpoints use: partial rotation (`partial_rotary_factor`) and Llama 3's frequency scaling (`rope_type: llama3`).

Every function that rotates takes its RoPE as `rope_theta: float | RoPE`. A float is the papers' RoPE: every
feature rotates, inverse frequencies `θ^(-2f/d)`; a `RoPE` adds the options. The name and the float stay
accepted because DESIGN §6 fixes `rope_theta=` in the public operators and about twenty functions only forward
it to `apply_rope` (whose `rotary_table` reads it, in `rope_angles`): the options reach every kind, cache
and kernel path unchanged (the kernels receive rotated or NoPE inputs and never rotate). `RoPE(theta)` computes
exactly what `theta` does. A decode step makes its `rotary_table` once and hands it to every layer's
`apply_rope(..., table=)`.
"""

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
  """Llama 3.1's RoPE scaling: Hugging Face `transformers`' `_compute_llama3_parameters`.

  With wavelengths `λ_f = 2π / inv_freq_f` and `L` = original_max_position_embeddings: frequencies whose
  wavelength is below `L / high_freq_factor` keep their value; those above `L / low_freq_factor` are divided by
  `factor`; in between, `s = (L / λ_f − low_freq_factor) / (high_freq_factor − low_freq_factor)` blends
  `(1 − s) inv_freq / factor + s inv_freq`. Defaults are Llama 3.1's.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __call__(self, inv_freq):
    """Scaled inverse frequencies, same shape and dtype as `inv_freq` `[rotary_dim/2]`."""
    context = self.original_max_position_embeddings
    low_freq_wavelen = context / self.low_freq_factor
    high_freq_wavelen = context / self.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
    smooth = (context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
    smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class RoPE:
  """A RoPE beyond the papers' (frozen and hashable: a static field of modules and jitted functions).

  Attributes:
    theta: base θ.
    fraction: share of each head's features that rotate: the first `rotary_dim = fraction * head_dim` (an even
      integer), in the rotate-half convention over those features with inverse frequencies
      `θ^(-2f/rotary_dim)`; the rest pass through unchanged (HF's `partial_rotary_factor`).
    scaling: None, or a `Llama3Scaling` applied to the inverse frequencies.
  """

  theta: float = 10000.0
  fraction: float = 1.0
  scaling: Llama3Scaling | None = None

  def rotary_dim(self, head_dim):
    """Features that rotate, `fraction * head_dim`; ValueError unless it is an even integer in [2, head_dim]."""
    width = self.fraction * head_dim
    rotary = round(width)
    if abs(width - rotary) > 1e-6 or rotary % 2 or not 2 <= rotary <= head_dim:
      raise ValueError(
        f"RoPE fraction {self.fraction} of head_dim {head_dim} must give an even integer number of rotated "
        f"features between 2 and head_dim, got {width:g}"
      )
    return rotary


def as_rope(rope_theta):
  """`rope_theta` (a float θ or a `RoPE`) as a `RoPE`."""
  return rope_theta if isinstance(rope_theta, RoPE) else RoPE(theta=rope_theta)


def rope_angles(positions, head_dim, theta=10000.0, dtype=jnp.float32):
  """Rotation angles for each position and rotated frequency.

  Args:
    positions: integer array of positions, any shape `P`.
    head_dim: even head width `d`.
    theta: a RoPE base θ, or a `RoPE`.
    dtype: floating dtype of the result.

  Returns:
    `[*P, r/2]` angles `pos * inv_freq_f` with `inv_freq_f = θ^(-2f/r)`, `f = 0..r/2-1`, `r` the rotated
    features (`head_dim` for a float θ), then scaled where the `RoPE` asks.
  """
  rope = as_rope(theta)
  rotary = rope.rotary_dim(head_dim)
  inv_freq = rope.theta ** (-jnp.arange(0, rotary, 2, dtype=dtype) / rotary)
  if rope.scaling is not None:
    inv_freq = rope.scaling(inv_freq)
  return positions.astype(dtype)[..., None] * inv_freq


@flax.struct.dataclass
class RotaryTable:
  """The cosines and sines that rotate vectors at some positions, `[batch|1, seq, 1, r]` each (`r` the rotated
  features, the rotate-half layout): `rotary_table` makes it once where several rotations share the positions,
  as a decode step's layers do, and `apply_rope(..., table=)` uses it."""

  cos: jax.Array
  sin: jax.Array


def rotary_table(positions, head_dim, theta=10000.0, dtype=jnp.float32):
  """The `RotaryTable` for `positions` (`[seq]` or `[batch, seq]` integers) and heads of `head_dim` features, in
  `dtype`: `cos` and `sin` of `rope_angles`, each repeated for the two halves of the rotated features."""
  angles = rope_angles(positions, head_dim, theta, dtype=dtype)
  if angles.ndim == 2:  # [seq, r/2] -> broadcast over batch
    angles = angles[None]
  angles = angles[:, :, None, :]  # [batch|1, seq, 1, r/2]
  return RotaryTable(
    cos=jnp.concatenate([jnp.cos(angles)] * 2, axis=-1), sin=jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)
  )


def apply_rope(x, positions, theta=10000.0, table=None):
  """Rotates `x` to its positions: `R(pos) x` (FS Eq. 3), rotate-half convention over the rotated features.

  Args:
    x: `[batch, seq, heads, head_dim]`, head_dim even.
    positions: `[seq]` or `[batch, seq]` integer positions.
    theta: a RoPE base θ, or a `RoPE` (partial rotation, Llama 3 scaling).
    table: None, or `rotary_table(positions, head_dim, theta, dtype)` made beforehand, with `dtype` x's dtype
      promoted to at least float32 (what is computed here otherwise): the same rotation, its sines and cosines
      shared with other calls.

  Returns:
    Rotated array, same shape and dtype as `x`; features past a partial RoPE's `rotary_dim` unchanged.
  """
  head_dim = x.shape[-1]
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  if table is None:
    table = rotary_table(positions, head_dim, theta, dtype=dtype)
  elif table.cos.dtype != dtype or table.cos.shape[1] != x.shape[1]:
    raise ValueError(
      f"a rotary table for x {x.shape} {x.dtype} must hold {x.shape[1]} positions in {dtype}, got "
      f"{table.cos.shape} {table.cos.dtype}"
    )
  cos, sin = table.cos, table.sin
  rotary = cos.shape[-1]
  x_c = x.astype(cos.dtype)
  x_rot, x_pass = x_c[..., :rotary], x_c[..., rotary:]
  x1, x2 = jnp.split(x_rot, 2, axis=-1)
  rotated_half = jnp.concatenate([-x2, x1], axis=-1)
  out = x_rot * cos + rotated_half * sin
  if rotary < head_dim:
    out = jnp.concatenate([out, x_pass], axis=-1)
  return out.astype(x.dtype)
