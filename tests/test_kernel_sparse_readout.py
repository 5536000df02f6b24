"""pallas_kernels.sparse_readout (forward and custom_vjp backward) at its own tile sizes against the reference
readout (Eq. 9), on random given selections with -1 sentinels. The ops that run it (freesolo_attention,
sparse_readout, cached_readout) are checked against the reference in tests/test_parity.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from pallas_kernels import sparse_readout as readout_kernel

from helpers import assert_close, kernel_modes

SIZES = readout_kernel.BlockSizes(queries=32)

# (batch, seq, seq_k, heads, head_dim, cell, top_k)
GEOMETRIES = [
  pytest.param(2, 128, 128, 2, 64, 16, 4, id="B2-T128-d64"),
  pytest.param(1, 75, 192, 3, 96, 16, 3, id="T75-not-multiple-of-tile-Tk192-d96"),
  pytest.param(1, 64, 64, 2, 32, 32, 2, id="K2-s32"),
]


def _random_selection(rng, batch, seq, heads, num_cells, top_k):
  """Distinct random cells per query, a random number of them (-1 padded), some queries selecting none."""
  idx = np.argsort(rng.random((batch, seq, heads, num_cells)), axis=-1)[..., :top_k]
  count = rng.integers(0, top_k + 1, (batch, seq, heads, 1))
  return jnp.asarray(np.where(np.arange(top_k) < count, idx, -1), jnp.int32)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,seq,seq_k,heads,dim,cell,top_k", GEOMETRIES)
def test_forward_and_gradients_match_reference(rng, interpret, dtype, batch, seq, seq_k, heads, dim, cell, top_k):
  q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((batch, seq_k, heads, dim)), dtype) for _ in range(2))
  cell_idx = _random_selection(rng, batch, seq, heads, seq_k // cell, top_k)
  weights = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), jnp.float32)

  def loss(readout, q, k, v):
    return jnp.sum(readout(q, k, v, cell_idx, cell=cell).astype(jnp.float32) * weights)

  kernel = functools.partial(readout_kernel.sparse_readout, block_sizes=SIZES, interpret=interpret)
  reference = lambda q, k, v, *a, **kw: ops.sparse_readout(*(x.astype(jnp.float32) for x in (q, k, v)), *a, **kw)
  # Jitted: op by op, the interpreted kernel and both backward passes dispatched every operation.
  forward = lambda readout: jax.jit(lambda q, k, v: readout(q, k, v, cell_idx, cell=cell))
  out = forward(kernel)(q, k, v)
  assert out.dtype == dtype
  assert_close(out.astype(jnp.float32), forward(reference)(q, k, v), dtype)
  none_selected = np.all(np.asarray(cell_idx) < 0, axis=-1)
  assert none_selected.any() and np.all(np.asarray(out)[none_selected] == 0)

  grads = jax.jit(jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2)))(q, k, v)
  expected = jax.jit(jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2)))(q, k, v)
  for name, got, want in zip("qkv", grads, expected):
    assert got.dtype == dtype, name
    assert_close(got.astype(jnp.float32), want, dtype)
  np.testing.assert_array_equal(np.asarray(grads[0])[none_selected], 0)


def test_tile_unions_are_the_distinct_selected_cells(rng):
  cell_idx = _random_selection(rng, 2, 64, 3, 10, 4)
  unions, counts = readout_kernel.tile_unions(cell_idx, 16)
  for b in range(2):
    for h in range(3):
      for t in range(4):
        expected = sorted(set(np.asarray(cell_idx[b, 16 * t : 16 * (t + 1), h]).ravel()) - {-1})
        assert list(np.asarray(unions[b, h, t, : counts[b, h, t]])) == expected
