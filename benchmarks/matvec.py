"""A decode step's projections: `pallas_kernels.matvec` against XLA's dot, product by product of a layer.

    python benchmarks/matvec.py [--preset fs_341m] [--rows 1] [--sweep [SECONDS]]

The preset's layers run as one `lax.scan` over stacked bf16 weights, as a scanned model's decode step reads them.
The rows are W_q/W_k/W_v (one launch), W_o, W_gate/W_up (one launch), W_down, then all four together. As in a
decode step, W_q/W_k/W_v and W_gate/W_up RMS-norm their input first (the kernel in its prologue, XLA before the
dot). Each time is µs per layer: the wall time of 30 calls of the scanned loop, divided by the layers. GB/s is the
weights' bytes over that time. Before timing, the kernel's sums are checked against XLA's (float32 sums of bf16
products, so only the order of the additions differs).

`--sweep` then times the kernel per product over other tilings and launch parameters (column and contraction
tiles, contraction splits, warps, pipeline stages), first the tiles at `tiling`'s warps and stages, then warps and
stages for the three best tiles, and prints each product's default against the five fastest others. It stops adding
candidates after SECONDS (default 300); a candidate Triton cannot compile is reported, not fatal.
"""

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from fsjax.config import model_preset
from pallas_kernels import matvec

from timing import queued_ms

CALLS = 30


def scanned(product, layers):
  """`product(x, weights, layer)` for every layer, in one jitted `lax.scan` over the layer index."""
  return jax.jit(lambda xs, ws: jax.lax.scan(lambda _, i: (None, product(xs, ws, i)), None, jnp.arange(layers))[1])


NORMED = ("q, k, v", "gate, up")  # the products whose input a decode step RMS-norms in the kernel's prologue


def products(config):
  """name → (K, [N_j]): a layer's matrix products, those sharing an input together."""
  d, hidden = config.d_model, config.ffn_hidden_size
  heads, kv = config.num_heads * config.head_dim, (config.num_kv_heads or config.num_heads) * config.head_dim
  return {"q, k, v": (d, [heads, kv, kv]), "o": (heads, [d]), "gate, up": (d, [hidden, hidden]), "down": (hidden, [d])}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="fs_341m")
  parser.add_argument("--rows", type=int, default=1)
  parser.add_argument("--sweep", type=float, nargs="?", const=300.0, default=None, help="seconds of tile sweep")
  args = parser.parse_args()
  config = model_preset(args.preset)
  layers, key = config.num_layers, jax.random.PRNGKey(0)
  groups = products(config)
  weights, inputs = {}, {}
  for g, (name, (k, ns)) in enumerate(groups.items()):
    keys = jax.random.split(jax.random.fold_in(key, g), len(ns) + 2)
    weights[name] = [jax.random.normal(kj, (layers, k, n), jnp.bfloat16) * k**-0.5 for kj, n in zip(keys[2:], ns)]
    scale = jax.random.uniform(keys[1], (layers, k), jnp.float32, 0.5, 1.5) if name in NORMED else None
    inputs[name] = (jax.random.normal(keys[0], (args.rows, k), jnp.bfloat16), scale)

  def xla(x, ws, i):
    x, scale = x
    x = x if scale is None else matvec.rms_normed(x, scale[i], 1e-6, jnp.bfloat16)
    return tuple(jnp.matmul(x, w[i], preferred_element_type=jnp.float32) for w in ws)

  kernel = lambda x, ws, i: matvec.matvec(x[0], ws, layer=i, norm_scale=x[1])
  every = lambda product: lambda xs, ws, i: [product(xs[name], ws[name], i) for name in groups]
  print(f"{jax.devices()[0].device_kind}, {args.preset}: {layers} layers, {args.rows} row(s), bf16, µs per layer")
  print("| product | XLA µs | XLA GB/s | kernel µs | kernel GB/s | kernel ÷ XLA | tiles (BK, BN, splits) |")
  print("|---|---|---|---|---|---|---|")
  rows = [(name, inputs[name], weights[name]) for name in groups] + [("all four", inputs, weights)]
  for name, x, ws in rows:
    reference, fast = (scanned(every(p) if name == "all four" else p, layers) for p in (xla, kernel))
    for got, want in zip(jax.tree_util.tree_leaves(fast(x, ws)), jax.tree_util.tree_leaves(reference(x, ws))):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    nbytes = sum(w.nbytes for w in jax.tree_util.tree_leaves(ws)) / layers
    us = [queued_ms(fn, x, ws, calls=CALLS) / layers * 1e3 for fn in (reference, fast)]
    tiles = "–" if name == "all four" else str(matvec.tiling(args.rows, groups[name][0], groups[name][1]))
    print(
      f"| {name} | {us[0]:.2f} | {nbytes / us[0] / 1e3:,.0f} | {us[1]:.2f} | {nbytes / us[1] / 1e3:,.0f} | "
      f"{us[1] / us[0]:.2f} | {tiles} |",
      flush=True,
    )
  if args.sweep is not None:
    sweep(groups, inputs, weights, layers, args.rows, seconds=args.sweep / len(groups))


