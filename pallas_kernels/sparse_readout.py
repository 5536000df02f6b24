"""FreeSolo sparse readout (FS Eq. 9 before the norm): the joint softmax of each query over the tokens of its
selected cells, and the weighted sum of their values — `fsjax.ops.sparse_readout` on tensor cores.

Design (docs/design.md §7, byte count): a per-query gather reads `K·s·d` keys and values per query, 32 KB per
(query, head) at K=4, s=32, d=64 in bf16. The queries of a tile select heavily overlapping cells, so one program
takes a tile of queries of one (batch, head), walks the sorted *union* of the cells they selected, loads each
cell's keys and values once, and runs `[Bq, d] x [d, s]` on tensor cores; queries that did not select the cell
are masked out of an online softmax (FlashAttention-2 style), and queries that selected nothing read zeros.

Backward (`custom_vjp`), two kernels that recompute the probabilities from the saved log-sum-exp: dq walks each
query tile's cells as the forward does; dk, dv walk, for each cell, the query tiles that selected it (the
inverse lists come from one sort of the tile unions) and accumulate in registers. Adding each (tile, cell)
contribution to float32 dk, dv with atomics instead is nondeterministic, and took 8 ms against the forward's 1.4 ms
at 64k tokens on an H200; the key-major pass writes every cell once and is deterministic.

Grouped-query attention: the query heads of a key/value head are folded into its query axis (position-major,
`common.fold_group`), so the three kernels run over key/value heads unchanged: a tile's union covers the cells
its group of heads selected (they score the same summaries, so they overlap), each cell's keys and values are
loaded once for the whole group, and dk, dv sum the group's contributions in the key-major pass. K and V are
never copied per query head.
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
  fold_group,
  group_size,
  pad_axis,
  pad_head_dim,
  unfold_group,
)

_UNUSED = jnp.iinfo(jnp.int32).max  # sorts after every cell index


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Queries per program (a power of two, >= 16 when compiled) and Triton launch options."""

  queries: int = 64
  num_warps: int = 4
  num_stages: int = 2

  @classmethod
  def get_default(cls):
    return cls()


def _dot(a, b, contract=(1, 1)):
  """`a @ b.T` (contract=(1, 1)), `a.T @ b` ((0, 0)) or `a @ b` ((1, 0)) with float32 accumulation; float32
  inputs multiply in full precision."""
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(
    a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )


def _selected(idx, cell_index):
  """`[Bq]` bool: which queries of the tile selected `cell_index` (idx `[Bq, K']`)."""
  return jnp.max((idx == cell_index).astype(jnp.int32), axis=1) > 0


def _forward_kernel(q_ref, k_ref, v_ref, idx_ref, union_ref, count_ref, o_ref, lse_ref, *, cell, scale):
  """q_ref `[Bq, d]`, k_ref / v_ref `[T_k, d]`, idx_ref `[Bq, K']`, union_ref `[U]`, count_ref `[tiles]`
  → o_ref `[Bq, d]`, lse_ref `[Bq]` (log-sum-exp of the scaled logits, 0 where nothing is selected)."""
  q = q_ref[...]
  idx = idx_ref[...]
  tile = q.shape[0]
  # A finite floor instead of -inf keeps exp(m_prev - m_next) finite for rows that selected nothing yet.
  floor = jnp.float32(-1e30)

  def body(u, carry):
    acc, row_max, row_sum = carry
    c = union_ref[u]
    keys = k_ref[pl.ds(c * cell, cell), :]
    logits = _dot(q, keys) * scale  # [Bq, s]
    selected = _selected(idx, c)[:, None]
    new_max = jnp.maximum(row_max, jnp.where(selected, jnp.max(logits, axis=1, keepdims=True), floor))
    probs = jnp.where(selected, jnp.exp(logits - new_max), 0.0)
    correction = jnp.exp(row_max - new_max)
    values = v_ref[pl.ds(c * cell, cell), :]
    acc = acc * correction + _dot(probs.astype(values.dtype), values, (1, 0))
    return acc, new_max, row_sum * correction + jnp.sum(probs, axis=1, keepdims=True)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((tile, 1), floor), jnp.zeros((tile, 1), jnp.float32))
  acc, row_max, row_sum = jax.lax.fori_loop(0, count_ref[pl.program_id(0)], body, init)
  nonempty = row_sum > 0
  o_ref[...] = jnp.where(nonempty, acc / jnp.where(nonempty, row_sum, 1.0), 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, row_max + jnp.log(jnp.where(nonempty, row_sum, 1.0)), 0.0)[:, 0]


