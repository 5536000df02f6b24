"""FS-B reference (fsjax.reference.forest) against brute-force loops, and the forest properties FS App. E.1 states."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.reference import forest

import brute_force
from helpers import random_qkv

# (batch, seq, heads, dim, cell, block, top_k, beam)
GEOMETRIES = [
  pytest.param(1, 200, 2, 8, 8, 16, 3, 4, id="M25-beam4"),
  pytest.param(2, 96, 1, 6, 4, 8, 4, 2, id="M24-beam2-K-above-beam"),
  pytest.param(1, 130, 2, 4, 2, 10, 2, 16, id="M65-not-power-of-two-block"),
]


def _routing(rng, heads):
  return dict(lam=rng.uniform(0.3, 2.0, heads), sigma=rng.uniform(1.0, 8.0, heads))


@pytest.mark.parametrize("batch,seq,heads,dim,cell,block,top_k,beam", GEOMETRIES)
def test_selection_matches_brute_force(rng, batch, seq, heads, dim, cell, block, top_k, beam):
  q, k, _ = random_qkv(rng, (batch, seq, heads, dim))
  routing = _routing(rng, heads)
  norms = np.linalg.norm(k[:, : seq // cell * cell].reshape(batch, -1, cell, heads, dim), axis=-1).max(axis=2)
  tau = np.median(norms.reshape(-1, heads), axis=0)
  kw = dict(tau=tau, cell=cell, block=block, top_k=top_k, beam=beam, bound_c=8.0, **routing)
  expected = brute_force.fsb_cells(q, k, **kw)
  with jax.enable_x64(True):
    actual = np.asarray(
      forest.fsb_select_cells(q, k, **{n: jnp.asarray(v) if isinstance(v, np.ndarray) else v for n, v in kw.items()})
    )
  assert actual.shape == expected.shape
  np.testing.assert_array_equal(np.sort(actual, axis=-1), np.sort(expected, axis=-1))
  assert np.any(expected[..., -1] >= 0)  # some queries fill all K slots


def test_a_beam_wider_than_the_forest_reranks_every_admitted_cell(rng):
  """With W_b at least the node count, the beams reach every leaf, so FS-B is the exhaustive Eq. 12 top-K over
  the eligible cells."""
  batch, seq, heads, dim, cell, block, top_k = 1, 160, 2, 8, 8, 32, 3
  q, k, _ = random_qkv(rng, (batch, seq, heads, dim))
  routing = _routing(rng, heads)
  with jax.enable_x64(True):
    actual = np.asarray(
      forest.fsb_select_cells(
        q,
        k,
        tau=jnp.full(heads, 1e9),
        cell=cell,
        block=block,
        top_k=top_k,
        beam=64,
        bound_c=8.0,
        **{n: jnp.asarray(v) for n, v in routing.items()},
      )
    )
  for h in range(heads):
    cells_k = k[0, : seq // cell * cell, h].reshape(-1, cell, dim)
    norms = np.linalg.norm(cells_k, axis=-1).max(axis=1)
    for i in range(seq):
      eligible = range(i // block * block // cell)
      score = {
        c: np.log(np.exp(cells_k[c] @ q[0, i, h] / math.sqrt(dim)).sum())
        + routing["lam"][h] * norms[c] * math.erf((i - (c + 0.5) * cell) / (2 * routing["sigma"][h]))
        for c in eligible
      }
      chosen = sorted(score, key=lambda c: (-score[c], c))[:top_k]
      assert sorted(actual[0, i, h][actual[0, i, h] >= 0]) == sorted(chosen), (i, h)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _forest_of_block(means, norms, admitted, cell, block, num_blocks):
  order = jnp.argsort(~admitted, stable=True)
  table, roots = forest._chunk_nodes(means[order], norms[order], ((order + 0.5) * cell).astype(means.dtype), order)
  eligible = jnp.arange(num_blocks) * (block // cell)
  before = jnp.sum(admitted[None] & (jnp.arange(means.shape[0])[None] < eligible[:, None]), axis=1)
  return forest.block_forests(table, roots, before), before


def test_every_ball_encloses_its_cells_and_forests_have_height_ceil_log2_m(rng):
  cell, block, num_cells, dim = 4, 8, 45, 6
  num_blocks = num_cells * cell // block + 1
  with jax.enable_x64(True):
    means = jnp.asarray(rng.standard_normal((num_cells, dim)))
    norms = jnp.asarray(rng.uniform(0.5, 3.0, num_cells))
    admitted = norms >= jnp.median(norms)
    (table, roots), before = _forest_of_block(means, norms, admitted, cell, block, num_blocks)
    table, before = {n: np.asarray(v) for n, v in table.items()}, np.asarray(before)
  means = np.asarray(means)

  def walk(node, depth):
    """(cells below, height) of a node, checking its ball on the way."""
    if table["leaf"][node] >= 0:
      cells, height = [table["leaf"][node]], 0
    else:
      (a, ha), (b, hb) = walk(table["child0"][node], depth + 1), walk(table["child1"][node], depth + 1)
      cells, height = a + b, 1 + max(ha, hb)
    distance = np.linalg.norm(means[cells] - table["mu"][node], axis=-1)
    assert np.all(distance <= table["rho"][node] + 1e-12)
    assert min(cells) == table["first"][node]
    return cells, height

  for n, root in enumerate(np.asarray(roots)):
    if before[n] == 0:
      assert root == forest.NO_NODE
      continue
    cells, height = walk(root, 0)
    admitted_cells = np.flatnonzero(np.asarray(admitted))[: before[n]]
    assert sorted(cells) == sorted(admitted_cells.tolist())
    assert height == math.ceil(math.log2(before[n]))
