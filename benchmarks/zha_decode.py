"""ZHA decode attention (one layer, batch 1, one new token) against dense decode attention, across lengths,
tree geometries and routing thresholds.

    python benchmarks/zha_decode.py [--lengths 16384,65536,262144,1048576] [--geometries R1-C8-L2,R16-C16-L3,R16-C4-L6]
        [--top-p 0.8,0.9,0.95] [--max-nodes 64] [--heads 16] [--head-dim 64] [--sharpness 4]

The capped decode step `fsjax.cache.zha.attend_gathered` (Pallas `tree_routing` kernels on a GPU) against
dense attention of the same query over the whole bf16 cache (cuDNN where it accepts the shape, else XLA), in
the same process. Rows: latency of ZHA and of its routing alone (candidate scoring + top-p, no final
attention), the ratio to dense, the fraction of keys attended, and the fraction the paper's uncapped routing
would attend (where it is larger, the cap binds and ZHA reads less than the paper's operator would). The tree
is built from the cache's keys with random reference queries; keys are standard normal and the query is
`sharpness` times a normal vector, so attention concentrates on few keys as in a trained model's retrieval heads
(sharpness 1 spreads it almost uniformly, which makes top-p keep nearly everything up to the cap). Times are
medians of repeated runs.

The paper's roofline model predicts ZHA overtakes dense decode near 48k tokens (ZHA Sec. V, R1-C8 at p=0.75);
the last lines print the measured crossover per geometry and threshold.
"""

import argparse

import jax
import jax.numpy as jnp

from fsjax.cache import zha as zha_cache
from fsjax.cache.store import KVStore
from fsjax.ops import zha
from timing import median_ms


def parse_geometry(text):
  """"R16-C4-L6" → (16, 4, 6)."""
  refs, chunk, levels = (int(part[1:]) for part in text.split("-"))
  return refs, chunk, levels


def dense_decode(q, k, v):
  """`[1, 1, h, d]` over `[1, T, h, d]`: cuDNN on a GPU when it accepts the shape, else XLA."""
  if jax.default_backend() == "gpu":
    try:
      return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    except Exception:  # noqa: BLE001 — cuDNN rejects some decode shapes; XLA's is the fallback baseline
      pass
  return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def build_cache(length, heads, dim, refs, chunk, levels, key):
  """A ZHA cache holding `length` random tokens: bf16 K/V and every level's tangents."""
  k_key, v_key, r_key = jax.random.split(key, 3)
  k = jax.random.normal(k_key, (1, length, heads, dim), jnp.bfloat16)
  v = jax.random.normal(v_key, (1, length, heads, dim), jnp.bfloat16)
  ref_queries = jax.random.normal(r_key, (heads, refs, dim), jnp.float32)
  tree = jax.jit(lambda k: zha.build_tree(k.astype(jnp.float32), ref_queries, chunk=chunk, levels=levels))(k)
  store = KVStore(k=k, v=v, pos=jnp.arange(length, dtype=jnp.int32)[None])
  return zha_cache.ZHACache(store=store, keys=tuple(t[0].astype(jnp.bfloat16) for t in tree),
                            bias=tuple(t[1].astype(jnp.float32) for t in tree))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="16384,65536,262144,1048576",
                      type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument("--geometries", default="R1-C8-L2,R16-C16-L3,R16-C4-L6",
                      type=lambda s: [parse_geometry(g) for g in s.split(",")])
  parser.add_argument("--top-p", default="0.8,0.9,0.95", type=lambda s: [float(p) for p in s.split(",")])
  parser.add_argument("--max-nodes", type=int, default=64)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--sharpness", type=float, default=4.0)
  args = parser.parse_args()

  kernels = jax.default_backend() == "gpu"
  print(f"{jax.devices()[0].device_kind}, {args.heads} heads x {args.head_dim}, bf16 cache, "
        f"max_nodes {args.max_nodes}, kernels {'compiled' if kernels else 'off (jnp path)'}")
  print("| geometry | p | length | dense ms | ZHA ms | vs dense | routing ms | routing share | keys attended | "
        "uncapped |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for refs, chunk, levels in args.geometries:
    for length in args.lengths:
      cache = build_cache(length, args.heads, args.head_dim, refs, chunk, levels, jax.random.PRNGKey(length))
      q = args.sharpness * jax.random.normal(jax.random.PRNGKey(1), (1, 1, args.heads, args.head_dim), jnp.float32)
      position = jnp.array([[length - 1]], jnp.int32)
      dense_ms = median_ms(jax.jit(dense_decode), q.astype(jnp.bfloat16), cache.store.k, cache.store.v, repeats=20)
      for p in args.top_p:
        routing = dict(chunk=chunk, top_p=zha.level_top_p(p, levels), max_nodes=args.max_nodes, kernels=kernels)
        step = jax.jit(lambda c, q, pos: zha_cache.attend_gathered(c, q, pos, **routing))
        route = jax.jit(lambda c, q, pos: zha_cache.route_gathered(c, q[:, 0], pos[:, 0], **routing))
        zha_ms = median_ms(step, cache, q, position, repeats=20)
        route_ms = median_ms(route, cache, q, position, repeats=20)
        fraction = float(jnp.mean(step(cache, q, position)[1]))
        uncapped = float(jnp.mean(jax.jit(lambda c, q, pos: zha_cache.attend(
            c, q, pos, chunk=chunk, top_p=zha.level_top_p(p, levels))[1])(cache, q, position)))
        name = f"R{refs}-C{chunk}-L{levels}"
        rows.append(dict(geometry=name, p=p, length=length, ratio=zha_ms / dense_ms))
        print(f"| {name} | {p} | {length:,} | {dense_ms:.3f} | {zha_ms:.3f} | {zha_ms / dense_ms:.2f}x | "
              f"{route_ms:.3f} | {route_ms / zha_ms:.0%} | {fraction:.2%} | {uncapped:.2%} |", flush=True)
      del cache
  print()
  for name in dict.fromkeys(r["geometry"] for r in rows):
    for p in args.top_p:
      faster = [r["length"] for r in rows if r["geometry"] == name and r["p"] == p and r["ratio"] < 1.0]
      print(f"{name} p={p}: faster than dense from {min(faster):,} tokens" if faster else
            f"{name} p={p}: not faster than dense at any measured length")


if __name__ == "__main__":
  main()
