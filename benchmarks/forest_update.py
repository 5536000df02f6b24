"""FS-B forest update per block: the streaming forest cache's `advance` by one block, at growing cell counts.

    python benchmarks/forest_update.py [--lengths 16384,65536,131072,262144] [--blocks 256] [--heads 16]
        [--head-dim 64] [--cell 32] [--block 128] [--looped-from 6] [--admission aligned|median] [--update-only]
        [--profile] [--hlo-dir DIR]

One layer, batch 1, `length` a power of two: an archive of `length + blocks·block` random bf16 keys; both forests
advanced to the cells eligible at `length` tokens, where forest 0 holds M = length / cell cells, a power of two;
then `blocks` consecutive block admissions run in one jitted loop and the time per block is their mean. The
update's cost depends only on which chunk levels each block builds, and so on the forests' counts: forest 0's
window crosses the same carries at every length, and with `--admission aligned` (the default) so does forest τ's,
whose admissions are drawn (about half, the heads' counters out of step by the same offsets at every length; see
`filled_cache`). With `--admission median` (τ = the median cell norm) each τ head starts
near M/2 at an offset of its own draw, and a window's builds differ between lengths (19% more leaf cells at 128k
than at 16k in one draw): time per block then mixes the cost of a build with the amount of building.

The rare builds beyond the window are timed alone: one build of a level for every head of both forests
(`--looped-from` levels up use `looped_leaf_order`), at level 2 (built about every block) and at the forest's top
level (built once per M / (block / cell) blocks), so the amortized cost of the largest chunk is top-level ms ÷ that
count. The same loop through the prefill formulation would rebuild every chunk tree at every block; its time is
printed beside it (`fsb_select_from_summaries` for one query, the archive path's cost per block boundary and per
token), and the beam search of one decode query over forest 0 in XLA and in the Pallas kernel (on a GPU). Target:
time per block flat in M (±20% from 16k to 128k). The block loop is timed as one synced call per
`--blocks`; the single builds, the rebuild and the beam search as calls queued back to back (`timing.queued_ms`),
since a synced call of a sub-millisecond program carries the host round trip (~0.1 ms on the H200).

Each length also prints, as an HTML comment, how many blocks of its window build each chunk level, the leaf cells
those builds cover (each build covers every forest head, whichever needed it) and the forest-τ heads' counts at
the window's start.
"""

import argparse
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from fsjax.attention.freesolo_step import forest_search
from fsjax.cache import archive as archive_lib
from fsjax.cache import forest as forest_cache
from fsjax.reference import forest as forest_ref
from fsjax.reference.routing import Routing

from timing import median_ms, queued_ms, traced_kernels


