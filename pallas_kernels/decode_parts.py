"""What the one-token decode kernels share (`pallas_kernels.bounded_decode` for FS-L, `archive_decode` for FS and
FS-B, `store_decode` for the baselines): a softmax split into parts over programs, the local branch's part over
one ring tile (Eq. 3-4), and the launches that merge the parts (and, for FreeSolo, mix the branches: Eq. 2, 9).

A step's attention launch has a grid (batch row, query head, part) so that a batch of one row still fills the GPU.
Each part writes its softmax normalized over its own keys and their log-sum-exp; `mix_branches` (one program per
row and head) combines them exactly into the local output and the long-range sum, applies the readout RMSNorm and
mixes the branches, reading α and the gain where they lie: in XLA that merge was a fusion that took no fused
slice of the parameter stacks, so each step copied α and the gain out first. No matrix product has 16 rows here
(one query), so the dot products are elementwise products and sums in float32.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

RING_TILE = 128  # ring slots per local-branch part (one program each)


def softmax_part(logits, seen, values, o_ref, lse_ref):
  """One part of a softmax over keys split across programs: writes the part's normalized output `[d]` and its
  log-sum-exp (-inf where it saw no key), which `mix_branches` combines exactly, and returns the log-sum-exp."""
  m = jnp.max(jnp.where(seen, logits, -jnp.inf))
  shift = jnp.where(m > -jnp.inf, m, 0.0)
  p = jnp.where(seen, jnp.exp(logits - shift), 0.0)
  total = jnp.sum(p)
  o_ref[...] = jnp.where(total > 0, jnp.sum(p[:, None] * values, axis=0) / jnp.where(total > 0, total, 1.0), 0.0)
  lse = jnp.where(total > 0, shift + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  lse_ref[...] = jnp.full(lse_ref.shape, lse)
  return lse


def ring_part(tile, q_rot, token, pos, valid, layer, scale, ring_refs, out_refs, *, window, ring_slots):
  """The local branch (Eq. 3-4) over ring tile `tile`: keys at j <= pos with pos - j <= window (the ring holds
  position j at slot j mod R). `token`: the token's rotated key and value `[d]` (float32 of the cache's dtype),
  taken in place of slot `pos mod R` for a valid row. ring_refs: the ring's k, v and pos; out_refs: o and lse."""
  ring_k_ref, ring_v_ref, ring_pos_ref = ring_refs
  slots = tile * RING_TILE + jnp.arange(RING_TILE)
  at = jnp.minimum(slots, ring_slots - 1)
  mine = valid & (slots == pos % ring_slots)
  k_pos = jnp.where(mine, pos, ring_pos_ref[layer, at])
  seen = (slots < ring_slots) & (k_pos >= 0) & (k_pos <= pos) & (pos - k_pos <= window)
  k_new, v_new = token
  k = jnp.where(mine[:, None], k_new[None, :], ring_k_ref[layer, at, :].astype(jnp.float32))  # [T, d]
  v = jnp.where(mine[:, None], v_new[None, :], ring_v_ref[layer, at, :].astype(jnp.float32))
  logits = jnp.sum(k * q_rot[None, :], axis=1) * scale
  softmax_part(logits, seen, v, *out_refs)


def _merged(o, lse, mask):
  """The softmax over the keys of the parts where `mask` `[P]` holds, from their outputs `o [P, d]` (each normalized
  over its own keys) and log-sum-exps `lse [P]`: `[d]`, 0 where no part saw a key. Parts outside `mask` may hold
  anything (the launch leaves the padding parts unwritten)."""
  lse = jnp.where(mask & (lse > -jnp.inf), lse, -jnp.inf)
  top = jnp.max(lse)
  weight = jnp.where(lse > -jnp.inf, jnp.exp(lse - jnp.where(top > -jnp.inf, top, 0.0)), 0.0)
  total = jnp.sum(weight)
  return jnp.sum(weight[:, None] * jnp.where(mask[:, None], o, 0.0), axis=0) / jnp.where(total > 0, total, 1.0)


def _best_parts(score, cell, candidate, top_k):
  """`[P']` bool: the `top_k` candidate parts (`candidate` `[P']`, distinct cells) of highest `score`, the lower
  `cell` first among equal scores (FS Eq. 12's rerank order, `fsjax.reference.forest.token_rerank`); and
  `[P']` int32, each candidate's rank in that order."""
  s = jnp.where(candidate, score, -jnp.inf)
  beats = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (cell[None, :] < cell[:, None]))
  rank = jnp.sum((candidate[None, :] & beats).astype(jnp.int32), axis=1)
  return candidate & (rank < top_k), rank


