"""Fused FreeSolo cell scoring and top-K (FS Eq. 6-8): the selection of the reference's `select_from_summaries`,
without ever writing the `[T, #cells]` score matrix.

One program scores a tile of queries of one (batch, head) against a range of cells in chunks, and keeps a running
top-K per query in registers: the chunk's scores that beat a query's current K-th best are extracted one at a
time (max, lowest index among equals; as many passes as the tile's most-improved query needs, at most K) and
inserted into the running list with strict comparisons, so among equal scores the lower cell index wins, as in
`lax.top_k`. Cells are visited in increasing index; a tile stops at the last cell any of its queries may see.
The erf prior is evaluated only for chunks close enough to the tile for it not to have saturated.

A decode step has one query per (batch, head): one program per head would walk every cell alone (110 µs per
layer at 4,096 cells on an H200). So the cells are split into ranges, one program each, when the query tiles alone
cannot fill the GPU; each range writes its own top-K with the scores, and `merge_ranges` (`lax.top_k`) merges the
ranges. The merge keeps the kernel's ties: candidates are laid out by range, then rank, so equal scores stay in
cell order. A consumer that can rank the candidates itself takes them unmerged (`ranges=True`): FS's decode step
(`pallas_kernels.archive_decode`) does, which saves the merge's two launches per layer.

Grouped-query attention: the programs of query head h read the summaries, key norms and FS-L death blocks of
key/value head `h // group` through their BlockSpec index maps, and h's own λ_h, σ_h; nothing is copied per
query head.

Cost per (batch, head): `T · m · (2d + ~40)` flops for `m` eligible cells per query (the dot product in float32,
the erf prior and the selection network), `T·d` + `M·d` bytes read and `T·K` int32 written.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
  NO_CELL,
  check_compilable,
  default_interpret,
  erf,
  group_size,
  layer_stack,
  pad_axis,
  pad_head_dim,
)

# About two programs per SM of an H200 (132 SMs). One decode query per head at 4,096 cells: 110 µs per layer
# unsplit, 32 µs at 16 ranges, no better at 32-64 (the sweep in docs/results/h200_decode_splits.json).
FILL_PROGRAMS = 256


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Queries per program and cells scored per loop step (both powers of two, >= 16 when compiled); `splits`:
  cell ranges per (query tile, batch, head), None to split only as far as needed to fill the GPU."""

  queries: int = 64
  cells: int = 64
  num_warps: int = 4
  num_stages: int = 2
  splits: int | None = None

  @classmethod
  def get_default(cls):
    return cls()


def _insert(top_values, top_indices, value, index):
  """Inserts one candidate per query into running lists sorted by (score desc, index asc).

  Candidates arrive in increasing cell index, so an equal score stays behind the entries already held.
  """
  values, indices = list(top_values), list(top_indices)
  shifting = jnp.zeros(value.shape, jnp.bool_)
  for p in range(len(values)):
    take = shifting | (value > values[p])
    values[p], value = jnp.where(take, value, values[p]), jnp.where(take, values[p], value)
    indices[p], index = jnp.where(take, index, indices[p]), jnp.where(take, indices[p], index)
    shifting = take
  return tuple(values), tuple(indices)


def _extract_into(carry, *, first, lane):
  """Moves each query's best remaining chunk score (lowest lane among equals) into its running top-K."""
  top_values, top_indices, scores = carry
  best = jnp.max(scores, axis=1)
  arg = jnp.argmax(scores, axis=1).astype(jnp.int32)
  index = jnp.where(best > -jnp.inf, first + arg, NO_CELL)
  top_values, top_indices = _insert(top_values, top_indices, best, index)
  return top_values, top_indices, jnp.where(lane[None, :] == arg[:, None], -jnp.inf, scores)


