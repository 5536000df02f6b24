"""ZHA's capped decode step for one query per (row, head) (ZHA III-C with `max_nodes`): the top-p descent over
candidate lists, and the attention over the keys it reaches. This is the specification of the decode kernels
(`pallas_kernels.zha_routing`, composed in `fsjax.ops.zha`), function for function.

The descent keeps exactly the leaves `fsjax.reference.zha.route` keeps with the same cap, without scoring every
node: level L lists every node, each level below lists the kept nodes' C children (in kept order) and then the
C − 1 complete nodes whose parent is not complete, so a level reads at most `max_nodes·C + C − 1` candidates.
Lists hold node indices with NO_NODE for "no candidate". Keeping each level's nodes in list order keeps every
list in node order, so the lower-position-first tie rule of a selection is the lower-node rule of the paper.

The arrays are one layer's: a tree level's keys `[batch, N, kv_heads, R, d]` and bias `[batch, N, kv_heads, R]`
(level 1 first), the dense cache's keys and values `[batch, S, kv_heads, d]` with slot = position. Queries,
candidate lists and leaves are per query head (`[batch, heads, ...]`); query head h reads the tree, keys and
values of key/value head `h // (heads // kv_heads)` (grouped-query attention, ZHA III-A), routes and attends on
its own (III-C).
"""

import math

import jax
import jax.numpy as jnp

from fsjax.reference.common import PRECISION, compute_dtype
from fsjax.reference.grouped import group_size
from fsjax.reference.softmax import masked_softmax
from fsjax.reference.zha import ZHATree, node_last_key

NO_NODE = -1  # the kernels' NO_NODE too


def gather_per_head(array, index):
  """`array` `[batch, N, kv_heads, ...]` at per-query-head indices `index` `[batch, heads, K]` (clipped into
  range; callers mask what NO_NODE read), query head h reading key/value head `h // (heads // kv_heads)` →
  `[batch, heads, K, ...]`."""
  rows = jnp.arange(index.shape[0])[:, None, None]
  heads = jnp.arange(index.shape[1])[None, :, None] // group_size(index.shape[1], array.shape[2])
  return array[rows, jnp.clip(index, 0, array.shape[1] - 1), heads]


def listed_scores(q, keys, bias, index):
  """Node scores `s(q) = max_r (q·k̂_r/√d + b̂_r)` (ZHA III-A) of listed nodes.

  Args:
    q: `[batch, heads, d]` rotated queries; keys `[batch, N, kv_heads, R, d]`, bias `[batch, N, kv_heads, R]`: one
      level.
    index: `[batch, heads, K]` int node indices, NO_NODE for none.

  Returns:
    `[batch, heads, K]` in at least float32 (half-precision scores would tie and reorder nodes; the kernels score
    in float32 too), −inf for NO_NODE.
  """
  dtype = compute_dtype(q.dtype)
  node_keys = gather_per_head(keys, index).astype(dtype)  # [batch, heads, K, R, d]
  node_bias = gather_per_head(bias, index).astype(dtype)
  tangents = jnp.einsum("bhd,bhkrd->bhkr", q.astype(dtype), node_keys, precision=PRECISION) / math.sqrt(q.shape[-1])
  return jnp.where(index >= 0, jnp.max(tangents + node_bias, axis=-1), -jnp.inf)


def keep_top_p(scores, index, *, p, max_nodes):
  """Capped top-p selection over candidate lists (`fsjax.reference.zha.top_p_select`'s rule, at most `max_nodes`).

  Ranked by (score desc, list position asc), a candidate is kept while fewer than `max_nodes` rank above it and
  (p < 1) the softmax mass ranked above it is below `p` of the list's. The valid candidates must come in node
  order, so that the list-position tie rule is the lower-node rule.

  Args:
    scores: `[batch, heads, K]`, −inf where there is no candidate; index: `[batch, heads, K]` or `[K]` nodes.
    p: the level's threshold (`p >= 1`: the cap alone); max_nodes: the cap.

  Returns:
    `[batch, heads, min(max_nodes, K)]` int32: the kept nodes in list order, then NO_NODE.
  """
  count = scores.shape[-1]
  index = jnp.broadcast_to(index, scores.shape).astype(jnp.int32)
  if count == 0:
    return index
  top_scores, ranked = jax.lax.top_k(scores, min(max_nodes, count))  # ties: the lower list position first
  best = top_scores[..., :1]
  shift = jnp.where(jnp.isfinite(best), best, 0.0)
  weights = jnp.where(jnp.isfinite(top_scores), jnp.exp(top_scores - shift), 0.0)
  keep = jnp.isfinite(top_scores)
  if p < 1:
    total = jnp.sum(jnp.exp(scores - shift), axis=-1, keepdims=True)
    keep &= jnp.cumsum(weights, axis=-1) - weights < p * total
  position = jnp.sort(jnp.where(keep, ranked, count), axis=-1)  # back in list order, dropped ones last
  kept = jnp.take_along_axis(index, jnp.minimum(position, count - 1), axis=-1)
  return jnp.where(position < count, kept, NO_NODE)


