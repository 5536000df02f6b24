"""FS-L's attention for one decode token over its bounded cache (FS Sec. 3.3 "Inference", Eq. 3-4 and 7-9) in one
launch per layer: one program per (batch row, query head) runs

  - the local branch over the ring (Eq. 3-4; the token already written to it), an online softmax over tiles;
  - the scores of `pool ∪ recent` (Eq. 7-8, empties skipped);
  - the top K by (score desc, cell index asc) as `lax.top_k` over the candidates sorted by cell index gives it. A
    recent cell that is also in the pool has the same index, score and keys in both lists: each pick takes a cell
    index and retires it from both, so the union needs no deduplication;
  - the readout of the K selected cells (Eq. 9) gathered from the pool or recent slot where each lies,

and returns the local output, the unnormed long-range sum and the selected cells. The jnp specification is
`fsjax.attention.freesolo_step.bounded_segment`: `attend` over the ring and the token, and `bounded_long_range`.

The cache arrays are read where they lie: a scanned model's stacks `[layers, batch, ...]` with the layer index,
so no layer is copied out per token (`fsjax.cache.layered`). Grouped-query attention: query head h reads the
state of key/value head `h // group` through its index maps. No matrix product has 16 rows here (one query), so
the dot products are elementwise products and sums in float32.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import default_interpret, erf, group_size, layer_stack

NO_CELL = -1
RING_TILE = 128  # ring slots per step of the local branch's online softmax


def _bounded_decode_kernel(
  q_ref,
  q_rot_ref,
  pos_ref,
  lam_ref,
  sigma_ref,
  layer_ref,
  ring_k_ref,
  ring_v_ref,
  ring_pos_ref,
  pool_ids_ref,
  pool_mean_ref,
  pool_norm_ref,
  pool_k_ref,
  pool_v_ref,
  recent_ids_ref,
  recent_mean_ref,
  recent_norm_ref,
  recent_k_ref,
  recent_v_ref,
  local_ref,
  long_ref,
  cells_ref,
  *,
  window,
  cell,
  top_k,
  ring_slots,
  pool_size,
  recent_size,
):
  """One (row, query head). q_ref / q_rot_ref `[d]`; pos_ref, lam_ref, sigma_ref, layer_ref `[1]`; cache refs
  `[layers, ...]` of which layer `layer_ref[0]` is read: ring k/v `[R, d]`, ring pos `[R]`, pool ids / norm `[P]`,
  mean `[P, d]`, k/v `[P, s, d]`, recent the same with W (recent ids shared by the heads). Writes local_ref and
  long_ref `[d]` (float32) and cells_ref `[K']` (K' ≥ K a power of two; -1 past K and where none)."""
  q = q_ref[...].astype(jnp.float32)
  q_rot = q_rot_ref[...].astype(jnp.float32)
  pos, lam, sigma, layer = pos_ref[0], lam_ref[0], sigma_ref[0], layer_ref[0]
  dim = q.shape[0]
  scale = 1.0 / math.sqrt(dim)

  # Local branch (Eq. 3-4): keys at j <= pos and pos - j <= window; the ring holds each position at slot j mod R.
  def ring_tile(t, carry):
    m, total, acc = carry
    slots = t * RING_TILE + jnp.arange(RING_TILE)
    at = jnp.minimum(slots, ring_slots - 1)
    k_pos = ring_pos_ref[layer, at]
    seen = (slots < ring_slots) & (k_pos >= 0) & (k_pos <= pos) & (pos - k_pos <= window)
    k = ring_k_ref[layer, at, :].astype(jnp.float32)  # [T, d]
    logits = jnp.where(seen, jnp.sum(k * q_rot[None, :], axis=1) * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits))
    shift = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p = jnp.where(seen, jnp.exp(logits - shift), 0.0)
    rescale = jnp.exp(jnp.where(m > -jnp.inf, m, shift) - shift)
    v = ring_v_ref[layer, at, :].astype(jnp.float32)
    return m_new, total * rescale + jnp.sum(p), acc * rescale + jnp.sum(p[:, None] * v, axis=0)

  tiles = -(-ring_slots // RING_TILE)
  init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((dim,), jnp.float32))
  _, total, acc = jax.lax.fori_loop(0, tiles, ring_tile, init)
  local_ref[...] = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)

  # Scores of pool ∪ recent (Eq. 7-8); P and W padded to powers of two, padding unavailable.
  def scores(ids, mean, norm):
    content = jnp.sum(mean * q[None, :], axis=1) * scale
    distance = pos.astype(jnp.float32) - (ids.astype(jnp.float32) + 0.5) * cell
    return content + lam * norm * erf(distance / (2.0 * sigma))

  pool_at = jnp.minimum(jnp.arange(pl.next_power_of_2(pool_size)), pool_size - 1)
  in_pool = jnp.arange(pool_at.shape[0]) < pool_size
  pool_ids = jnp.where(in_pool, pool_ids_ref[layer, pool_at], NO_CELL)
  pool_scores = scores(
    pool_ids, pool_mean_ref[layer, pool_at, :].astype(jnp.float32), pool_norm_ref[layer, pool_at].astype(jnp.float32)
  )
  pool_scores = jnp.where(pool_ids >= 0, pool_scores, -jnp.inf)
  never = jnp.iinfo(jnp.int32).max
  candidates = [(pool_ids, pool_scores, pool_at, True)]
  if recent_size:
    recent_at = jnp.minimum(jnp.arange(pl.next_power_of_2(recent_size)), recent_size - 1)
    recent_ids = recent_ids_ref[layer, recent_at]
    recent_ids = jnp.where(jnp.arange(recent_at.shape[0]) < recent_size, recent_ids, NO_CELL)
    recent_scores = scores(
      recent_ids,
      recent_mean_ref[layer, recent_at, :].astype(jnp.float32),
      recent_norm_ref[layer, recent_at].astype(jnp.float32),
    )
    candidates.append((recent_ids, jnp.where(recent_ids >= 0, recent_scores, -jnp.inf), recent_at, False))

  # Top K, then the readout (Eq. 9) of each chosen cell as it is found: an online softmax over its s keys.
  m = jnp.float32(-jnp.inf)
  total = jnp.float32(0.0)
  acc = jnp.zeros((dim,), jnp.float32)
  chosen = jnp.full(cells_ref.shape, NO_CELL, jnp.int32)
  slots_out = jnp.arange(cells_ref.shape[0])
  live = [score for _, score, _, _ in candidates]
  for j in range(top_k):
    best = live[0].max()
    for score in live[1:]:
      best = jnp.maximum(best, score.max())
    found = best > -jnp.inf
    winner = never
    for (ids, _, _, _), score in zip(candidates, live):
      winner = jnp.minimum(winner, jnp.min(jnp.where(found & (score == best), ids, never)))
    cell_k = jnp.zeros((cell, dim), jnp.float32)
    cell_v = jnp.zeros((cell, dim), jnp.float32)
    for (ids, _, at, from_pool), score in zip(candidates, live):
      hit = (ids == winner) & found
      slot = jnp.max(jnp.where(hit, at, -1))
      here = slot >= 0
      k_ref, v_ref = (pool_k_ref, pool_v_ref) if from_pool else (recent_k_ref, recent_v_ref)
      safe = jnp.maximum(slot, 0)
      cell_k = jnp.where(here, k_ref[layer, safe, :, :].astype(jnp.float32), cell_k)
      cell_v = jnp.where(here, v_ref[layer, safe, :, :].astype(jnp.float32), cell_v)
    live = [jnp.where(ids == winner, -jnp.inf, score) for (ids, _, _, _), score in zip(candidates, live)]
    chosen = jnp.where(found & (slots_out == j), winner, chosen)
    logits = jnp.sum(cell_k * q[None, :], axis=1) * scale  # [s]
    m_new = jnp.where(found, jnp.maximum(m, jnp.max(logits)), m)
    shift = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p = jnp.where(found, jnp.exp(logits - shift), 0.0)
    rescale = jnp.exp(jnp.where(m > -jnp.inf, m, shift) - shift)
    m, total, acc = m_new, total * rescale + jnp.sum(p), acc * rescale + jnp.sum(p[:, None] * cell_v, axis=0)
  long_ref[...] = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)
  cells_ref[...] = chosen


