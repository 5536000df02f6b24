"""ZHA decode attention (one layer, batch 1, one new token) against dense decode attention, across lengths,
tree geometries and routing thresholds.

    python benchmarks/zha_decode.py [--lengths 16384,65536,262144,1048576] [--geometries R1-C8-L2,R16-C16-L3,R16-C4-L6]
        [--top-p 0.8,0.9,0.95] [--max-nodes 64] [--heads 16] [--kv-heads 16] [--head-dim 64] [--sharpness 4]
        [--calls 200] [--in-loop 24] [--profile]

The capped decode step `fsjax.attention.zha_step.attend` (`fsjax.ops.zha.zha_decode` with impl="auto": the Pallas
`zha_routing` kernels on a GPU) against dense attention of the same query over the whole bf16 cache (cuDNN where it
accepts the shape, else XLA), in the same process. Rows: latency of ZHA and of its routing alone (candidate scoring
+ top-p, no final attention), the ratio to dense, the fraction of keys attended, and the fraction the paper's
uncapped routing would attend (where it is larger, the cap binds and ZHA reads less than the paper's operator
would). The tree is built from the cache's keys with random reference queries; keys are standard normal and the
query is `sharpness` times a normal vector, so attention concentrates on few keys as in a trained model's retrieval
heads (sharpness 1 spreads it almost uniformly, which makes top-p keep nearly everything up to the cap). Times are
means over calls queued back to back with one sync at the end (`timing.queued_ms`): a decode loop never waits for
the host, and a synced median adds a host round trip of about 0.1 ms to every call (cuDNN dense decode at 64k: 0.21
ms synced, 0.074 ms queued, on an H200).

`--kv-heads` below `--heads` is grouped-query attention (Llama 3.2-1B: 32 heads over 8, d 64; Qwen3-0.6B: 16 over
8, d 128): one tree and one set of reference queries per key/value head (ZHA III-A), routing per query head; the
dense baseline reads the same grouped cache.

`--in-loop N` times every program as N dependent calls inside one jitted `lax.fori_loop` (each call's query
nudged by the previous output, so nothing is hoisted), per call: the way a scanned model runs its layers' attention
in one executable, where XLA may launch a loop body's kernels as one CUDA graph. ZHA's routing is a chain of small
kernels, so launch overhead, which isolated calls pay in full, is most of what this can change.

`--profile` traces 20 queued calls of each ZHA step and prints, after the tables, the kernels one call launches
(name, µs and launches per call, most time first): the chain whose latency the routing is.

The paper's roofline model predicts ZHA overtakes dense decode near 48k tokens (ZHA Sec. V, R1-C8 at p=0.75);
the last lines print the measured crossover per geometry and threshold.
"""

import argparse
import concurrent.futures

import jax
import jax.numpy as jnp

from fsjax.attention import zha_step
from fsjax.cache import zha as zha_cache
from fsjax.cache.store import KVStore
from fsjax.ops import dispatch
from fsjax.ops import zha as zha_ops
from fsjax.reference import zha

from timing import profiled_kernels, queued_ms


def parse_geometry(text):
  """ "R16-C4-L6" → (16, 4, 6)."""
  refs, chunk, levels = (int(part[1:]) for part in text.split("-"))
  return refs, chunk, levels


def dense_decode(q, k, v):
  """`[1, 1, h, d]` over `[1, T, h, d]`: cuDNN on a GPU when it accepts the shape, else XLA."""
  if dispatch.on_gpu():
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    except Exception:  # noqa: BLE001 — cuDNN rejects some decode shapes; XLA's is the fallback baseline
      pass
  return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def build_cache(length, heads, dim, refs, chunk, levels, key):
  """A ZHA cache holding `length` random tokens of `heads` key/value heads: bf16 K/V and every level's tangents."""
  k_key, v_key, r_key = jax.random.split(key, 3)
  k = jax.random.normal(k_key, (1, length, heads, dim), jnp.bfloat16)
  v = jax.random.normal(v_key, (1, length, heads, dim), jnp.bfloat16)
  ref_queries = jax.random.normal(r_key, (heads, refs, dim), jnp.float32)
  tree = jax.jit(lambda k: zha.build_tree(k.astype(jnp.float32), ref_queries, chunk=chunk, levels=levels))(k)
  store = KVStore(k=k, v=v, pos=jnp.arange(length, dtype=jnp.int32)[None])
  return zha_cache.ZHACache(
    store=store, keys=tuple(t[0].astype(jnp.bfloat16) for t in tree), bias=tuple(t[1].astype(jnp.float32) for t in tree)
  )


