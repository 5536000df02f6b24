"""What the per-case benchmarks share: each case runs in its own subprocess, so a device's peak-memory counter and
compile caches belong to that case alone, and a case that hangs or runs out of memory is reported instead of
ending the table; a case's model is the preset's shape with random weights (`random_model`), and its decode loop
is compiled once (`compiled_decode_loop`)."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from fsjax import calibrate, decode, loading
from fsjax.config import model_preset
from fsjax.model import Transformer, init_variables


def case_parser(description, default_lengths):
  """An argument parser with the options every benchmark shares: lengths, kinds, preset, case timeout, and the
  hidden --case "kind:length" that a subprocess runs."""
  parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default=default_lengths, type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument("--kinds", default="tfpp,swa,fs,fsl", type=lambda s: s.split(","))
  parser.add_argument("--preset", default="fs_341m")
  parser.add_argument("--case-timeout", type=float, default=None, help="seconds per case, compile included")
  parser.add_argument("--case", type=lambda s: (s.split(":")[0], int(s.split(":")[1])), help=argparse.SUPPRESS)
  return parser


def run_cases(script, kinds, lengths, extra_args, timeout=None):
  """For every length and kind, runs `script --case kind:length *extra_args` and parses its last stdout line.

  Returns:
    list of dicts: the case's JSON, or `{"kind", "length", "error"}` when it failed or timed out.
  """
  rows = []
  for length in lengths:
    for kind in kinds:
      cmd = [sys.executable, script, "--case", f"{kind}:{length}", *map(str, extra_args)]
      try:
        result = subprocess.run(
          cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        row = (
          json.loads(result.stdout.strip().splitlines()[-1])
          if result.returncode == 0
          else dict(kind=kind, length=length, error=(result.stderr.strip().splitlines() or ["?"])[-1][:100])
        )
      except subprocess.TimeoutExpired as timed_out:
        done = timed_out.stderr or b""  # what the case printed before it was stopped (bytes, even with text=True)
        done = (done.decode(errors="replace") if isinstance(done, bytes) else done).strip().splitlines()
        row = dict(
          kind=kind,
          length=length,
          error=f"not done after {timeout:.0f} s" + (f"; last: {done[-1][:100]}" if done else ""),
        )
      rows.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  return rows


def random_model(kind, preset, tokens, scan_layers=True, zha_max_nodes=None, impl="auto"):
  """The preset's model of `kind` with bf16 parameters and activations and random weights: `(config, model,
  variables)`. ZHA keeps at most `zha_max_nodes` per level (None: the preset's routing). FS-B's τ is what
  `fsjax.calibrate` computes from the FS forward over the first 4096 tokens of `tokens` `[batch, T]`. `impl`:
  the attention's `impl` (`fsjax.ops.dispatch`)."""
  config = dataclasses.replace(
    model_preset(preset, kind=kind), dtype="bfloat16", param_dtype="bfloat16", scan_layers=scan_layers
  )
  config = dataclasses.replace(config, attention=dataclasses.replace(config.attention, impl=impl))
  if kind == "zha" and zha_max_nodes is not None:
    att = config.attention
    config = dataclasses.replace(
      config, attention=dataclasses.replace(att, zha=dataclasses.replace(att.zha, max_nodes=zha_max_nodes))
    )
  variables = jax.jit(lambda: init_variables(config, jax.random.PRNGKey(0), 128))()
  if kind == "fsb":
    fs_model = Transformer(dataclasses.replace(config, attention=model_preset(preset, kind="fs").attention))
    variables = loading.with_tau(config, variables, calibrate.calibrate(fs_model, variables, [tokens[:, :4096]]))
  return config, Transformer(config), variables


def compiled_decode_loop(model, variables, cache, batch, decode_tokens):
  """`fsjax.decode`'s on-device loop compiled for `batch` rows and `cache` (arrays or shapes): greedy, no EOS, every
  row running `decode_tokens` steps. Call it as `loop(variables, cache, first_token, position, rng, limits)` →
  `(tokens, cells, final cache)`; it donates the cache. One compile serves every call (lowering the loop again
  for its HLO text would compile it twice: minutes for FS-B)."""
  rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return decode._decode_loop.lower(
    model,
    variables,
    cache,
    rows,
    rows,
    jax.random.PRNGKey(0),
    rows,
    max_new_tokens=decode_tokens,
    eos_id=-1,
    temperature=0.0,
    top_p=1.0,
    return_cells=False,
  ).compile()
