"""Shared fixtures and settings."""

import os

import jax
import pytest

from fsjax.config import load_config
from fsjax.train import loop

from helpers import seeded_rng

MICRO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "micro_fs.yaml")

# Tests check math: on GPUs, float32 matmuls outside the references would otherwise default to TF32.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test module. The suite compiles thousands of programs in one
  process; kept alive, they grew the process to 6.6 GB and XLA's CPU compiler crashed (SIGSEGV) late in the run,
  at a different test each time and never when the module ran alone."""
  yield
  jax.clear_caches()


@pytest.fixture
def rng(request):
  """Fresh random inputs (never zeros), seeded from the test's id so every run draws the same ones."""
  return seeded_rng(request.node.nodeid)


@pytest.fixture(scope="session")
def micro_workdir(tmp_path_factory):
  """A training workdir of the micro FS config after 2 steps (checkpoints at step 2), shared by CLI tests."""
  path = tmp_path_factory.mktemp("micro_run")
  loop.train(load_config(MICRO_CONFIG, ["train.steps=2", "checkpoint.async_save=false"]), str(path))
  return path
