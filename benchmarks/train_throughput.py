"""Training-step throughput and peak memory: FS, FS-L, TF++ and SWA at the 341M shape.

    python benchmarks/train_throughput.py [--lengths 4096,16384] [--kinds tfpp,swa,fs,fsl]
        [--tokens-per-step 32768] [--steps 5]

Each (kind, length) runs in its own subprocess, so the device's peak-memory counter belongs to that case alone.
Random tokens and weights; bf16 compute, fp32 master params, AdamW, per-layer remat, scanned layers (one compiled
layer body). TF++ and SWA use cuDNN attention on GPU, FS and FS-L the Pallas kernels with a cuDNN local branch.
Prints one table with tokens/s and the ratio to TF++ at the same length.
"""

import dataclasses
import json
import os
import time

import jax

from fsjax.config import TrainConfig, model_preset
from fsjax.model import Transformer, init_variables
from fsjax.train import objectives
from fsjax.train.optim import learning_rate_schedule, make_optimizer
from fsjax.train.step import create_state, make_train_step

from cases import case_parser, run_cases


def run_case(kind, seq_len, tokens_per_step, steps, preset):
  config = dataclasses.replace(
    model_preset(preset, kind=kind), dtype="bfloat16", param_dtype="float32", remat=True, scan_layers=True
  )
  batch = max(1, tokens_per_step // seq_len)
  train = TrainConfig(steps=1000, warmup_steps=10, batch_size=batch)
  optimizer = make_optimizer(train)
  model = Transformer(config)
  state = jax.jit(lambda: create_state(init_variables(config, jax.random.PRNGKey(0), 128), optimizer))()
  loss = objectives.get(train.objective).loss(model, train)
  step = jax.jit(make_train_step(loss, optimizer, learning_rate_schedule(train)), donate_argnums=0)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq_len + 1), 0, config.vocab_size)
  start = time.perf_counter()
  state, metrics = step(state, {"tokens": tokens})
  jax.block_until_ready(metrics["loss"])
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, {"tokens": tokens})
  jax.block_until_ready(metrics["loss"])
  step_s = (time.perf_counter() - start) / steps
  stats = jax.local_devices()[0].memory_stats() or {}
  return dict(
    kind=kind,
    length=seq_len,
    batch=batch,
    step_ms=1e3 * step_s,
    tokens_per_s=batch * seq_len / step_s,
    peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
    compile_s=compile_s,
    loss=float(metrics["loss"]),
    device=jax.devices()[0].device_kind,
  )


def main():
  parser = case_parser(__doc__, "4096,16384")
  parser.add_argument("--tokens-per-step", type=int, default=32768)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()
  if args.case:
    print(json.dumps(run_case(*args.case, args.tokens_per_step, args.steps, args.preset)))
    return
  rows = run_cases(
    __file__,
    args.kinds,
    args.lengths,
    ["--tokens-per-step", args.tokens_per_step, "--steps", args.steps, "--preset", args.preset],
    args.case_timeout,
  )

  baseline = {r["length"]: r["tokens_per_s"] for r in rows if r["kind"] == "tfpp" and "error" not in r}
  print(
    f"\n{args.preset}, {args.tokens_per_step} tokens per step, bf16 compute, remat, scanned layers, "
    f"{next((r['device'] for r in rows if 'device' in r), '?')}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  )
  print("| kind | length | batch | step ms | tokens/s | vs TF++ | peak GiB | compile s |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['kind']} | {r['length']} | – | – | failed: {r['error']} | – | – | – |")
      continue
    ratio = r["tokens_per_s"] / baseline[r["length"]] if r["length"] in baseline else float("nan")
    print(
      f"| {r['kind']} | {r['length']} | {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
      f"{ratio:.2f}x | {r['peak_gib']:.1f} | {r['compile_s']:.0f} |"
    )


if __name__ == "__main__":
  main()
