"""pallas_kernels.cell_scoring at its own tile sizes and cell-range splits against the reference selection
(fsjax.reference.cells, Eq. 5-8). The ops that run it (select_cells, select_from_summaries, freesolo_attention)
are checked against the reference in tests/test_parity.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.reference import cells
from pallas_kernels import cell_scoring

from helpers import assert_same_cells, kernel_modes, pallas_call_input_shapes

SIZES = cell_scoring.BlockSizes(queries=32, cells=16)
SCORE_ATOL = 1e-5  # float32 rounding of Eq. 7 computed in a different order (and XLA's erf approximation)

# (batch, seq, heads, head_dim, cell, block, top_k, retain_top, retain_recent)
GEOMETRIES = [
  pytest.param(2, 256, 2, 64, 16, 32, 4, 5, 2, id="B2-T256-d64"),
  pytest.param(1, 203, 3, 96, 16, 32, 3, 4, 1, id="T203-not-multiple-of-tile-d96"),
  pytest.param(1, 160, 2, 16, 16, 64, 8, 3, 0, id="K-above-available-W0"),
  pytest.param(1, 40, 1, 32, 16, 32, 2, 2, 1, id="first-block-and-one-cell"),
]


def _inputs(rng, batch, seq, heads, dim, dtype):
  q, k = (jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), dtype) for _ in range(2))
  return q, k, rng.uniform(0.3, 2.0, heads).astype(np.float32), rng.uniform(1.0, 8.0, heads).astype(np.float32)


def _kernel_select(q, k, *, variant, lam, sigma, cell, block, top_k, retain_top, retain_recent, interpret):
  """The kernel's selection over a whole sequence, as `fsjax.ops.select_cells` composes it: cell summaries (Eq. 5)
  and, for FS-L, each cell's death block (Eq. 8), then the fused scoring and top-K at `SIZES`."""
  mean_keys, max_norms, _ = cells.cell_summaries(k.astype(jnp.float32), cell)
  death = None
  if variant == "fsl":
    death = cells.retention_death_block(max_norms, cell=cell, block=block, retain_top=retain_top)
  return cell_scoring.select_from_summaries(
    q,
    None,
    mean_keys,
    max_norms,
    death,
    variant=variant,
    lam=lam,
    sigma=sigma,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
    block_sizes=SIZES,
    interpret=interpret,
  )


def _reference_scores(q, k, lam, sigma, cell, positions=None):
  mean_keys, max_norms, centers = cells.cell_summaries(k.astype(jnp.float32), cell)
  return cells.cell_scores(
    q.astype(jnp.float32),
    mean_keys,
    max_norms,
    centers,
    lam=jnp.asarray(lam),
    sigma=jnp.asarray(sigma),
    positions=positions,
  )


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("batch,seq,heads,dim,cell,block,top_k,retain_top,retain_recent", GEOMETRIES)
def test_select_cells_matches_reference(
  rng, interpret, dtype, variant, batch, seq, heads, dim, cell, block, top_k, retain_top, retain_recent
):
  q, k, lam, sigma = _inputs(rng, batch, seq, heads, dim, dtype)
  routing = dict(
    variant=variant,
    lam=lam,
    sigma=sigma,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_top=retain_top,
    retain_recent=retain_recent,
  )
  got = _kernel_select(q, k, interpret=interpret, **routing)
  want = ops.select_cells(q, k, **routing)
  assert got.dtype == jnp.int32 and got.shape == want.shape
  assert_same_cells(got, want, _reference_scores(q, k, lam, sigma, cell), SCORE_ATOL)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("num_cells", [80, 72], ids=["whole-chunks", "a-partial-chunk"])
