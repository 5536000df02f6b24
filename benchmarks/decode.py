"""Prefill and decode throughput, attention-state bytes and the HBM roofline: FS-L, FS, FS-B, TF++, SWA and ZHA.

    python benchmarks/decode.py [--lengths 4096,16384,65536,131072,262144] [--kinds fsl,fs,fsb,tfpp,swa,zha]
        [--decode-tokens 64] [--preset fs_341m] [--layers scanned|unrolled] [--zha-max-nodes 64] [--profile [N]]
        [--impl auto|pallas|reference] [--batch 1]

Batch 1 (or `--batch` copies of the prompt, decoded together), random weights, bf16 parameters and caches. Each
(kind, length) runs in its own subprocess. Prefill goes through `fsjax.decode.prefill` (the chunk it chooses, or
`--chunk`); decode through the on-device `decode_loop`. The roofline is the parameter and attention-state bytes
divided by the device's measured copy bandwidth: the bound for TF++, SWA and FS-L, which read their whole state
each step; FS and FS-B need only parts of theirs (summaries or forest nodes, the window, the selected cells), so
they can beat it. Prints one table with ratios to TF++ at the same length, and the device kernels (fusions and
library calls) one compiled decode step launches: at batch 1 a step is short enough for launches to matter.
`--layers unrolled` decodes with one layer body per layer instead of `nn.scan` over stacked layers and caches.
ZHA (the preset's tree, random reference queries) decodes through the capped routing, `--zha-max-nodes` per level,
which runs the `zha_routing` kernels on a GPU; 0 keeps the uncapped reference routing, which masks the whole cache.
FS-B prefills with the prefill formulation and decodes through the streaming forest cache, τ calibrated on the
first 4096 tokens; its per-block forest update is timed alone by `forest_update.py`. `--profile [N]` traces one
more decode loop per case and prints the N (default 12) device kernels that take the most time per token. A case
prints its phases on stderr (prefill compile, prefill, decode-loop compile), so one cut by `--case-timeout` says
how far it got. `--impl` sets the attention's `impl` (`fsjax.ops.dispatch`), which also picks how a step's
projections run (`pallas_kernels.matvec` on a GPU under `auto` and `pallas`). With `--batch B`, tokens/s count
every row's tokens, the state column is per sequence, the roofline reads the parameters once and every row's
state per step, and the profile is per decode step (B tokens).
"""

import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from fsjax.cache import init_cache
from fsjax.config import model_preset
from fsjax.decode import prefill
from fsjax.ops.dispatch import IMPLS

from cases import case_parser, compiled_decode_loop, random_model, run_cases
from timing import copy_bandwidth, print_top_kernels, traced_kernels


def kernels_per_step(compiled_text):
  """Kernels a compiled decode loop launches per step: its fusions and custom calls (cuDNN, cuBLAS, Triton)."""
  return len(re.findall(r"= [^=]*\b(?:fusion|custom-call)\(", compiled_text))


def progress(message):
  """A case's progress on stderr: what a case cut by --case-timeout had finished (`cases.run_cases`)."""
  print(message, file=sys.stderr, flush=True)


