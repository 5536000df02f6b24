"""RoPE options of Hugging Face checkpoints (partial rotation, Llama 3 scaling) against an independent NumPy
implementation written from `transformers`' formulas, and the float θ of the papers unchanged."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.reference.rope import Llama3Scaling, RoPE, apply_rope, rotary_table

from brute_force import hf_apply_rope, hf_inverse_frequencies
from helpers import assert_close

LLAMA3 = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_the_test_scaling_covers_all_three_bands():
  """θ = 500,000 over 64 rotated features (half of the tests' head_dim 128): wavelengths from 6 to 2·10^6
  tokens, several in each band: kept (below 2,048), blended (2,048 to 8,192) and divided (above 8,192)."""
  wavelen = 2 * math.pi / hf_inverse_frequencies(500000.0, 64)
  assert (wavelen < 2048).sum() >= 3 and ((wavelen >= 2048) & (wavelen <= 8192)).sum() >= 3
  assert (wavelen > 8192).sum() >= 3


@pytest.mark.parametrize(
  "theta,fraction,scaling",
  [
    (10000.0, 0.5, None),
    (500000.0, 1.0, LLAMA3),
    (500000.0, 0.5, LLAMA3),
    (1000000.0, 0.25, Llama3Scaling(factor=32.0, low_freq_factor=2.0, high_freq_factor=3.0)),
  ],
  ids=["partial", "llama3", "partial-llama3", "quarter-factor32"],
)
def test_rope_equals_hugging_faces_formulas(rng, theta, fraction, scaling):
  head_dim = 128
  x = rng.standard_normal((2, 40, 3, head_dim))
  positions = np.sort(rng.choice(200000, 40, replace=False))
  rope = RoPE(theta=theta, fraction=fraction, scaling=scaling)
  with jax.enable_x64(True):
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), rope))
  expected = hf_apply_rope(x, positions.astype(np.float64), theta, int(fraction * head_dim), scaling)
  assert_close(got, expected, np.float64)
  np.testing.assert_array_equal(got[..., int(fraction * head_dim) :], x[..., int(fraction * head_dim) :])


def test_a_float_theta_and_its_rope_rotate_identically(rng):
  x = jnp.asarray(rng.standard_normal((2, 24, 2, 16)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 5000, (2, 24)))
  np.testing.assert_array_equal(apply_rope(x, positions, RoPE(theta=500.0)), apply_rope(x, positions, 500.0))


@pytest.mark.parametrize("batched", [False, True], ids=["shared-positions", "per-row-positions"])
def test_a_table_made_beforehand_rotates_as_apply_rope_does_alone(rng, batched):
  """`apply_rope(..., table=rotary_table(...))` (a decode step's layers sharing one table) is the same rotation,
  bit for bit, for bf16 and float32 inputs and a partial, scaled RoPE; a table for other positions or another
  dtype is refused."""
  rope = RoPE(theta=500000.0, fraction=0.5, scaling=LLAMA3)
  positions = jnp.asarray(rng.integers(0, 200000, (2, 3) if batched else (3,)))
  table = rotary_table(positions, 32, rope)
  for dtype in (jnp.bfloat16, jnp.float32):
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 32)), dtype)
    np.testing.assert_array_equal(apply_rope(x, positions, rope, table), apply_rope(x, positions, rope))
  with pytest.raises(ValueError, match="must hold 1 positions in float32"):
    apply_rope(jnp.zeros((2, 1, 4, 32)), positions[..., :1], rope, table)


@pytest.mark.parametrize("fraction,head_dim", [(0.3, 16), (0.0625, 16), (0.75, 12)], ids=["fractional", "one", "odd"])
def test_a_rotary_width_that_is_not_an_even_whole_number_is_refused(fraction, head_dim):
  with pytest.raises(ValueError, match="even integer number of rotated features"):
    RoPE(fraction=fraction).rotary_dim(head_dim)
