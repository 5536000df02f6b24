"""Shared fixtures and settings."""

import os
import shutil
import tempfile

import jax
import pytest

from fsjax.config import load_config
from fsjax.train import loop

from helpers import seeded_rng

MICRO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "micro_fs.yaml")

# Tests check math: on GPUs, float32 matmuls outside the references would otherwise default to TF32.
jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache per test session, shared by the xdist workers and the train.py / CLI
# subprocesses the tests start (they inherit the environment): many modules and every micro training run compile
# the same programs (the tiny models' chunk and decode programs, the micro config's train step), and on CPU the
# compiles are most of the suite's time. Keyed by the program, so a hit runs exactly what a compile would give;
# tracing still runs, so monkeypatched Python still takes effect. A size bound turns on JAX's file lock around
# every read and write: without it one process can read an entry another is still writing (a warning, and a
# test that counts stderr lines would see it).
_COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"
_MIN_COMPILE_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_MAX_SIZE = "JAX_COMPILATION_CACHE_MAX_SIZE"


def pytest_configure(config):
  # CPU only: compiled GPU runs (the kernels' parity tests on the device) stay exactly as a user's first run.
  controller = not hasattr(config, "workerinput")
  if controller and _COMPILATION_CACHE not in os.environ and jax.default_backend() == "cpu":  # set once
    config._fsjax_compilation_cache = tempfile.mkdtemp(prefix="fsjax-jit-cache-")
    os.environ[_COMPILATION_CACHE] = config._fsjax_compilation_cache
    os.environ.setdefault(_MIN_COMPILE_SECONDS, "0.2")
    os.environ.setdefault(_MAX_SIZE, str(16 << 30))
  if os.environ.get(_COMPILATION_CACHE):
    jax.config.update("jax_compilation_cache_dir", os.environ[_COMPILATION_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(os.environ.get(_MIN_COMPILE_SECONDS, 1)))
    jax.config.update("jax_compilation_cache_max_size", int(os.environ.get(_MAX_SIZE, 16 << 30)))


def pytest_unconfigure(config):
  path = getattr(config, "_fsjax_compilation_cache", None)
  if path:
    shutil.rmtree(path, ignore_errors=True)


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