def run_case(kind, length, decode_tokens, preset, chunk, layers, zha_max_nodes, profile=0, impl="auto", batch=1):
  vocab_size = model_preset(preset, kind=kind).vocab_size
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, length), 0, vocab_size)
  tokens = jnp.broadcast_to(tokens, (batch, length))
  config, model, variables = random_model(
    kind, preset, tokens, scan_layers=layers == "scanned", zha_max_nodes=zha_max_nodes or None, impl=impl
  )
  max_len = length + decode_tokens
  fresh = lambda: init_cache(config, batch, max_len, dtype=jnp.bfloat16)
  state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(fresh()))
  lengths = jnp.full((batch,), length, jnp.int32)
  clock = time.perf_counter()
  _, cache = prefill(model, variables, tokens, lengths, fresh(), chunk, all_logits=False)  # compile
  progress(f"{kind} at {length:,}: prefill chunk compiled and run in {time.perf_counter() - clock:.0f} s")
  start = time.perf_counter()
  logits, cache = prefill(model, variables, tokens, lengths, fresh(), chunk, all_logits=False)
  logits.block_until_ready()
  prefill_s = time.perf_counter() - start
  progress(f"{kind} at {length:,}: prefill {prefill_s:.0f} s")
  clock = time.perf_counter()
  limits = jnp.full(lengths.shape, decode_tokens, jnp.int32)  # every row runs the whole loop
  loop = compiled_decode_loop(model, variables, cache, batch, decode_tokens)
  run = lambda c: loop(variables, c, tokens[:, -1], lengths, jax.random.PRNGKey(2), limits)[0]
  run(jax.tree_util.tree_map(jnp.copy, cache)).block_until_ready()  # the loop donates its cache: warm up on a copy
  progress(f"{kind} at {length:,}: decode loop compiled and warmed up in {time.perf_counter() - clock:.0f} s")
  traced = jax.tree_util.tree_map(jnp.copy, cache) if profile else None
  start = time.perf_counter()
  run(cache).block_until_ready()
  decode_s = (time.perf_counter() - start) / (decode_tokens - 1)
  kernels = traced_kernels(lambda: run(traced), decode_tokens - 1, count=profile) if profile else []
  param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(variables))
  return dict(
    kind=kind,
    length=length,
    prefill_tok_s=batch * length / prefill_s,
    decode_tok_s=batch / decode_s,
    state_mib=state_bytes / batch / 2**20,
    roofline_tok_s=batch * copy_bandwidth() / (param_bytes + state_bytes),
    kernels=kernels_per_step(loop.as_text()),
    layers=layers,
    device=jax.devices()[0].device_kind,
    top_kernels=kernels,
  )


def main():
  parser = case_parser(__doc__, "4096,16384,65536,131072,262144")
  parser.add_argument("--decode-tokens", type=int, default=64)
  parser.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: chosen per prompt)")
  parser.add_argument("--layers", choices=("scanned", "unrolled"), default="scanned")
  parser.add_argument("--zha-max-nodes", type=int, default=64, help="ZHA's per-level cap in decode (0: none)")
  parser.add_argument(
    "--profile", type=int, nargs="?", const=12, default=0, help="print each case's N (12) costliest kernels per token"
  )
  parser.add_argument(
    "--impl", choices=IMPLS, default="auto", help="the attention's impl; pallas also runs the projections' kernel"
  )
  parser.add_argument("--batch", type=int, default=1, help="rows decoded together (copies of one prompt)")
  args = parser.parse_args()
  if args.case:
    print(
      json.dumps(
        run_case(
          *args.case,
          args.decode_tokens,
          args.preset,
          args.chunk,
          args.layers,
          args.zha_max_nodes,
          args.profile,
          args.impl,
          args.batch,
        )
      )
    )
    return
  rows = run_cases(
    __file__,
    args.kinds,
    args.lengths,
    [
      "--decode-tokens",
      args.decode_tokens,
      *(["--chunk", args.chunk] if args.chunk else []),
      "--preset",
      args.preset,
      "--layers",
      args.layers,
      "--zha-max-nodes",
      args.zha_max_nodes,
      *(["--profile", args.profile] if args.profile else []),
      "--impl",
      args.impl,
      "--batch",
      args.batch,
    ],
    args.case_timeout,
  )

  base = {r["length"]: r for r in rows if r["kind"] == "tfpp" and "error" not in r}
  print(
    f"\n{args.preset}, batch {args.batch}, bf16, {args.layers} layers, "
    f"{next((r['device'] for r in rows if 'device' in r), '?')}"
  )
  print("| kind | length | prefill tok/s | vs TF++ | decode tok/s | vs TF++ | roofline tok/s | state MiB | kernels |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['kind']} | {r['length']} | failed: {r['error']} | | | | | | |")
      continue
    b = base.get(r["length"])
    ratio = lambda key: f"{r[key] / b[key]:.2f}x" if b else "–"
    print(
      f"| {r['kind']} | {r['length']} | {r['prefill_tok_s']:,.0f} | {ratio('prefill_tok_s')} | "
      f"{r['decode_tok_s']:,.1f} | {ratio('decode_tok_s')} | {r['roofline_tok_s']:,.0f} | {r['state_mib']:.1f} | "
      f"{r['kernels']} |"
    )
  print_top_kernels(rows, "per decoded token" if args.batch == 1 else f"per decode step ({args.batch} tokens)")


if __name__ == "__main__":
  main()
