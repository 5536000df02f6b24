"""Shared fixtures."""

import pytest

from helpers import seeded_rng


@pytest.fixture
def rng(request):
  """Fresh random inputs (never zeros), seeded from the test's id so every run draws the same ones."""
  return seeded_rng(request.node.nodeid)
