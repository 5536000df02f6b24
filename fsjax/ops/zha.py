"""ZHA ops (ZHA III) with their implementation chosen by `fsjax.ops.dispatch`.

The training-form operator (`fsjax.reference.zha`) and the distillation loss also run over blocks of queries in bounded
memory (`fsjax.ops.zha_blocked`, `fsjax.ops.zha_kl`). The capped decode step (one query per row, `max_nodes` set) has
Pallas kernels (`pallas_kernels.zha_routing`): two launches per level (candidate scoring, then the capped top-p
selection) and the attention over the reached keys; its reference is `fsjax.reference.zha_decode`. One dispatch entry,
"zha_route", decides for both stages, which pass each other the kernels' NO_NODE-padded rows as they are.

Grouped-query attention (ZHA III-A): trees, reference queries and the dense cache hold `kv_heads` heads, queries
and routing `heads`; query head h reads key/value head `h // (heads // kv_heads)`. The references gather by that
index, and the kernels read it through their BlockSpec index maps: nothing is repeated per query head.

Decode ops take one layer's arrays, or a scanned model's stacks `[layers, ...]` of them with the int32 `layer`
to read: the kernels then read that layer where it lies, the reference slices it out.
"""

import jax.numpy as jnp

from fsjax.ops import dispatch, zha_blocked, zha_kl
from fsjax.reference import zha as reference
from fsjax.reference import zha_decode as decode_reference
from fsjax.reference.zha import ZHATree
from pallas_kernels import zha_routing


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
  impl="reference",
):
  """Causal attention over the keys each query reaches through the ZHA tree: the reference's `zha_attention`
  plus `impl`. "auto" runs the reference's routing and attention over blocks of queries (`fsjax.ops.zha_blocked`,
  in memory that grows with T instead of T²) wherever the queries span more than one block of
  `query_blocks.query_block_for` them; no kernel computes the training form.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q` (and with `return_fraction` the attended fraction
    `[batch, T, heads]`).
  """
  batch, seq, heads, _ = q.shape
  form = (
    zha_blocked
    if dispatch.resolve("zha_attention", impl, batch=batch, heads=heads, tokens=seq) == "blocked"
    else reference
  )
  return form.zha_attention(
    q,
    k,
    v,
    ref_queries,
    chunk=chunk,
    levels=levels,
    top_p=top_p,
    rope_theta=rope_theta,
    max_nodes=max_nodes,
    return_fraction=return_fraction,
  )


def zha_kl_per_level(q, k, ref_queries, *, chunk, levels, rope_theta=None, impl="reference"):
  """ZHA III-B distillation loss of each level of one layer (`fsjax.reference.zha.zha_kl_per_level`). `[levels]`.

  `impl` "auto" takes the query-blocked form (`fsjax.ops.zha_kl`: the same loss in memory that grows with T
  instead of T²) wherever the queries span more than one block of `query_blocks.query_block_for` them.
  """
  batch, seq, heads, _ = q.shape
  if dispatch.resolve("zha_kl_loss", impl, batch=batch, heads=heads, tokens=seq) == "blocked":
    return zha_kl.zha_kl_per_level(q, k, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta)
  return reference.zha_kl_per_level(q, k, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta)


def zha_kl_loss(q, k, ref_queries, *, chunk, levels, rope_theta=None, impl="reference"):
  """ZHA III-B distillation loss of one layer (`fsjax.reference.zha.zha_kl_loss`; `impl` as `zha_kl_per_level`).
  Scalar."""
  return jnp.sum(zha_kl_per_level(q, k, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta, impl=impl))


def _kernels(impl, tree: ZHATree, keys):
  """Whether `impl` runs the decode step on the kernels, for this tree (R read from the arrays)."""
  return dispatch.resolve("zha_route", impl, chunk=tree.chunk, refs=keys[0].shape[-2]) != "reference"


def _layer(x, layer):
  """One layer's array: `x`, or layer `layer` of a scanned model's stack `x`."""
  return x if layer is None else x[layer]


