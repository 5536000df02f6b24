"""Import time and peak host memory of `fsjax.convert` on a random checkpoint of a real model's shape.

    python benchmarks/convert.py [--shapes llama3.2_1b,qwen3_0.6b] [--dir /tmp/fsjax_convert]

For each shape: a random bf16 checkpoint in Hugging Face's layout (written by `fsjax.convert`'s own writer,
sharded at 1 GiB as Hugging Face shards large models), then `python -m fsjax.convert import` in a fresh process,
timed, with that process's CPU time and peak resident memory (`VmHWM`) against the checkpoint's bytes (the
CPU time says more than the wall time where other jobs share the machine). Prints one table.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from ml_dtypes import bfloat16

from fsjax.convert.hf_config import ARCHITECTURES, model_config_from_hf
from fsjax.convert.hf_weights import global_tensors, hf_shape, layer_tensors, write_tensors
from fsjax.model import init_variables

SHAPES = {
  "llama3.2_1b": dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_parameters=dict(
      rope_type="llama3",
      rope_theta=500000.0,
      factor=32.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=8192,
    ),
  ),
  "qwen3_0.6b": dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
  ),
}


def write_random(shape, directory):
  """A random bf16 checkpoint of `shape` in `directory` (config.json + 1-GiB shards); returns its tensor bytes."""
  hf = {"architectures": [ARCHITECTURES[SHAPES[shape]["model_type"]]], **SHAPES[shape], "dtype": "bfloat16"}
  config = model_config_from_hf(hf, param_dtype="bfloat16", scan_layers=False)
  params = jax.eval_shape(lambda: init_variables(config, jax.random.PRNGKey(0)))["params"]
  rng = np.random.default_rng(0)
  total = 0

  def tensors():  # one random tensor at a time, in Hugging Face's layout
    nonlocal total
    named = [(t.hf, t, params) for t in global_tensors(config)]
    for i in range(config.num_layers):
      named += [(f"model.layers.{i}.{t.hf}", t, params[f"layer_{i}"]) for t in layer_tensors(config)]
    for name, tensor, tree in named:
      for key in tensor.path:
        tree = tree[key]
      array = (0.02 * rng.standard_normal(hf_shape(config, tensor, tree.shape), np.float32)).astype(bfloat16)
      total += array.nbytes
      yield name, array

  directory.mkdir(parents=True, exist_ok=True)
  write_tensors(directory, tensors(), max_shard_bytes=2**30)
  (directory / "config.json").write_text(json.dumps(hf))
  return total


def timed_import(source, workdir):
  """(seconds, CPU seconds, peak resident bytes) of `python -m fsjax.convert import` in a fresh process, run as
  the command line runs it (its `__main__` block included).

  The peak is the process's own `VmHWM`: its `ru_maxrss` also counts the resident set of this process at the
  fork (Linux carries it over the exec), which holds the random checkpoint's arrays."""
  driver = (
    "import re, resource, runpy, sys\n"
    "sys.argv = ['fsjax.convert', *sys.argv[1:]]\n"
    "try:\n"
    "  runpy.run_module('fsjax.convert', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "  usage = resource.getrusage(resource.RUSAGE_SELF)\n"
    "  peak = int(re.search(r'VmHWM:\\s*(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024\n"
    "  print('usage', usage.ru_utime + usage.ru_stime, peak)\n"
  )
  start = time.perf_counter()
  run = subprocess.run(
    [sys.executable, "-c", driver, "import", str(source), "--workdir", str(workdir)],
    capture_output=True,
    text=True,
  )
  seconds = time.perf_counter() - start
  if run.returncode != 0:  # the import's own error, not only its exit status
    sys.exit(f"the import of {source} exited with status {run.returncode}:\n{run.stderr[-4000:]}")
  cpu, peak = run.stdout.split("usage")[-1].split()
  return seconds, float(cpu), int(peak)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--dir", default="/tmp/fsjax_convert")
  args = parser.parse_args()
  print(f"devices: {jax.devices()}", flush=True)
  rows = []
  for shape in args.shapes.split(","):
    root = Path(args.dir) / shape
    shutil.rmtree(root, ignore_errors=True)
    weights = write_random(shape, root / "hf")
    seconds, cpu, peak = timed_import(root / "hf", root / "work")
    rows.append((shape, weights, seconds, cpu, peak))
    shutil.rmtree(root, ignore_errors=True)
  print(
    "| shape | weights GiB (bf16) | import s (process start included) | CPU s (user + system) | peak host GiB "
    "| peak ÷ weights |"
  )
  print("|---|---|---|---|---|---|")
  for shape, weights, seconds, cpu, peak in rows:
    gib = lambda n: f"{n / 2**30:.2f}"
    print(f"| {shape} | {gib(weights)} | {seconds:.1f} | {cpu:.1f} | {gib(peak)} | {peak / weights:.2f} |")


if __name__ == "__main__":
  main()
