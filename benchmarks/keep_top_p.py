"""ZHA's capped top-p selection kernel (`pallas_kernels.zha_routing.keep_top_p`) by list width and warps per
program.

    python benchmarks/keep_top_p.py [--widths 1024,4096,16384] [--warps 4,8,16] [--heads 16]

Batch 1, one program per head, p = 0.9 and max_nodes = 64 over random scores (the top level of R1-C8-L2 holds
4,096 nodes at 256k tokens; a level below, 519 candidates in a list 1,024 wide). The time is the kernel's own,
from a profile of 20 queued calls: the selection is a chain of dependent reductions, so launch gaps would hide
what the settings change. Every setting's kept nodes are checked against the first's.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import zha_routing

from timing import traced_kernels

CALLS = 20


def kernel_us(fn):
  """Device time per call of the selection kernel, in µs (None off a GPU, where nothing is traced)."""
  kernels = traced_kernels(lambda: [fn() for _ in range(CALLS)], CALLS)
  times = [ms for name, ms, _ in kernels if "keep_top_p" in name]
  return 1e3 * sum(times) if times else None


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ints = lambda text: [int(n) for n in text.split(",")]
  parser.add_argument("--widths", type=ints, default=[1024, 4096, 16384])
  parser.add_argument("--warps", type=ints, default=[4, 8, 16])
  parser.add_argument("--heads", type=int, default=16)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  print(f"{jax.devices()[0].device_kind}, {args.heads} heads, p 0.9, max_nodes 64, kernel µs per call")
  print("| width | " + " | ".join(f"{w} warps" for w in args.warps) + " |")
  print("|---|" + "---|" * len(args.warps))
  for width in args.widths:
    scores = jnp.asarray(rng.standard_normal((1, args.heads, width)) * 2, jnp.float32)
    index = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), scores.shape)
    expected, cells = None, []
    for warps in args.warps:
      fn = lambda w=warps: zha_routing.keep_top_p(scores, index, p=0.9, max_nodes=64, num_warps=w)
      kept = np.asarray(fn())
      expected = kept if expected is None else expected
      if not np.array_equal(kept, expected):
        cells.append("differs")
        continue
      us = kernel_us(fn)
      cells.append("–" if us is None else f"{us:.1f}")
    print(f"| {width:,} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
