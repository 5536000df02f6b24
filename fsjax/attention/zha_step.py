"""ZHA's cached step, shared by prefill chunks and decode tokens: extend the tree cache with a chunk, route each
query through it, attend over the reached keys (ZHA III-A, III-C).

A chunk (or an uncapped tree) is routed by scoring every node of the cache and masking its keys
(`fsjax.reference.zha.routed_attention`, the training form's own routing). One token per row with `max_nodes` set
takes the capped decode op (`fsjax.ops.zha.zha_decode`), which reads only the candidate lists and the reached
keys; its kernels read a scanned model's stacked cache in place, so this module hands them the stacks and the
layer index instead of a copied layer.
"""

from fsjax.cache import zha as zha_cache
from fsjax.cache.layered import LayerSlice, read
from fsjax.cache.zha import ZHACache
from fsjax.ops import zha as zha_ops
from fsjax.reference import zha as zha_ref
from fsjax.reference.common import compute_dtype
from fsjax.reference.zha import ZHATree


def _in_place(fields):
  """Cache fields as a kernel takes them: a scanned model's stacks and their layer (the same for every field of
  one layer's view), or the plain arrays and None."""
  if isinstance(fields[0], LayerSlice):
    return tuple(x.stack for x in fields), fields[0].layer
  return tuple(fields), None


def attend(cache: ZHACache, q_rot, positions, *, tree: ZHATree, impl="reference"):
  """ZHA attention of a chunk of queries over the cache, after `zha_cache.extend` wrote the chunk.

  Args:
    q_rot: `[batch, n, heads, d]` rotated queries at `positions` `[batch, n]`; the cache holds `kv_heads` heads
      (query head h reads key/value head `h // (heads // kv_heads)`).
    tree: the routing; impl: the decode op's (`fsjax.ops.dispatch`, "zha_route").

  Returns:
    outputs `[batch, n, heads, d]` in q_rot's dtype and the fraction of visible keys each query read,
    `[batch, n, heads]`.
  """
  if tree.max_nodes is not None and q_rot.shape[1] == 1:  # one decode token: only the candidate lists are read
    keys, layer = _in_place(cache.keys)
    bias, _ = _in_place(cache.bias)
    (k, v), _ = _in_place((cache.store.k, cache.store.v))
    out, fraction = zha_ops.zha_decode(
      q_rot[:, 0], positions[:, 0], keys, bias, k, v, tree=tree, layer=layer, impl=impl
    )
    return out[:, None].astype(q_rot.dtype), fraction[:, None]
  dtype = q_rot.dtype
  nodes = [(read(keys).astype(dtype), read(bias).astype(dtype)) for keys, bias in zip(cache.keys, cache.bias)]
  out, fraction = zha_ref.routed_attention(
    q_rot,
    positions,
    nodes,
    read(cache.store.k).astype(dtype),
    read(cache.store.v).astype(dtype),
    read(cache.store.pos),
    chunk=tree.chunk,
    top_p=tree.level_top_p,
    max_nodes=tree.max_nodes,
  )
  return out.astype(dtype), fraction


def write(cache: ZHACache, k, v, positions, valid, ref_queries, *, tree: ZHATree, rope_theta):
  """The cache with a chunk's rotated keys, its values and every node it completes (`zha_cache.extend`).

  Args:
    k, v: `[batch, n, kv_heads, d]` unrotated projections at `positions` `[batch, n]`; valid: `[batch, n]` (right
      padding is not cached); ref_queries: `[kv_heads, R, d]`.
  """
  dtype = compute_dtype(k.dtype)
  k_rot = zha_ref.rotate(k.astype(dtype), positions, rope_theta)
  return zha_cache.extend(
    cache, k_rot, v.astype(dtype), positions, valid, ref_queries.astype(dtype), tree=tree, rope_theta=rope_theta
  )


def step(cache: ZHACache, q, k, v, positions, valid, ref_queries, *, tree: ZHATree, rope_theta, impl="reference"):
  """One cached ZHA step: rotate, extend the cache with the chunk, attend.

  Args:
    q: `[batch, n, heads, d]`, k, v: `[batch, n, kv_heads, d]` unrotated projections of a chunk at `positions`
      `[batch, n]`; valid: `[batch, n]` (right padding is not cached).
    ref_queries: `[kv_heads, R, d]`.
    tree, impl: as `attend`; rope_theta: RoPE base θ or a `fsjax.reference.rope.RoPE` (None: NoPE).

  Returns:
    outputs `[batch, n, heads, d]` in q's compute dtype (at least float32), the attended fraction
    `[batch, n, heads]`, and the extended cache.
  """
  q_rot = zha_ref.rotate(q.astype(compute_dtype(q.dtype)), positions, rope_theta)
  cache = write(cache, k, v, positions, valid, ref_queries, tree=tree, rope_theta=rope_theta)
  out, fraction = attend(cache, q_rot, positions, tree=tree, impl=impl)
  return out, fraction, cache
