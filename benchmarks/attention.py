"""Per-layer FreeSolo attention against cuDNN dense attention, forward and forward+backward, on one GPU.

    python benchmarks/attention.py [--lengths 4096,8192,32768,65536] [--head-dims 64,96] [--tokens 65536]

bf16, 16 heads, `tokens` per step split into `tokens // length` sequences, the FS geometry of the paper presets
(s=32, B=128, K=4, w=512; FS-L P=64, W=8). Rows per (head_dim, length): cuDNN causal (the baseline of every
ratio) and window-512 attention; FS and FS-L (`ops.freesolo_attention(impl="pallas")`: cuDNN local branch,
the fused cell-scoring + top-K kernel, the sparse readout kernel, RMSNorm); each kernel alone, the readout on
the selections the scoring kernel made. The readout's achieved bandwidth counts the bytes it must move (q, o,
and each tile's distinct selected cells of K and V read once) against the measured device copy bandwidth.

First the harness is checked: cuDNN causal forward at 8k, head_dim 128 should reach >= 0.55 of the bf16 peak.
Times are medians of repeated runs, inputs random normal.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from fsjax import ops
from fsjax.ops.cudnn import causal_rope_attention_cudnn
from pallas_kernels import sparse_readout

from timing import copy_bandwidth, median_ms

ROUTING = dict(cell=32, block=128, top_k=4, retain_top=64, retain_recent=8)
HEADS = 16
BF16_PEAK_FLOPS = 989e12  # H200 dense bf16 tensor-core peak (datasheet)


def forward_backward(fn):
  """`fn(q, k, v, *rest)` → a jitted function of `(q, k, v, w, *rest)` giving the gradients in q, k, v of
  `sum(fn(...) * w)`. Everything is an argument: a closed-over array would be constant-folded at compile time."""

  def loss(q, k, v, w, *rest):
    return jnp.sum(fn(q, k, v, *rest).astype(jnp.float32) * w)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def random_inputs(shape, seed):
  return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.PRNGKey(seed), 4))


def harness_check():
  """cuDNN causal forward at 8k, head_dim 128, 65,536 tokens: achieved fraction of the bf16 peak."""
  batch, length, dim = 8, 8192, 128
  q, k, v, _ = random_inputs((batch, length, HEADS, dim), 0)
  causal = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
  flops = 2 * batch * HEADS * length * length * dim  # QK^T and PV, half of each under the causal mask
  return flops / (median_ms(causal, q, k, v) / 1e3) / BF16_PEAK_FLOPS


def readout_bytes(q, cell_idx, tile):
  """Fewest bytes the readout forward moves: q in, o out, every tile's distinct cells of K and V once."""
  _, counts = sparse_readout.tile_unions(cell_idx, tile)
  cell_bytes = 2 * ROUTING["cell"] * q.shape[-1] * q.dtype.itemsize
  return 2 * q.nbytes + cell_idx.nbytes + float(jnp.sum(counts)) * cell_bytes, float(jnp.mean(counts))


def measure(length, dim, tokens):
  batch = max(1, tokens // length)
  q, k, v, w = random_inputs((batch, length, HEADS, dim), length + dim)
  alpha = jnp.ones((HEADS,), jnp.float32)
  fs = lambda variant: (
    lambda q, k, v: ops.freesolo_attention(q, k, v, variant=variant, alpha=alpha, window=512, impl="pallas", **ROUTING)
  )
  layers = {
    "cuDNN causal": lambda q, k, v: causal_rope_attention_cudnn(q, k, v),
    "cuDNN window 512": lambda q, k, v: causal_rope_attention_cudnn(q, k, v, window=512),
    "FS": fs("fs"),
    "FS-L": fs("fsl"),
  }
  times = {}
  for name, fn in layers.items():
    try:
      times[name] = (median_ms(jax.jit(fn), q, k, v), median_ms(forward_backward(fn), q, k, v, w))
    except Exception as error:  # an out-of-memory case must not end the table
      times[name] = (float("nan"), float("nan"))
      print(f"{name} at {length}: {type(error).__name__}: {str(error)[:200]}", flush=True)
  select = jax.jit(functools.partial(ops.select_cells, impl="pallas", **ROUTING))
  cell_idx = select(q, k)
  times["cell scoring + top-K"] = (median_ms(select, q, k), float("nan"))
  readout = functools.partial(sparse_readout.sparse_readout, cell=ROUTING["cell"])
  times["sparse readout"] = (
    median_ms(jax.jit(readout), q, k, v, cell_idx),
    median_ms(forward_backward(readout), q, k, v, w, cell_idx),
  )
  moved, mean_cells = readout_bytes(q, cell_idx, sparse_readout.BlockSizes.get_default().queries)
  return batch, times, moved / (times["sparse readout"][0] / 1e3), mean_cells


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", default="4096,8192,32768,65536", type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument("--head-dims", default="64,96", type=lambda s: [int(n) for n in s.split(",")])
  parser.add_argument("--tokens", type=int, default=65536)
  args = parser.parse_args()
  peak_fraction = harness_check()
  bandwidth = copy_bandwidth()
  print(
    f"harness: cuDNN causal fwd 8k d128 at {peak_fraction:.2f} of bf16 peak (target >= 0.55); "
    f"copy bandwidth {bandwidth / 1e12:.2f} TB/s",
    flush=True,
  )
  lines = []
  for dim in args.head_dims:
    for length in args.lengths:
      batch, times, readout_bw, mean_cells = measure(length, dim, args.tokens)
      base_fwd, base_fwd_bwd = times["cuDNN causal"]
      for name, (fwd, fwd_bwd) in times.items():
        lines.append(
          f"| {dim} | {length} | {batch} | {name} | {fwd:.2f} | {fwd / base_fwd:.2f}x | "
          f"{fwd_bwd:.2f} | {fwd_bwd / base_fwd_bwd:.2f}x |"
        )
      lines.append(
        f"| {dim} | {length} | {batch} | readout: {mean_cells:.0f} cells per 64-query tile, "
        f"{readout_bw / 1e12:.2f} TB/s = {readout_bw / bandwidth:.2f} of copy | | | | |"
      )
      print(*lines[-len(times) - 1 :], sep="\n", flush=True)
  print(
    f"\n{args.tokens} tokens per step, {HEADS} heads, bf16, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
    f"harness {peak_fraction:.2f} of bf16 peak, copy {bandwidth / 1e12:.2f} TB/s"
  )
  print("| head_dim | length | batch | op | fwd ms | fwd vs causal | fwd+bwd ms | fwd+bwd vs causal |")
  print("|---|---|---|---|---|---|---|---|")
  print(*lines, sep="\n")


if __name__ == "__main__":
  main()
