"""Batched serving: per attention kind and context, the largest batch whose caches fit the device, its decode
tokens/s, the cache bytes per sequence and the time to first token, with ratios to TF++ in the same run.

    python benchmarks/serve.py [--lengths 32768,131072] [--kinds tfpp,swa,fs,fsl,fsb,moba,zha]
        [--fsl-lengths 1048576] [--decode-tokens 32] [--max-batch 4096] [--preset fs_341m] [--case-timeout S]

Random weights, bf16 parameters and caches, scanned layers; each (kind, context) runs in its own subprocess.
A case:
1. Time to first token: one prompt of `context` random tokens through `fsjax.decode.prefill` into a fresh cache,
   then one decode step, timed on a second run (compiles excluded): what a request that arrives alone waits.
2. The largest batch: the cache bytes per sequence from `init_cache`'s shapes (nothing allocated), and the batch
   whose caches plus the decode loop's own buffers (XLA's buffer assignment of the loop compiled for that batch)
   fit in 90% of the memory free beside the parameters, at most `--max-batch`. The prefilled row waits on the host
   while the batch is sized and copied in one array at a time (so the caches must also fit beside the row's largest
   array): a kind whose row is large (TF++'s 12 GiB at 128k) is not sized with that row still on the device.
3. Decode tokens/s over all rows at that batch: `decode_loop` for `--decode-tokens` steps, every row running all of
   them, timed on its second call (the first compiles; the second continues from the cache the first left).
   Every row's cache is a copy of the prefilled row's: prefilling 64 rows of 1M tokens would take half an hour,
   and each kind's decode step does the same work per row whatever the cached values are (fixed window, top-K
   cells, beam width, capped ZHA routing, or every slot for TF++ and MoBA). `rows_agree` in a case's JSON says
   whether every row decoded the same tokens, as copies of one cache under greedy decoding should.
ZHA decodes through its capped routing (`--zha-max-nodes` per level, as `benchmarks/decode.py`), FS-B with τ
calibrated on the prompt's first 4096 tokens.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp

from fsjax import decode, memory
from fsjax.cache import cache_rows, init_cache
from fsjax.config import model_preset
from fsjax.decode import prefill

from cases import case_parser, compiled_decode_loop, random_model, run_cases

FIT = 0.9  # of the free memory the batch's caches and the decode loop's buffers may take
SEARCH_STEPS = 6  # recompiles of the decode loop while shrinking the batch to fit


def progress(message):
  print(message, file=sys.stderr, flush=True)


def sequence_bytes(config, max_len):
  """The cache bytes per sequence and the bytes that do not grow with the batch: `(per_sequence, fixed)`, from the
  shapes of one and two rows (nothing allocated)."""
  one, two = (
    memory.tree_bytes(jax.eval_shape(lambda b=b: init_cache(config, b, max_len, dtype=jnp.bfloat16))) for b in (1, 2)
  )
  return two - one, 2 * one - two


def largest_batch(model, variables, config, max_len, per_sequence, fixed, decode_tokens, max_batch, transient=0):
  """The largest batch whose caches and compiled decode loop fit `FIT` of the free memory, and whose caches fit
  beside `transient` bytes (one array of the row they are copied from), and that loop: `(batch, compiled, loop
  bytes)`. Where the platform reports no memory size (CPU), `max_batch`."""
  free = memory.free_bytes()
  if free is not None:
    max_batch = min(max_batch, int((free - fixed - transient) // per_sequence))
  batch = max_batch if free is None else max(1, min(max_batch, int((FIT * free - fixed) // per_sequence)))
  for _ in range(SEARCH_STEPS):
    shapes = jax.eval_shape(lambda: init_cache(config, batch, max_len, dtype=jnp.bfloat16))
    loop = compiled_decode_loop(model, variables, shapes, batch, decode_tokens)
    need = memory.program_bytes(loop) + memory.tree_bytes(shapes)
    if free is None or need <= FIT * free or batch == 1:
      return batch, loop, memory.program_bytes(loop)
    batch = max(1, int(batch * FIT * free / need))
  raise memory.DeviceMemoryError(f"no batch of {config.attention.kind} at {max_len} tokens fits after shrinking")


def run_case(kind, length, preset, decode_tokens, max_batch, zha_max_nodes):
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, length), 0, model_preset(preset, kind=kind).vocab_size)
  config, model, variables = random_model(kind, preset, tokens, zha_max_nodes=zha_max_nodes or None)
  max_len = length + 2 * decode_tokens  # two loop calls: the compiling one, then the timed one
  lengths = jnp.array([length], jnp.int32)

  def first_token():
    cache = init_cache(config, 1, max_len, dtype=jnp.bfloat16)
    logits, cache = prefill(model, variables, tokens, lengths, cache, all_logits=False)
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits, cache, _ = decode.extend(model, variables, token[:, None], cache, lengths[:, None], jnp.ones((1, 1), bool))
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

  clock = time.perf_counter()
  jax.block_until_ready(first_token())
  progress(f"{kind} at {length:,}: prefill and first step compiled and run in {time.perf_counter() - clock:.0f} s")
  start = time.perf_counter()
  token, row_cache = jax.block_until_ready(first_token())
  ttft_s = time.perf_counter() - start

  per_sequence, fixed = sequence_bytes(config, max_len)
  row_cache = jax.device_get(row_cache)  # on the host while the batch is sized and built
  largest_array = max(x.nbytes for x in jax.tree_util.tree_leaves(row_cache))
  clock = time.perf_counter()
  batch, loop, loop_bytes = largest_batch(
    model, variables, config, max_len, per_sequence, fixed, decode_tokens, max_batch, transient=largest_array
  )
  progress(f"{kind} at {length:,}: batch {batch}, decode loop compiled in {time.perf_counter() - clock:.0f} s")
  # The prefilled row, `batch` times: `jnp.take` moves one host array at a time to the device.
  cache = cache_rows(row_cache, jnp.zeros((batch,), jnp.int32))
  del row_cache
  first = jnp.repeat(token, batch)
  limits = jnp.full((batch,), decode_tokens, jnp.int32)
  position = jnp.full((batch,), length + 1, jnp.int32)
  out, _, cache = loop(variables, cache, first, position, jax.random.PRNGKey(2), limits)  # warm-up
  jax.block_until_ready(out)
  start = time.perf_counter()
  position = position + decode_tokens - 1  # out[:, -1]'s: the loop consumed all its tokens but the last
  out, _, cache = loop(variables, cache, out[:, -1], position, jax.random.PRNGKey(3), limits)
  jax.block_until_ready(out)
  decode_s = time.perf_counter() - start
  stats = jax.devices()[0].memory_stats() or {}
  return dict(
    kind=kind,
    length=length,
    batch=batch,
    decode_tok_s=batch * (decode_tokens - 1) / decode_s,  # the loop emits its first token without a step
    ttft_s=ttft_s,
    mib_per_sequence=per_sequence / 2**20,
    loop_gib=loop_bytes / 2**30,
    peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
    rows_agree=bool(jnp.all(out == out[:1])),  # copies of one cache decode alike: a check on `cache_rows`
    device=jax.devices()[0].device_kind,
  )


def main():
  parser = case_parser(__doc__, "32768,131072")
  parser.set_defaults(kinds="tfpp,swa,fs,fsl,fsb,moba,zha".split(","))
  parser.add_argument("--fsl-lengths", default=[1048576], type=lambda s: [int(n) for n in s.split(",") if n])
  parser.add_argument("--decode-tokens", type=int, default=32)
  parser.add_argument("--max-batch", type=int, default=4096, help="the largest batch tried")
  parser.add_argument("--zha-max-nodes", type=int, default=64, help="ZHA's per-level cap in decode (0: none)")
  args = parser.parse_args()
  if args.case:
    kind, length = args.case
    print(json.dumps(run_case(kind, length, args.preset, args.decode_tokens, args.max_batch, args.zha_max_nodes)))
    return
  extra = ["--preset", args.preset, "--decode-tokens", args.decode_tokens, "--max-batch", args.max_batch]
  extra += ["--zha-max-nodes", args.zha_max_nodes]
  rows = run_cases(__file__, args.kinds, args.lengths, extra, args.case_timeout)
  if "fsl" in args.kinds and args.fsl_lengths:
    rows += run_cases(__file__, ["fsl"], args.fsl_lengths, extra, args.case_timeout)
  base = {r["length"]: r for r in rows if r["kind"] == "tfpp" and "error" not in r}
  device = next((r["device"] for r in rows if "device" in r), "?")
  print(f"\n{args.preset}, bf16, scanned layers, {args.decode_tokens} decoded tokens per row, {device}")
  print("| kind | context | largest batch | decode tok/s | vs TF++ | MiB per sequence | time to first token s |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    if "error" in r:
      print(f"| {r['kind']} | {r['length']} | failed: {r['error']} | | | | |")
      continue
    b = base.get(r["length"])
    ratio = f"{r['decode_tok_s'] / b['decode_tok_s']:.1f}x" if b else "–"
    print(
      f"| {r['kind']} | {r['length']} | {r['batch']} | {r['decode_tok_s']:,.0f} | {ratio} | "
      f"{r['mib_per_sequence']:,.1f} | {r['ttft_s']:.2f} |"
    )


if __name__ == "__main__":
  main()