def filled_cache(start_cells, window_cells, heads, dim, cell, key, admission):
  """An archive of `start_cells + window_cells` cells of random bf16 keys and forest τ's threshold `[heads]`.

  admission "aligned": which cells forest τ admits is drawn, not left to the keys: in the prefix, exactly
  start_cells/2 + δ_h cells of head h (δ_h in [64, 128) fixed across lengths, so the heads' counters are not in
  step), in the window one fixed Bernoulli(1/2) draw shared by every length. Keys of admitted cells are scaled
  by 2 and the others by 1/2, and τ is set between the two groups' max norms. Since the update's cost depends on
  the counts alone (fixed shapes), every length's window then holds the same chunk builds. "median": τ is the
  median cell norm of unscaled keys (each length's carries fall where its draw puts them)."""
  capacity = (start_cells + window_cells) * cell
  cache = forest_cache.empty_forest_cache(1, capacity, heads, dim, cell, window=512, dtype=jnp.bfloat16)
  k = jax.random.normal(key, (1, capacity, heads, dim), jnp.float32)
  if admission == "aligned":
    prefix_key, offset_key, window_key = jax.random.split(jax.random.PRNGKey(0), 3)
    offsets = jax.random.randint(offset_key, (heads,), 64, 128)
    ranks = jnp.argsort(jax.random.uniform(prefix_key, (start_cells, heads)), axis=0)
    admitted = jnp.concatenate(
      [ranks < start_cells // 2 + offsets, jax.random.bernoulli(window_key, 0.5, (window_cells, heads))]
    )  # [cells, heads]
    k = k * jnp.repeat(jnp.where(admitted, 2.0, 0.5), cell, axis=0)[None, :, :, None]
  k = k.astype(jnp.bfloat16)
  pos = jnp.arange(capacity, dtype=jnp.int32)[None]
  archive = jax.jit(lambda a: archive_lib.extend(a, k, k, k, pos, jnp.ones(pos.shape, bool), cell))(cache.archive)
  norms = archive.max_norms[0].astype(jnp.float32)  # [cells, heads]
  if admission == "median":
    return cache.replace(archive=archive), jnp.median(norms, axis=0)
  low, high = jnp.max(jnp.where(admitted, -jnp.inf, norms), 0), jnp.min(jnp.where(admitted, norms, jnp.inf), 0)
  if not bool(jnp.all(low < high)):
    raise AssertionError("admitted and refused cells' max norms overlap: the scales do not separate them")
  return cache.replace(archive=archive), (low + high) / 2


def write_hlo(text, nodes, directory, name):
  """Writes a compiled program's HLO text to `directory/name`; returns how many `copy` instructions outside its
  entry computation (so in loop bodies and conditional branches, run per block) produce an array of a node-table
  field's shape: copies of a whole table, where the update should write in place. The entry computation's copies
  of the (undonated) input run once per call."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, name), "w") as f:
    f.write(text)
  shapes = {",".join(str(n) for n in x.shape) for x in nodes.values()}
  body = text.split("\nENTRY ")[0]  # XLA prints the entry computation last
  return sum(shape in shapes for shape in re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", body))


def window_builds(archive, tau, start_cells, blocks, per_block):
  """The chunk-level builds inside the timed window, as `advance` runs them (one build of a level per block in
  which any forest head needs it, batched over all heads): ({level: blocks building it}, leaf cells built, the
  least and most cells a forest-τ head holds at the window's start). Forest
  0 admits every cell, forest τ the cells whose max key norm is ≥ τ (Eq. 10)."""
  norms = np.asarray(archive.max_norms[0], np.float32)  # [cells, heads]
  cells = start_cells + per_block * np.arange(blocks + 1)  # cells admitted before each block, and after the last
  above = np.concatenate([np.zeros((1, norms.shape[1]), int), np.cumsum(norms >= np.asarray(tau), axis=0)])
  counts = np.concatenate([np.broadcast_to(cells[:, None], (blocks + 1, norms.shape[1])), above[cells]], axis=1)
  levels = forest_cache.num_levels(norms.shape[0])
  changed = np.asarray(forest_cache.changed_levels(jnp.asarray(counts[:-1]), jnp.asarray(counts[1:]), levels))
  per_level = changed.any(axis=1).sum(axis=0)  # [levels]: blocks in which some head builds level k
  built = {k: int(n) for k, n in enumerate(per_level) if n}
  return (
    built,
    int(sum(n << k for k, n in enumerate(per_level))),
    (int(above[start_cells].min()), int(above[start_cells].max())),
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="16384,65536,131072,262144", type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument("--blocks", type=int, default=256)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--cell", type=int, default=32)
  parser.add_argument("--block", type=int, default=128)
  parser.add_argument(
    "--looped-from",
    type=int,
    default=forest_cache.LOOPED_FROM,
    help="first chunk level built by looped_leaf_order (above the top level: all unrolled)",
  )
  parser.add_argument(
    "--hlo-dir",
    help="write each length's compiled block loop (HLO text) here, and print its "
    "count of copies of node-table-shaped arrays",
  )
  parser.add_argument(
    "--admission",
    choices=("aligned", "median"),
    default="aligned",
    help="aligned: forest τ admits the same cells in every length's window (see filled_cache); "
    "median: τ is the median cell norm",
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help="print the device kernels of the block loop that take the most time per block",
  )
  parser.add_argument(
    "--update-only",
    action="store_true",
    help="time the block loop only (the other columns compile for minutes at 128k)",
  )
  args = parser.parse_args()
  per_block = args.block // args.cell
  for length in args.lengths:
    if length & (length - 1) or length < args.cell:
      parser.error(f"--lengths must be powers of two >= --cell, got {length}")
  print(
    f"{jax.devices()[0].device_kind}, one layer, {args.heads} heads x {args.head_dim}, cell {args.cell}, "
    f"block {args.block}, mean over {args.blocks} blocks, levels from {args.looped_from} looped, "
    f"{args.admission} forest-τ admissions"
  )
  kernels = jax.default_backend() == "gpu"
  print(
    f"| length | cells M | update ms/block | vs first length | level-2 build ms | top-level build ms "
    f"(every M/{per_block} blocks) | prefill-formulation rebuild ms | beam search ms (XLA) | "
    f"beam search ms (kernel) |"
  )
  print("|---|---|---|---|---|---|---|---|---|", flush=True)
  first = None
  for length in args.lengths:
    start_cells = length // args.cell
    cache, tau = filled_cache(
      start_cells,
      args.blocks * per_block,
      args.heads,
      args.head_dim,
      args.cell,
      jax.random.PRNGKey(length),
      args.admission,
    )
    advance = lambda c, target: forest_cache.advance(
      c, jnp.full((1,), target, jnp.int32), tau, cell=args.cell, block=args.block, looped_from=args.looped_from
    )
    cache = jax.jit(advance, static_argnums=1)(cache, start_cells)

    def loop(cache):
      return jax.lax.fori_loop(0, args.blocks, lambda n, c: advance(c, start_cells + (n + 1) * per_block), cache)

    blocks = jax.jit(loop).lower(cache).compile()
    if args.hlo_dir:
      table_copies = write_hlo(blocks.as_text(), cache.forests.nodes, args.hlo_dir, f"blocks_{length}.txt")
      print(
        f"<!-- {length:,}: {table_copies} copy instructions of node-table-shaped arrays in the compiled block "
        f"loop's body (static count) -->",
        flush=True,
      )
    update_ms = median_ms(blocks, cache, repeats=5) / args.blocks
    built, leaf_cells, (least, most) = window_builds(cache.archive, tau, start_cells, args.blocks, per_block)
    print(
      f"<!-- {length:,}: blocks building each level in the window {built}, {leaf_cells:,} leaf cells built "
      f"(each build covers every forest head); forest τ heads start at {least:,}-{most:,} cells -->",
      flush=True,
    )
    first = first or update_ms
    if args.profile:
      for name, ms, launches in traced_kernels(lambda: blocks(cache), args.blocks, count=30):
        print(f"<!-- {length:,}: {1e3 * ms:8.1f} µs {launches:6.2f} launches per block  {name[:90]} -->")
    if args.update_only:
      print(f"| {length:,} | {start_cells:,} | {update_ms:.3f} | {update_ms / first:.2f}x |{' – |' * 5}", flush=True)
      continue
    build_ms = [
      queued_ms(
        jax.jit(lambda f, a, k=k: forest_cache.level_trees(f, a, k, cell=args.cell, looped=k >= args.looped_from)),
        cache.forests,
        cache.archive,
        calls=20,
      )
      for k in (2, forest_cache.num_levels(start_cells) - 1)
    ]
    archive = cache.archive
    q = jax.random.normal(jax.random.PRNGKey(1), (1, 1, args.heads, args.head_dim), jnp.float32)
    rebuild = jax.jit(
      lambda a, q: forest_ref.fsb_select_from_summaries(
        q,
        jnp.full((1, 1), length - 1),
        a.tokens.k.astype(q.dtype),
        a.mean_keys.astype(q.dtype),
        a.max_norms.astype(q.dtype),
        tau=tau,
        lam=jnp.ones(args.heads),
        sigma=jnp.full(args.heads, 4.0),
        cell=args.cell,
        block=args.block,
      )
    )
    rebuild_ms = queued_ms(rebuild, archive, q, calls=20)
    geometry = Routing(variant="fsb", cell=args.cell, block=args.block, beam=16, bound_c=8.0)
    pos = jnp.full((1, 1), length - 1)
    search = lambda kernels: jax.jit(
      lambda f, q: forest_search(
        f,
        q,
        pos,
        geometry,
        lam=jnp.ones(args.heads),
        sigma=jnp.full(args.heads, 4.0),
        impl="pallas" if kernels else "reference",
      )
    )
    beam_ms = [
      queued_ms(search(k), cache.forest(0), q, calls=100) if k in (False, kernels) else None for k in (False, True)
    ]
    shown = lambda ms: "–" if ms is None else f"{ms:.3f}"
    print(
      f"| {length:,} | {start_cells:,} | {update_ms:.3f} | {update_ms / first:.2f}x | {build_ms[0]:.3f} | "
      f"{build_ms[1]:.2f} | {rebuild_ms:.2f} | {shown(beam_ms[0])} | {shown(beam_ms[1])} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
