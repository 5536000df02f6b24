"""Baseline references (TF++, SWA, MoBA) against brute-force loops, and their oracles."""

import functools

import jax
import numpy as np
import pytest

from fsjax import ops

import brute_force
from helpers import assert_close, random_qkv


def test_tfpp_matches_brute_force(rng):
  q, k, v = random_qkv(rng, (2, 150, 2, 8))
  with jax.enable_x64(True):
    out = np.asarray(jax.jit(ops.tfpp_attention)(q, k, v))
  assert_close(out, brute_force.local(q, k, v, window=149), np.float64)


def test_swa_matches_brute_force(rng):
  q, k, v = random_qkv(rng, (1, 300, 2, 8))
  with jax.enable_x64(True):
    out = np.asarray(jax.jit(functools.partial(ops.swa_attention, window=20))(q, k, v))
  assert_close(out, brute_force.local(q, k, v, window=20), np.float64)


@pytest.mark.parametrize(
  "seq,moba_block,moba_top_k",
  [(200, 32, 3), (130, 16, 2), (96, 32, 1)],
  ids=["T200-top3", "T130-partial-last-block", "current-block-only"],
)
def test_moba_matches_brute_force(rng, seq, moba_block, moba_top_k):
  q, k, v = random_qkv(rng, (2, seq, 2, 8))
  fn = jax.jit(functools.partial(ops.moba_attention, moba_block=moba_block, moba_top_k=moba_top_k))
  with jax.enable_x64(True):
    out = np.asarray(fn(q, k, v))
  assert_close(out, brute_force.moba(q, k, v, moba_block=moba_block, moba_top_k=moba_top_k), np.float64)


def test_moba_reading_every_block_equals_tfpp(rng):
  q, k, v = random_qkv(rng, (1, 128, 2, 8), np.float32)
  moba = ops.moba_attention(q, k, v, moba_block=16, moba_top_k=8)
  assert_close(moba, ops.tfpp_attention(q, k, v), np.float32)