def _probabilities(q, keys, idx, lse, cell_index, scale):
  """Recomputed softmax weights `[Bq, s]` of one cell for a query tile (zero where it was not selected)."""
  logits = _dot(q, keys) * scale
  return jnp.where(_selected(idx, cell_index)[:, None], jnp.exp(logits - lse), 0.0)


def _backward_dq_kernel(
  q_ref, k_ref, v_ref, idx_ref, union_ref, count_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cell, scale
):
  """Query-major: dq_ref `[Bq, d]` from the tile's selected cells (the forward walk)."""
  q, idx, do = q_ref[...], idx_ref[...], do_ref[...]
  lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]  # delta = rowsum(do · o)

  def body(u, dq):
    c = union_ref[u]
    rows = pl.ds(c * cell, cell)
    keys, values = k_ref[rows, :], v_ref[rows, :]
    probs = _probabilities(q, keys, idx, lse, c, scale)
    dlogits = probs * (_dot(do, values) - delta) * scale
    return dq + _dot(dlogits.astype(keys.dtype), keys, (1, 0))

  dq = jax.lax.fori_loop(0, count_ref[pl.program_id(0)], body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _backward_dkv_kernel(
  k_ref,
  v_ref,
  q_ref,
  idx_ref,
  do_ref,
  lse_ref,
  delta_ref,
  readers_ref,
  offsets_ref,
  dk_ref,
  dv_ref,
  *,
  cell,
  tile,
  scale,
):
  """Key-major: one cell's dk_ref, dv_ref `[s, d]`, summed over the query tiles that selected it
  (readers_ref `[P]`: tile indices grouped by cell; offsets_ref `[M + 1]`: each cell's range in it)."""
  c = pl.program_id(0)
  keys, values = k_ref[...], v_ref[...]

  def body(r, carry):
    dk, dv = carry
    rows = pl.ds(readers_ref[r] * tile, tile)
    q, do = q_ref[rows, :], do_ref[rows, :]
    probs = _probabilities(q, keys, idx_ref[rows, :], lse_ref[rows][:, None], c, scale)
    dlogits = probs * (_dot(do, values) - delta_ref[rows][:, None]) * scale
    return (dk + _dot(dlogits.astype(q.dtype), q, (0, 0)), dv + _dot(probs.astype(do.dtype), do, (0, 0)))

  zeros = jnp.zeros(keys.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(offsets_ref[c], offsets_ref[c + 1], body, (zeros, zeros))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def tile_unions(cell_idx, tile):
  """Per (batch, head, query tile) the sorted distinct selected cells and their number.

  Args:
    cell_idx: `[batch, T, heads, K]` with T a multiple of `tile`, -1 for none.

  Returns:
    unions `[batch, heads, T // tile, tile·K]` int32 (unused slots hold int32 max), counts
    `[batch, heads, T // tile]` int32.
  """
  batch, seq, heads, top_k = cell_idx.shape
  x = jnp.transpose(cell_idx, (0, 2, 1, 3)).reshape(batch, heads, seq // tile, tile * top_k)
  x = jnp.sort(jnp.where(x < 0, _UNUSED, x), axis=-1)
  repeated = jnp.concatenate([jnp.zeros_like(x[..., :1], jnp.bool_), x[..., 1:] == x[..., :-1]], axis=-1)
  x = jnp.sort(jnp.where(repeated, _UNUSED, x), axis=-1)
  return x.astype(jnp.int32), jnp.sum(x != _UNUSED, axis=-1, dtype=jnp.int32)


def _prepare(q, k, v, cell_idx, tile):
  """Pads T to the tile, head_dim and K to powers of two; returns padded arrays and the tile unions."""
  padded_seq = pl.cdiv(q.shape[1], tile) * tile
  cell_idx = pad_axis(pad_axis(cell_idx, 3, pl.next_power_of_2(cell_idx.shape[3]), NO_CELL), 1, padded_seq, NO_CELL)
  unions, counts = tile_unions(cell_idx, tile)
  return pad_axis(pad_head_dim(q), 1, padded_seq), pad_head_dim(k), pad_head_dim(v), cell_idx, unions, counts


def _specs(tile, seq_k, dim, top_k, union, num_tiles):
  """BlockSpecs of (q, k, v, cell_idx, unions, counts) on the grid (tile, batch, head)."""
  return [
    pl.BlockSpec((None, tile, None, dim), lambda i, b, h: (b, i, h, 0)),
    pl.BlockSpec((None, seq_k, None, dim), lambda i, b, h: (b, 0, h, 0)),
    pl.BlockSpec((None, seq_k, None, dim), lambda i, b, h: (b, 0, h, 0)),
    pl.BlockSpec((None, tile, None, top_k), lambda i, b, h: (b, i, h, 0)),
    pl.BlockSpec((None, None, None, union), lambda i, b, h: (b, h, i, 0)),
    pl.BlockSpec((None, None, num_tiles), lambda i, b, h: (b, h, 0)),
  ]


def _row_spec(tile):
  """BlockSpec of a `[batch, heads, T]` per-query row (lse, delta)."""
  return pl.BlockSpec((None, None, tile), lambda i, b, h: (b, h, i))


def _launch_options(sizes, interpret):
  return dict(
    compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages), interpret=interpret
  )


def _forward(q, k, v, cell_idx, cell, sizes, interpret):
  """Returns `(u [batch, T, heads, d], residuals)`."""
  batch, seq, heads, head_dim = q.shape
  tile = min(sizes.queries, pl.next_power_of_2(seq))
  qp, kp, vp, idx, unions, counts = _prepare(q, k, v, cell_idx, tile)
  num_tiles = qp.shape[1] // tile
  kernel = functools.partial(_forward_kernel, cell=cell, scale=1.0 / math.sqrt(head_dim))
  out, lse = pl.pallas_call(
    kernel,
    grid=(num_tiles, batch, heads),
    in_specs=_specs(tile, kp.shape[1], qp.shape[-1], idx.shape[-1], unions.shape[-1], num_tiles),
    out_specs=[pl.BlockSpec((None, tile, None, qp.shape[-1]), lambda i, b, h: (b, i, h, 0)), _row_spec(tile)],
    out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, qp.shape[1]), jnp.float32)],
    name="freesolo_sparse_readout_fwd",
    **_launch_options(sizes, interpret),
  )(qp, kp, vp, idx, unions, counts)
  return out[:, :seq, :, :head_dim], (qp, kp, vp, idx, unions, counts, out, lse)