def test_a_layer_of_stacked_summaries_is_scored_as_that_layer_alone(rng, interpret, variant, num_cells):
  """A scanned model's decode cache holds every layer's summaries `[layers, batch, M, ...]`, and its "routing"
  collection every layer's λ and σ `[layers, heads]`: scoring layer 1 of the stacks selects what scoring layer 1's
  own summaries, λ and σ does, and not what another layer's summaries or λ would. The kernel is
  handed the stack as it lies, also where the cells do not fill whole chunks (72 cells in chunks of 16: row 0's
  query sees cells 64-69 of the last chunk, whose loads past cell 71 are masked)."""
  batch, heads, dim, cell, block, top_k = 2, 2, 32, 16, 32, 4
  q = jnp.asarray(rng.standard_normal((batch, 1, heads, dim)), jnp.float32)
  mean_keys = jnp.asarray(rng.standard_normal((3, batch, num_cells, 1, dim)), jnp.bfloat16)
  max_norms = jnp.asarray(rng.uniform(0.5, 3.0, (3, batch, num_cells, 1)), jnp.bfloat16)
  positions = jnp.array([[num_cells * cell - 5], [700]], jnp.int32)
  routing = dict(variant=variant, cell=cell, block=block, retain_top=3, retain_recent=1, top_k=top_k)
  routing.update(block_sizes=SIZES, interpret=interpret)
  # [layers, heads]: layer 1's λ lets the distance prior rank the cells, the others' leave it to the content
  lam = jnp.asarray(rng.uniform(0.5, 2.0, (3, heads)) * np.array([[0.01], [30.0], [0.01]]), jnp.float32)
  sigma = jnp.asarray(rng.uniform(2.0, 8.0, (3, heads)), jnp.float32)

  def select(mean_keys, max_norms, lam, sigma, layer=None):
    norms = max_norms if layer is None else max_norms[layer]
    death = None
    if variant == "fsl":
      death = cells.retention_death_block(norms.astype(jnp.float32), cell=cell, block=block, retain_top=3)
    return cell_scoring.select_from_summaries(
      q, positions, mean_keys, max_norms, death, lam=lam, sigma=sigma, layer=layer, **routing
    )

  stacked = select(mean_keys, max_norms, lam, sigma, layer=jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(stacked), np.asarray(select(mean_keys[1], max_norms[1], lam[1], sigma[1])))
  assert not np.array_equal(np.asarray(stacked), np.asarray(select(mean_keys[0], max_norms[0], lam[1], sigma[1])))
  assert not np.array_equal(np.asarray(stacked), np.asarray(select(mean_keys[1], max_norms[1], lam[0], sigma[0])))
  jaxpr = jax.make_jaxpr(select)(mean_keys, max_norms, lam, sigma, jnp.int32(1)).jaxpr
  kernel_inputs = pallas_call_input_shapes(jaxpr)
  # no copy of the layer, no padding: the stacks as they lie
  assert {mean_keys.shape, max_norms.shape, lam.shape} <= set(kernel_inputs)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize(
  "variant,splits,summaries",
  [("fs", 1, jnp.float32), ("fsl", 1, jnp.float32), ("fs", 3, jnp.float32), ("fsl", 3, jnp.float32)]
  + [("fs", 3, jnp.bfloat16), ("fsl", 1, jnp.bfloat16)],
)
def test_select_from_summaries_at_decode_positions(rng, interpret, variant, splits, summaries):
  """Rows at different positions (a decode batch): eligibility, the prior and FS-L pools follow each query's
  own position; summaries of cells no query may see yet hold garbage that must never be read. With cell ranges
  split over programs (3 ranges of 2 chunks over 5 chunks: the last range is short, some are past a row's
  eligible cells), the merged top-K is the same. bf16 summaries (a decode cache's) are scored as their float32
  values."""
  batch, heads, dim, cell, block, top_k, num_cells = 2, 2, 32, 16, 32, 4, 80
  q = jnp.asarray(rng.standard_normal((batch, 5, heads, dim)), jnp.float32)
  mean_keys = jnp.asarray(rng.standard_normal((batch, num_cells, heads, dim)), summaries)
  max_norms = jnp.asarray(rng.uniform(0.5, 3.0, (batch, num_cells, heads)), summaries)
  positions = jnp.array([[31, 32, 100, 700, 1279], [64, 65, 66, 900, 1201]], jnp.int32)
  lam, sigma = rng.uniform(0.3, 2.0, heads).astype(np.float32), rng.uniform(1.0, 8.0, heads).astype(np.float32)
  routing = dict(variant=variant, cell=cell, block=block, retain_top=3, retain_recent=1)
  death = cells.retention_death_block(max_norms, cell=cell, block=block, retain_top=3) if variant == "fsl" else None
  got = cell_scoring.select_from_summaries(
    q,
    positions,
    mean_keys,
    max_norms,
    death,
    lam=lam,
    sigma=sigma,
    top_k=top_k,
    block_sizes=dataclasses.replace(SIZES, splits=splits),
    interpret=interpret,
    **routing,
  )
  centers = (jnp.arange(num_cells) + 0.5) * cell
  scores = cells.cell_scores(
    q, mean_keys, max_norms, centers, lam=jnp.asarray(lam), sigma=jnp.asarray(sigma), positions=positions
  )
  available = cells.available_cells(max_norms, 5, positions=positions, **routing)
  assert_same_cells(got, cells.top_k_cells(scores, available, top_k), scores, SCORE_ATOL)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_equal_scores_go_to_the_lower_cell_index(rng, interpret):
  """Identical cells score exactly alike: the kernel must keep the lowest indices, best first, like lax.top_k."""
  cell, dim = 16, 16
  k = jnp.tile(jnp.asarray(rng.standard_normal((1, cell, 1, dim)), jnp.float32), (1, 12, 1, 1))
  q = jnp.asarray(rng.standard_normal((1, 12 * cell, 1, dim)), jnp.float32)
  got = _kernel_select(
    q,
    k,
    variant="fs",
    lam=0.0,
    sigma=4.0,
    cell=cell,
    block=32,
    top_k=4,
    retain_top=64,
    retain_recent=8,
    interpret=interpret,
  )
  np.testing.assert_array_equal(got, ops.select_cells(q, k, lam=0.0, cell=cell, block=32, top_k=4))
  np.testing.assert_array_equal(got[0, -1, 0], [0, 1, 2, 3])


@pytest.mark.parametrize("interpret", kernel_modes())
def test_equal_scores_across_cell_ranges_go_to_the_lower_cell_index(rng, interpret):
  """One query, cells split into four ranges of 16: five copies of the best cell lie in different ranges, and
  the merge must keep the four lowest indices, in order."""
  dim, cell, num_cells = 16, 16, 64
  mean_keys = rng.standard_normal((1, num_cells, 1, dim)).astype(np.float32) * 0.1
  q = rng.standard_normal((1, 1, 1, dim)).astype(np.float32)
  mean_keys[0, [50, 17, 33, 60, 2], 0] = 10.0 * q[0, 0, 0]
  got = cell_scoring.select_from_summaries(
    jnp.asarray(q),
    jnp.array([[num_cells * cell]], jnp.int32),
    jnp.asarray(mean_keys),
    jnp.ones((1, num_cells, 1), jnp.float32),
    lam=0.0,
    cell=cell,
    block=32,
    top_k=4,
    block_sizes=dataclasses.replace(SIZES, splits=4),
    interpret=interpret,
  )
  np.testing.assert_array_equal(got[0, 0, 0], [2, 17, 33, 50])
