"""Timing helpers the benchmarks share: medians of repeated runs, queued runs, profiled kernels, and the device's
copy bandwidth."""

import collections
import gzip
import json
import pathlib
import statistics
import tempfile
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


def top_kernels(trace_dir, steps, count=12):
  """`[(kernel name, ms per step, launches per step)]` of the device events in the Perfetto trace that
  `jax.profiler.trace(..., create_perfetto_trace=True)` wrote under `trace_dir`, most time first."""
  path = next(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"))
  events = json.loads(gzip.decompress(path.read_bytes()))
  events = events["traceEvents"] if isinstance(events, dict) else events
  devices = {
    e["pid"]
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name" and "/device:GPU" in e.get("args", {}).get("name", "")
  }
  time_us, launches = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in devices:
      time_us[e["name"]] += e.get("dur", 0)
      launches[e["name"]] += 1
  return [(name, us / 1e3 / steps, launches[name] / steps) for name, us in time_us.most_common(count)]


def traced_kernels(run, steps, count=12):
  """`top_kernels` of one traced call of `run()`, per step of the `steps` it runs."""
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      jax.block_until_ready(run())
    return top_kernels(trace_dir, steps, count)


def profiled_kernels(fn, *args, calls=20, count=40):
  """`top_kernels` of `calls` queued calls of `fn(*args)` (after one warm-up call), per call."""
  jax.block_until_ready(fn(*args))

  def queued():
    for _ in range(calls):
      out = fn(*args)
    return out

  return traced_kernels(queued, calls, count)


def print_top_kernels(rows, what):
  """Each benchmark row's `top_kernels` under a "<kind> at <length>: costliest device kernels <what>" heading."""
  for r in rows:
    if r.get("top_kernels"):
      print(f"\n{r['kind']} at {r['length']:,}: costliest device kernels {what}")
      for name, ms, launches in r["top_kernels"]:
        print(f"  {ms:9.3f} ms  {launches:6.1f} launches  {name[:100]}")


def copy_bandwidth():
  """Bytes per second (read + write) of a 1 GiB device copy."""
  x = jnp.ones((256 * 2**20,), jnp.float32)
  return 2 * x.nbytes / (median_ms(jax.jit(lambda a: a + 1.0), x) / 1e3)
