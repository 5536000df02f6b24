"""`pallas_kernels.decode_parts`, what the one-token decode kernels share: a softmax split into parts over programs
and merged exactly by the mixing launch (and by the merge of a single branch), against the softmaxes over all keys
at once, the readout RMSNorm and Eq. 2's mix of `fsjax.reference.freesolo` (interpreted on CPU, compiled on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.reference.freesolo import READOUT_NORM_EPS, mix_branches, rms_norm
from pallas_kernels import decode_parts

from helpers import assert_close, kernel_modes

BATCH, HEADS, DIM, LAYERS = 2, 3, 16, 4


def _parts(rng, keys_per_part):
  """Random logits and values split into parts of `keys_per_part[p]` keys each (0: a part that saw no key): each
  part's softmax output and log-sum-exp, as `decode_parts.softmax_part` writes them, and the logits and values."""
  o, lse, logits, values = [], [], [], []
  for count in keys_per_part:
    x = rng.standard_normal((BATCH, HEADS, count)) * 3.0
    v = rng.standard_normal((BATCH, HEADS, count, DIM))
    if count:
      p = np.exp(x - x.max(axis=-1, keepdims=True))
      o.append(np.einsum("bhk,bhkd->bhd", p, v) / p.sum(axis=-1)[..., None])
      lse.append(x.max(axis=-1) + np.log(p.sum(axis=-1)))
    else:
      o.append(np.zeros((BATCH, HEADS, DIM)))
      lse.append(np.full((BATCH, HEADS), -np.inf))
    logits.append(x)
    values.append(v)
  return np.stack(o, axis=2), np.stack(lse, axis=2), np.concatenate(logits, -1), np.concatenate(values, 2)


def _softmax_readout(logits, values):
  """The softmax over every key at once `[batch, heads, d]`; zero where there is none."""
  if logits.shape[-1] == 0:
    return np.zeros(values.shape[:2] + values.shape[3:])
  p = np.exp(logits - logits.max(axis=-1, keepdims=True))
  return np.einsum("bhk,bhkd->bhd", p, values) / p.sum(axis=-1)[..., None]


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize(
  "local_parts,cell_parts",
  [([128, 128, 57], [32, 32, 32]), ([128, 0, 40], [32, 0, 32, 32]), ([100], [0, 0])],
  ids=["full", "empty-parts", "no-cell"],
)
def test_merged_parts_mixed_equal_the_softmaxes_over_all_keys(rng, interpret, local_parts, cell_parts):
  """The mix of the local parts' and the cell parts' softmaxes equals local + α · RMSNorm(readout) · gain (Eq. 2,
  9) over all keys at once, with α and the gain read at layer 2 of their stacks. Parts that saw no key weigh
  nothing; with no cell at all the long-range branch is zero. The padding parts (to a power of two) hold garbage
  the mix must never read."""
  split = decode_parts.StepParts(tiles=len(local_parts), parts=len(local_parts) + len(cell_parts), layers=LAYERS)
  o, lse, logits, values = _parts(rng, local_parts + cell_parts)
  pad = split.padded - split.parts
  o = np.concatenate([o, np.full((BATCH, HEADS, pad, DIM), 1e30)], axis=2)
  lse = np.concatenate([lse, np.full((BATCH, HEADS, pad), 50.0)], axis=2)
  alpha = rng.uniform(0.5, 1.5, (LAYERS, HEADS)).astype(np.float32)
  gain = rng.uniform(0.5, 1.5, (LAYERS, DIM)).astype(np.float32)
  mix = jax.jit(lambda *args: split.mix(*args, eps=READOUT_NORM_EPS, out_dtype=jnp.float32, interpret=interpret))
  got = mix(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32), alpha, gain, jnp.array([2], jnp.int32))

  local_keys = sum(local_parts)
  local = _softmax_readout(logits[..., :local_keys], values[:, :, :local_keys])
  long_range = rms_norm(jnp.asarray(_softmax_readout(logits[..., local_keys:], values[:, :, local_keys:])), gain[2])
  expected = mix_branches(jnp.asarray(local)[:, None], long_range[:, None], jnp.asarray(alpha[2]))[:, 0]
  assert_close(got, expected, np.float32)
  if sum(cell_parts) == 0:
    assert_close(got, local, np.float32)


@pytest.mark.parametrize("interpret", kernel_modes())
@pytest.mark.parametrize("keys_per_part", [[128, 0, 128, 57, 3], [0, 0, 0]], ids=["ragged", "no-key"])
def test_merged_parts_equal_the_softmax_over_all_keys(rng, interpret, keys_per_part):
  """`merge_parts` (one branch: the baselines' store attention) equals the softmax over every part's keys at once,
  zero where no part saw a key; the padding parts hold garbage it must never read."""
  o, lse, logits, values = _parts(rng, keys_per_part)
  pad = (1 << (len(keys_per_part) - 1).bit_length()) - len(keys_per_part)  # to a power of two
  o = np.concatenate([o, np.full((BATCH, HEADS, pad, DIM), 1e30)], axis=2)
  lse = np.concatenate([lse, np.full((BATCH, HEADS, pad), 50.0)], axis=2)
  merge = jax.jit(
    lambda o, lse: decode_parts.merge_parts(
      o, lse, parts=len(keys_per_part), out_dtype=jnp.float32, interpret=interpret
    )
  )
  got = merge(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32))
  assert_close(got, _softmax_readout(logits, values), np.float32)
  if not sum(keys_per_part):
    assert np.all(np.asarray(got) == 0)


@pytest.mark.parametrize("interpret", kernel_modes())
def test_one_layers_alpha_and_gain_are_broadcast_to_the_layers(rng, interpret):
  """α `[heads]` and the gain `[d]` of an unstacked layer give what their stacks give at any layer index."""
  split = decode_parts.StepParts(tiles=1, parts=2, layers=LAYERS)
  o, lse, _, _ = _parts(rng, [64, 32])
  alpha = rng.uniform(0.5, 1.5, HEADS).astype(np.float32)
  gain = rng.uniform(0.5, 1.5, DIM).astype(np.float32)
  mix = lambda a, g, layer: split.mix(
    jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32), a, g, jnp.array([layer], jnp.int32),
    eps=READOUT_NORM_EPS, out_dtype=jnp.float32, interpret=interpret,
  )  # fmt: skip
  stacked = mix(np.tile(alpha, (LAYERS, 1)), np.tile(gain, (LAYERS, 1)), 0)
  np.testing.assert_array_equal(np.asarray(mix(alpha, gain, 3)), np.asarray(stacked))


def test_step_parts_cover_the_ring_in_tiles():
  """A ring of R slots takes ceil(R / RING_TILE) tiles, then one part per selected cell, padded to a power of two."""
  split = decode_parts.StepParts.of(ring_slots=513, top_k=4, layers=24)
  assert (split.tiles, split.parts, split.padded) == (5, 9, 16)
  assert decode_parts.StepParts.of(ring_slots=128, top_k=4, layers=1).tiles == 1