def _cell_topk_kernel(
  q_ref,
  pos_ref,
  layer_ref,
  mean_ref,
  norm_ref,
  death_ref,
  lam_ref,
  sigma_ref,
  idx_ref,
  value_ref,
  *,
  cell,
  block,
  top_k,
  retain_recent,
  chunk,
  num_cells,
  steps_per_split,
  pruned,
  stacked,
  scale,
  precision,
):
  """q_ref `[Bq, d]`, pos_ref `[Bq]`, layer_ref `[1]`, mean_ref `[layers, M, d]` and norm_ref `[layers, M]` (read
  at layer `layer_ref[0]` where `stacked`, else at 0), death_ref `[M]` (a_c and Eq. 8 death blocks of the
  key/value head this query head reads; read only when `pruned`), lam_ref / sigma_ref `[layers]` (this query
  head's λ_h and σ_h, read at the same layer) → idx_ref, value_ref `[Bq, K']`: the top-K of this program's cell
  range (chunks `split · steps_per_split` onwards) and their scores. M = `num_cells` need not be a multiple of
  the chunk: the last chunk's loads are masked, so a decode cache's summaries are read where they lie rather
  than padded (a copy of the layer at every step)."""
  q = q_ref[...].astype(jnp.float32)
  pos = pos_ref[...]
  layer = layer_ref[0] if stacked else jnp.int32(0)  # a constant index where there is one layer (training, prefill)
  query_block = pos // block
  num_eligible = query_block * (block // cell)  # Eq. 6: m_n cells precede the query's block
  lam, inv_two_sigma = lam_ref[layer], 1.0 / (2.0 * sigma_ref[layer])
  lane = jnp.arange(chunk)
  nearest_query = jnp.min(pos).astype(jnp.float32)

  def body(step, carry):
    top_values, top_indices = carry
    first = step * chunk
    c = first + lane
    inside = c < num_cells
    load = lambda ref, mask, *index: plgpu.load(ref.at[(*index, pl.ds(first, chunk))], mask=mask, other=0)
    mean = load(mean_ref, inside[:, None], layer).astype(jnp.float32)
    content = (
      jax.lax.dot_general(q, mean, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
      * scale
    )
    amplitude = (lam * load(norm_ref, inside, layer).astype(jnp.float32))[None, :]  # λ_h a_c of Eq. 7

    def prior_with_erf():
      distance = pos.astype(jnp.float32)[:, None] - (c.astype(jnp.float32)[None, :] + 0.5) * cell
      return amplitude * erf(distance * inv_two_sigma)

    # erf saturates to 1 in float32 beyond 4: only the chunks nearest the tile's queries need it.
    saturated = (nearest_query - (first + chunk - 0.5) * cell) * inv_two_sigma >= 4.0
    prior = jax.lax.cond(saturated, lambda: jnp.broadcast_to(amplitude, content.shape), prior_with_erf)
    scores = content + prior  # Eq. 7
    available = c[None, :] < num_eligible[:, None]
    if pruned:  # Eq. 8: Recent_W ∪ TopP
      recent = c[None, :] >= num_eligible[:, None] - retain_recent
      in_pool = query_block[:, None] < load(death_ref, inside)[None, :]
      available &= recent | in_pool
    # Only scores above a query's current K-th best can enter its list (an equal one loses on index).
    scores = jnp.where(available & (scores > top_values[-1][:, None]), scores, -jnp.inf)
    contenders = jnp.minimum(jnp.max(jnp.sum((scores > -jnp.inf).astype(jnp.int32), axis=1)), top_k)
    top_values, top_indices, _ = jax.lax.fori_loop(
      0, contenders, lambda _, carry: _extract_into(carry, first=first, lane=lane), (top_values, top_indices, scores)
    )
    return top_values, top_indices

  init = (
    tuple(jnp.full(pos.shape, -jnp.inf, jnp.float32) for _ in range(top_k)),
    tuple(jnp.full(pos.shape, NO_CELL, jnp.int32) for _ in range(top_k)),
  )
  first_step = pl.program_id(3) * steps_per_split
  num_steps = jnp.minimum((jnp.max(num_eligible) + chunk - 1) // chunk, first_step + steps_per_split)
  top_values, top_indices = jax.lax.fori_loop(first_step, num_steps, body, init)
  slot = jnp.arange(idx_ref.shape[-1])[None, :]
  out = jnp.full(idx_ref.shape, NO_CELL, jnp.int32)
  out_values = jnp.full(value_ref.shape, -jnp.inf, jnp.float32)
  for p, (value, index) in enumerate(zip(top_values, top_indices)):
    out = jnp.where(slot == p, index[:, None], out)
    out_values = jnp.where(slot == p, value[:, None], out_values)
  idx_ref[...] = out
  value_ref[...] = out_values


def _loadable(x):
  """`x` as the kernel loads it: float32, or the half-precision dtype it has (widened to float32 in the kernel)."""
  return x if x.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else x.astype(jnp.float32)


def _num_splits(sizes, *, programs, num_chunks):
  """Cell ranges per program of the query grid: `sizes.splits`, or enough for `FILL_PROGRAMS` programs in all;
  never more ranges than chunks."""
  wanted = sizes.splits if sizes.splits is not None else pl.cdiv(FILL_PROGRAMS, programs)
  return max(1, min(wanted, num_chunks))


@functools.partial(
  jax.jit,
  static_argnames=(
    "variant",
    "cell",
    "block",
    "top_k",
    "retain_top",
    "retain_recent",
    "block_sizes",
    "ranges",
    "interpret",
  ),
)
def select_from_summaries(
  q,
  positions,
  mean_keys,
  max_norms,
  death=None,
  *,
  variant="fs",
  lam=1.0,
  sigma=4.0,
  cell=32,
  block=128,
  top_k=4,
  retain_top=64,
  retain_recent=8,
  block_sizes=None,
  layer=None,
  ranges=False,
  interpret=None,
):
  """Top-K cells (Eq. 6-8) for queries at `positions`, given the cell summaries (Eq. 5).

  Args:
    q: `[batch, T, heads, d]` unrotated queries.
    positions: `[batch, T]` int32 query positions, or None for `0..T-1`.
    mean_keys: `[batch, M, kv_heads, d]`; max_norms: `[batch, M, kv_heads]` of cells `0..M-1` (only cells that
      end before a query's block are ever read, so later cells may hold anything), float32 or a half precision
      (read as it is and widened to float32 in the kernel; wider dtypes are cast to float32 first); kv_heads
      divides heads and query head h reads key/value head `h // (heads // kv_heads)`.
    death: for "fsl", `[batch, M, kv_heads]` int32: the first block at which each cell has left the top-P pool
      (the reference's `retention_death_block`, computed once per sequence by the caller); unused by "fs".
    variant: "fs" or "fsl"; lam, sigma: scalars or `[heads]`, or with `layer` the scanned model's stacks
      `[layers, heads]` (its "routing" collection's), read at `layer` where they lie; cell, block, top_k,
      retain_top, retain_recent: `s`, `B`, `K`, `P`, `W`.
    block_sizes: `BlockSizes`; interpret: None = compiled on GPU, interpreted elsewhere.
    layer: int32 scalar, or None. With it, mean_keys and max_norms are a scanned model's stacks `[layers, batch,
      M, ...]` (a decode cache's), read at `layer` where they lie when the head dim is a power of two (else the
      layer is sliced out and padded first, a copy); death stays `[batch, M, kv_heads]`.
    ranges: return each cell range's top-K unmerged (see Returns).

  Returns:
    `[batch, T, heads, K]` int32, best first (ties: lower index), -1 where fewer than K cells are available. With
    `ranges`, the candidates `(cells, scores)` `[batch, T, heads, S·K']` (int32, float32) of the S cell ranges, in
    cell order and each best first, -1 and −inf past a range's available cells (K' = K rounded up to a power of
    two): `merge_ranges` of them is the top-K.
  """
  interpret = default_interpret() if interpret is None else interpret
  sizes = block_sizes or BlockSizes.get_default()
  batch, seq, heads, head_dim = q.shape
  check_compilable(cell=cell, head_dim=head_dim, interpret=interpret)
  if variant not in ("fs", "fsl"):
    raise ValueError(f"variant must be 'fs' or 'fsl' for the cell-scoring kernel, got {variant!r}")
  tile, chunk = min(sizes.queries, pl.next_power_of_2(seq)), sizes.cells
  num_cells = max_norms.shape[-2]
  lam, sigma = (jnp.asarray(x, jnp.float32) for x in (lam, sigma))
  if layer is not None and head_dim != pl.next_power_of_2(head_dim):
    mean_keys, max_norms = mean_keys[layer], max_norms[layer]  # padding would copy every layer
    lam, sigma = (x[layer] if x.ndim == 2 else x for x in (lam, sigma))
    layer = None
  (mean_keys, layer_index), (max_norms, _) = layer_stack(mean_keys, layer, 4), layer_stack(max_norms, layer, 3)
  kv_heads = max_norms.shape[-1]
  group = group_size(heads, kv_heads)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  # Summaries in a decode cache's half precision stay so: the kernel widens each chunk as it loads it (exactly),
  # where a float32 copy of the whole archive would be written and read again at every step.
  q = jax.lax.stop_gradient(q.astype(jnp.float32))
  mean_keys, max_norms = (jax.lax.stop_gradient(_loadable(x)) for x in (mean_keys, max_norms))
  pruned = variant == "fsl"
  if not pruned:
    death = jnp.zeros((1, 1, 1), jnp.int32)  # never read: no `[batch, M, kv_heads]` fill at every decode step
  elif death is None or death.shape != max_norms.shape[1:]:
    raise ValueError(
      f"variant 'fsl' needs death blocks shaped like max_norms {max_norms.shape[1:]}, got "
      f"{None if death is None else death.shape}"
    )

  padded_seq = pl.cdiv(seq, tile) * tile
  padded_cells = pl.cdiv(num_cells, chunk) * chunk  # cells the chunks cover; the loads past M are masked
  padded_k = pl.next_power_of_2(top_k)
  splits = _num_splits(sizes, programs=padded_seq // tile * batch * heads, num_chunks=padded_cells // chunk)
  q = pad_axis(pad_head_dim(q), 1, padded_seq)
  positions = pad_axis(positions.astype(jnp.int32), 1, padded_seq)
  mean_keys = pad_head_dim(mean_keys)
  dim, layers = q.shape[-1], mean_keys.shape[0]
  per_layer = lambda x: x if x.ndim == 2 else jnp.broadcast_to(x, (layers, heads))  # a scalar or `[heads]`

  kernel = functools.partial(
    _cell_topk_kernel,
    cell=cell,
    block=block,
    top_k=top_k,
    retain_recent=retain_recent,
    chunk=chunk,
    num_cells=num_cells,
    steps_per_split=pl.cdiv(padded_cells // chunk, splits),
    pruned=pruned,
    stacked=layer is not None,
    scale=1.0 / math.sqrt(head_dim),
    # Tensor cores in three TF32 passes keep float32 accuracy; the CPU interpreter has
    # no such algorithm and multiplies in full float32.
    precision=(jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
  )
  if pruned:
    death_map = lambda i, b, h, s: (b, 0, h // group)
  else:
    death_map = lambda i, b, h, s: (0, 0, 0)
  out_spec = pl.BlockSpec((None, tile, None, None, padded_k), lambda i, b, h, s: (b, i, h, s, 0))
  out_shape = (batch, padded_seq, heads, splits, padded_k)
  idx, values = pl.pallas_call(
    kernel,
    grid=(padded_seq // tile, batch, heads, splits),
    in_specs=[
      pl.BlockSpec((None, tile, None, dim), lambda i, b, h, s: (b, i, h, 0)),
      pl.BlockSpec((None, tile), lambda i, b, h, s: (b, i)),
      pl.BlockSpec((1,), lambda i, b, h, s: (0,)),
      pl.BlockSpec((layers, None, num_cells, None, dim), lambda i, b, h, s: (0, b, 0, h // group, 0)),
      pl.BlockSpec((layers, None, num_cells, None), lambda i, b, h, s: (0, b, 0, h // group)),
      pl.BlockSpec((None, death.shape[1], None), death_map),
      pl.BlockSpec((layers, None), lambda i, b, h, s: (0, h)),
      pl.BlockSpec((layers, None), lambda i, b, h, s: (0, h)),
    ],
    out_specs=[out_spec, out_spec],
    out_shape=[jax.ShapeDtypeStruct(out_shape, jnp.int32), jax.ShapeDtypeStruct(out_shape, jnp.float32)],
    compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
    interpret=interpret,
    name="freesolo_cell_topk",
  )(q, positions, layer_index, mean_keys, max_norms, death, *(per_layer(x) for x in (lam, sigma)))
  if ranges:  # every range's padded_k slots: those past K hold -1 and −inf, and slicing them off would be a copy
    idx, values = idx[:, :seq], values[:, :seq]
    return idx.reshape(*idx.shape[:3], -1), values.reshape(*values.shape[:3], -1)
  idx, values = idx[:, :seq, :, :, :top_k], values[:, :seq, :, :, :top_k]
  if splits == 1:
    return idx[..., 0, :]
  return merge_ranges(idx.reshape(*idx.shape[:3], -1), values.reshape(*values.shape[:3], -1), top_k)


def merge_ranges(cells, scores, top_k):
  """The top-K of `select_from_summaries(..., ranges=True)`'s candidates `cells`, `scores` `[..., S·K']`: `[...,
  K]` int32, best first. The ranges lie in cell order, each best first, so `lax.top_k`'s ties (the lower position
  first) are the kernel's (the lower cell)."""
  _, best = jax.lax.top_k(scores, top_k)
  return jnp.take_along_axis(cells, best, axis=-1)
