"""pallas_kernels.common: the in-kernel erf, padding, the geometry rules of the compiled kernels and the layer stack
kernels take."""

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


def test_power_of_two_rule_names_the_field_and_spares_the_interpreter():
  common.check_power_of_two("beam", 16, interpret=False)
  common.check_power_of_two("beam", 12, interpret=True)
  with pytest.raises(ValueError, match="beam must be a power of two for the compiled Pallas kernels, got 12"):
    common.check_power_of_two("beam", 12, interpret=False)


def test_layer_stack_gives_a_stack_and_the_layer_to_read(rng):
  """One layer becomes a stack of one read at layer 0; a scanned model's stack is passed whole with its layer;
  the wrong rank either way is refused."""
  x = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
  stack, layer = common.layer_stack(x, None, 3)
  assert stack.shape == (1, 2, 3, 4) and layer.dtype == jnp.int32
  np.testing.assert_array_equal(stack[layer[0]], x)
  stacked = jnp.stack([x, 2 * x])
  stack, layer = common.layer_stack(stacked, jnp.int32(1), 3)
  assert stack is stacked and layer.shape == (1,)
  np.testing.assert_array_equal(stack[layer[0]], 2 * x)
  with pytest.raises(ValueError, match="an array of 3 dims"):
    common.layer_stack(stacked, None, 3)
  with pytest.raises(ValueError, match="a stack of 4 dims"):
    common.layer_stack(x, jnp.int32(0), 3)
