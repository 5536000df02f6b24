"""MoBA's training operator over blocks of queries: `fsjax.reference.dense.moba_attention` in bounded memory.

The reference masks a dense `[batch, heads, T, T]` attention with each query's chosen key blocks; a training
step keeps several such arrays per layer for its backward (23.6 GiB for the recall configs' MoBA at 64 rows of
1,024 tokens, four layers of four heads). Here the queries go through a `lax.scan` in blocks
(`fsjax.ops.query_blocks`): each block gates its queries against every key block's mean key, masks its rows of
the logits to the chosen blocks and its causal past, and reads out, as the reference does row by row. The
block's body is under `jax.checkpoint`, so what is live, forward or backward, is one block's `[batch, heads,
query_block, T]` rows. The work stays the reference's O(T²): this bounds memory, not time.
"""

import math

import jax.numpy as jnp

from fsjax.ops.query_blocks import over_query_blocks, query_block_for
from fsjax.reference.dense import moba_chosen_blocks, moba_inputs, moba_mean_keys
from fsjax.reference.grouped import grouped_logits, grouped_readout
from fsjax.reference.softmax import masked_softmax


def moba_attention(q, k, v, *, moba_block=512, moba_top_k=3, rope_theta=10000.0, query_block=None):
  """Equal to `fsjax.reference.dense.moba_attention` (each query's row is computed as there), in memory that
  grows with `query_block · T` instead of `T²`.

  Args:
    q: `[batch, T, heads, d]`, k, v: `[batch, T, kv_heads, d]`, unrotated.
    moba_block, moba_top_k, rope_theta: as the reference.
    query_block: queries per block (any T: the last block is padded and its rows dropped); None picks
      `query_block_for` the shapes.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q`.
  """
  q_rot, k_rot, v = moba_inputs(q, k, v, moba_block=moba_block, moba_top_k=moba_top_k, rope_theta=rope_theta)
  batch, seq, heads, head_dim = q.shape
  block = query_block or query_block_for(batch, heads, seq)
  positions = jnp.arange(seq)
  mean_keys = moba_mean_keys(k_rot, moba_block)  # [batch, num_blocks, kv_heads, d]
  key_block = positions // moba_block

  def one_block(start, q_block):  # q_block [batch, Bq, heads, d] → [batch, Bq, heads, d]
    q_pos = start + jnp.arange(block)
    chosen = moba_chosen_blocks(q_block, q_pos, mean_keys, moba_block=moba_block, moba_top_k=moba_top_k)
    mask = jnp.take(chosen, key_block, axis=-1) & (positions[None, :] <= q_pos[:, None])  # [batch, heads, Bq, T]
    logits = grouped_logits(q_block, k_rot) / math.sqrt(head_dim)
    return grouped_readout(masked_softmax(logits, mask), v)

  return over_query_blocks(one_block, block, q_rot).astype(q.dtype)
