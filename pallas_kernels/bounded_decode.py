"""FS-L's attention for one decode token over its bounded cache (FS Sec. 3.3 "Inference", Eq. 3-4 and 7-9) in one
launch per layer, which also writes the token into the cache. The grid is (batch row, query head, part), T + K
parts per head, so that a batch of one row still fills the GPU (each part is a short chain of loads; one program
walking them all is latency-bound):

  - parts 0 .. T-1: the local branch (Eq. 3-4) over one ring tile each, the token in its slot;
  - parts T .. T+K-1: each scores `pool ∪ recent` (Eq. 7-8, empties skipped), finds the top K by (score desc,
    cell index asc) as `lax.top_k` over the candidates sorted by cell index gives it, and reads out (Eq. 9) the
    one selected cell of its rank from the pool or recent slot where it lies. A recent cell that is also in the
    pool has the same index, score and keys in both lists: each pick takes a cell index and retires it from
    both, so the union needs no deduplication. The K parts repeat the scoring (a few KB, from L2) rather than
    wait for one another.

Each part writes its softmax normalized over its own keys and their log-sum-exp; a second launch merges them and
mixes the branches (`pallas_kernels.decode_parts.mix_branches`, shared with FS's step). The jnp specification is
`fsjax.attention.freesolo_step.bounded_segment`: `attend` over the ring and the token, `bounded_long_range`,
`mix_branches`, and the ring and block-buffer writes of `bounded.write_segment`.

The token's writes (its rotated key, value and position into ring slot `pos mod R`, its raw key and value into
block-buffer slot `pos mod B`) happen here, in place (the cache arrays are aliased to outputs): part 0 of the
first query head of each key/value head writes them. In XLA each write was a launch or two per array (a
dropped-index scatter reads the old slot, then writes). The ring parts do not read the token back from the ring,
which other programs write concurrently: the ring slot `pos mod R` held position `pos - R`, outside the window,
and they take the token from their inputs in its place.

The cache arrays are read where they lie: a scanned model's stacks `[layers, batch, ...]` with the layer index,
so no layer is copied out per token (`fsjax.cache.layered`). Grouped-query attention: query head h reads the
state of key/value head `h // group` through its index maps.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import default_interpret, erf, group_size, layer_stack
from pallas_kernels.decode_parts import StepParts, per_layer, ring_part, softmax_part, token_operands

NO_CELL = -1


def _cell_part(
  rank, q, pos, lam, sigma, layer, scale, cell_refs, o_ref, lse_ref, cells_ref, *, cell, top_k, pool_size, recent_size
):
  """The long-range branch's part for the `rank`-th selected cell: scores of pool ∪ recent (Eq. 7-8, empties
  skipped), the top K by (score desc, cell index asc), then the readout (Eq. 9) over that one cell's s keys,
  gathered from its pool or recent slot. Every cell part finds the same K and writes them all to cells_ref."""

  def scores(ids, mean, norm):
    content = jnp.sum(mean * q[None, :], axis=1) * scale
    distance = pos.astype(jnp.float32) - (ids.astype(jnp.float32) + 0.5) * cell
    return jnp.where(ids >= 0, content + lam * norm * erf(distance / (2.0 * sigma)), -jnp.inf)

  # P and W padded to powers of two; padding is no cell.
  candidates = []
  for (ids_ref, mean_ref, norm_ref, k_ref, v_ref), size in ((cell_refs[:5], pool_size), (cell_refs[5:], recent_size)):
    if not size:
      continue
    at = jnp.minimum(jnp.arange(pl.next_power_of_2(size)), size - 1)
    ids = jnp.where(jnp.arange(at.shape[0]) < size, ids_ref[layer, at], NO_CELL)
    mean, norm = mean_ref[layer, at, :].astype(jnp.float32), norm_ref[layer, at].astype(jnp.float32)
    candidates.append((ids, scores(ids, mean, norm), at, k_ref, v_ref))

  never = jnp.iinfo(jnp.int32).max
  chosen = jnp.full(cells_ref.shape, NO_CELL, jnp.int32)
  ranks = jnp.arange(cells_ref.shape[0])
  live = [score for _, score, _, _, _ in candidates]
  mine = [jnp.int32(-1)] * len(candidates)  # the rank-th cell's slot in each list (-1: not there)
  for j in range(top_k):
    best = live[0].max()
    for score in live[1:]:
      best = jnp.maximum(best, score.max())
    found = best > -jnp.inf
    winner = never
    for (ids, *_), score in zip(candidates, live):
      winner = jnp.minimum(winner, jnp.min(jnp.where(found & (score == best), ids, never)))
    for i, ((ids, _, at, _, _), score) in enumerate(zip(candidates, live)):
      slot = jnp.max(jnp.where(found & (ids == winner), at, -1))
      mine[i] = jnp.where(rank == j, slot, mine[i])
    live = [jnp.where(ids == winner, -jnp.inf, score) for (ids, *_), score in zip(candidates, live)]
    chosen = jnp.where(found & (ranks == j), winner, chosen)
  cells_ref[...] = chosen

  cell_k = jnp.zeros((cell, q.shape[0]), jnp.float32)
  cell_v = jnp.zeros((cell, q.shape[0]), jnp.float32)
  for (_, _, _, k_ref, v_ref), slot in zip(candidates, mine):
    here, safe = slot >= 0, jnp.maximum(slot, 0)
    cell_k = jnp.where(here, k_ref[layer, safe, :, :].astype(jnp.float32), cell_k)
    cell_v = jnp.where(here, v_ref[layer, safe, :, :].astype(jnp.float32), cell_v)
  any_here = mine[0] >= 0
  for slot in mine[1:]:
    any_here = any_here | (slot >= 0)
  logits = jnp.sum(cell_k * q[None, :], axis=1) * scale  # [s]
  softmax_part(logits, jnp.broadcast_to(any_here, logits.shape), cell_v, o_ref, lse_ref)


def _bounded_decode_kernel(
  q_ref,
  q_rot_ref,
  k_rot_ref,
  k_ref,
  v_ref,
  pos_ref,
  valid_ref,
  lam_ref,
  sigma_ref,
  layer_ref,
  ring_k_ref,
  ring_v_ref,
  ring_pos_ref,
  *refs,
  window,
  cell,
  top_k,
  ring_slots,
  block,
  group,
  pool_size,
  recent_size,
  tiles,
):
  """One (row, query head, part): parts 0 .. T-1 are the ring's tiles (local branch), parts T .. T+K-1 the K
  selected cells (long-range branch). q_ref / q_rot_ref `[d]`; k_rot_ref, k_ref, v_ref `[d]` the token's key
  (rotated and raw) and value for this head's key/value head, in the cache's dtype; pos_ref, valid_ref, layer_ref
  `[1]`; lam_ref, sigma_ref `[layers]` (this head's λ and σ) and the cache refs `[layers, ...]`, all read at layer
  `layer_ref[0]`: ring k/v `[R, d]`, ring pos `[R]`, block k/v `[B, d]` (written only), pool ids / norm `[P]`,
  mean `[P, d]`, k/v `[P, s, d]`, recent the same with W (recent ids shared by the heads). Writes the part's
  o_ref `[d]` and lse_ref `[1]` (float32); cell parts write cells_ref `[K']` (K' ≥ K a power of two; -1 past K
  and where none); part 0 of a key/value head's first query head writes the token into the aliased ring and
  block buffer."""
  block_k_ref, block_v_ref = refs[:2]
  cell_refs, (o_ref, lse_ref, cells_ref, ring_k_out, ring_v_out, ring_pos_out, block_k_out, block_v_out) = (
    refs[2:12],
    refs[12:],
  )
  del block_k_ref, block_v_ref  # aliased to block_k_out / block_v_out, which are only written
  head, part = pl.program_id(1), pl.program_id(2)
  pos, valid, layer = pos_ref[0], valid_ref[0] != 0, layer_ref[0]
  scale = 1.0 / math.sqrt(q_ref.shape[0])

  @pl.when(valid & (part == 0) & (head % group == 0))
  def _():
    slot, block_slot = pos % ring_slots, pos % block
    ring_k_out[layer, slot, :] = k_rot_ref[...]
    ring_v_out[layer, slot, :] = v_ref[...]
    block_k_out[layer, block_slot, :] = k_ref[...]
    block_v_out[layer, block_slot, :] = v_ref[...]

    @pl.when(head == 0)
    def _():
      ring_pos_out[layer, pl.ds(slot, 1)] = jnp.full((1,), pos, ring_pos_out.dtype)

  @pl.when(part < tiles)
  def _():
    q_rot = q_rot_ref[...].astype(jnp.float32)
    token = (k_rot_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32))
    ring_refs = (ring_k_ref, ring_v_ref, ring_pos_ref)
    ring_part(
      part, q_rot, token, pos, valid, layer, scale, ring_refs, (o_ref, lse_ref), window=window, ring_slots=ring_slots
    )

  @pl.when(part >= tiles)
  def _():
    q = q_ref[...].astype(jnp.float32)
    _cell_part(
      part - tiles,
      q,
      pos,
      lam_ref[layer],
      sigma_ref[layer],
      layer,
      scale,
      cell_refs,
      o_ref,
      lse_ref,
      cells_ref,
      cell=cell,
      top_k=top_k,
      pool_size=pool_size,
      recent_size=recent_size,
    )


WRITTEN = ("ring_k", "ring_v", "ring_pos", "block_k", "block_v")  # the cache arrays the kernel writes in place


@functools.partial(jax.jit, static_argnames=("window", "cell", "top_k", "eps", "out_dtype", "interpret"))
def bounded_decode(
  q,
  q_rot,
  k_rot,
  k,
  v,
  pos,
  valid,
  lam,
  sigma,
  alpha,
  gain,
  cache,
  *,
  window,
  cell,
  top_k,
  eps,
  out_dtype=jnp.float32,
  layer=None,
  interpret=None,
):
  """FS-L's one-token step: the token into the ring and block buffer, the local branch, the long-range selection
  and readout, and their mix (Eq. 2).

  Args:
    q, q_rot: `[batch, heads, d]` the token's query, unrotated (long-range branch) and RoPE-rotated (local).
    k_rot, k, v: `[batch, kv_heads, d]` its key, rotated (for the ring) and raw (for the block buffer), and value.
    pos: `[batch]` int32 its position; valid: `[batch]` bool (an invalid row writes nothing and its token is not
      a key); lam, sigma: `[heads]`, or with `layer` the scanned model's stacks `[layers, heads]` (the "routing"
      collection's), read at `layer` where they lie like the cache (a `[heads]` pair is broadcast to the layers).
    alpha: `[heads]` the branch mix α (Eq. 2) and gain `[d]` the readout RMSNorm's (Eq. 9), or with `layer` the
      scanned model's parameter stacks `[layers, heads]` and `[layers, d]`, read the same way.
    cache: the layer's `fsjax.cache.bounded.BoundedCache` fields as a dict of arrays, before the token: ring_k,
      ring_v `[batch, R, kv_heads, d]`, ring_pos `[batch, R]`, block_k, block_v `[batch, B, kv_heads, d]`,
      pool_ids `[batch, kv_heads, P]`, pool_mean `[.., P, d]`, pool_norm `[.., P]`, pool_k / pool_v `[.., P, s,
      d]`, recent_ids `[batch, W]`, recent_mean / norm / k / v as the pool's with W. With `layer` (int32 scalar),
      each is a scanned model's stack `[layers, ...]` of that shape, read at `layer` where it lies.
    window, cell, top_k: the routing's w, s and K; eps: the readout RMSNorm's ε.
    out_dtype: the output's dtype (the model's, so that the output projection reads it as it is).

  Returns:
    o `[batch, heads, d]` in `out_dtype`: local (Eq. 3-4) + α · RMSNorm(long-range readout) (Eq. 9, 2), computed
    in float32; cells `[batch, heads, K]` int32 in decreasing score order (-1 where fewer are available); and the
    `WRITTEN` arrays after the token's writes, as given (stacks with `layer`). Under `jit` with the cache donated
    or dead after the call, XLA writes them in place.
  """
  interpret = default_interpret() if interpret is None else interpret
  batch, heads, dim = q.shape
  axes = dict(
    ring_k=4,
    ring_v=4,
    ring_pos=2,
    block_k=4,
    block_v=4,
    pool_ids=3,
    pool_mean=4,
    pool_norm=3,
    pool_k=5,
    pool_v=5,
    recent_ids=2,
    recent_mean=4,
    recent_norm=3,
    recent_k=5,
    recent_v=5,
  )
  stacks = {}
  for name, ndim in axes.items():
    stacks[name], layer_index = layer_stack(cache[name], layer, ndim)
  layers, _, ring_slots, kv_heads, _ = stacks["ring_k"].shape
  block = stacks["block_k"].shape[2]
  pool_size, recent_size = stacks["pool_ids"].shape[3], stacks["recent_ids"].shape[2]
  group = group_size(heads, kv_heads)
  width = pl.next_power_of_2(top_k)
  split = StepParts.of(ring_slots=ring_slots, top_k=top_k, layers=layers)

  def spec(name):
    shape = stacks[name].shape
    if name in ("ring_k", "ring_v", "block_k", "block_v"):
      return pl.BlockSpec((layers, None, shape[2], None, dim), lambda b, h, z: (0, b, 0, h // group, 0))
    if name in ("ring_pos", "recent_ids"):
      return pl.BlockSpec((layers, None, shape[2]), lambda b, h, z: (0, b, 0))
    rest = shape[3:]
    return pl.BlockSpec((layers, None, None, *rest), lambda b, h, z: (0, b, h // group) + (0,) * len(rest))

  names = list(axes)
  recent = max(recent_size, 1)  # an empty recent list still hands the kernel a one-slot array it never reads
  if recent_size == 0:
    for name in ("recent_ids", "recent_mean", "recent_norm", "recent_k", "recent_v"):
      x = stacks[name]
      stacks[name] = jnp.zeros(
        x.shape[:2] + (recent,) + x.shape[3:] if name == "recent_ids" else x.shape[:3] + (recent,) + x.shape[4:],
        x.dtype,
      )
  token, token_specs = token_operands(
    q, q_rot, k_rot, k, v, pos, valid, ring_dtype=stacks["ring_k"].dtype, dtype=stacks["block_k"].dtype, group=group
  )
  inputs = [
    *token,
    *(per_layer(x, layers).astype(jnp.float32) for x in (lam, sigma)),
    layer_index,
    *(stacks[name] for name in names),
  ]
  first_cache_input = len(inputs) - len(names)
  part_specs, part_shapes = split.outputs(batch, heads, dim)
  o, lse, cells, *written = pl.pallas_call(
    functools.partial(
      _bounded_decode_kernel,
      window=window,
      cell=cell,
      top_k=top_k,
      ring_slots=ring_slots,
      block=block,
      group=group,
      pool_size=pool_size,
      recent_size=recent_size,
      tiles=split.tiles,
    ),
    grid=(batch, heads, split.parts),
    in_specs=[
      *token_specs,
      pl.BlockSpec((layers, None), lambda b, h, z: (0, h)),
      pl.BlockSpec((layers, None), lambda b, h, z: (0, h)),
      pl.BlockSpec((1,), lambda b, h, z: (0,)),
      *(spec(name) for name in names),
    ],
    out_specs=[
      *part_specs,
      pl.BlockSpec((None, None, width), lambda b, h, z: (b, h, 0)),
      *(spec(name) for name in WRITTEN),
    ],
    out_shape=[
      *part_shapes,
      jax.ShapeDtypeStruct((batch, heads, width), jnp.int32),
      *(jax.ShapeDtypeStruct(stacks[name].shape, stacks[name].dtype) for name in WRITTEN),
    ],
    input_output_aliases={first_cache_input + names.index(name): 3 + i for i, name in enumerate(WRITTEN)},
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="fsl_bounded_decode",
  )(*inputs)
  mixed = split.mix(o, lse, alpha, gain, layer_index, eps=eps, out_dtype=out_dtype, interpret=interpret)
  unstack = (lambda x: x) if layer is not None else (lambda x: x[0])
  return mixed, cells[..., :top_k], {name: unstack(x) for name, x in zip(WRITTEN, written)}
