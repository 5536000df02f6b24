"""ZHA (ZHA Sec. III): a tree of compressed key summaries built with learned reference queries (III-A), top-p
routing level by level (III-C), exact attention over the reached keys, and the KL distillation loss (III-B).

Geometry (DESIGN §5): chunk `C`, `L` levels, `R` reference queries per tree shared by every node and level.
Key 0 is left out of the tree and always read, so level-ℓ node `m` covers keys `[1 + m C^ℓ, 1 + (m+1) C^ℓ)`
and is *complete* for the query at position `i` when its last key `(m+1) C^ℓ <= i` (a query's own key is in
the cache when it attends). Only nodes whose keys all lie inside the sequence exist.

Per reference query `r` a node holds a tangent of its log attention mass `F(q) = LSE_j(q·k_j/√d)`:
`k̂_r = Σ_j softmax_j(e_j) k_j`, `b̂_r = LSE_j(e_j) − q̂_r·k̂_r/√d` with `e_j = q̂_r·k_j/√d` over its C children
(raw keys at level 1; at higher levels the children's `k̂_r` with `e_j = q̂_r·k̂_{r,j}/√d + b̂_{r,j}`). The node
score of a query is `s(q) = max_r (q·k̂_r/√d + b̂_r)`.

RoPE (`rope_theta` not None): queries and keys are rotated to their positions and every node rotates the
reference queries to its own last key position. The merge formula above, evaluated with the parent's rotated
`q̂_{r,P}`, equals the child's tangent at the child's query plus the III-B correction
`⟨k̂_{r,c}, q̂_{r,P} − q̂_{r,c}⟩/√d`, so one formula serves both cases; without RoPE it reproduces the summary
computed directly from the raw keys.

Grouped-query attention (III-A, III-B, III-C): one tree per key/value head, built with that head's own R
reference queries (`[kv_heads, R, d]`) and shared by the `group = heads // kv_heads` query heads that read it
(query head h reads key/value head `h // group`, `fsjax.reference.grouped`). Routing and the attention mask stay
per query head: each query head scores its key/value head's tree, descends it with its own top-p selections and
attends over its own reached keys. Node scores fold each key/value head's query heads into the query axis
(`grouped_logits`' fold), so with `kv_heads == heads` every product is the multi-head one, operation for operation.

Readings fixed here (DESIGN §5): ties in the top-p order go to the lower node index; `p >= 1` selects every
candidate; a non-empty candidate set always yields at least one node; `top_p` may be one value for every level
or one per level, level 1 (the raw-key chunks) first.

`max_nodes` (ours, not the paper's; None = the paper's routing) caps the nodes a query keeps per level at the
highest-scoring `max_nodes` of its top-p prefix. It gives decode static sizes (`fsjax.reference.zha_decode`
gathers candidate lists instead of scoring every node) and is part of the operator, so the reference, the decode
step and its kernels agree exactly with or without it.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from fsjax.reference.common import PRECISION, compute_dtype
from fsjax.reference.grouped import check_grouped_qkv, group_size, grouped_logits, grouped_readout
from fsjax.reference.rope import apply_rope
from fsjax.reference.softmax import masked_softmax


def level_top_p(top_p, levels):
  """`top_p` as a tuple of one threshold per level (level 1 first); a scalar applies to every level."""
  values = tuple(top_p) if isinstance(top_p, (tuple, list)) else (top_p,)
  return values * levels if len(values) == 1 else values


def validate_zha(*, chunk, levels, top_p, refs=1, max_nodes=None, prefix=""):
  """Raises ValueError naming the first argument that breaks a ZHA geometry rule (`prefix` as in configs)."""
  if max_nodes is not None and max_nodes < 1:
    raise ValueError(f"{prefix}max_nodes must be >= 1 or null (no cap), got {max_nodes}")
  if chunk < 2:
    raise ValueError(f"{prefix}chunk must be >= 2, got {chunk}")
  for name, value in (("levels", levels), ("refs", refs)):
    if value < 1:
      raise ValueError(f"{prefix}{name} must be >= 1, got {value}")
  values = tuple(top_p) if isinstance(top_p, (tuple, list)) else (top_p,)
  if len(values) not in (1, levels):
    raise ValueError(f"{prefix}top_p must hold one value or one per level ({levels}), got {len(values)}")
  if any(not p > 0 for p in values):
    raise ValueError(f"{prefix}top_p values must be > 0 (>= 1 selects everything), got {values}")


@dataclasses.dataclass(frozen=True)
class ZHATree:
  """A ZHA tree's geometry and routing as one frozen, hashable object (built by `ZHAConfig.tree`).

  Attributes:
    refs: reference queries R per tree (one tree per key/value head).
    chunk: C, children per node and keys per leaf.
    levels: L.
    top_p: routing threshold, one value or one per level (level 1 first).
    max_nodes: per-level cap on the nodes a query keeps (ours; None = the paper's routing).
  """

  refs: int = 16
  chunk: int = 8
  levels: int = 2
  top_p: tuple = (0.9,)
  max_nodes: int | None = None

  def validate(self, prefix=""):
    """Raises ValueError naming the first field that breaks a rule; returns self."""
    validate_zha(
      chunk=self.chunk, levels=self.levels, top_p=self.top_p, refs=self.refs, max_nodes=self.max_nodes, prefix=prefix
    )
    return self

  @property
  def level_top_p(self):
    """One threshold per level, level 1 first."""
    return level_top_p(self.top_p, self.levels)


def node_count(seq, chunk, level):
  """Level-`level` nodes whose keys all lie in `[1, seq)`: `(seq - 1) // chunk**level`."""
  return max(seq - 1, 0) // chunk**level


def node_last_key(index, chunk, level):
  """Position of the last key of level-`level` node `index` (any int array): `(index + 1) C^ℓ`."""
  return (index + 1) * chunk**level


def rotate(x, positions, rope_theta):
  """`x` `[batch, seq, heads, d]` rotated to `positions`; unchanged when `rope_theta` is None (NoPE)."""
  return x if rope_theta is None else apply_rope(x, positions, rope_theta)


def rotated_refs(ref_queries, positions, rope_theta, dtype):
  """Reference queries rotated to node positions.

  Args:
    ref_queries: `[kv_heads, R, d]`.
    positions: `[batch, N]` int last-key positions of the nodes.

  Returns:
    `[batch, N, kv_heads, R, d]` in `dtype`.
  """
  heads, refs, dim = ref_queries.shape
  batch, count = positions.shape
  flat = jnp.broadcast_to(ref_queries.astype(dtype).reshape(1, 1, heads * refs, dim), (batch, count, heads * refs, dim))
  return rotate(flat, positions, rope_theta).reshape(batch, count, heads, refs, dim)


def summarize(refs, children, child_bias=None):
  """Node tangents from their C children, for every reference query (ZHA III-A).

  Args:
    refs: `[batch, N, kv_heads, R, d]` reference queries rotated to each node's last key.
    children: raw keys `[batch, N, C, kv_heads, d]` (level 1) or child tangents `[batch, N, C, kv_heads, R, d]`.
    child_bias: None (level 1) or the children's biases `[batch, N, C, kv_heads, R]`.

  Returns:
    keys `[batch, N, kv_heads, R, d]` (`k̂`) and bias `[batch, N, kv_heads, R]` (`b̂`).
  """
  scale = 1.0 / math.sqrt(refs.shape[-1])
  if child_bias is None:
    scores = jnp.einsum("bnhrd,bnchd->bnchr", refs, children, precision=PRECISION) * scale
    weights = jax.nn.softmax(scores, axis=2)
    keys = jnp.einsum("bnchr,bnchd->bnhrd", weights, children, precision=PRECISION)
  else:
    scores = jnp.einsum("bnhrd,bnchrd->bnchr", refs, children, precision=PRECISION) * scale + child_bias
    weights = jax.nn.softmax(scores, axis=2)
    keys = jnp.einsum("bnchr,bnchrd->bnhrd", weights, children, precision=PRECISION)
  own = jnp.einsum("bnhrd,bnhrd->bnhr", refs, keys, precision=PRECISION) * scale
  return keys, jax.nn.logsumexp(scores, axis=2) - own


def build_tree(k, ref_queries, *, chunk, levels, rope_theta=None):
  """Every node of every level over one sequence of keys: one tree per key/value head.

  Args:
    k: `[batch, T, kv_heads, d]` keys as attention sees them (already rotated for RoPE models).
    ref_queries: `[kv_heads, R, d]`.

  Returns:
    list over levels 1..L of (keys `[batch, N_ℓ, kv_heads, R, d]`, bias `[batch, N_ℓ, kv_heads, R]`),
    `N_ℓ = node_count(T, chunk, ℓ)` (possibly 0).
  """
  batch, seq, heads, dim = k.shape
  tree, children, child_bias = [], k[:, 1:], None
  for level in range(1, levels + 1):
    count = node_count(seq, chunk, level)
    children = children[:, : count * chunk].reshape(batch, count, chunk, *children.shape[2:])
    if child_bias is not None:
      child_bias = child_bias[:, : count * chunk].reshape(batch, count, chunk, *child_bias.shape[2:])
    positions = node_last_key(jnp.arange(count), chunk, level)[None]
    refs = rotated_refs(ref_queries, positions, rope_theta, k.dtype)
    children, child_bias = summarize(refs, children, child_bias)
    tree.append((children, child_bias))
  return tree


def node_scores(q, keys, bias):
  """`s(q) = max_r (q·k̂_r/√d + b̂_r)` (ZHA III-A) of every query head over its key/value head's tree.

  Args:
    q: `[batch, T, heads, d]`; keys `[batch, N, kv_heads, R, d]`, bias `[batch, N, kv_heads, R]`: one level.

  Returns:
    `[batch, heads, T, N]`.
  """
  batch, seq, heads, dim = q.shape
  kv_heads = keys.shape[2]
  group = group_size(heads, kv_heads)
  # Each key/value head's query heads ride on the query axis (`[batch, group · T, kv_heads, d]`), as in
  # `grouped_logits`: the tree is read once per key/value head, and group 1 is the multi-head einsum.
  folded = jnp.moveaxis(q.reshape(batch, seq, kv_heads, group, dim), 3, 1).reshape(batch, group * seq, kv_heads, dim)
  tangents = jnp.einsum("bthd,bnhrd->bhtnr", folded, keys, precision=PRECISION) / math.sqrt(dim)
  scores = jnp.max(tangents + jnp.moveaxis(bias, 1, 2)[:, :, None], axis=-1)  # [batch, kv_heads, group · T, N]
  return scores.reshape(batch, heads, seq, keys.shape[1])


def complete_nodes(q_pos, count, chunk, level):
  """`[batch, 1, T, count]` bool: node m is complete for the query at `q_pos` `[batch, T]`."""
  return (node_last_key(jnp.arange(count), chunk, level) <= q_pos[..., None])[:, None]


def top_p_select(scores, candidates, p, max_nodes=None):
  """The smallest score-sorted prefix of the candidates holding at least mass `p` of their softmax (III-C).

  Args:
    scores: `[..., N]` node scores; candidates: bool, broadcastable to `scores`.
    p: threshold; `p >= 1` selects every candidate.
    max_nodes: keep at most this many (the first of the prefix); None = no cap.

  Returns:
    bool `[..., N]`. A node is kept when the mass ranked strictly before it is below `p`, so the best candidate
    is always kept; ties rank the lower index first.
  """
  candidates = jnp.broadcast_to(candidates, scores.shape)
  if (p >= 1 and max_nodes is None) or scores.shape[-1] == 0:
    return candidates
  masked = jnp.where(candidates, scores, -jnp.inf)
  order = jnp.argsort(-masked, axis=-1, stable=True)
  ranked = jnp.take_along_axis(masked, order, axis=-1)
  top = jnp.max(ranked[..., :1], axis=-1, keepdims=True)
  weights = jnp.where(jnp.isfinite(ranked), jnp.exp(ranked - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  before = jnp.cumsum(weights, axis=-1) - weights
  keep_ranked = jnp.isfinite(ranked)
  if p < 1:
    keep_ranked &= before < p * jnp.sum(weights, axis=-1, keepdims=True)
  if max_nodes is not None:
    keep_ranked &= jnp.arange(scores.shape[-1]) < max_nodes
  return jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)


def route(level_scores, q_pos, *, chunk, top_p, max_nodes=None):
  """Top-p descent through the tree (ZHA III-C): which level-1 nodes (raw-key chunks) each query reaches.

  Args:
    level_scores: list over levels 1..L of `[batch, heads, T, N_ℓ]` node scores. `N_ℓ` may exceed the nodes
      that exist for these queries (a cache's capacity): incomplete nodes are never candidates.
    q_pos: `[batch, T]` query positions.
    top_p: one threshold per level, level 1 first (see `level_top_p`).
    max_nodes: per-level cap on kept nodes (None = none).

  Returns:
    `[batch, heads, T, N_1]` bool: the selected leaves `S_1(q)`.
  """
  levels = len(level_scores)
  candidates = complete_nodes(q_pos, level_scores[-1].shape[-1], chunk, levels)  # A_L = U_L
  for level in range(levels, 0, -1):
    selected = top_p_select(level_scores[level - 1], candidates, top_p[level - 1], max_nodes)
    if level == 1:
      return selected
    below = level_scores[level - 2].shape[-1]
    parent = jnp.arange(below) // chunk
    has_parent = parent < selected.shape[-1]
    from_parent = jnp.zeros(selected.shape[:-1] + (below,), bool)
    if selected.shape[-1]:
      from_parent = jnp.take(selected, jnp.minimum(parent, selected.shape[-1] - 1), axis=-1) & has_parent
    parent_complete = has_parent & (node_last_key(parent, chunk, level) <= q_pos[..., None])[:, None]
    parentless = complete_nodes(q_pos, below, chunk, level - 1) & ~parent_complete
    candidates = from_parent | parentless  # A_{ℓ-1} = ch(S_ℓ) ∪ U_{ℓ-1}


def key_mask(leaves, q_pos, k_pos, chunk):
  """The index set `I(q) = {0} ∪ keys of the selected leaves ∪ the current chunk` (ZHA III-C) as a mask.

  Args:
    leaves: `[batch, heads, T, N_1]` selected level-1 nodes.
    q_pos: `[batch, T]`; k_pos: `[batch, S]` key positions (-1 = empty slot).

  Returns:
    `[batch, heads, T, S]` bool, only ever true for visible keys (`0 <= k_pos <= q_pos`).
  """
  node = (k_pos - 1) // chunk  # [batch, S]
  in_tree = (k_pos >= 1) & (node < leaves.shape[-1])
  index = jnp.broadcast_to(
    jnp.clip(node, 0, max(leaves.shape[-1] - 1, 0))[:, None, None], leaves.shape[:-1] + node.shape[-1:]
  )
  in_leaf = (jnp.take_along_axis(leaves, index, axis=-1) if leaves.shape[-1] else False) & in_tree[:, None, None]
  q, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
  current = kp >= 1 + chunk * (q // chunk)
  return (in_leaf | current | (kp == 0)) & (kp >= 0) & (kp <= q)


def routed_attention(q, q_pos, nodes, k, v, k_pos, *, chunk, top_p, max_nodes=None):
  """Attention of queries over the keys the tree routes them to (ZHA III-C): the training form over a whole
  sequence and a decode cache's chunk step both read their keys through this.

  Args:
    q: `[batch, T, heads, d]` queries as attention sees them (rotated for RoPE models) at `q_pos` `[batch, T]`.
    nodes: list over levels 1..L of (keys `[batch, N_ℓ, kv_heads, R, d]`, bias `[batch, N_ℓ, kv_heads, R]`) in q's
      dtype (`build_tree`'s output, or a cache's levels); `N_ℓ` may exceed the nodes complete for these queries.
    k, v: `[batch, S, kv_heads, d]` keys (as attention sees them) and values at `k_pos` `[batch, S]` (-1 = empty);
      query head h reads key/value head `h // (heads // kv_heads)`.
    top_p: one threshold per level, level 1 first; max_nodes: per-level cap (None = none).

  Returns:
    `[batch, T, heads, d]` in q's dtype and the fraction of visible keys each query reads, `[batch, T, heads]`.
  """
  leaves = route([node_scores(q, *level) for level in nodes], q_pos, chunk=chunk, top_p=top_p, max_nodes=max_nodes)
  mask = key_mask(leaves, q_pos, k_pos, chunk)
  logits = grouped_logits(q, k) / math.sqrt(q.shape[-1])
  out = grouped_readout(masked_softmax(logits, mask), v)
  return out, jnp.moveaxis(jnp.sum(mask, axis=-1) / (q_pos[:, None] + 1), 1, 2)


def check_ref_queries(ref_queries, k):
  """Raises ValueError unless `ref_queries` is `[kv_heads, R, d]` for keys `k` `[batch, T, kv_heads, d]`."""
  kv_heads, dim = k.shape[2:]
  if ref_queries.ndim != 3 or ref_queries.shape[::2] != (kv_heads, dim):
    raise ValueError(f"ref_queries must be [kv_heads={kv_heads}, R, head_dim={dim}], got {ref_queries.shape}")


def zha_attention(
  q, k, v, ref_queries, *, chunk, levels, top_p, rope_theta=None, max_nodes=None, return_fraction=False
):
  """Causal attention restricted to the keys each query reaches through the ZHA tree (ZHA III).

  Args:
    q: `[batch, T, heads, d]`; k, v: `[batch, T, kv_heads, d]` (`kv_heads` dividing `heads`), unrotated.
    ref_queries: `[kv_heads, R, d]` learned reference queries, one set per tree (key/value head).
    chunk, levels: tree geometry C and L.
    top_p: routing threshold, one value or one per level (level 1 first).
    rope_theta: RoPE base θ or a `fsjax.reference.rope.RoPE`, or None for a NoPE model.
    max_nodes: per-level cap on the nodes a query keeps (None = the paper's uncapped routing).
    return_fraction: also return the fraction of visible keys each query attends, `[batch, T, heads]`.

  Returns:
    `[batch, T, heads, d]` in the dtype of `q` (and the fraction).
  """
  check_grouped_qkv(q, k, v)
  validate_zha(chunk=chunk, levels=levels, top_p=top_p, refs=ref_queries.shape[1], max_nodes=max_nodes)
  check_ref_queries(ref_queries, k)
  batch, seq, _, _ = q.shape
  dtype = compute_dtype(q.dtype)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  q_rot = rotate(q.astype(dtype), positions, rope_theta)
  k_rot = rotate(k.astype(dtype), positions, rope_theta)
  nodes = build_tree(k_rot, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta)
  out, fraction = routed_attention(
    q_rot,
    positions,
    nodes,
    k_rot,
    v.astype(dtype),
    positions,
    chunk=chunk,
    top_p=level_top_p(top_p, levels),
    max_nodes=max_nodes,
  )
  out = out.astype(q.dtype)
  return (out, fraction) if return_fraction else out


def zha_kl_per_level(q, k, ref_queries, *, chunk, levels, rope_theta=None):
  """ZHA III-B distillation loss of each level: `[levels]`, summed by `zha_kl_loss`.

  For level ℓ the keys visible to query `i` are split into key 0, the complete level-ℓ nodes and the remainder
  (keys after the last complete node, the incomplete current chunk). Target: the dense attention mass on each
  part. Prediction: softmax over the parts of the node scores, with key 0 and the remainder scored by their
  exact log masses (footnote 4). `KL(target ‖ prediction)` is averaged over batch, query heads and the queries
  with at least one complete node at that level (a level with none contributes 0). q and k carry no gradient.

  q: `[batch, T, heads, d]`, k: `[batch, T, kv_heads, d]` unrotated; ref_queries: `[kv_heads, R, d]`. With
  grouped heads the target is each query head's dense attention over its key/value head, the prediction its
  scores over that head's tree.
  """
  check_grouped_qkv(q, k, k)
  check_ref_queries(ref_queries, k)
  batch, seq, heads, dim = q.shape
  dtype = compute_dtype(q.dtype)
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  q_rot = jax.lax.stop_gradient(rotate(q.astype(dtype), positions, rope_theta))
  k_rot = jax.lax.stop_gradient(rotate(k.astype(dtype), positions, rope_theta))
  tree = build_tree(k_rot, ref_queries.astype(dtype), chunk=chunk, levels=levels, rope_theta=rope_theta)
  return mean_query_kl(summed_query_kl(q_rot, k_rot, tree, jnp.arange(seq), chunk=chunk), batch, heads, seq, chunk)


def mean_query_kl(sums, batch, heads, seq, chunk):
  """`summed_query_kl`'s `[levels]` sums over all `seq` queries as means over batch, query heads and the queries
  that count at each level (those at or past its first complete node; a level with none gives 0)."""
  eligible = jnp.asarray([max(seq - chunk**level, 0) for level in range(1, sums.shape[0] + 1)], sums.dtype)
  return sums / (batch * heads * jnp.maximum(eligible, 1.0))


def summed_query_kl(q_rot, k_rot, tree, positions, *, chunk):
  """Each level's KL (see `zha_kl_per_level`) of a set of queries, summed over batch, query heads and the queries
  with at least one complete node at that level: `[levels]`, the numerators of the per-level means.

  Args:
    q_rot: `[batch, Tq, heads, d]` rotated queries at `positions` `[Tq]` (int; one at or past the last key is
      padding and weighs nothing).
    k_rot: `[batch, T, kv_heads, d]` rotated keys; tree: `build_tree` of them.
  """
  seq = k_rot.shape[1]
  logits = grouped_logits(q_rot, k_rot) / math.sqrt(q_rot.shape[-1])  # [batch, heads, Tq, T]
  attention = masked_softmax(logits, jnp.arange(seq)[None, :] <= positions[:, None])
  sums = []
  for level, node in enumerate(tree, start=1):
    if node[0].shape[1] == 0:
      sums.append(jnp.zeros((), q_rot.dtype))
      continue
    kl = _query_level_kl(q_rot, logits, attention, node, positions, chunk=chunk, level=level)  # [batch, heads, Tq]
    eligible = ((positions >= chunk**level) & (positions < seq)).astype(q_rot.dtype)
    sums.append(jnp.sum(kl * eligible))
  return jnp.stack(sums)


def _query_level_kl(q_rot, logits, attention, node, positions, *, chunk, level):
  """`KL(target ‖ prediction)` of each query at one level (`summed_query_kl`): `[batch, heads, Tq]`.

  Args:
    q_rot: `[batch, Tq, heads, d]` rotated queries at `positions` `[Tq]` (int; a position past the last key sees
      every key).
    logits, attention: `[batch, heads, Tq, T]` the queries' scaled logits over all T keys and their causal softmax.
    node: one level's `(keys [batch, N, kv_heads, R, d], bias [batch, N, kv_heads, R])`, N ≥ 1.
  """
  batch, heads, queries, seq = logits.shape
  span, count = chunk**level, node[0].shape[1]
  i, j = positions[:, None], jnp.arange(seq)[None, :]
  complete = complete_nodes(jnp.broadcast_to(positions, (batch, queries)), count, chunk, level)  # [batch, 1, Tq, N]
  node_mass = attention[..., 1 : 1 + count * span].reshape(batch, heads, queries, count, span).sum(-1)
  remainder = (j >= 1 + span * (i // span)) & (j <= i)  # [Tq, T]
  target = jnp.concatenate(
    [
      attention[..., :1],
      jnp.where(complete, node_mass, 0.0),
      jnp.sum(jnp.where(remainder, attention, 0.0), -1, keepdims=True),
    ],
    axis=-1,
  )
  scores = jnp.where(complete, node_scores(q_rot, *node), -jnp.inf)
  predicted = jnp.concatenate(
    [logits[..., :1], scores, jax.nn.logsumexp(jnp.where(remainder, logits, -jnp.inf), -1, keepdims=True)], axis=-1
  )
  log_predicted = jax.nn.log_softmax(predicted, axis=-1)
  return jnp.sum(
    jnp.where(target > 0, target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_predicted), 0.0), axis=-1
  )


def zha_kl_loss(q, k, ref_queries, *, chunk, levels, rope_theta=None):
  """`L_KL = Σ_ℓ E_q[KL(p_ℓ(q) ‖ p̂_ℓ(q))]` for one layer (ZHA III-B); see `zha_kl_per_level`. Scalar."""
  return jnp.sum(zha_kl_per_level(q, k, ref_queries, chunk=chunk, levels=levels, rope_theta=rope_theta))