def candidates_below(kept, position, *, chunk, level):
  """Level ℓ−1's candidate list (ZHA III-C `A_{ℓ-1} = ch(S_ℓ) ∪ U_{ℓ-1}`) from level ℓ's kept nodes.

  Args:
    kept: `[batch, heads, M]` level-ℓ nodes in node order, then NO_NODE; position: `[batch]` query positions.

  Returns:
    `[batch, heads, M·C + C − 1]` int32: each kept node's C children, then the C − 1 nodes after the children of
    the last complete level-ℓ node, where complete (their parent is not, so none passed them down); NO_NODE for
    a missing parent's children and an incomplete parentless node.
  """
  batch, heads, _ = kept.shape
  i = position[:, None, None]
  children = jnp.where(kept[..., None] >= 0, kept[..., None] * chunk + jnp.arange(chunk), NO_NODE)
  parentless = chunk * (i // chunk**level) + jnp.arange(chunk - 1)
  parentless = jnp.where(node_last_key(parentless, chunk, level - 1) <= i, parentless, NO_NODE)
  return jnp.concatenate(
    [children.reshape(batch, heads, -1), jnp.broadcast_to(parentless, (batch, heads, chunk - 1))], axis=-1
  ).astype(jnp.int32)


def route_gathered(q, position, keys, bias, tree: ZHATree):
  """Capped top-p descent for one query per (row, head) over candidate lists (ZHA III-C).

  Args:
    q: `[batch, heads, d]` rotated queries at `position` `[batch]`.
    keys, bias: tuples over levels 1..L of one layer's `[batch, N_ℓ, kv_heads, R, d]` and `[batch, N_ℓ, kv_heads, R]`
      (`N_ℓ` may exceed the nodes complete at the position: incomplete nodes are never candidates).
    tree: the routing (`tree.max_nodes` must be set: it sizes the lists).

  Returns:
    `[batch, heads, M]` int32 reached leaves (level-1 nodes; leaf m holds keys `1 + mC … (m+1)C`) in node order,
    then NO_NODE; `M = min(max_nodes, candidates of level 1)`.
  """
  if tree.max_nodes is None:
    raise ValueError("the gathered descent needs a cap: tree.max_nodes must be set")
  if len(keys) != tree.levels or len(bias) != tree.levels:
    raise ValueError(f"keys and bias must hold one array per level ({tree.levels}), got {len(keys)}, {len(bias)}")
  batch, heads, _ = q.shape
  top = keys[-1].shape[1]
  nodes = jnp.arange(top)
  index = jnp.where(node_last_key(nodes, tree.chunk, tree.levels) <= position[:, None, None], nodes, NO_NODE)
  index = jnp.broadcast_to(index, (batch, heads, top))  # A_L = U_L: every complete top-level node
  for level in range(tree.levels, 0, -1):
    kept = keep_top_p(
      listed_scores(q, keys[level - 1], bias[level - 1], index),
      index,
      p=tree.level_top_p[level - 1],
      max_nodes=tree.max_nodes,
    )
    if level > 1:
      index = candidates_below(kept, position, chunk=tree.chunk, level=level)
  return kept


def fraction_read(leaves, position, chunk):
  """Share of the visible keys a query at `position` `[batch]` reads with `leaves` `[batch, heads, M]` (NO_NODE:
  none): key 0, the leaves' chunks and the current chunk `1 + C⌊i/C⌋ … i`, over the i + 1 visible keys.
  `[batch, heads]`."""
  i = position[:, None]
  return (jnp.sum(leaves >= 0, axis=-1) * chunk + 1 + i % chunk) / (i + 1)


def leaf_attention(q, k, v, leaves, position, *, chunk):
  """Attention of one query per (row, head) over `I(q) = {0} ∪ the leaves' keys ∪ the current chunk` (ZHA III-C).

  Args:
    q: `[batch, heads, d]` rotated; k, v: `[batch, S, kv_heads, d]` the dense cache (slot = position).
    leaves: `[batch, heads, M]` int level-1 nodes, NO_NODE for none; position: `[batch]`.

  Returns:
    `[batch, heads, d]` in at least float32.
  """
  batch, heads, dim = q.shape
  dtype = compute_dtype(q.dtype)
  i = position[:, None, None]
  leaf_keys = (1 + jnp.maximum(leaves, 0)[..., None] * chunk + jnp.arange(chunk)).reshape(batch, heads, -1)
  current = 1 + chunk * (i // chunk) + jnp.arange(chunk)
  key_pos = jnp.concatenate(
    [jnp.zeros((batch, heads, 1), jnp.int32), leaf_keys, jnp.broadcast_to(current, (batch, heads, chunk))], axis=-1
  )
  key_valid = jnp.concatenate(
    [
      jnp.ones((batch, heads, 1), bool),
      jnp.repeat(leaves >= 0, chunk, axis=-1),
      jnp.broadcast_to(current <= i, (batch, heads, chunk)),
    ],
    axis=-1,
  )
  keys = gather_per_head(k, key_pos).astype(dtype)  # [batch, heads, K, d]
  values = gather_per_head(v, key_pos).astype(dtype)
  logits = jnp.einsum("bhd,bhkd->bhk", q.astype(dtype), keys, precision=PRECISION) / math.sqrt(dim)
  return jnp.einsum("bhk,bhkd->bhd", masked_softmax(logits, key_valid), values, precision=PRECISION)
