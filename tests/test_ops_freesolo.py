"""FreeSolo reference (fsjax.ops) against independent brute-force loops, and its stated properties."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops

import brute_force
from helpers import assert_close, random_qkv

# (batch, seq, heads, head_dim, cell, block, window, top_k, retain_top, retain_recent)
GEOMETRIES = [
  pytest.param(2, 256, 2, 8, 8, 32, 40, 4, 5, 2, id="T256-B2-H2"),
  pytest.param(1, 203, 3, 6, 4, 16, 15, 3, 4, 1, id="T203-not-multiple-of-block"),
  pytest.param(2, 1024, 2, 4, 32, 128, 130, 4, 6, 3, id="T1024-paper-cells"),
  pytest.param(1, 120, 1, 8, 8, 32, 31, 8, 3, 0, id="K-above-available-W0"),
]


def _routing(rng, heads):
  """Per-head λ, σ drawn so the prior and the content term are of similar size."""
  return rng.uniform(0.3, 2.0, heads), rng.uniform(1.0, 8.0, heads)


@functools.partial(
  jax.jit, static_argnames=("variant", "cell", "block", "top_k", "retain_top", "retain_recent", "window")
)
def _long_range_and_cells(q, k, v, lam, sigma, gain, **kw):
  routing = {n: kw[n] for n in ("variant", "cell", "block", "top_k", "retain_top", "retain_recent")}
  return (
    ops.freesolo_long_range(q, k, v, lam=lam, sigma=sigma, lr_gain=gain, **kw),
    ops.select_cells(q, k, lam=lam, sigma=sigma, **routing),
  )


def _selected_sets(cell_idx):
  batch, seq, heads, _ = cell_idx.shape
  return {
    (b, i, h): {int(c) for c in cell_idx[b, i, h] if c >= 0}
    for b in range(batch)
    for i in range(seq)
    for h in range(heads)
  }


@pytest.mark.parametrize("variant", ["fs", "fsl"])
@pytest.mark.parametrize("batch,seq,heads,dim,cell,block,window,top_k,retain_top,retain_recent", GEOMETRIES)
def test_long_range_matches_brute_force(
  rng, variant, batch, seq, heads, dim, cell, block, window, top_k, retain_top, retain_recent
):
  q, k, v = random_qkv(rng, (batch, seq, heads, dim))
  lam, sigma = _routing(rng, heads)
  gain = rng.uniform(0.5, 1.5, dim)
  kw = dict(variant=variant, cell=cell, block=block, top_k=top_k, retain_top=retain_top, retain_recent=retain_recent)
  with jax.enable_x64(True):
    out, cell_idx = _long_range_and_cells(q, k, v, lam, sigma, gain, window=window, **kw)
    out, cell_idx = np.asarray(out), np.asarray(cell_idx)
  expected, expected_sets = brute_force.fs_long_range(q, k, v, lam=lam, sigma=sigma, gain=gain, **kw)
  assert out.dtype == np.float64
  assert _selected_sets(cell_idx) == expected_sets
  assert_close(out, expected, np.float64)


def test_float32_matches_float64_brute_force(rng):
  batch, seq, heads, dim = 2, 256, 2, 16
  q, k, v = random_qkv(rng, (batch, seq, heads, dim), np.float32)
  lam, sigma = _routing(rng, heads)
  kw = dict(variant="fsl", cell=8, block=32, top_k=4, retain_top=6, retain_recent=2)
  out, cell_idx = _long_range_and_cells(
    q, k, v, lam.astype(np.float32), sigma.astype(np.float32), np.float32(1.0), window=64, **kw
  )
  expected, expected_sets = brute_force.fs_long_range(
    q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), lam=lam, sigma=sigma, gain=1.0, **kw
  )
  assert out.dtype == jnp.float32
  assert _selected_sets(np.asarray(cell_idx)) == expected_sets
  assert_close(out, expected, np.float32)


@pytest.mark.parametrize("seq,window", [(200, 40), (97, 200)], ids=["banded", "window-covers-sequence"])
def test_local_attention_matches_brute_force(rng, seq, window):
  q, k, v = random_qkv(rng, (2, seq, 2, 8))
  with jax.enable_x64(True):
    out = np.asarray(jax.jit(functools.partial(ops.local_attention, window=window))(q, k, v))
  assert_close(out, brute_force.local(q, k, v, window), np.float64)


def test_freesolo_attention_mixes_branches_with_alpha(rng):
  batch, seq, heads, dim = 1, 160, 3, 8
  q, k, v = random_qkv(rng, (batch, seq, heads, dim))
  lam, sigma = _routing(rng, heads)
  alpha = rng.uniform(-1.0, 2.0, heads)
  kw = dict(variant="fsl", cell=8, block=32, top_k=3, retain_top=4, retain_recent=1)
  attention = jax.jit(  # op by op, both branches dispatched every operation
    lambda q, k, v, alpha, lam, sigma: ops.freesolo_attention(
      q, k, v, alpha=alpha, lam=lam, sigma=sigma, lr_gain=1.0, window=40, **kw
    )
  )
  with jax.enable_x64(True):
    out = np.asarray(attention(q, k, v, alpha, lam, sigma))
  long_range, _ = brute_force.fs_long_range(q, k, v, lam=lam, sigma=sigma, gain=1.0, **kw)
  assert_close(out, brute_force.local(q, k, v, 40) + alpha[:, None] * long_range, np.float64)


def test_first_block_has_zero_long_range_output(rng):
  q, k, v = random_qkv(rng, (2, 96, 2, 8), np.float32)
  out = jax.jit(functools.partial(ops.freesolo_long_range, cell=8, block=32, window=32))(q, k, v)  # op by op: slow
  np.testing.assert_array_equal(np.asarray(out[:, :32]), 0.0)
  assert np.all(np.abs(np.asarray(out[:, 32:])).sum(-1) > 0)


def test_fsl_with_pool_covering_all_cells_equals_fs(rng):
  q, k, v = random_qkv(rng, (2, 256, 2, 8), np.float32)
  kw = dict(cell=8, block=32, top_k=4, window=40)
  fs_out, fs_idx = _long_range_and_cells(q, k, v, 1.0, 4.0, 1.0, variant="fs", retain_top=4, retain_recent=0, **kw)
  fsl_out, fsl_idx = _long_range_and_cells(
    q, k, v, 1.0, 4.0, 1.0, variant="fsl", retain_top=256 // 8, retain_recent=0, **kw
  )
  np.testing.assert_array_equal(np.asarray(fsl_idx), np.asarray(fs_idx))
  np.testing.assert_array_equal(np.asarray(fsl_out), np.asarray(fs_out))


def test_retention_death_blocks_match_per_block_recomputation(rng):
  """Integer norms with many exact ties exercise the lower-index tie rule of Eq. 8."""
  cell, block, retain_top, retain_recent, seq = 4, 16, 3, 2, 160
  norms = rng.integers(0, 4, size=(2, seq // cell, 3)).astype(np.float32)
  available = np.asarray(
    ops.available_cells(
      jnp.asarray(norms), seq, variant="fsl", cell=cell, block=block, retain_top=retain_top, retain_recent=retain_recent
    )
  )
  for b in range(2):
    for h in range(3):
      for i in range(seq):
        expected = brute_force.fs_available(
          norms[b, :, h], i, variant="fsl", cell=cell, block=block, retain_top=retain_top, retain_recent=retain_recent
        )
        assert list(np.flatnonzero(available[b, i, h])) == expected, (b, i, h)


def test_top_k_prefers_lower_index_and_pads_with_minus_one():
  scores = jnp.array([[[[1.0, 3.0, 3.0, 2.0, 3.0]]]])
  available = jnp.array([[[[True, True, True, True, False]]]])
  np.testing.assert_array_equal(ops.top_k_cells(scores, available, 2)[0, 0, 0], [1, 2])
  np.testing.assert_array_equal(ops.top_k_cells(scores, available, 7)[0, 0, 0], [1, 2, 3, 0, -1, -1, -1])


def test_long_range_runs_at_16k_tokens_without_quadratic_memory(rng):
  """T = 16384 on CPU: scores are [T, #cells], readout [T, K*s]; a [T, T] array per head would be 1 GiB."""
  seq, dim = 16384, 8
  q, k, v = random_qkv(rng, (1, seq, 1, dim), np.float32)
  kw = dict(variant="fsl", cell=32, block=128, top_k=4, retain_top=64, retain_recent=8)
  out, cell_idx = _long_range_and_cells(q, k, v, 1.0, 4.0, 1.0, window=512, **kw)
  out, cell_idx = np.asarray(out), np.asarray(cell_idx)
  assert np.all(np.isfinite(out)) and np.all(out[:, :128] == 0)
  # Spot-check late queries against the brute force on the full prefix.
  for i in (128, 5000, seq - 1):
    expected, sets = brute_force.fs_long_range(
      q[:, : i + 1].astype(np.float64),
      k[:, : i + 1].astype(np.float64),
      v[:, : i + 1].astype(np.float64),
      lam=[1.0],
      sigma=[4.0],
      gain=1.0,
      **kw,
    )
    assert {int(c) for c in cell_idx[0, i, 0] if c >= 0} == sets[(0, i, 0)]
    assert_close(out[:, i], expected[:, i], np.float32)


def test_bad_arguments_raise_before_tracing(rng):
  q, k, v = random_qkv(rng, (1, 64, 2, 8), np.float32)
  with pytest.raises(ValueError, match="block must be a multiple of cell"):
    ops.freesolo_long_range(q, k, v, cell=8, block=20, window=64)
  with pytest.raises(ValueError, match="window must be >= block - 1"):
    ops.freesolo_attention(q, k, v, alpha=1.0, cell=8, block=32, window=16)
  with pytest.raises(ValueError, match="variant"):
    ops.freesolo_long_range(q, k, v, variant="fsx", cell=8, block=32, window=64)
  with pytest.raises(ValueError, match="tau must be given for variant 'fsb'"):
    ops.freesolo_long_range(q, k, v, variant="fsb", cell=8, block=32, window=64)
  with pytest.raises(ValueError, match="lam must be a scalar or have shape"):
    ops.freesolo_long_range(q, k, v, lam=np.ones(3), cell=8, block=32, window=64)
  with pytest.raises(ValueError, match="k, v must be equal"):
    ops.freesolo_long_range(q, k[:, :32], v, cell=8, block=32, window=64)
  with pytest.raises(ValueError, match="must divide the query heads"):  # 2 query heads, 3 key/value heads
    ops.freesolo_long_range(q, *(jnp.concatenate([x, x[:, :, :1]], axis=2) for x in (k, v)), cell=8, window=64)