def candidate_tiles(rows, k, ns):
  """(block_k, block_n, splits) that divide the product's sizes, at most 16,384 weight elements per tile, the
  likelier tiles first (wide columns, moderate contraction tiles)."""
  for block_n, block_k, splits in itertools.product((128, 64, 256, 32), (128, 64, 256, 512), (1, 2, 4, 8, 16)):
    if all(n % block_n == 0 for n in ns) and k % (block_k * splits) == 0 and block_k * block_n <= 16384:
      yield block_k, block_n, splits


def sweep(groups, inputs, weights, layers, rows, *, seconds):
  """Each product's kernel time per layer over `candidate_tiles` (4 warps, 2 stages), then over warps and stages
  for its three fastest tiles, for at most `seconds` per product: the default's time and the five fastest, as a
  table."""
  print("\n| product | tiles (BK, BN, splits) | warps | stages | kernel µs | kernel GB/s | vs default |")
  print("|---|---|---|---|---|---|---|")
  for name, (k, ns) in groups.items():
    x, ws = inputs[name], weights[name]
    nbytes = sum(w.nbytes for w in ws) / layers

    def time_us(tiles, warps, stages):
      run = scanned(
        lambda x, ws, i: matvec.matvec(
          x[0], ws, layer=i, norm_scale=x[1], tiles=tiles, num_warps=warps, num_stages=stages
        ),
        layers,
      )
      try:
        return queued_ms(run, x, ws, calls=CALLS) / layers * 1e3
      except Exception as error:  # noqa: BLE001 - a tiling Triton rejects is a result of the sweep
        print(f"| {name} | {tiles} | {warps} | {stages} | failed: {type(error).__name__} | | |", flush=True)
        return float("inf")

    deadline = time.perf_counter() + seconds
    default = (matvec.tiling(rows, k, ns), 4, 2)
    timed = {default: time_us(*default)}
    for tiles in candidate_tiles(rows, k, ns):
      if time.perf_counter() > deadline:
        break
      timed.setdefault((tiles, 4, 2), time_us(tiles, 4, 2))
    best = sorted(timed, key=timed.get)[:3]
    for (tiles, _, _), warps, stages in itertools.product(best, (2, 4, 8), (1, 2, 3, 4)):
      if time.perf_counter() > deadline:
        break
      timed.setdefault((tiles, warps, stages), time_us(tiles, warps, stages))
    for config in [default, *[c for c in sorted(timed, key=timed.get) if c != default][:5]]:
      us = timed[config]
      print(
        f"| {name}{' (default)' if config == default else ''} | {config[0]} | {config[1]} | {config[2]} | "
        f"{us:.2f} | {nbytes / us / 1e3:,.0f} | {us / timed[default]:.2f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
