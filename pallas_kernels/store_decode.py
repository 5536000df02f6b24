"""The baselines' attention for one decode token over a positional key/value store (TF++'s dense cache, SWA's ring
of w + 1 slots; `fsjax.cache.store`), in one launch per layer that also writes the token into the store, then a
second that merges the parts (`pallas_kernels.decode_parts.merge_parts`).

The grid is (batch row, query head, part): each part walks its run of consecutive slots in tiles with an online
softmax (flash-decoding), so that a batch of one row still fills the GPU and the store is read once, in its
storage dtype, where it lies. The jnp specification is `fsjax.attention.cached.attend_one` over the store after
`fsjax.cache.store.write` of the token: keys at positions j with 0 <= j <= pos (and pos - j <= window for SWA),
the token's own key included. In XLA that step was about a dozen launches per layer (the cache writes, the logits,
the softmax's reductions, the readout), two of which read the whole layer: the logits and the readout.

Slot `pos mod N` holds position `pos`. While `pos < N` (the store has not wrapped: always for a dense cache), the
slots after `pos` hold nothing visible (an empty slot, or a position ≥ its slot index, which is later than
`pos`), so a part skips the tiles past `pos`: a step reads only the filled prefix of a long cache.

The token's writes (its rotated key, value and position into slot `pos mod N`) happen here, in place (the store's
arrays are aliased to outputs): the part holding that slot, in the first query head of each key/value head,
writes them. The parts read the token from their inputs in place of that slot, so they never depend on whether
the write has landed.

A scanned model's stacks `[layers, batch, ...]` are read at the layer index (`fsjax.cache.layered`), so no layer
is copied out per token. Grouped-query attention: query head h reads key/value head `h // group` through its
index maps (each of a group's query heads reads the shared tile: a group of g heads reads the store g times).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import default_interpret, group_size, layer_stack
from pallas_kernels.decode_parts import merge_parts, token_specs

TILE_ELEMENTS = 8192  # keys × head dims loaded per tile: 128 slots at d = 64, 64 at d = 128
TARGET_PARTS = 64  # parts per (row, head): enough programs to fill the GPU at batch 1, few to merge


def compilable(*, head_dim):
  """Whether Triton can tile this geometry: a head's vectors as a power-of-two tile of at least 16."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def tiling(slots, head_dim, tile=None, max_parts=TARGET_PARTS):
  """`(tile, tiles_per_part, parts)`: slots per tile (by default `TILE_ELEMENTS // head_dim`, at least 16), tiles
  per part and parts per (row, head) for a store of `slots` slots: at most `max_parts` parts of whole tiles."""
  tile = tile or max(16, TILE_ELEMENTS // head_dim)
  tiles = -(-slots // tile)
  per_part = -(-tiles // max_parts)
  return tile, per_part, -(-tiles // per_part)


def _store_decode_kernel(
  q_ref,
  k_ref,
  v_ref,
  pos_ref,
  valid_ref,
  layer_ref,
  cache_k_ref,
  cache_v_ref,
  cache_pos_ref,
  o_ref,
  lse_ref,
  k_out,
  v_out,
  pos_out,
  *,
  window,
  slots,
  tile,
  per_part,
  group,
):
  """One (row, query head, part). q_ref `[d]` the rotated query (float32); k_ref, v_ref `[d]` the token's rotated
  key and value in the store's dtype; pos_ref, valid_ref, layer_ref `[1]`; the store's k, v `[layers, N, d]` and
  pos `[layers, N]`, read at layer `layer_ref[0]`. Writes o_ref `[d]` (the part's softmax over its own keys) and
  lse_ref `[1]` (their log-sum-exp, -inf for none); the part holding slot `pos mod N`, in a key/value head's first
  query head, writes the token into the aliased k_out, v_out and pos_out."""
  head, part = pl.program_id(1), pl.program_id(2)
  pos, valid, layer = pos_ref[0], valid_ref[0] != 0, layer_ref[0]
  slot = pos % slots
  first = part * per_part * tile
  k_new, v_new = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
  q = q_ref[...].astype(jnp.float32) / math.sqrt(q_ref.shape[0])
  lane = jnp.arange(tile)

  @pl.when(valid & (head % group == 0) & (slot // (per_part * tile) == part))
  def _():
    k_out[layer, slot, :] = k_ref[...]
    v_out[layer, slot, :] = v_ref[...]

    @pl.when(head == 0)
    def _():
      pos_out[layer, pl.ds(slot, 1)] = jnp.full((1,), pos, pos_out.dtype)

  def body(t, carry):
    top, total, acc = carry
    start = first + t * tile
    at = start + lane
    inside = at < slots
    load = lambda ref, mask, other: plgpu.load(ref.at[layer, pl.ds(start, tile)], mask=mask, other=other)
    mine = valid & (at == slot)
    k_pos = jnp.where(mine, pos, load(cache_pos_ref, inside, -1))
    keys = jnp.where(mine[:, None], k_new[None, :], load(cache_k_ref, inside[:, None], 0).astype(jnp.float32))
    values = jnp.where(mine[:, None], v_new[None, :], load(cache_v_ref, inside[:, None], 0).astype(jnp.float32))
    seen = inside & (k_pos >= 0) & (k_pos <= pos)
    if window is not None:
      seen &= pos - k_pos <= window
    logits = jnp.where(seen, jnp.sum(keys * q[None, :], axis=1), -jnp.inf)
    new_top = jnp.maximum(top, jnp.max(logits))
    shift = jnp.where(new_top > -jnp.inf, new_top, 0.0)
    rescale = jnp.exp(top - shift)  # 0 while nothing was seen (top = -inf)
    p = jnp.exp(logits - shift)
    return new_top, total * rescale + jnp.sum(p), acc * rescale + jnp.sum(p[:, None] * values, axis=0)

  # Tiles past `pos` hold nothing visible until the store wraps (module docstring).
  live = jnp.where(pos >= slots, per_part, jnp.clip((pos - first) // tile + 1, 0, per_part))
  init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros(q.shape, jnp.float32))
  top, total, acc = jax.lax.fori_loop(0, live, body, init)
  some = total > 0
  o_ref[...] = jnp.where(some, acc / jnp.where(some, total, 1.0), 0.0)
  lse_ref[...] = jnp.full(lse_ref.shape, jnp.where(some, top + jnp.log(jnp.where(some, total, 1.0)), -jnp.inf))


@functools.partial(jax.jit, static_argnames=("window", "out_dtype", "tile", "max_parts", "interpret"))
def store_decode(
  q_rot,
  k_rot,
  v,
  pos,
  valid,
  store,
  *,
  window=None,
  out_dtype=jnp.float32,
  layer=None,
  tile=None,
  max_parts=TARGET_PARTS,
  interpret=None,
):
  """One decode token per row over a key/value store: the token written into slot `pos mod N`, then its
  attention over the store's keys at positions `0 <= j <= pos` (`pos - j <= window` where given).

  Args:
    q_rot: `[batch, heads, d]` the token's RoPE-rotated query.
    k_rot, v: `[batch, kv_heads, d]` its rotated key and its value (cast to the store's dtype).
    pos: `[batch]` int32 its position; valid: `[batch]` bool (an invalid row writes nothing and its token is not
      a key; its output is that of the store as it is).
    store: dict k, v `[batch, N, kv_heads, d]`, pos `[batch, N]` (int32, -1 = empty), or with `layer` (int32
      scalar) a scanned model's stacks `[layers, ...]` of those shapes, read and written at that layer.
    window: SWA's look-back radius, None for TF++.
    out_dtype: the output's dtype.
    tile, max_parts: the split of the store over programs (`tiling`; the defaults suit a GPU, tests take small
      ones to cover many parts of several tiles).

  Returns:
    o `[batch, heads, d]` in `out_dtype` (computed in float32; zero where a row sees no key), and the store after
    the token's write as a dict of the same arrays (stacks with `layer`). Under `jit` with the store donated or
    dead after the call, XLA writes it in place.
  """
  interpret = default_interpret() if interpret is None else interpret
  batch, heads, dim = q_rot.shape
  stacks = {}
  for name, ndim in (("k", 4), ("v", 4), ("pos", 2)):
    stacks[name], layer_index = layer_stack(store[name], layer, ndim)
  layers, _, slots, kv_heads, _ = stacks["k"].shape
  group = group_size(heads, kv_heads)
  tile, per_part, parts = tiling(slots, dim, tile, max_parts)
  padded = pl.next_power_of_2(parts)
  dtype = stacks["k"].dtype

  row, kv_row, per_row = token_specs(dim, group)
  store_specs = [
    pl.BlockSpec((layers, None, slots, None, dim), lambda b, h, z: (0, b, 0, h // group, 0)),
    pl.BlockSpec((layers, None, slots, None, dim), lambda b, h, z: (0, b, 0, h // group, 0)),
    pl.BlockSpec((layers, None, slots), lambda b, h, z: (0, b, 0)),
  ]
  inputs = [q_rot.astype(jnp.float32), k_rot.astype(dtype), v.astype(dtype), pos.astype(jnp.int32)]
  inputs += [valid.astype(jnp.int32), layer_index, stacks["k"], stacks["v"], stacks["pos"]]
  o, lse, *written = pl.pallas_call(
    functools.partial(_store_decode_kernel, window=window, slots=slots, tile=tile, per_part=per_part, group=group),
    grid=(batch, heads, parts),
    in_specs=[row, kv_row, kv_row, per_row, per_row, pl.BlockSpec((1,), lambda b, h, z: (0,)), *store_specs],
    out_specs=[
      pl.BlockSpec((None, None, None, dim), lambda b, h, z: (b, h, z, 0)),
      pl.BlockSpec((None, None, 1), lambda b, h, z: (b, h, z)),
      *store_specs,
    ],
    out_shape=[
      jax.ShapeDtypeStruct((batch, heads, padded, dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, padded), jnp.float32),
      *(jax.ShapeDtypeStruct(stacks[name].shape, stacks[name].dtype) for name in ("k", "v", "pos")),
    ],
    input_output_aliases={6: 2, 7: 3, 8: 4},
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="kv_store_decode",
  )(*inputs)
  out = merge_parts(o, lse, parts=parts, out_dtype=out_dtype, interpret=interpret)
  unstack = (lambda x: x) if layer is not None else (lambda x: x[0])
  return out, {name: unstack(x) for name, x in zip(("k", "v", "pos"), written)}