def _mix_kernel(o_ref, lse_ref, alpha_ref, gain_ref, layer_ref, *refs, tiles, parts, eps, top_k):
  """One (row, query head): o_ref `[P', d]` and lse_ref `[P']` a step's parts (P' ≥ T + K a power of two; the rest
  unwritten); alpha_ref `[layers]` (this head's α), gain_ref `[layers, d]`, read at layer
  `layer_ref[0]`. Writes out_ref `[d]`: local + α · RMSNorm(long-range sum) · gain (Eq. 2, 9), in float32 until
  the final cast, as the reference path computes it. With `top_k` (FS-B's rerank), score_ref and cell_ref `[P']`
  come first among `refs`, each long-range part's Eq. 12 score and cell (−inf for none or a repeat): only the
  `top_k` best parts enter the long-range sum, and chosen_ref `[K']` (after out_ref) receives their cells, best
  first, -1 past the candidates."""
  score_ref, cell_ref, out_ref, chosen_ref = refs if top_k else (None, None, *refs, None)
  layer = layer_ref[0]
  o, lse = o_ref[...], lse_ref[...]
  part = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 0)
  local = _merged(o, lse, part < tiles)
  long_range_parts = (part >= tiles) & (part < parts)
  if top_k:
    score, cell = score_ref[...], cell_ref[...]
    long_range_parts, rank = _best_parts(score, cell, long_range_parts & (score > -jnp.inf), top_k)
    slot = jax.lax.broadcasted_iota(jnp.int32, chosen_ref.shape, 0)
    chosen = jnp.full(chosen_ref.shape, -1, jnp.int32)
    for r in range(top_k):
      chosen = jnp.where(slot == r, jnp.max(jnp.where(long_range_parts & (rank == r), cell, -1)), chosen)
    chosen_ref[...] = chosen
  summed = _merged(o, lse, long_range_parts)
  gain = gain_ref[layer, :].astype(jnp.float32)
  long_range = summed * jax.lax.rsqrt(jnp.sum(summed * summed) / summed.shape[0] + eps) * gain
  out_ref[...] = (local + alpha_ref[layer].astype(jnp.float32) * long_range).astype(out_ref.dtype)


def compilable(*, cell, head_dim):
  """Whether Triton can tile this geometry: a cell's keys and a head's vectors as power-of-two tiles."""
  return cell >= 1 and cell & (cell - 1) == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def token_specs(dim, group):
  """The BlockSpecs of a step launch's (grid (row, query head, part)) per-token operands: a `[batch, heads, d]`
  array as the program's query head's row, a `[batch, kv_heads, d]` one as its key/value head's (`group` query
  heads each), and a `[batch]` one as `[1]` of its row."""
  row = pl.BlockSpec((None, None, dim), lambda b, h, z: (b, h, 0))
  kv_row = pl.BlockSpec((None, None, dim), lambda b, h, z: (b, h // group, 0))
  per_row = pl.BlockSpec((1,), lambda b, h, z: (b,))
  return row, kv_row, per_row


def token_operands(q, q_rot, k_rot, k, v, pos, valid, *, ring_dtype, dtype, group):
  """The token's seven operands of a step's attention launch (grid (row, query head, part)) and their BlockSpecs:
  q and q_rot `[batch, heads, d]` as float32 rows of the program's query head; k_rot (in `ring_dtype`), k and v
  (in `dtype`) `[batch, kv_heads, d]` as rows of its key/value head (`group` query heads each); pos and valid
  `[batch]` as int32 `[1]` of its row."""
  row, kv_row, per_row = token_specs(q.shape[-1], group)
  operands = [q.astype(jnp.float32), q_rot.astype(jnp.float32), k_rot.astype(ring_dtype)]
  operands += [k.astype(dtype), v.astype(dtype), pos.astype(jnp.int32), valid.astype(jnp.int32)]
  return operands, [row, row, kv_row, kv_row, kv_row, per_row, per_row]


@dataclasses.dataclass(frozen=True)
class StepParts:
  """How a step's attention launch splits each (row, query head)'s softmaxes over programs: parts 0 .. `tiles`-1
  the local branch's ring tiles, `tiles` .. `parts`-1 one selected cell each; their outputs are padded to
  `padded` parts (Triton loads power-of-two tiles; the mix masks the rest). `layers`: the stacks' depth, which
  the mix reads α and the gain at."""

  tiles: int
  parts: int
  layers: int

  @classmethod
  def of(cls, *, ring_slots, top_k, layers):
    tiles = -(-ring_slots // RING_TILE)
    return cls(tiles=tiles, parts=tiles + top_k, layers=layers)

  @property
  def padded(self):
    return pl.next_power_of_2(self.parts)

  def outputs(self, batch, heads, dim):
    """The out_specs and out_shapes of the parts' o `[batch, heads, padded, d]` and lse `[batch, heads, padded]`
    (float32), one part per program."""
    specs = [
      pl.BlockSpec((None, None, None, dim), lambda b, h, z: (b, h, z, 0)),
      pl.BlockSpec((None, None, 1), lambda b, h, z: (b, h, z)),
    ]
    shapes = [
      jax.ShapeDtypeStruct((batch, heads, self.padded, dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, self.padded), jnp.float32),
    ]
    return specs, shapes

  def mix(self, o, lse, alpha, gain, layer_index, *, eps, out_dtype, interpret, rerank=None):
    """`mix_branches` of the parts, α `[heads]` and the gain `[d]` broadcast to the layers where not stacks."""
    alpha, gain = (per_layer(x, self.layers) for x in (alpha, gain))
    tiles, parts = self.tiles, self.parts
    return mix_branches(
      o,
      lse,
      alpha,
      gain,
      layer_index,
      tiles=tiles,
      parts=parts,
      eps=eps,
      out_dtype=out_dtype,
      interpret=interpret,
      rerank=rerank,
    )


def mix_branches(o, lse, alpha, gain, layer_index, *, tiles, parts, eps, out_dtype, interpret, rerank=None):
  """The launch that merges a step's parts and mixes the branches: local + α · RMSNorm(long-range sum) · gain.

  Args:
    o, lse: `[batch, heads, P', d]` and `[batch, heads, P']` float32, the parts written by a step's attention
      launch: parts 0 .. `tiles`-1 the local branch's, `tiles` .. `parts`-1 the long-range branch's, the rest
      (to P', a power of two) never written.
    alpha `[layers, heads]`, gain `[layers, d]` (one layer as `[1, ...]`), read at `layer_index` `[1]` int32.
    eps: the readout RMSNorm's ε; out_dtype: the output's dtype.
    rerank: None, or `(score, cell, top_k)`: `[batch, heads, P']` float32 and int32, each long-range part's score
      and cell (−inf for a part that is no candidate), of which only the `top_k` best parts (the lower cell first
      among equal scores) enter the long-range sum.

  Returns:
    `[batch, heads, d]` in `out_dtype`; with `rerank`, also the chosen cells `[batch, heads, top_k]` int32, best
    first, -1 where fewer parts were candidates.
  """
  batch, heads, padded_parts, dim = o.shape
  layers = alpha.shape[0]
  per_part = pl.BlockSpec((None, None, padded_parts), lambda b, h: (b, h, 0))
  score, cell, top_k = rerank or (None, None, None)
  width = pl.next_power_of_2(top_k) if top_k else 0
  out_specs = [pl.BlockSpec((None, None, dim), lambda b, h: (b, h, 0))]
  out_shape = [jax.ShapeDtypeStruct((batch, heads, dim), out_dtype)]
  if top_k:
    out_specs.append(pl.BlockSpec((None, None, width), lambda b, h: (b, h, 0)))
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, width), jnp.int32))
  mixed = pl.pallas_call(
    functools.partial(_mix_kernel, tiles=tiles, parts=parts, eps=eps, top_k=top_k),
    grid=(batch, heads),
    in_specs=[
      pl.BlockSpec((None, None, padded_parts, dim), lambda b, h: (b, h, 0, 0)),
      per_part,
      pl.BlockSpec((layers, None), lambda b, h: (0, h)),
      pl.BlockSpec((layers, dim), lambda b, h: (0, 0)),
      pl.BlockSpec((1,), lambda b, h: (0,)),
      *([per_part, per_part] if top_k else []),
    ],
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    interpret=interpret,
    name="decode_mix_branches",
  )(o, lse, alpha, gain, layer_index, *([score, cell] if top_k else []))
  if top_k:
    return mixed[0], mixed[1][..., :top_k]
  return mixed[0]


