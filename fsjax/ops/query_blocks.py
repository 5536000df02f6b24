"""Queries in blocks, for operators whose reference holds `[batch, heads, T, T]` arrays (MoBA, ZHA's training form and
its distillation loss): how many query rows a block may hold, and a sequence's queries split into padded blocks for a
`lax.scan`. At 64 rows of 1,024 tokens and 4 heads one such float32 array is 1 GiB, and a training step keeps several
per layer for its backward; a scan over blocks whose body is under `jax.checkpoint` keeps one block's."""

import jax
import jax.numpy as jnp

# Bytes of one float32 `[batch, heads, query_block, T]` array: the block is the largest power of two under it.
BLOCK_BYTES = 2**26


def query_block_for(batch, heads, seq):
  """The largest power of two ≥ 16, and at most the first one ≥ `seq`, whose float32 rows of attention over
  `seq` keys, `batch · heads · block · seq · 4` bytes, fit `BLOCK_BYTES`."""
  block = 16
  while block < seq and batch * heads * (2 * block) * seq * 4 <= BLOCK_BYTES:
    block *= 2
  return block


def split_queries(x, block):
  """`[batch, T, ...]` → (`[blocks, batch, block, ...]`, the last block padded with zeros; `[blocks]` the
  position of each block's first query)."""
  batch, seq = x.shape[:2]
  blocks = -(-seq // block)
  padded = jnp.pad(x, ((0, 0), (0, blocks * block - seq)) + ((0, 0),) * (x.ndim - 2))
  return jnp.moveaxis(padded.reshape(batch, blocks, block, *x.shape[2:]), 1, 0), jnp.arange(blocks) * block


def join_queries(x, seq):
  """`[blocks, batch, block, ...]` → `[batch, seq, ...]`: `split_queries` undone, its padding dropped."""
  blocks, batch, block = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(batch, blocks * block, *x.shape[3:])[:, :seq]


def over_query_blocks(body, block, queries):
  """`body(start, query_block)` over blocks of `block` queries of `queries` `[batch, T, ...]`, one after another in
  a `lax.scan` with `body` under `jax.checkpoint` (the backward recomputes a block's temporaries instead of
  keeping every block's); its outputs, a pytree of `[batch, block, ...]` arrays, joined to `[batch, T, ...]`.
  `start` is the block's first position; the last block is padded with zero queries past T − 1, whose rows are
  dropped."""
  blocks, starts = split_queries(queries, block)
  _, out = jax.lax.scan(jax.checkpoint(lambda _, inputs: (None, body(*inputs))), None, (starts, blocks))
  return jax.tree_util.tree_map(lambda x: join_queries(x, queries.shape[1]), out)
