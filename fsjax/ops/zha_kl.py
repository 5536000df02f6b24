"""ZHA's distillation loss (ZHA III-B) over blocks of queries: the reference's `zha_kl_per_level` in bounded memory.

The reference holds at once the dense attention of every query over every key, `[batch, heads, T, T]`, several
arrays of that size derived from it, and for the backward every query's tangents over every node, `[batch,
heads, T, N, R]`: at 64 rows of 1,024 tokens and 4 heads one `[T, T]` array is 1 GiB in float32, and a training
step of a four-layer model asked for 20 GiB in one allocation. Here the queries go through a `lax.scan` in blocks
of `query_block`; each block builds its rows of the dense attention, the level targets and the predictions with
the reference's own `summed_query_kl`, and adds its queries' KL to a per-level sum. The block's body is under
`jax.checkpoint`, so the backward recomputes a block's tangents instead of keeping them for every block: what is
live is one block's `[batch, heads, query_block, T]` rows and `[batch, heads, query_block, N, R]` tangents.
"""

import jax
import jax.numpy as jnp

from fsjax.ops.query_blocks import query_block_for, split_queries
from fsjax.reference.common import compute_dtype
from fsjax.reference.grouped import check_grouped_qkv
from fsjax.reference.zha import build_tree, check_ref_queries, mean_query_kl, rotate, summed_query_kl


def zha_kl_per_level(q, k, ref_queries, *, chunk, levels, rope_theta=None, query_block=None):
  """`[levels]`: equal to `fsjax.reference.zha.zha_kl_per_level` (to float rounding: sums run per block), in
  memory that grows with `query_block · T` instead of `T²`.

  Args:
    q: `[batch, T, heads, d]`, k: `[batch, T, kv_heads, d]` unrotated; ref_queries: `[kv_heads, R, d]`.
    query_block: queries per block (any T: the last block is padded, its padding weighs nothing); None picks
      `query_block_for` the shapes.
  """
  check_grouped_qkv(q, k, k)
  check_ref_queries(ref_queries, k)
  batch, seq, heads, _ = q.shape
  block = query_block or query_block_for(batch, heads, seq)
  dtype = compute_dtype(q.dtype)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  q_rot = jax.lax.stop_gradient(rotate(q.astype(dtype), positions, rope_theta))
  k_rot = jax.lax.stop_gradient(rotate(k.astype(dtype), positions, rope_theta))
  tree = build_tree(k_rot, ref_queries.astype(dtype), chunk=chunk, levels=levels, rope_theta=rope_theta)
  q_blocks, starts = split_queries(q_rot, block)  # [blocks, batch, Bq, h, d]

  def block_kl(sums, inputs):
    q_block, start = inputs
    return sums + summed_query_kl(q_block, k_rot, tree, start + jnp.arange(block), chunk=chunk), None

  sums, _ = jax.lax.scan(jax.checkpoint(block_kl), jnp.zeros((len(tree),), dtype), (q_blocks, starts))
  return mean_query_kl(sums, batch, heads, seq, chunk)