def _merge_kernel(o_ref, lse_ref, out_ref, *, parts):
  """One (row, query head): the softmax over every key of parts 0 .. `parts`-1 of o_ref `[P', d]`, lse_ref
  `[P']` (the rest unwritten), into out_ref `[d]`."""
  lse = lse_ref[...]
  part = jax.lax.broadcasted_iota(jnp.int32, lse.shape, 0)
  out_ref[...] = _merged(o_ref[...], lse, part < parts).astype(out_ref.dtype)


def merge_parts(o, lse, *, parts, out_dtype, interpret):
  """The launch that merges a step's parts into one softmax per (row, head), for an attention with one branch.

  Args:
    o, lse: `[batch, heads, P', d]` and `[batch, heads, P']` float32: parts 0 .. `parts`-1 written by a step's
      attention launch, each normalized over its own keys with their log-sum-exp (-inf for none), the rest (to
      P', a power of two) never written.
    out_dtype: the output's dtype.

  Returns:
    `[batch, heads, d]` in `out_dtype`, 0 where no part saw a key.
  """
  batch, heads, padded_parts, dim = o.shape
  return pl.pallas_call(
    functools.partial(_merge_kernel, parts=parts),
    grid=(batch, heads),
    in_specs=[
      pl.BlockSpec((None, None, padded_parts, dim), lambda b, h: (b, h, 0, 0)),
      pl.BlockSpec((None, None, padded_parts), lambda b, h: (b, h, 0)),
    ],
    out_specs=pl.BlockSpec((None, None, dim), lambda b, h: (b, h, 0)),
    out_shape=jax.ShapeDtypeStruct((batch, heads, dim), out_dtype),
    compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    interpret=interpret,
    name="decode_merge_parts",
  )(o, lse)


def per_layer(x, layers):
  """A `[layers, n]` stack as it is, or one layer's `[n]` broadcast to the layers (a kernel reads it at the
  layer index either way)."""
  return x if x.ndim == 2 else jnp.broadcast_to(x, (layers, x.shape[-1]))
