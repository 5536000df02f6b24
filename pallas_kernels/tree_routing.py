"""ZHA decode kernels (ZHA III-C): node scoring over a gathered candidate list, and the final attention over the
keys the routing reached (key 0, the kept leaves' chunks, the current chunk) — the two parts of a capped decode
step that read memory (`fsjax.cache.zha.attend_gathered` is their jnp specification; top-p itself is a sort of
a few hundred scores per head, left to XLA).

Byte counts per (layer, head) for one decode token: scoring reads `K·R·d` node-key entries for K candidates
(every top-level node, then at most `max_nodes·C + C − 1` per level below); the attention reads
`(max_nodes·C + C + 1)·d` keys and as many values. At C=8, R=16, d=64, max_nodes=64 in bf16 that is 1 MB of
level-1 node keys and 130 KB of keys and values, against `2·T·d·2` bytes (16 MB at 64k) for dense decode.

Parallelism at batch 1: scoring runs one program per (batch, head, block of candidates); the attention splits
each head's leaves over `splits` programs (flash-decoding) and merges their partial softmaxes by log-sum-exp.
Loads are contiguous rows at scalar offsets (one node, or one leaf's C keys), the pattern the FreeSolo readout
uses; a single query needs no tensor-core dot.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import default_interpret, pad_axis, pad_head_dim

NO_NODE = -1


def compilable(*, chunk, refs):
  """Whether Triton can tile this tree: chunk and refs powers of two (tiles of C keys and R node keys)."""
  return chunk & (chunk - 1) == 0 and refs & (refs - 1) == 0


def _power_of_two(name, value, interpret):
  if not interpret and value & (value - 1):
    raise ValueError(f"{name} must be a power of two for the compiled Pallas kernels, got {value}")


def _score_kernel(q_ref, keys_ref, bias_ref, index_ref, out_ref, *, scale):
  """q_ref `[d]`, keys_ref `[N, R, d]`, bias_ref `[N, R]`, index_ref `[BK]` → out_ref `[BK]` (−inf for NO_NODE)."""
  q = q_ref[...].astype(jnp.float32)
  index = index_ref[...]
  block = index.shape[0]

  def body(j, scores):
    node = index_ref[j]
    keys = keys_ref[pl.ds(jnp.maximum(node, 0), 1), :, :][0].astype(jnp.float32)  # [R, d]
    bias = bias_ref[pl.ds(jnp.maximum(node, 0), 1), :][0].astype(jnp.float32)  # [R]
    score = jnp.max(jnp.sum(keys * q[None, :], axis=1) * scale + bias)
    score = jnp.where(node >= 0, score, -jnp.inf)
    return jnp.where(jnp.arange(block) == j, score, scores)

  out_ref[...] = jax.lax.fori_loop(0, block, body, jnp.full((block,), -jnp.inf, jnp.float32))


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def score_candidates(q, node_keys, node_bias, index, *, block=16, interpret=None):
  """`max_r (q·k̂_r/√d + b̂_r)` of listed nodes (ZHA III-A).

  Args:
    q: `[batch, heads, d]` rotated queries (one decode token).
    node_keys: `[batch, N, heads, R, d]`; node_bias: `[batch, N, heads, R]` (one tree level).
    index: `[batch, heads, K]` int32 node indices, NO_NODE for none.
    block: candidates per program.

  Returns:
    `[batch, heads, K]` float32 scores, −inf for NO_NODE.
  """
  interpret = default_interpret() if interpret is None else interpret
  batch, heads, dim = q.shape
  refs = node_keys.shape[3]
  _power_of_two("refs", refs, interpret)
  count = index.shape[-1]
  padded = -(-count // block) * block
  index = pad_axis(index.astype(jnp.int32), 2, padded, NO_NODE)
  scores = pl.pallas_call(
      functools.partial(_score_kernel, scale=1.0 / math.sqrt(dim)),
      grid=(batch, heads, padded // block),
      in_specs=[pl.BlockSpec((None, None, pl.next_power_of_2(dim)), lambda b, h, c: (b, h, 0)),
                pl.BlockSpec((None, node_keys.shape[1], None, refs, pl.next_power_of_2(dim)),
                             lambda b, h, c: (b, 0, h, 0, 0)),
                pl.BlockSpec((None, node_keys.shape[1], None, refs), lambda b, h, c: (b, 0, h, 0)),
                pl.BlockSpec((None, None, block), lambda b, h, c: (b, h, c))],
      out_specs=pl.BlockSpec((None, None, block), lambda b, h, c: (b, h, c)),
      out_shape=jax.ShapeDtypeStruct((batch, heads, padded), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="zha_score_candidates",
  )(pad_head_dim(q), pad_head_dim(node_keys), node_bias, index)
  return scores[..., :count]


def _attention_kernel(q_ref, k_ref, v_ref, leaves_ref, position_ref, out_ref, lse_ref, *, chunk, scale, per_split):
  """One split of one (batch, head): online softmax over its share of leaves; split 0 also reads key 0 and the
  current chunk. q_ref `[d]`, k_ref / v_ref `[S, d]`, leaves_ref `[M]` → out_ref `[d]` (normalized), lse_ref `[1]`."""
  split = pl.program_id(2)
  q = q_ref[...].astype(jnp.float32)
  position = position_ref[0]
  capacity = k_ref.shape[0]
  floor = jnp.float32(-1e30)  # finite: exp(old_max - new_max) stays defined before the first key

  def absorb(carry, start, valid):
    acc, row_max, row_sum = carry
    keys = k_ref[pl.ds(start, chunk), :].astype(jnp.float32)  # [C, d]
    logits = jnp.where(valid, jnp.sum(keys * q[None, :], axis=1) * scale, floor)
    new_max = jnp.maximum(row_max, jnp.max(logits))
    probs = jnp.where(valid, jnp.exp(logits - new_max), 0.0)
    correction = jnp.exp(row_max - new_max)
    values = v_ref[pl.ds(start, chunk), :].astype(jnp.float32)
    return (acc * correction + jnp.sum(probs[:, None] * values, axis=0), new_max,
            row_sum * correction + jnp.sum(probs))

  def leaf(j, carry):
    node = leaves_ref[split * per_split + j]
    return absorb(carry, 1 + jnp.maximum(node, 0) * chunk, jnp.full((chunk,), node >= 0))

  carry = (jnp.zeros(q.shape, jnp.float32), floor, jnp.float32(0.0))
  carry = jax.lax.fori_loop(0, per_split, leaf, carry)
  # Key 0 and the current chunk `1 + C⌊i/C⌋ … i`, read as one C-row window ending inside the cache.
  rows = jnp.arange(chunk)
  carry = absorb(carry, 0, (rows == 0) & (split == 0))
  current = 1 + chunk * (position // chunk)
  start = jnp.minimum(current, capacity - chunk)
  key = start + rows
  carry = absorb(carry, start, (key >= current) & (key <= position) & (split == 0))
  acc, row_max, row_sum = carry
  out_ref[...] = (acc / jnp.where(row_sum > 0, row_sum, 1.0)).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(row_sum > 0, row_max + jnp.log(jnp.where(row_sum > 0, row_sum, 1.0)), -jnp.inf)[None]


@functools.partial(jax.jit, static_argnames=("chunk", "splits", "interpret"))
def leaf_attention(q, k, v, leaves, position, *, chunk, splits=4, interpret=None):
  """Attention of one decode token per row over `I(q) = {0} ∪ kept leaves ∪ current chunk` (ZHA III-C).

  Args:
    q: `[batch, heads, d]` rotated; k, v: `[batch, S, heads, d]` the dense cache (slot = position, S >= chunk).
    leaves: `[batch, heads, M]` int32 kept level-1 nodes (leaf m holds keys `1 + mC … (m+1)C`), NO_NODE for none.
    position: `[batch]` int32 query positions.

  Returns:
    `[batch, heads, d]` float32.
  """
  interpret = default_interpret() if interpret is None else interpret
  _power_of_two("chunk", chunk, interpret)
  batch, heads, dim = q.shape
  per_split = -(-leaves.shape[-1] // splits)
  leaves = pad_axis(leaves.astype(jnp.int32), 2, per_split * splits, NO_NODE)
  width = pl.next_power_of_2(dim)
  seq = k.shape[1]
  out, lse = pl.pallas_call(
      functools.partial(_attention_kernel, chunk=chunk, scale=1.0 / math.sqrt(dim), per_split=per_split),
      grid=(batch, heads, splits),
      in_specs=[pl.BlockSpec((None, None, width), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((None, seq, None, width), lambda b, h, s: (b, 0, h, 0)),
                pl.BlockSpec((None, seq, None, width), lambda b, h, s: (b, 0, h, 0)),
                pl.BlockSpec((None, None, per_split * splits), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((1,), lambda b, h, s: (b,))],
      out_specs=[pl.BlockSpec((None, None, None, width), lambda b, h, s: (b, h, s, 0)),
                 pl.BlockSpec((None, None, None, 1), lambda b, h, s: (b, h, s, 0))],
      out_shape=[jax.ShapeDtypeStruct((batch, heads, splits, width), jnp.float32),
                 jax.ShapeDtypeStruct((batch, heads, splits, 1), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=2),
      interpret=interpret,
      name="zha_leaf_attention",
  )(pad_head_dim(q), pad_head_dim(k), pad_head_dim(v), leaves, position.astype(jnp.int32))
  weights = jax.nn.softmax(lse, axis=2)  # merge the splits' partial softmaxes
  weights = jnp.where(jnp.isfinite(lse), weights, 0.0)
  return jnp.sum(weights * out, axis=2)[..., :dim]
