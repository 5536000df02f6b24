"""Prefill throughput and peak memory per attention kind, with ratios to TF++ measured in the same run.

    python benchmarks/prefill.py [--lengths 4096,16384,65536,131072,262144] [--kinds tfpp,swa,fs,fsl,fsb,moba,zha]
        [--batches 1] [--preset fs_341m] [--chunk N] [--profile] [--case-timeout S]

Batches of `--batches` prompts of one length (tok/s counts every row's tokens), random weights, bf16 parameters
and caches, scanned layers. Each (kind, length, batch) runs in its own subprocess, so the device's peak-memory
counter belongs to that case. A case prefills once to compile, then times a second prefill of the same prompts
into a fresh cache, keeping only the last position's logits (what generation asks). `--chunk` fixes the chunk
(default: `fsjax.decode.prefill_chunk`, the whole prompt where the kind's training operator runs fused and the
batch's activations fit; prefill halves a chunk that does not fit, and the table prints the sizes it ran). Peak
memory is the device's high-water mark over the case, compile included; the parameters and the filled cache are
printed beside it. `--profile` traces one more prefill and splits its device
time into matrix products (the dense layers: projections, MLP, logits) and everything else (attention, its
routing and the cache writes), then lists the costliest kernels.
FS-B's τ is calibrated on the first 4096 tokens, as `benchmarks/decode.py` does.
"""

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp

from fsjax.cache import init_cache
from fsjax.config import model_preset
from fsjax.decode import chunk_sizes, prefill

from cases import case_parser, random_model, run_cases
from timing import print_top_kernels, traced_kernels

# cuBLAS / CUTLASS matrix products: the dense layers' kernels (projections, MLP, logits).
MATMUL = re.compile(r"gemm|cublas|cutlass|xmma|nvjet", re.IGNORECASE)


def run_case(kind, length, batch, preset, chunk, profile):
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 0, model_preset(preset, kind=kind).vocab_size)
  config, model, variables = random_model(kind, preset, tokens)
  lengths = jnp.full((batch,), length)
  run = lambda: prefill(
    model,
    variables,
    tokens,
    lengths,
    init_cache(config, batch, length + 1, dtype=jnp.bfloat16),
    chunk,
    all_logits=False,
  )
  clock = time.perf_counter()
  jax.block_until_ready(run())
  compile_s = time.perf_counter() - clock
  start = time.perf_counter()
  logits, cache = run()
  jax.block_until_ready(logits)
  seconds = time.perf_counter() - start
  first, later = chunk_sizes(model, variables, cache, batch, length, chunk, all_logits=False)  # as run, no compile
  kernels = traced_kernels(lambda: run()[0], 1, count=100_000) if profile else []
  total_ms = sum(ms for _, ms, _ in kernels)
  matmul_ms = sum(ms for name, ms, _ in kernels if MATMUL.search(name))
  stats = jax.devices()[0].memory_stats() or {}
  gib = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)) / 2**30
  return dict(
    kind=kind,
    length=length,
    batch=batch,
    chunk=first if later == first else f"{first}, then {later}",
    tok_s=batch * length / seconds,
    first_call_s=compile_s,
    peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
    params_gib=gib(variables),
    cache_gib=gib(cache),
    matmul_share=matmul_ms / total_ms if total_ms else None,
    device=jax.devices()[0].device_kind,
    top_kernels=kernels[:10],
  )


def main():
  parser = case_parser(__doc__, "4096,16384,65536,131072,262144")
  parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: chosen per prompt)")
  parser.add_argument("--batches", default=[1], type=lambda s: [int(n) for n in s.split(",")], help="default: 1")
  parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument("--profile", action="store_true", help="split device time: matrix products vs the rest")
  args = parser.parse_args()
  if args.case:
    print(json.dumps(run_case(*args.case, args.batch, args.preset, args.chunk, args.profile)))
    return
  extra = ["--preset", args.preset, *(["--chunk", args.chunk] if args.chunk else []), *(["--profile"] * args.profile)]
  rows = []
  for batch in args.batches:
    rows += [
      {"batch": batch, **row}
      for row in run_cases(__file__, args.kinds, args.lengths, [*extra, "--batch", batch], args.case_timeout)
    ]
  base = {(r["length"], r["batch"]): r for r in rows if r["kind"] == "tfpp" and "error" not in r}
  device = next((r["device"] for r in rows if "device" in r), "?")
  print(f"\n{args.preset}, bf16, scanned layers, last-position logits, {device}")
  print(
    "| kind | length | batch | chunk | prefill tok/s | vs TF++ | peak GiB | params GiB | cache GiB | matmul share |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['kind']} | {r['length']} | {r['batch']} | failed: {r['error']} | | | | | | |")
      continue
    b = base.get((r["length"], r["batch"]))
    share = "–" if r["matmul_share"] is None else f"{r['matmul_share']:.0%}"
    ratio = f"{r['tok_s'] / b['tok_s']:.2f}x" if b else "–"
    print(
      f"| {r['kind']} | {r['length']} | {r['batch']} | {r['chunk']} | {r['tok_s']:,.0f} | {ratio} | "
      f"{r['peak_gib']:.1f} | {r['params_gib']:.2f} | {r['cache_gib']:.2f} | {share} |"
    )
  print_top_kernels(rows, "of one prefill")


if __name__ == "__main__":
  main()