def cell_readers(unions, num_cells):
  """The inverse of `tile_unions`: per (batch, head) the query tiles that read each cell.

  Returns:
    readers `[batch, heads, tiles·U]` int32 tile indices grouped by cell (ascending), and offsets
    `[batch, heads, num_cells + 1]`: cell c's readers are `readers[offsets[c]:offsets[c + 1]]`.
  """
  batch, heads, num_tiles, union = unions.shape
  cells_flat = unions.reshape(batch, heads, num_tiles * union)
  tiles_flat = jnp.broadcast_to(jnp.repeat(jnp.arange(num_tiles, dtype=jnp.int32), union), cells_flat.shape)
  cells_sorted, readers = jax.lax.sort((cells_flat, tiles_flat), dimension=-1, num_keys=1)
  bounds = jnp.arange(num_cells + 1, dtype=cells_sorted.dtype)
  offsets = jax.vmap(jax.vmap(lambda row: jnp.searchsorted(row, bounds, side="left")))(cells_sorted)
  return readers, offsets.astype(jnp.int32)


def _backward(q, k, cell, sizes, interpret, residuals, d_out):
  batch, seq, heads, head_dim = q.shape
  qp, kp, vp, idx, unions, counts, out, lse = residuals
  tile = min(sizes.queries, pl.next_power_of_2(seq))
  num_tiles, dim = qp.shape[1] // tile, qp.shape[-1]
  d_out = pad_axis(pad_head_dim(d_out.astype(q.dtype)), 1, qp.shape[1])
  delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
  scale = 1.0 / math.sqrt(head_dim)
  q_spec = pl.BlockSpec((None, tile, None, dim), lambda i, b, h: (b, i, h, 0))
  dq = pl.pallas_call(
    functools.partial(_backward_dq_kernel, cell=cell, scale=scale),
    grid=(num_tiles, batch, heads),
    in_specs=[
      *_specs(tile, kp.shape[1], dim, idx.shape[-1], unions.shape[-1], num_tiles),
      q_spec,
      _row_spec(tile),
      _row_spec(tile),
    ],
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
    name="freesolo_sparse_readout_bwd_dq",
    **_launch_options(sizes, interpret),
  )(qp, kp, vp, idx, unions, counts, d_out, lse, delta)

  num_cells = pl.cdiv(kp.shape[1], cell)
  kc, vc = (pad_axis(x, 1, num_cells * cell) for x in (kp, vp))
  readers, offsets = cell_readers(unions, num_cells)
  cell_spec = pl.BlockSpec((None, cell, None, dim), lambda c, b, h: (b, c, h, 0))
  whole = lambda width: pl.BlockSpec((None, qp.shape[1], None, width), lambda c, b, h: (b, 0, h, 0))
  row = lambda length: pl.BlockSpec((None, None, length), lambda c, b, h: (b, h, 0))
  dk, dv = pl.pallas_call(
    functools.partial(_backward_dkv_kernel, cell=cell, tile=tile, scale=scale),
    grid=(num_cells, batch, heads),
    in_specs=[
      cell_spec,
      cell_spec,
      whole(dim),
      whole(idx.shape[-1]),
      whole(dim),
      row(qp.shape[1]),
      row(qp.shape[1]),
      row(readers.shape[-1]),
      row(num_cells + 1),
    ],
    out_specs=[cell_spec, cell_spec],
    out_shape=[jax.ShapeDtypeStruct(kc.shape, k.dtype)] * 2,
    name="freesolo_sparse_readout_bwd_dkv",
    **_launch_options(sizes, interpret),
  )(kc, vc, qp, idx, d_out, lse, delta, readers, offsets)
  trim = lambda x, length: x[:, :length, :, :head_dim]
  return trim(dq, seq), trim(dk, k.shape[1]), trim(dv, k.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _readout(q, k, v, cell_idx, cell, sizes, interpret):
  return _forward(q, k, v, cell_idx, cell, sizes, interpret)[0]


def _readout_fwd(q, k, v, cell_idx, cell, sizes, interpret):
  out, residuals = _forward(q, k, v, cell_idx, cell, sizes, interpret)
  return out, (q, k, residuals)


def _readout_bwd(cell, sizes, interpret, saved, d_out):
  q, k, residuals = saved
  dq, dk, dv = _backward(q, k, cell, sizes, interpret, residuals, d_out)
  return dq, dk, dv, None


_readout.defvjp(_readout_fwd, _readout_bwd)


def sparse_readout(q, k, v, cell_idx, *, cell, block_sizes=None, interpret=None):
  """Kernel twin of `fsjax.ops.sparse_readout` (same arguments and result), differentiable in q, k, v.

  Args:
    q: `[batch, T, heads, d]` unrotated queries (NoPE readout).
    k, v: `[batch, T_k, kv_heads, d]` keys and values (T_k may differ from T, e.g. a decode archive); the
      tiles multiply in the dtype of k. kv_heads divides heads: query head h reads key/value head
      `h // (heads // kv_heads)`.
    cell_idx: `[batch, T, heads, K]` int32 selected cells, -1 for none; each query's cells are distinct.
    cell: cell size `s`.
    block_sizes: `BlockSizes`; interpret: None = compiled on GPU, interpreted elsewhere.

  Returns:
    `u`: `[batch, T, heads, d]` in the dtype of `q`, zero (with zero gradients) where nothing is selected.
  """
  if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
    raise ValueError(
      f"q must be [batch, T, heads, d] and k, v equal [batch, T_k, kv_heads, d], got {q.shape}, {k.shape}, {v.shape}"
    )
  heads, kv_heads = q.shape[2], k.shape[2]
  group_size(heads, kv_heads)
  if cell_idx.shape[:3] != q.shape[:3]:
    raise ValueError(f"cell_idx must be [batch, T, heads, K] matching q {q.shape[:3]}, got {cell_idx.shape}")
  interpret = default_interpret() if interpret is None else interpret
  check_compilable(cell=cell, head_dim=q.shape[-1], interpret=interpret)
  # The tiles multiply in the keys' storage dtype: casting the (short) queries is cheap, casting a decode
  # archive's keys and values would copy all of them at every step.
  u = _readout(
    fold_group(q.astype(k.dtype), kv_heads),
    k,
    v.astype(k.dtype),
    fold_group(cell_idx.astype(jnp.int32), kv_heads),
    cell,
    block_sizes or BlockSizes.get_default(),
    interpret,
  )
  return unfold_group(u, heads).astype(q.dtype)
