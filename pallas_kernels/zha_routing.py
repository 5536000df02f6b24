"""ZHA decode kernels (ZHA III-C): node scoring over a candidate list (given, or built in the kernel from the
kept nodes of the level above), the capped top-p selection of each level, and the final attention over the keys
the routing reached (key 0, the kept leaves' chunks, the current chunk). `fsjax.reference.zha_decode` is their
jnp specification, function for function (`listed_scores`, `candidates_below`, `keep_top_p`, `leaf_attention`);
`fsjax.ops.zha` composes them into the decode step.

The selection replaces `lax.top_k`, which XLA lowers on a GPU to a full sort of every candidate list (at 256k
tokens and C=8, L=2 that sort was a third of the decode step's kernel time). A cap of `max_nodes` over a top-p
prefix only needs the score of the last kept node: a 32-step bisection over the scores' bit patterns finds it
with two reductions per step, and one prefix count writes the kept nodes out in list order.

Byte counts per (layer, head) for one decode token: scoring reads `K·R·d` node-key entries for K candidates
(every top-level node, then at most `max_nodes·C + C − 1` per level below); the attention reads
`(max_nodes·C + C + 1)·d` keys and as many values. At C=8, R=16, d=64, max_nodes=64 in bf16 that is 1 MB of
level-1 node keys and 130 KB of keys and values, against `2·T·d·2` bytes (16 MB at 64k) for dense decode.

Grouped-query attention: the trees and the dense cache hold `kv_heads` heads, queries, lists and leaves `heads`.
Every grid runs per query head h and its BlockSpec index maps read key/value head `h // (heads // kv_heads)`, so
no key, value or node is copied per query head; routing and attention stay per query head (ZHA III-C).

Parallelism at batch 1: scoring runs one program per (batch, head, block of candidates), the selection one per
(batch, head), and the attention splits each head's leaves over `splits` programs (flash-decoding) whose partial
softmaxes are merged by log-sum-exp in one more launch (`decode_parts.merge_parts`). Each program gathers its rows
(a block of nodes `[BK, R, d]`, its leaves' keys `[P, C, d]`) in one load instead of a loop of dependent loads; a
single query needs no tensor-core dot.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_power_of_two, default_interpret, layer_stack, pad_axis, pad_head_dim
from pallas_kernels.decode_parts import merge_parts

NO_NODE = -1


def group_size(heads, kv_heads):
  """Query heads per key/value head (`fsjax.reference.grouped.group_size`; the kernels import nothing from fsjax)."""
  if kv_heads <= 0 or heads % kv_heads:
    raise ValueError(f"key/value heads ({kv_heads}) must divide the query heads ({heads})")
  return heads // kv_heads


def compilable(*, chunk, refs):
  """Whether Triton can tile this tree: chunk and refs powers of two (tiles of C keys and R node keys)."""
  return chunk & (chunk - 1) == 0 and refs & (refs - 1) == 0


def list_width(count):
  """The candidate-list width `score_candidates` and `keep_top_p` take without padding: a power of two, at
  least 16. Lists built at this width (NO_NODE after the candidates) skip the pads."""
  return max(16, pl.next_power_of_2(count))


def _node_scores(q_ref, keys_ref, bias_ref, layer_ref, index, valid, *, scale):
  """`[BK]` scores of nodes `index` (−inf where not `valid`). The block's nodes are read as one gather
  `[BK, R, d]`: a loop over them made each program a chain of dependent loads (6.4 µs for 1,024 candidates on
  an H200)."""
  q = q_ref[...].astype(jnp.float32)
  layer = layer_ref[0]
  node = jnp.maximum(index, 0)
  keys = keys_ref[layer, node, :, :].astype(jnp.float32)  # [BK, R, d]
  bias = bias_ref[layer, node, :].astype(jnp.float32)  # [BK, R]
  scores = jnp.max(jnp.sum(keys * q[None, None, :], axis=2) * scale + bias, axis=1)
  return jnp.where(valid, scores, -jnp.inf)


def _score_kernel(q_ref, keys_ref, bias_ref, index_ref, position_ref, layer_ref, out_ref, *, scale, span):
  """q_ref `[d]`, keys_ref `[L, N, R, d]`, bias_ref `[L, N, R]` of which layer `layer_ref[0]` is read,
  index_ref `[BK]`, position_ref `[1]` → out_ref `[BK]` (−inf for NO_NODE, and with `span` for nodes whose last
  key `(node + 1)·span` is after the position)."""
  index = index_ref[...]
  valid = index >= 0
  if span is not None:
    valid &= (index + 1) * span <= position_ref[0]
  out_ref[...] = _node_scores(q_ref, keys_ref, bias_ref, layer_ref, index, valid, scale=scale)


def _score_children_kernel(
  q_ref,
  keys_ref,
  bias_ref,
  parents_ref,
  position_ref,
  layer_ref,
  out_ref,
  index_ref,
  *,
  scale,
  chunk,
  span,
  parents,
  block,
):
  """As `_score_kernel`, for the list `score_children` describes, built here from parents_ref `[W]` (the kept
  parents first, then NO_NODE): candidate j < parents·C is child j % C of parent j // C; the next C − 1 are the
  complete nodes after the last parent-level node (ZHA III-C's parentless nodes); the rest are NO_NODE. The
  list goes to index_ref `[BK]`, for the selection."""
  j = pl.program_id(2) * block + jnp.arange(block)
  parent = parents_ref[jnp.minimum(j // chunk, parents - 1)]
  orphan = chunk * (position_ref[0] // (span * chunk)) + j - parents * chunk
  is_child = j < parents * chunk
  is_orphan = ~is_child & (j < parents * chunk + chunk - 1)
  valid = (is_child & (parent >= 0)) | (is_orphan & ((orphan + 1) * span <= position_ref[0]))
  index = jnp.where(valid, jnp.where(is_child, parent * chunk + j % chunk, orphan), NO_NODE)  # reads stay in bounds
  index_ref[...] = index
  out_ref[...] = _node_scores(q_ref, keys_ref, bias_ref, layer_ref, index, valid, scale=scale)


# Node-key entries one scoring program gathers: large enough to hide the loads' latency, small enough to stay in
# registers at 4 warps.
_SCORE_ENTRIES = 8192


def _score_block(q, node_keys, count, block, interpret):
  """Candidates per scoring program, a power of two: by default `_SCORE_ENTRIES` node-key entries, at most the
  list's power-of-two width (so a list of `list_width` is not padded)."""
  refs = node_keys.shape[-2]
  check_power_of_two("refs", refs, interpret)
  if block is None:
    block = min(max(1, _SCORE_ENTRIES // (refs * pl.next_power_of_2(q.shape[-1]))), pl.next_power_of_2(count))
  check_power_of_two("block", block, interpret)
  return block


def _scoring_call(
  kernel,
  q,
  node_keys,
  node_bias,
  layer,
  candidates,
  candidates_spec,
  position,
  *,
  programs,
  block,
  out_dtypes,
  interpret,
  name,
):
  """Runs a scoring kernel `(q, keys, bias, candidates, position, layer, *outputs, scale)` on a grid of (batch,
  query head, block of candidates) over one tree level (or a scanned stack's `layer`), query head h reading the
  tree of key/value head `h // group`; one output `[batch, heads, programs·block]` per dtype of `out_dtypes`."""
  batch, heads, dim = q.shape
  (node_keys, layer_index), (node_bias, _) = layer_stack(node_keys, layer, 5), layer_stack(node_bias, layer, 4)
  layers, _, nodes, kv_heads, refs, _ = node_keys.shape
  group = group_size(heads, kv_heads)
  width = pl.next_power_of_2(dim)
  out_spec = pl.BlockSpec((None, None, block), lambda b, h, c: (b, h, c))
  return pl.pallas_call(
    functools.partial(kernel, scale=1.0 / math.sqrt(dim)),
    grid=(batch, heads, programs),
    in_specs=[
      pl.BlockSpec((None, None, width), lambda b, h, c: (b, h, 0)),
      pl.BlockSpec((layers, None, nodes, None, refs, width), lambda b, h, c: (0, b, 0, h // group, 0, 0)),
      pl.BlockSpec((layers, None, nodes, None, refs), lambda b, h, c: (0, b, 0, h // group, 0)),
      candidates_spec,
      pl.BlockSpec((1,), lambda b, h, c: (b,)),
      pl.BlockSpec((1,), lambda b, h, c: (0,)),
    ],
    out_specs=[out_spec] * len(out_dtypes),
    out_shape=[jax.ShapeDtypeStruct((batch, heads, programs * block), dtype) for dtype in out_dtypes],
    compiler_params=plgpu.CompilerParams(num_warps=4 if block * refs * width >= 4096 else 1, num_stages=1),
    interpret=interpret,
    name=name,
  )(pad_head_dim(q), pad_head_dim(node_keys), node_bias, candidates, position.astype(jnp.int32), layer_index)


@functools.partial(jax.jit, static_argnames=("span", "block", "interpret"))
def score_candidates(
  q, node_keys, node_bias, index, *, position=None, span=None, layer=None, block=None, interpret=None
):
  """`max_r (q·k̂_r/√d + b̂_r)` of listed nodes (ZHA III-A).

  Args:
    q: `[batch, heads, d]` rotated queries (one decode token).
    node_keys: `[batch, N, kv_heads, R, d]`; node_bias: `[batch, N, kv_heads, R]` (one tree level; `kv_heads`
      divides `heads` and query head h reads key/value head `h // (heads // kv_heads)`).
    index: `[batch, heads, K]` int32 node indices, NO_NODE for none; or `[K]`, one list for every row and head
      (the top level's, read by every program from one array: broadcasting it would be a kernel of its own).
    position, span: with `position` `[batch]` int32 and `span` the level's keys per node (C^ℓ), nodes not yet
      complete at the position (last key `(node + 1)·span` after it) score −inf too. The top level lists every
      node, so its list is then a constant and needs no masking kernel of its own.
    layer: None, or an int32 scalar when `node_keys` and `node_bias` are a scanned model's stacks
      `[layers, batch, ...]`: the kernel reads that layer where it lies.
    block: candidates per program, a power of two (default: `_SCORE_ENTRIES` node-key entries, at most the
      list's power-of-two width, so a list of `list_width` is not padded).

  Returns:
    `[batch, heads, K]` float32 scores, −inf for NO_NODE.
  """
  interpret = default_interpret() if interpret is None else interpret
  count = index.shape[-1]
  block = _score_block(q, node_keys, count, block, interpret)
  padded = -(-count // block) * block
  index = pad_axis(index.astype(jnp.int32), index.ndim - 1, padded, NO_NODE)
  index_spec = (
    pl.BlockSpec((block,), lambda b, h, c: (c,))
    if index.ndim == 1
    else pl.BlockSpec((None, None, block), lambda b, h, c: (b, h, c))
  )
  if (position is None) != (span is None):
    raise ValueError("position and span go together: give both or neither")
  position = jnp.zeros(q.shape[:1], jnp.int32) if position is None else position
  (scores,) = _scoring_call(
    functools.partial(_score_kernel, span=span),
    q,
    node_keys,
    node_bias,
    layer,
    index,
    index_spec,
    position,
    programs=padded // block,
    block=block,
    out_dtypes=(jnp.float32,),
    interpret=interpret,
    name="zha_score_candidates",
  )
  return scores[..., :count]


@functools.partial(jax.jit, static_argnames=("parents_kept", "chunk", "span", "block", "interpret"))
def score_children(
  q, node_keys, node_bias, parents, position, *, parents_kept, chunk, span, layer=None, block=None, interpret=None
):
  """`score_candidates` over a lower level's list, built in the kernel from the level above's kept nodes: the
  children of each kept parent, in parent order, then the C − 1 nodes after the last complete parent-level
  node's children, where complete (ZHA III-C: their parent is not complete, so no parent passed them down).
  Building the list in the kernel saves the XLA kernels that would build it between selection and scoring.

  Args:
    q, node_keys, node_bias, layer, block: as `score_candidates` (one tree level).
    parents: `[batch, heads, W]` int32, the level above's kept nodes first, then NO_NODE (`keep_top_p` with
      `full_row=True`); its first `parents_kept` entries are read.
    position: `[batch]` int32 query positions; chunk: C; span: keys per node at this level (C^ℓ).

  Returns:
    (scores `[batch, heads, K]` float32, index `[batch, heads, K]` int32) with `K = list_width(parents_kept·C +
    C − 1)`: the list's nodes (NO_NODE for a dropped parent's children, an incomplete parentless node, and
    after the list) and their scores (−inf there).
  """
  interpret = default_interpret() if interpret is None else interpret
  check_power_of_two("chunk", chunk, interpret)
  row = parents.shape[-1]
  if not 1 <= parents_kept <= row:
    raise ValueError(f"parents_kept must be in [1, {row}] (the parents row's width), got {parents_kept}")
  count = list_width(parents_kept * chunk + chunk - 1)
  block = _score_block(q, node_keys, count, block, interpret)
  kernel = functools.partial(_score_children_kernel, chunk=chunk, span=span, parents=parents_kept, block=block)
  scores, index = _scoring_call(
    kernel,
    q,
    node_keys,
    node_bias,
    layer,
    parents.astype(jnp.int32),
    pl.BlockSpec((None, None, row), lambda b, h, c: (b, h, 0)),
    position,
    programs=count // block,
    block=block,
    out_dtypes=(jnp.float32, jnp.int32),
    interpret=interpret,
    name="zha_score_children",
  )
  return scores, index


def _sortable(scores):
  """float32 → int32 keys whose signed order is the scores' order (negative floats have their magnitude bits
  flipped)."""
  bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
  return jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))


def _keep_top_kernel(scores_ref, index_ref, out_ref, *, p, max_nodes):
  """One (batch, head): scores_ref `[K]` (−inf: no candidate), index_ref `[K]` → out_ref `[K]`, the kept
  candidates' nodes in list order, then NO_NODE.

  Ranked by (score desc, list position asc), candidate r is kept when r < max_nodes and the mass ranked above it
  is < p·total (`fsjax.reference.zha_decode.keep_top_p`). Both sides of that test only grow down the ranking, so
  the kept set is every candidate above a threshold score T plus the first few candidates tied at T. T is the
  lowest key at which the candidates above it do not yet fill the cap or the mass; it is found bit by bit."""
  scores = scores_ref[...]
  index = index_ref[...]
  valid = scores > -jnp.inf
  best = jnp.max(scores)
  weights = jnp.where(valid, jnp.exp(scores - jnp.where(best > -jnp.inf, best, 0.0)), 0.0)
  target = p * jnp.sum(weights) if p < 1 else jnp.float32(jnp.inf)
  key = _sortable(scores)
  low = jnp.iinfo(jnp.int32).min

  def counted_above(threshold):
    above = valid & (key > threshold)
    mass = jnp.sum(jnp.where(above, weights, 0.0)) if p < 1 else jnp.float32(0.0)  # p = 1: the cap alone
    return jnp.sum(above.astype(jnp.int32)), mass

  def filled(threshold):
    count, mass = counted_above(threshold)
    return (count >= max_nodes) | (mass >= target)

  def bit(b, last_filled):  # the highest key that still fills, built from the top bit down (unsigned order)
    trial = last_filled | jax.lax.shift_left(jnp.int32(1), 31 - b)
    return jnp.where(filled(trial ^ low), trial, last_filled)

  threshold = (jax.lax.fori_loop(0, 32, bit, jnp.int32(0)) ^ low) + 1
  count, mass = counted_above(threshold)
  tied = valid & (key == threshold)
  tie_weight = jnp.max(jnp.where(tied, weights, 0.0))
  tie_rank = (jnp.cumsum(tied.astype(jnp.int32)) - tied).astype(jnp.float32)
  kept = (valid & (key > threshold)) | (tied & (count + tie_rank < max_nodes) & (mass + tie_rank * tie_weight < target))
  # A permutation of the row: the kept candidates to the front in list order, the others behind them.
  slot = jnp.cumsum(kept.astype(jnp.int32))
  dest = jnp.where(kept, slot - 1, jnp.sum(kept.astype(jnp.int32)) + jnp.arange(kept.shape[0]) - slot)
  out_ref[dest] = jnp.where(kept, index, NO_NODE)


@functools.partial(jax.jit, static_argnames=("p", "max_nodes", "full_row", "num_warps", "interpret"))
def keep_top_p(scores, index, *, p, max_nodes, full_row=False, num_warps=None, interpret=None):
  """Capped top-p selection over candidate lists: the nodes `fsjax.reference.zha_decode.keep_top_p` keeps, in list
  order.

  Args:
    scores: `[batch, heads, K]` float32, −inf where there is no candidate (as `score_candidates` gives).
    index: `[batch, heads, K]` int32 node of each candidate, or `[K]` shared by every row and head.
    p: the level's top-p threshold in (0, 1]; max_nodes: the cap.
    full_row: return the kernel's whole power-of-two row instead of its first `min(max_nodes, K)` entries (the
      rest are NO_NODE). For `score_children`: a slice that feeds another kernel is a copy kernel of its own.
    num_warps: warps per (batch, head) program (default: one per 512 candidates, 4 to 8: on an H200, 4 warps
      were fastest at 1,024 candidates, 9.0 µs, and 8 at 4,096 and 16,384, 15.9 and 37.6 µs).

  Returns:
    `[batch, heads, min(max_nodes, K)]` int32 kept nodes in list order, then NO_NODE (with `full_row`, `[batch,
    heads, next_power_of_2(K)]`). Ties rank the earlier candidate first, as `lax.top_k`. The mass above each
    candidate is summed in another order than the jnp path's running sum, so a candidate whose mass lies within
    float32 rounding of p·total may go either way.
  """
  interpret = default_interpret() if interpret is None else interpret
  batch, heads, count = scores.shape
  if not 0 < p <= 1:
    raise ValueError(f"p must be in (0, 1], got {p}")
  if max_nodes < 1:
    raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
  if count == 0:
    return jnp.zeros((batch, heads, 0), jnp.int32)
  width = pl.next_power_of_2(count)
  row_spec = pl.BlockSpec((None, None, width), lambda b, h: (b, h, 0))
  kept = pl.pallas_call(
    functools.partial(_keep_top_kernel, p=p, max_nodes=max_nodes),
    grid=(batch, heads),
    in_specs=[row_spec, pl.BlockSpec((width,), lambda b, h: (0,)) if index.ndim == 1 else row_spec],
    out_specs=pl.BlockSpec((None, None, width), lambda b, h: (b, h, 0)),
    out_shape=jax.ShapeDtypeStruct((batch, heads, width), jnp.int32),
    compiler_params=plgpu.CompilerParams(num_warps=num_warps or min(8, max(4, width // 512)), num_stages=1),
    interpret=interpret,
    name="zha_keep_top_p",
  )(
    pad_axis(scores.astype(jnp.float32), 2, width, -jnp.inf),
    pad_axis(index.astype(jnp.int32), index.ndim - 1, width, NO_NODE),
  )
  return kept if full_row else kept[..., : min(max_nodes, count)]


def _attention_kernel(q_ref, k_ref, v_ref, leaves_ref, position_ref, layer_ref, out_ref, lse_ref, *, chunk, scale):
  """One split of one (batch, head): softmax over its share of leaves, read as one gather `[P, C, d]` of keys
  and one of values (a loop over leaves made each program a chain of dependent loads); split 0 also reads key 0
  and the current chunk. q_ref `[d]`, k_ref / v_ref `[L, S, d]` of which layer `layer_ref[0]` is read,
  leaves_ref `[P]` → out_ref `[d]` (normalized), lse_ref `[1]`."""
  split = pl.program_id(2)
  q = q_ref[...].astype(jnp.float32)
  position = position_ref[0]
  layer = layer_ref[0]
  capacity = k_ref.shape[1]
  floor = jnp.float32(-1e30)  # finite: exp(old_max - new_max) stays defined before the first key
  rows = jnp.arange(chunk)[None, :]

  def absorb(carry, key, valid):  # key, valid: `[n, C]` cache slots and whether each is attended
    acc, row_max, row_sum = carry
    keys = k_ref[layer, key, :].astype(jnp.float32)  # [n, C, d]
    logits = jnp.where(valid, jnp.sum(keys * q[None, None, :], axis=2) * scale, floor)
    new_max = jnp.maximum(row_max, jnp.max(jnp.max(logits, axis=1), axis=0))
    probs = jnp.where(valid, jnp.exp(logits - new_max), 0.0)
    correction = jnp.exp(row_max - new_max)
    values = v_ref[layer, key, :].astype(jnp.float32)
    return (
      acc * correction + jnp.sum(jnp.sum(probs[:, :, None] * values, axis=1), axis=0),
      new_max,
      row_sum * correction + jnp.sum(jnp.sum(probs, axis=1), axis=0),
    )

  leaves = leaves_ref[...]
  carry = (jnp.zeros(q.shape, jnp.float32), floor, jnp.float32(0.0))
  carry = absorb(
    carry,
    1 + jnp.maximum(leaves, 0)[:, None] * chunk + rows,
    jnp.broadcast_to((leaves >= 0)[:, None], (leaves.shape[0], chunk)),
  )
  # Key 0 and the current chunk `1 + C⌊i/C⌋ … i`, read as one C-row window ending inside the cache.
  carry = absorb(carry, rows, (rows == 0) & (split == 0))
  current = 1 + chunk * (position // chunk)
  key = jnp.minimum(current, capacity - chunk) + rows
  carry = absorb(carry, key, (key >= current) & (key <= position) & (split == 0))
  acc, row_max, row_sum = carry
  out_ref[...] = (acc / jnp.where(row_sum > 0, row_sum, 1.0)).astype(out_ref.dtype)
  lse_ref[...] = jnp.full(
    lse_ref.shape, jnp.where(row_sum > 0, row_max + jnp.log(jnp.where(row_sum > 0, row_sum, 1.0)), -jnp.inf)
  )


# Keys (and values) one split of the leaf attention gathers at most, so that they stay in registers at 4 warps.
# One program per (batch, head) looping over tiles of this many keys needs no merge, but its dependent tiles took
# 12.2 µs for 64 leaves at C=8 and 33 µs at C=16 on an H200, against 5.1 and 7.1 µs for the split kernel plus
# about 3 µs for the merge (then XLA's softmax over the splits: three kernels).
_SPLIT_KEYS = 128


@functools.partial(jax.jit, static_argnames=("chunk", "splits", "interpret"))
def leaf_attention(q, k, v, leaves, position, *, chunk, layer=None, splits=None, interpret=None):
  """Attention of one decode token per row over `I(q) = {0} ∪ kept leaves ∪ current chunk` (ZHA III-C).

  Args:
    q: `[batch, heads, d]` rotated; k, v: `[batch, S, kv_heads, d]` the dense cache (slot = position, S >= chunk),
      query head h reading key/value head `h // (heads // kv_heads)`.
    leaves: `[batch, heads, M]` int32 kept level-1 nodes (leaf m holds keys `1 + mC … (m+1)C`), NO_NODE for none.
    position: `[batch]` int32 query positions.
    layer: None, or an int32 scalar when `k` and `v` are a scanned model's stacks `[layers, batch, S, heads, d]`:
      the kernel reads that layer where it lies.
    splits: programs per (batch, head), each over a power-of-two share of the leaves, their partial softmaxes
      merged by log-sum-exp in a second launch (flash-decoding; default: enough that a split reads at most
      `_SPLIT_KEYS` keys).

  Returns:
    `[batch, heads, d]` float32.
  """
  interpret = default_interpret() if interpret is None else interpret
  check_power_of_two("chunk", chunk, interpret)
  batch, heads, dim = q.shape
  count = max(1, leaves.shape[-1])
  if splits is None:
    splits = -(-count * chunk // _SPLIT_KEYS)
  per_split = pl.next_power_of_2(-(-count // splits))
  leaves = pad_axis(leaves.astype(jnp.int32), 2, per_split * splits, NO_NODE)
  width = pl.next_power_of_2(dim)
  (k, layer_index), (v, _) = layer_stack(k, layer, 4), layer_stack(v, layer, 4)
  layers, _, seq, kv_heads = k.shape[:4]
  group = group_size(heads, kv_heads)
  cache_spec = pl.BlockSpec((layers, None, seq, None, width), lambda b, h, s: (0, b, 0, h // group, 0))
  out, lse = pl.pallas_call(
    functools.partial(_attention_kernel, chunk=chunk, scale=1.0 / math.sqrt(dim)),
    grid=(batch, heads, splits),
    in_specs=[
      pl.BlockSpec((None, None, width), lambda b, h, s: (b, h, 0)),
      cache_spec,
      cache_spec,
      pl.BlockSpec((None, None, per_split), lambda b, h, s: (b, h, s)),
      pl.BlockSpec((1,), lambda b, h, s: (b,)),
      pl.BlockSpec((1,), lambda b, h, s: (0,)),
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, width), lambda b, h, s: (b, h, s, 0)),
      pl.BlockSpec((None, None, 1), lambda b, h, s: (b, h, s)),
    ],
    out_shape=[  # to a power of two of splits, which the merge loads whole (and masks)
      jax.ShapeDtypeStruct((batch, heads, pl.next_power_of_2(splits), width), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, pl.next_power_of_2(splits)), jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=4 if per_split * chunk * width >= 4096 else 1, num_stages=1),
    interpret=interpret,
    name="zha_leaf_attention",
  )(pad_head_dim(q), pad_head_dim(k), pad_head_dim(v), leaves, position.astype(jnp.int32), layer_index)
  return merge_parts(out, lse, parts=splits, out_dtype=jnp.float32, interpret=interpret)[..., :dim]
