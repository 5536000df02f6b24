"""Flax attention modules: variables, wiring to the references, and which variables train."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.attention import ROUTING, DenseAttention, FreeSoloAttention
from fsjax.reference.routing import Routing

from helpers import assert_close

GEOMETRY = dict(window=40, cell=8, block=32, top_k=3, retain_top=3, retain_recent=1)


def _x(rng, seq=96, width=24):
  return jnp.asarray(rng.standard_normal((2, seq, width)), jnp.float32)


def _qkv(params, x):
  return tuple(jnp.einsum("btm,mhd->bthd", x, params[n]["kernel"]) for n in ("q_proj", "k_proj", "v_proj"))


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_freesolo_module_variables_and_wiring(rng, variant):
  module = FreeSoloAttention(num_heads=3, head_dim=8, routing=Routing(variant=variant, **GEOMETRY), lam=0.5, sigma=3.0)
  x = _x(rng)
  variables = jax.jit(module.init)(jax.random.PRNGKey(0), x)  # jitted here and below: op by op was slower
  params, routing = variables["params"], variables[ROUTING]
  assert params["q_proj"]["kernel"].shape == (24, 3, 8)
  assert params["o_proj"]["kernel"].shape == (3, 8, 24)
  np.testing.assert_array_equal(params["alpha"], np.ones(3))
  np.testing.assert_array_equal(params["lr_gain"], np.ones(8))
  np.testing.assert_array_equal(routing["lam"], np.full(3, 0.5))
  np.testing.assert_array_equal(routing["sigma"], np.full(3, 3.0))

  params = jax.tree_util.tree_map(lambda p: p + 0.1 * jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
  out = jax.jit(module.apply)({"params": params, ROUTING: routing}, x)
  q, k, v = _qkv(params, x)
  o = jax.jit(
    lambda q, k, v, alpha, lr_gain: ops.freesolo_attention(
      q, k, v, variant=variant, alpha=alpha, lam=0.5, sigma=3.0, lr_gain=lr_gain, **GEOMETRY
    )
  )(q, k, v, params["alpha"], params["lr_gain"])
  assert_close(out, jnp.einsum("bthd,hdm->btm", o, params["o_proj"]["kernel"]), np.float32)


def test_no_gradient_reaches_lambda_or_sigma(rng):
  module = FreeSoloAttention(num_heads=2, head_dim=8, routing=Routing(variant="fsl", **GEOMETRY))
  x = _x(rng)
  variables = jax.jit(module.init)(jax.random.PRNGKey(1), x)  # jitted: op by op was slower
  grads = jax.jit(jax.grad(lambda var: jnp.sum(module.apply(var, x) ** 2)))(variables)
  np.testing.assert_array_equal(grads[ROUTING]["lam"], 0.0)
  np.testing.assert_array_equal(grads[ROUTING]["sigma"], 0.0)
  assert np.all(np.asarray(grads["params"]["alpha"]) != 0)
  assert np.all(np.isfinite(np.asarray(grads["params"]["lr_gain"])))


@pytest.mark.parametrize("kind", ["tfpp", "swa", "moba"])
def test_dense_module_wiring(rng, kind):
  module = DenseAttention(num_heads=2, head_dim=8, kind=kind, window=16, moba_block=32, moba_top_k=2)
  x = _x(rng)
  # Jitted: op by op, every operation compiled on its own.
  params = jax.jit(module.init)(jax.random.PRNGKey(2), x)["params"]
  q, k, v = _qkv(params, x)
  o = {
    "tfpp": ops.tfpp_attention,
    "swa": functools.partial(ops.swa_attention, window=16),
    "moba": functools.partial(ops.moba_attention, moba_block=32, moba_top_k=2),
  }[kind]
  assert_close(
    jax.jit(module.apply)({"params": params}, x),
    jnp.einsum("bthd,hdm->btm", jax.jit(o)(q, k, v), params["o_proj"]["kernel"]),
    np.float32,
  )


def test_dense_module_rejects_unknown_kind(rng):
  with pytest.raises(ValueError, match="kind must be one of"):
    DenseAttention(num_heads=2, head_dim=8, kind="full").init(jax.random.PRNGKey(0), _x(rng))