def compilable(*, cell, head_dim):
  """Whether Triton can tile this geometry: a cell's keys and a head's vectors as power-of-two tiles."""
  return cell >= 1 and cell & (cell - 1) == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


@functools.partial(jax.jit, static_argnames=("window", "cell", "top_k", "interpret"))
def bounded_decode(q, q_rot, pos, lam, sigma, cache, *, window, cell, top_k, layer=None, interpret=None):
  """FS-L's local branch and long-range selection and readout for one token per row.

  Args:
    q, q_rot: `[batch, heads, d]` the token's query, unrotated (long-range branch) and RoPE-rotated (local).
    pos: `[batch]` int32 its position; lam, sigma: `[heads]`.
    cache: the layer's `fsjax.cache.bounded.BoundedCache` fields as a dict of arrays, the ring holding the token
      already: ring_k, ring_v `[batch, R, kv_heads, d]`, ring_pos `[batch, R]`, pool_ids `[batch, kv_heads, P]`,
      pool_mean `[.., P, d]`, pool_norm `[.., P]`, pool_k / pool_v `[.., P, s, d]`, recent_ids `[batch, W]`,
      recent_mean / norm / k / v as the pool's with W. With `layer` (int32 scalar), each is a scanned model's
      stack `[layers, ...]` of that shape, read at `layer` where it lies.
    window, cell, top_k: the routing's w, s and K.

  Returns:
    local `[batch, heads, d]` float32 (Eq. 3-4), the long-range sum `[batch, heads, d]` float32 before its
    RMSNorm (Eq. 9), cells `[batch, heads, K]` int32 in decreasing score order, -1 where fewer are available.
  """
  interpret = default_interpret() if interpret is None else interpret
  batch, heads, dim = q.shape
  axes = dict(
    ring_k=4,
    ring_v=4,
    ring_pos=2,
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
  pool_size, recent_size = stacks["pool_ids"].shape[3], stacks["recent_ids"].shape[2]
  group = group_size(heads, kv_heads)
  width = pl.next_power_of_2(top_k)

  def spec(name):
    shape = stacks[name].shape
    if name in ("ring_k", "ring_v"):
      return pl.BlockSpec((layers, None, ring_slots, None, dim), lambda b, h: (0, b, 0, h // group, 0))
    if name in ("ring_pos", "recent_ids"):
      return pl.BlockSpec((layers, None, shape[2]), lambda b, h: (0, b, 0))
    rest = shape[3:]
    return pl.BlockSpec((layers, None, None, *rest), lambda b, h: (0, b, h // group) + (0,) * len(rest))

  names = list(axes)
  recent = max(recent_size, 1)  # an empty recent list still hands the kernel a one-slot array it never reads
  if recent_size == 0:
    for name in ("recent_ids", "recent_mean", "recent_norm", "recent_k", "recent_v"):
      x = stacks[name]
      stacks[name] = jnp.zeros(
        x.shape[:2] + (recent,) + x.shape[3:] if name == "recent_ids" else x.shape[:3] + (recent,) + x.shape[4:],
        x.dtype,
      )
  row = pl.BlockSpec((None, None, dim), lambda b, h: (b, h, 0))
  local, long_range, cells = pl.pallas_call(
    functools.partial(
      _bounded_decode_kernel,
      window=window,
      cell=cell,
      top_k=top_k,
      ring_slots=ring_slots,
      pool_size=pool_size,
      recent_size=recent_size,
    ),
    grid=(batch, heads),
    in_specs=[
      row,
      row,
      pl.BlockSpec((1,), lambda b, h: (b,)),
      pl.BlockSpec((1,), lambda b, h: (h,)),
      pl.BlockSpec((1,), lambda b, h: (h,)),
      pl.BlockSpec((1,), lambda b, h: (0,)),
      *(spec(name) for name in names),
    ],
    out_specs=[row, row, pl.BlockSpec((None, None, width), lambda b, h: (b, h, 0))],
    out_shape=[
      jax.ShapeDtypeStruct((batch, heads, dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, width), jnp.int32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="fsl_bounded_decode",
  )(
    q.astype(jnp.float32),
    q_rot.astype(jnp.float32),
    pos.astype(jnp.int32),
    lam.astype(jnp.float32),
    sigma.astype(jnp.float32),
    layer_index,
    *(stacks[name] for name in names),
  )
  return local, long_range, cells[..., :top_k]
