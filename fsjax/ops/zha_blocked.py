"""ZHA's training-form attention (ZHA III) over blocks of queries: `fsjax.reference.zha.zha_attention` in bounded
memory.

The reference routes every query through the tree at once and masks a dense `[batch, heads, T, T]` attention with
the keys each reached; at 8 rows of 16,384 tokens and 16 heads one such float32 array is 128 GiB, so a ZHA
model's full forward (perplexity, a prompt's first chunk) could not run past a few thousand tokens. Here the tree
is built once and the queries go through `fsjax.reference.zha.routed_attention` a block at a time
(`fsjax.ops.query_blocks`), each block under `jax.checkpoint`: what is live is one block's `[batch, heads,
query_block, T]` rows and its node scores. The work is the reference's; the memory grows with T, not T².
"""

import jax.numpy as jnp

from fsjax.ops.query_blocks import over_query_blocks, query_block_for
from fsjax.reference.common import compute_dtype
from fsjax.reference.grouped import check_grouped_qkv
from fsjax.reference.zha import build_tree, check_ref_queries, level_top_p, rotate, routed_attention, validate_zha


def zha_attention(
  q,
  k,
  v,
  ref_queries,
  *,
  chunk,
  levels,
  top_p,
  rope_theta=None,
  max_nodes=None,
  return_fraction=False,
  query_block=None,
):
  """Equal to `fsjax.reference.zha.zha_attention` (each query is routed and attends as there), in memory that
  grows with `query_block · T` instead of `T²`.

  Args:
    q: `[batch, T, heads, d]`; k, v: `[batch, T, kv_heads, d]`, unrotated; ref_queries: `[kv_heads, R, d]`.
    chunk, levels, top_p, rope_theta, max_nodes, return_fraction: as the reference.
    query_block: queries per block (any T: the last block is padded and its rows dropped); None picks
      `query_block_for` the shapes.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q` (and the fraction of visible keys each query reads, `[batch, T,
    heads]`).
  """
  check_grouped_qkv(q, k, v)
  validate_zha(chunk=chunk, levels=levels, top_p=top_p, refs=ref_queries.shape[1], max_nodes=max_nodes)
  check_ref_queries(ref_queries, k)
  batch, seq, heads, _ = q.shape
  block = query_block or query_block_for(batch, heads, seq)
  dtype = compute_dtype(q.dtype)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  q_rot = rotate(q.astype(dtype), positions, rope_theta)
  k_rot = rotate(k.astype(dtype), positions, rope_theta)
  v = v.astype(dtype)
  nodes = build_tree(k_rot, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta)

  def one_block(start, q_block):  # [batch, Bq, heads, d] → ([batch, Bq, heads, d], [batch, Bq, heads])
    q_pos = jnp.broadcast_to(start + jnp.arange(block), (batch, block))
    return routed_attention(
      q_block, q_pos, nodes, k_rot, v, positions, chunk=chunk, top_p=level_top_p(top_p, levels), max_nodes=max_nodes
    )

  out, fraction = over_query_blocks(one_block, block, q_rot)
  out = out.astype(q.dtype)
  return (out, fraction) if return_fraction else out
