"""Gradients of the FreeSolo reference: finite, none reach λ/σ, and equal to finite differences in float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops

from helpers import assert_close, random_qkv

GEOMETRY = dict(cell=4, block=16, window=15, top_k=2, retain_top=2, retain_recent=1)


def _loss(q, k, v, alpha, lam, sigma, gain, weights, variant):
  out = ops.freesolo_attention(q, k, v, variant=variant, alpha=alpha, lam=lam, sigma=sigma, lr_gain=gain, **GEOMETRY)
  return jnp.sum(out * weights)


def _inputs(rng, dtype, seq=64, heads=2, dim=8):
  q, k, v = random_qkv(rng, (2, seq, heads, dim), dtype)
  return dict(
    q=q,
    k=k,
    v=v,
    alpha=rng.uniform(0.5, 1.5, heads).astype(dtype),
    lam=np.ones(heads, dtype),
    sigma=np.full(heads, 4.0, dtype),
    gain=rng.uniform(0.5, 1.5, dim).astype(dtype),
    weights=rng.standard_normal((2, seq, heads, dim)).astype(dtype),
  )


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_gradients_are_finite_and_skip_routing_scalars(rng, variant):
  x = _inputs(rng, np.float32)
  grads = jax.jit(jax.grad(functools.partial(_loss, variant=variant), argnums=tuple(range(7))))(
    *(x[n] for n in ("q", "k", "v", "alpha", "lam", "sigma", "gain", "weights"))
  )
  names = ("q", "k", "v", "alpha", "lam", "sigma", "gain")
  for name, g in zip(names, grads):
    assert np.all(np.isfinite(np.asarray(g))), name
  np.testing.assert_array_equal(np.asarray(grads[4]), 0.0)  # λ: buffer, no gradient (FS Sec. 3.3)
  np.testing.assert_array_equal(np.asarray(grads[5]), 0.0)  # σ
  for name, g in zip(names, grads):
    if name not in ("lam", "sigma"):
      assert np.any(np.asarray(g) != 0), name
  # The long-range branch reaches k and v of past cells: the first block's keys get gradient from later queries.
  assert np.any(np.asarray(grads[1])[:, :16] != 0)


@pytest.mark.parametrize("variant", ["fs", "fsl"])
def test_gradient_matches_finite_differences_in_float64(rng, variant):
  x = _inputs(rng, np.float64, seq=48)
  names = ("q", "k", "v", "alpha", "gain")
  with jax.enable_x64(True):

    def loss(*diff):
      args = dict(x, **dict(zip(names, diff)))
      return _loss(
        args["q"],
        args["k"],
        args["v"],
        args["alpha"],
        args["lam"],
        args["sigma"],
        args["gain"],
        args["weights"],
        variant,
      )

    # Jitted (op by op was slower); both differences run one compiled loss.
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(*(x[n] for n in names))
    directions = [rng.standard_normal(x[n].shape) for n in names]
    eps = 1e-6
    jitted = jax.jit(loss)
    plus = jitted(*(x[n] + eps * d for n, d in zip(names, directions)))
    minus = jitted(*(x[n] - eps * d for n, d in zip(names, directions)))
  numeric = (float(plus) - float(minus)) / (2 * eps)
  analytic = sum(float(np.sum(np.asarray(g) * d)) for g, d in zip(grads, directions))
  assert_close(np.array([analytic]), np.array([numeric]), np.float32)  # central differences: ~eps² error
