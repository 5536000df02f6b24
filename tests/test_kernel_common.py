"""pallas_kernels.common: the in-kernel erf and the geometry rules of the compiled kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common


def test_erf_matches_xla_within_float32_rounding():
  x = jnp.linspace(-6.0, 6.0, 100_001, dtype=jnp.float32)
  assert float(jnp.max(jnp.abs(common.erf(x) - jax.scipy.special.erf(x)))) < 1e-6


def test_padding_keeps_values_and_reaches_powers_of_two(rng):
  x = jnp.asarray(rng.standard_normal((2, 5, 96)), jnp.float32)
  padded = common.pad_head_dim(x)
  assert padded.shape == (2, 5, 128)
  np.testing.assert_array_equal(padded[..., :96], x)
  np.testing.assert_array_equal(padded[..., 96:], 0)
  np.testing.assert_array_equal(common.pad_axis(x, 1, 8, value=-1)[:, 5:], -1)


def test_compiled_geometry_rules_name_the_field():
  assert common.compilable(cell=32, head_dim=64) and not common.compilable(cell=24, head_dim=64)
  common.check_compilable(cell=8, head_dim=8, interpret=True)  # the interpreter takes any size
  with pytest.raises(ValueError, match="cell must be a power of two >= 16"):
    common.check_compilable(cell=24, head_dim=64, interpret=False)
  with pytest.raises(ValueError, match="head_dim must be >= 16"):
    common.check_compilable(cell=32, head_dim=8, interpret=False)