def in_loop(fn, calls, query_arg):
  """`fn(*args)` run `calls` times in one `lax.fori_loop`, the query `args[query_arg]` nudged each time by 1e-30
  times the mean of the previous result: a real dependence that changes no value, so XLA cannot hoist the calls
  out of the loop."""

  def looped(*args):
    def body(_, q):
      out = fn(*args[:query_arg], q, *args[query_arg + 1 :])
      out = out[0] if isinstance(out, tuple) else out
      return q + (1e-30 * jnp.mean(out.astype(jnp.float32))).astype(q.dtype)

    return jax.lax.fori_loop(0, calls, body, args[query_arg])

  return looped


def compile_all(jobs):
  """AOT-compiles `(fn, args)` jobs: traced in order, then compiled on a thread pool (XLA's compiler, Triton's
  included, releases the GIL), since compilation, not the timed runs, is most of this benchmark's wall time.
  Returns the compiled programs, or the exception a job's compilation raised in its place."""
  lowered = []
  for fn, args in jobs:
    try:
      lowered.append(jax.jit(fn).lower(*args))
    except Exception as error:  # noqa: BLE001 — reported by the caller
      lowered.append(error)

  def compile_one(low):
    if isinstance(low, Exception):
      return low
    try:
      return low.compile()
    except Exception as error:  # noqa: BLE001 — reported by the caller
      return error

  with concurrent.futures.ThreadPoolExecutor(max_workers=len(lowered)) as pool:
    return list(pool.map(compile_one, lowered))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="16384,65536,262144,1048576", type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument(
    "--geometries", default="R1-C8-L2,R16-C16-L3,R16-C4-L6", type=lambda s: [parse_geometry(g) for g in s.split(",")]
  )
  parser.add_argument("--top-p", default="0.8,0.9,0.95", type=lambda s: [float(p) for p in s.split(",")])
  parser.add_argument("--max-nodes", type=int, default=64)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--sharpness", type=float, default=4.0)
  parser.add_argument("--calls", type=int, default=200, help="calls queued per timing")
  parser.add_argument(
    "--in-loop", type=int, default=0, help="time N dependent calls inside one jitted loop, per call (0: isolated calls)"
  )
  parser.add_argument("--profile", action="store_true", help="print the kernels of each ZHA step, per call")
  args = parser.parse_args()
  kv_heads = args.kv_heads or args.heads
  if args.heads % kv_heads:
    parser.error(f"--kv-heads ({kv_heads}) must divide --heads ({args.heads})")

  def wrap(fn, query_arg=1):  # query_arg: where the query is among the job's arguments
    return in_loop(fn, args.in_loop, query_arg) if args.in_loop else fn

  per_call = max(args.in_loop, 1)
  jobs_per_p = 4 if args.in_loop else 3  # a looped step returns its query: the fraction needs its own program

  on_gpu = dispatch.on_gpu()
  routes = {
    f"R{refs}-C{chunk}-L{levels}": dispatch.resolve("zha_route", "auto", chunk=chunk, refs=refs)
    for refs, chunk, levels in args.geometries
  }
  print(
    f"{jax.devices()[0].device_kind}, {args.heads} heads ({kv_heads} key/value) x {args.head_dim}, bf16 cache, "
    f"max_nodes {args.max_nodes}, routing impl={', '.join(f'{g}: {i}' for g, i in routes.items())}, "
    + (f"{args.in_loop} calls per jitted loop, times per call" if args.in_loop else "isolated calls")
  )
  print(
    "Rows in measuring order (length by length; every geometry at a length before the next length); the same "
    "rows sorted by geometry follow the crossover lines."
  )
  header = (
    "| geometry | p | length | dense ms | ZHA ms | vs dense | routing ms | routing share | keys attended | "
    "uncapped |\n|---|---|---|---|---|---|---|---|---|---|"
  )
  print(header, flush=True)
  rows = []
  profiles = []
  dense_kinds = {}
  try:
    for length in args.lengths:  # lengths outermost: a run cut short still covers every geometry
      for refs, chunk, levels in args.geometries:
        name = f"R{refs}-C{chunk}-L{levels}"
        cache = build_cache(length, kv_heads, args.head_dim, refs, chunk, levels, jax.random.PRNGKey(length))
        q = args.sharpness * jax.random.normal(jax.random.PRNGKey(1), (1, 1, args.heads, args.head_dim), jnp.float32)
        position = jnp.array([[length - 1]], jnp.int32)
        inputs = (cache, q, position)
        dense_inputs = (q.astype(jnp.bfloat16), cache.store.k, cache.store.v)
        jobs = [(wrap(dense_decode, query_arg=0), dense_inputs)]
        for p in args.top_p:
          tree = zha.ZHATree(refs=refs, chunk=chunk, levels=levels, top_p=(p,), max_nodes=args.max_nodes)
          uncapped = zha.ZHATree(refs=refs, chunk=chunk, levels=levels, top_p=(p,))
          decode = lambda c, q, pos, t=tree: zha_step.attend(c, q, pos, tree=t, impl="auto")
          jobs += [
            (wrap(decode), inputs),
            (
              wrap(
                lambda c, q, pos, t=tree: zha_ops.zha_route(q[:, 0], pos[:, 0], c.keys, c.bias, tree=t, impl="auto")
              ),
              inputs,
            ),
            (lambda c, q, pos, t=uncapped: zha_step.attend(c, q, pos, tree=t)[1], inputs),
          ]
          if args.in_loop:
            jobs.append((lambda c, q, pos, d=decode: d(c, q, pos)[1], inputs))
        dense, *compiled = compile_all(jobs)
        dense_kind = "cudnn" if on_gpu else "xla"
        if isinstance(dense, Exception):  # cuDNN refused the shape only at compile time: XLA's is the baseline
          dense_kind = "xla"
          (dense,) = compile_all(
            [
              (
                wrap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"), query_arg=0),
                dense_inputs,
              )
            ]
          )
        dense_kinds[length] = dense_kind
        if isinstance(dense, Exception):
          print(f"| {name} | - | {length:,} | dense failed: {type(dense).__name__}: {str(dense)[:300]} |", flush=True)
          del cache
          continue
        dense_ms = queued_ms(dense, *dense_inputs, calls=args.calls) / per_call
        for i, p in enumerate(args.top_p):
          step, route, uncapped, *attended = compiled[jobs_per_p * i : jobs_per_p * (i + 1)]
          failed = next((f for f in (step, route, uncapped, *attended) if isinstance(f, Exception)), None)
          if failed is not None:
            print(
              f"| {name} | {p} | {length:,} | {dense_ms:.3f} | failed: {type(failed).__name__}: {str(failed)[:1500]} |",
              flush=True,
            )
            continue
          zha_ms = queued_ms(step, *inputs, calls=args.calls) / per_call
          route_ms = queued_ms(route, *inputs, calls=args.calls) / per_call
          fraction = float(jnp.mean(attended[0](*inputs) if attended else step(*inputs)[1]))
          uncapped_fraction = float(jnp.mean(uncapped(*inputs)))
          row = dict(
            geometry=name,
            p=p,
            length=length,
            ratio=zha_ms / dense_ms,
            text=f"| {name} | {p} | {length:,} | {dense_ms:.3f} | {zha_ms:.3f} | {zha_ms / dense_ms:.2f}x | "
            f"{route_ms:.3f} | {route_ms / zha_ms:.0%} | {fraction:.2%} | {uncapped_fraction:.2%} |",
          )
          rows.append(row)
          print(row["text"], flush=True)
          if args.profile:
            profiles.append((f"{name} p={p} at {length:,}", profiled_kernels(step, *inputs)))
        del cache, inputs, dense_inputs, dense, compiled
  except KeyboardInterrupt:
    print("\n(interrupted: the crossover lines below cover only the rows above)")
  print(f"\ndense baseline per length: {', '.join(f'{n:,}: {k}' for n, k in dense_kinds.items())}")
  print()
  for name in dict.fromkeys(r["geometry"] for r in rows):
    for p in args.top_p:
      faster = [r["length"] for r in rows if r["geometry"] == name and r["p"] == p and r["ratio"] < 1.0]
      print(
        f"{name} p={p}: faster than dense from {min(faster):,} tokens"
        if faster
        else f"{name} p={p}: not faster than dense at any measured length"
      )
  print("\nSorted by geometry, threshold and length:")
  print(header)
  order = {f"R{refs}-C{chunk}-L{levels}": i for i, (refs, chunk, levels) in enumerate(args.geometries)}
  for row in sorted(rows, key=lambda r: (order[r["geometry"]], r["p"], r["length"])):
    print(row["text"])
  print(flush=True)
  for title, kernels in profiles:
    launches = sum(n for _, _, n in kernels)
    print(
      f"ZHA step kernels, {title}: {launches:g} launches, {1e3 * sum(ms for _, ms, _ in kernels):.1f} us "
      f"of kernel time per call{' (per loop: --in-loop)' if args.in_loop else ''}"
    )
    for kernel, ms, n in kernels:
      print(f"  {1e3 * ms:8.2f} us  x{n:<5g} {kernel[:110]}")
  print(flush=True)


if __name__ == "__main__":
  main()