def _route_with_kernels(q, position, keys, bias, tree: ZHATree, layer):
  """`route_gathered` on the kernels, two launches per level. The top level scores one constant list for every
  row and head (the kernel drops nodes not complete at the position); each level below scores the list
  `score_children` builds in the kernel from the kept row above; `keep_top_p` keeps each level's nodes in list
  order, which is node order, so the children's list is in node order too."""
  top = keys[-1].shape[-4]
  nodes = jnp.arange(zha_routing.list_width(top))
  index, kept, count, cap = jnp.where(nodes < top, nodes, zha_routing.NO_NODE), None, top, None
  for level in range(tree.levels, 0, -1):
    span = tree.chunk**level
    if kept is None:
      scores = zha_routing.score_candidates(
        q, keys[level - 1], bias[level - 1], index, position=position, span=span, layer=layer
      )
    else:
      scores, index = zha_routing.score_children(
        q, keys[level - 1], bias[level - 1], kept, position, parents_kept=cap, chunk=tree.chunk, span=span, layer=layer
      )
      count = cap * tree.chunk + tree.chunk - 1
    cap = min(tree.max_nodes, count)
    kept = zha_routing.keep_top_p(scores, index, p=tree.level_top_p[level - 1], max_nodes=cap, full_row=level > 1)
  return kept


def _check_decode(q, position, keys, bias, tree: ZHATree):
  if tree.max_nodes is None:
    raise ValueError(
      "the capped decode step needs tree.max_nodes (None routes through every node: "
      "`fsjax.reference.zha.routed_attention`)"
    )
  if len(keys) != tree.levels or len(bias) != tree.levels:
    raise ValueError(f"keys and bias must hold one array per level ({tree.levels}), got {len(keys)}, {len(bias)}")
  if q.ndim != 3 or position.shape != q.shape[:1]:
    raise ValueError(f"q must be [batch, heads, d] and position [batch], got {q.shape} and {position.shape}")


def zha_route(q, position, keys, bias, *, tree: ZHATree, layer=None, impl="reference"):
  """The leaves one decode query per (row, head) reaches by the capped top-p descent (ZHA III-C):
  `fsjax.reference.zha_decode.route_gathered` plus `impl` (and `layer`).

  Args:
    q: `[batch, heads, d]` rotated queries at `position` `[batch]` int32.
    keys, bias: tuples over levels 1..L of `[batch, N_ℓ, kv_heads, R, d]` and `[batch, N_ℓ, kv_heads, R]`, or of a
      scanned model's stacks `[layers, batch, ...]` with `layer` (int32 scalar) the one to read.
    tree: the routing; `tree.max_nodes` must be set.

  Returns:
    `[batch, heads, M]` int32 leaves, NO_NODE (-1) for none, `M = min(max_nodes, level-1 candidates)`; a set (the
    reference lists it in node order, the kernels in their list order).
  """
  _check_decode(q, position, keys, bias, tree)
  if _kernels(impl, tree, keys):
    return _route_with_kernels(q, position, keys, bias, tree, layer)
  return decode_reference.route_gathered(
    q, position, tuple(_layer(x, layer) for x in keys), tuple(_layer(x, layer) for x in bias), tree
  )


def zha_decode(q, position, keys, bias, k, v, *, tree: ZHATree, layer=None, impl="reference"):
  """One capped decode step's ZHA attention (ZHA III-C): `zha_route`, then attention over key 0, the reached
  leaves' keys and the current chunk, reading only the candidate lists and the ≤ `max_nodes·C + C + 1` keys.

  Args:
    q, position, keys, bias, tree, layer, impl: as `zha_route`.
    k, v: `[batch, S, kv_heads, d]` the dense cache (rotated keys, slot = position), or stacks with `layer`.

  Returns:
    `[batch, heads, d]` in at least float32, and the fraction of visible keys read, `[batch, heads]`.
  """
  leaves = zha_route(q, position, keys, bias, tree=tree, layer=layer, impl=impl)
  if _kernels(impl, tree, keys):
    out = zha_routing.leaf_attention(q, k, v, leaves, position, chunk=tree.chunk, layer=layer)
  else:
    out = decode_reference.leaf_attention(q, _layer(k, layer), _layer(v, layer), leaves, position, chunk=tree.chunk)
  return out, decode_reference.fraction_read(leaves, position, tree.chunk)
