"""Timing helpers the benchmarks share: medians of repeated runs, queued runs, and the device's copy bandwidth."""

import statistics
import time

import jax
import jax.numpy as jnp


def median_ms(fn, *args, repeats=10):
  """Median wall time of `fn(*args)` in milliseconds, after one warm-up call (compilation)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def queued_ms(fn, *args, calls=200):
  """Mean time per call of `calls` calls of `fn(*args)` queued back to back with one sync at the end, in
  milliseconds, after one warm-up call. For kernels shorter than a host round trip this is the device time a
  loop of them takes (a synced median adds the ~0.1 ms round trip to each), as long as dispatch keeps ahead."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - start) / calls


def copy_bandwidth():
  """Bytes per second (read + write) of a 1 GiB device copy."""
  x = jnp.ones((256 * 2**20,), jnp.float32)
  return 2 * x.nbytes / (median_ms(jax.jit(lambda a: a + 1.0), x) / 1e3)
