"""Changing tokens after position t never changes outputs at positions <= t, for every attention type."""

import functools

import jax
import numpy as np
import pytest

from fsjax import ops

from helpers import random_qkv

SEQ, CUT = 160, 70  # CUT sits inside a query block: same-block futures must not leak either

ATTENTIONS = {
  "fs": functools.partial(ops.freesolo_attention, variant="fs", alpha=1.0, cell=8, block=32, window=40, top_k=3),
  "fsl": functools.partial(
    ops.freesolo_attention,
    variant="fsl",
    alpha=1.0,
    cell=8,
    block=32,
    window=40,
    top_k=3,
    retain_top=2,
    retain_recent=1,
  ),
  "fsb": functools.partial(
    ops.freesolo_attention, variant="fsb", alpha=1.0, cell=8, block=32, window=40, top_k=3, tau=2.5, beam=2
  ),
  "tfpp": ops.tfpp_attention,
  "swa": functools.partial(ops.swa_attention, window=24),
  "moba": functools.partial(ops.moba_attention, moba_block=32, moba_top_k=2),
}


@pytest.mark.parametrize("kind", sorted(ATTENTIONS))
def test_future_tokens_do_not_change_the_past(rng, kind):
  q, k, v = random_qkv(rng, (2, SEQ, 2, 8), np.float32)
  q2, k2, v2 = (x.copy() for x in (q, k, v))
  for x in (q2, k2, v2):
    x[:, CUT + 1 :] = 10.0 * rng.standard_normal(x[:, CUT + 1 :].shape)  # large, to reorder any leaked ranking
  fn = jax.jit(ATTENTIONS[kind])
  before, after = np.asarray(fn(q, k, v)), np.asarray(fn(q2, k2, v2))
  np.testing.assert_array_equal(after[:, : CUT + 1], before[:, : CUT + 1])
  assert not np.allclose(after[:, CUT + 1 :], before[:, CUT + 1 :])
