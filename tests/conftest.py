"""Shared fixtures and settings."""

import jax
import pytest

from helpers import seeded_rng

# Tests check math: on GPUs, float32 matmuls outside the references would otherwise default to TF32.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng(request):
  """Fresh random inputs (never zeros), seeded from the test's id so every run draws the same ones."""
  return seeded_rng(request.node.nodeid)
