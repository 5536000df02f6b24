"""Grouped-query attention (GQA; Llama 3, Qwen): fewer key/value heads than query heads.

Query head `h` reads key/value head `h // group`, `group = heads // kv_heads`: Hugging Face's `repeat_kv` layout,
and `jax.nn.dot_product_attention`'s. K and V are never repeated per group: each key/value head's queries are
folded into its query axis (`[.., group · Tq, kv_heads, d]`), so one product per key/value head reads each key
and value once, as a decode cache stores them. With `kv_heads == heads` the fold is the identity and the products
are ordinary multi-head attention's, operation for operation.
"""

import jax.numpy as jnp

from fsjax.reference.common import PRECISION


def group_size(heads, kv_heads):
  """Query heads per key/value head; ValueError unless `kv_heads` divides `heads`."""
  if kv_heads <= 0 or heads % kv_heads:
    raise ValueError(f"key/value heads ({kv_heads}) must divide the query heads ({heads})")
  return heads // kv_heads


def check_grouped_qkv(q, k, v):
  """Raises ValueError unless q is `[batch, seq, heads, head_dim]` and k, v are equal
  `[batch, seq, kv_heads, head_dim]` with `kv_heads` dividing `heads`."""
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, seq, heads, head_dim], got shape {q.shape}")
  if k.shape != v.shape or k.ndim != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
    raise ValueError(f"k, v must be equal [batch, seq, kv_heads, head_dim] for q {q.shape}, got {k.shape}, {v.shape}")
  group_size(q.shape[2], k.shape[2])


def grouped_logits(q, k):
  """`q · k` per query head over the key/value head it reads (unscaled).

  Args:
    q: `[..., Tq, heads, d]`; k: `[..., Tk, kv_heads, d]` (the same leading axes).

  Returns:
    `[..., heads, Tq, Tk]`.
  """
  *lead, seq, heads, dim = q.shape
  kv_heads = k.shape[-2]
  group = group_size(heads, kv_heads)
  folded = jnp.moveaxis(q.reshape(*lead, seq, kv_heads, group, dim), -2, -4).reshape(*lead, group * seq, kv_heads, dim)
  logits = jnp.einsum("...qhd,...khd->...hqk", folded, k, precision=PRECISION)  # [..., kv_heads, group · Tq, Tk]
  return logits.reshape(*lead, heads, seq, k.shape[-3])


def grouped_readout(probs, v):
  """`Σ_k probs v` per query head over the key/value head it reads.

  Args:
    probs: `[..., heads, Tq, Tk]`; v: `[..., Tk, kv_heads, d]` (the same leading axes).

  Returns:
    `[..., Tq, heads, d]`.
  """
  *lead, heads, seq, keys = probs.shape
  kv_heads, dim = v.shape[-2:]
  group = group_size(heads, kv_heads)
  folded = probs.reshape(*lead, kv_heads, group * seq, keys)
  out = jnp.einsum("...hqk,...khd->...qhd", folded, v, precision=PRECISION)  # [..., group · Tq, kv_heads, d]
  return jnp.moveaxis(out.reshape(*lead, group, seq, kv_heads, dim), -4, -2).reshape(*lead, seq, heads, dim)


def kv_head_of(heads, kv_heads):
  """`[heads]` int32: the key/value head each query head reads, `h // group`."""
  return jnp.arange(heads, dtype=jnp.int32) // group_size(heads, kv_heads)


def per_query_head(x, heads, axis):
  """`x` with its key/value-head axis `axis` read once per query head (`h // group`): `x` itself when there are
  as many key/value heads as query heads. For small per-cell state (summaries, availability), never K or V."""
  if x.shape[axis] == heads:
    return x
  return jnp.take(x, kv_head_of(heads, x.shape[axis]), axis=axis)


def fold_group(x, kv_heads, axis=1):
  """Per-query-head `x` `[batch, T, heads, ...]` (`axis` = 1, the query axis; heads at `axis + 1`) as
  `[batch, T · group, kv_heads, ...]`: each key/value head's query heads folded into the query axis,
  position-major (row `t · group + j` is query head `kv · group + j` at t). Exact (a reshape and a transpose)."""
  heads = x.shape[axis + 1]
  group = group_size(heads, kv_heads)
  if group == 1:
    return x
  lead, seq, rest = x.shape[:axis], x.shape[axis], x.shape[axis + 2 :]
  split = x.reshape(*lead, seq, kv_heads, group, *rest)
  return jnp.moveaxis(split, axis + 2, axis + 1).reshape(*lead, seq * group, kv_heads, *rest)


def unfold_group(x, heads, axis=1):
  """The inverse of `fold_group`: `[batch, T · group, kv_heads, ...]` → `[batch, T, heads, ...]`."""
  kv_heads = x.shape[axis + 1]
  group = group_size(heads, kv_heads)
  if group == 1:
    return x
  lead, rest = x.shape[:axis], x.shape[axis + 2 :]
  split = x.reshape(*lead, x.shape[axis] // group, group, kv_heads, *rest)
  return jnp.moveaxis(split, axis + 1, axis + 2).reshape(*lead, x.shape[axis] // group, heads, *rest)
