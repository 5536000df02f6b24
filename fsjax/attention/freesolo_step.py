"""FreeSolo attention over the decode caches (FS Sec. 3.3 "Inference", App. C, App. E.1): one chunk of a
prefill or one decode token, with the caches of `fsjax.cache` as state and the operators of `fsjax.ops` (which
own the kernel choice) as maths.

- The FS archive (FS, and FS-B's): the local branch reads the archive's ring of rotated keys and the chunk;
  selection scores the cached cell summaries (Eq. 6-8) or, for FS-B, rebuilds the forests from them (Eq. 10-12)
  or searches the forest cache's; the readout gathers the selected cells (Eq. 9); the branches are mixed (Eq. 2).
  One token per row runs `pallas_kernels.archive_decode` after the selection where `impl` picks it.
- FS-B's forest cache: a one-token step advances the cached forests to its block and beam-searches them (Eq. 11),
  then reranks with token keys (Eq. 12); a longer chunk does the same block by block (`blockwise_select`) and
  leaves the forests past its last complete block.
- FS-L's bounded cache: segment by segment within query blocks, the local branch over the ring plus the segment,
  the long-range branch over `pool ∪ recent` (Eq. 8) and their mix (Eq. 2: FS-L's steps return the layer's
  attention output, so that one token's step can mix in its kernels), then the cache update (Eq. 15).

With grouped-query attention every cache holds its state per key/value head (tokens, summaries, FS-L's pool and
recent cells, FS-B's forests); queries `[batch, C, heads, d]` read the state of key/value head `h // group`.
"""

import functools
import math

import jax
import jax.numpy as jnp

from fsjax import ops
from fsjax.attention.cached import attend, by_head_groups
from fsjax.cache import archive as archive_cache
from fsjax.cache import bounded, forest
from fsjax.cache import store as kv_store
from fsjax.cache.archive import Archive
from fsjax.cache.forest import ForestCache
from fsjax.cache.layered import LayerSlice, after, kernel_arrays, read, rewritten
from fsjax.ops import dispatch
from fsjax.ops.freesolo import cached_readout, cached_readout_runs_kernel
from fsjax.reference import cells as cells_ref
from fsjax.reference import forest as forest_ref
from fsjax.reference.common import PRECISION
from fsjax.reference.freesolo import READOUT_NORM_EPS, mix_branches, rms_norm
from fsjax.reference.grouped import group_size, kv_head_of, per_query_head
from fsjax.reference.rope import apply_rope
from fsjax.reference.routing import Routing
from fsjax.reference.softmax import masked_softmax
from pallas_kernels import archive_decode, bounded_decode, cell_scoring

NO_CELL = -1


def archive_local(archive: Archive, q_rot, k_rot, v, pos, valid, *, window):
  """Eq. 3-4 for a chunk's rotated queries at `pos` `[batch, C]` (`valid` `[batch, C]`) over the archive's ring,
  which holds the w + 1 tokens before the chunk (read before the chunk is written), and the chunk's own rotated
  keys: O(w + C) keys per query, whatever the archive's length. Returns `[batch, C, heads, d]`."""
  return attend(q_rot, pos, *kv_store.concat(archive.ring, k_rot, v, pos, valid), window=window)


def archive_select(archive: Archive, q, pos, routing: Routing, *, lam, sigma, tau=None, impl="reference", ranges=False):
  """Top-K cells (Eq. 6-8; FS-B Eq. 10-12 rebuilt from the summaries) for queries at `pos`:
  `[batch, C, heads, K]`, -1 for none. No gradient. `ranges` (FS only): `(cells, scores)`, the scoring kernel's
  candidates unmerged where it runs, else the top-K and None (`fsjax.ops.select_from_summaries`)."""
  if routing.variant == "fsb":
    return fsb_archive_select(archive, q, pos, routing, lam=read(lam), sigma=read(sigma), tau=tau)
  # The summaries, λ and σ as they lie (views into a scanned model's stacks): the scoring kernel reads the layer
  # in place.
  mean_keys, max_norms = archive.mean_keys, archive.max_norms
  return ops.select_from_summaries(
    q, pos, mean_keys, max_norms, routing=routing, lam=lam, sigma=sigma, impl=impl, ranges=ranges
  )


def fsb_archive_select(archive: Archive, q, pos, routing: Routing, *, lam, sigma, tau):
  """FS-B's cells (Eq. 10-12) from forests rebuilt over the archive's summaries, `[batch, C, heads, K]`. The
  forests of a long archive are large (`dispatch.forest_head_groups`), so groups of key/value heads (with the
  query heads that read them) run one after another; they are independent, so the cells are those of one call
  over all heads."""
  k, mean_keys, max_norms = read(archive.tokens.k), read(archive.mean_keys), read(archive.max_norms)
  batch, count, heads, head_dim = q.shape
  kv_heads = max_norms.shape[2]
  per_kv = group_size(heads, kv_heads)
  select = functools.partial(
    forest_ref.fsb_select_from_summaries,
    cell=routing.cell,
    block=routing.block,
    top_k=routing.top_k,
    beam=routing.beam,
    bound_c=routing.bound_c,
  )

  def heads_from(start, size):  # key/value heads start .. start+size, their summaries, query heads and parameters
    take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, size, axis)
    take_q = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start * per_kv, size * per_kv, axis)
    return select(
      take_q(q, 2),
      pos,
      take(k, 2).astype(q.dtype),
      take(mean_keys, 2).astype(q.dtype),
      take(max_norms, 2).astype(q.dtype),
      tau=take(tau, 0),
      lam=take_q(lam, 0),
      sigma=take_q(sigma, 0),
    )

  groups = dispatch.forest_head_groups(batch, max_norms.shape[1], kv_heads, head_dim)
  if groups == 1:
    return heads_from(0, kv_heads)
  size = kv_heads // groups
  cells = jax.lax.map(lambda group: heads_from(group * size, size), jnp.arange(groups))  # [groups, b, C, .., K]
  return jnp.moveaxis(cells, 0, 2).reshape(batch, count, heads, routing.top_k)


def archive_long_range(
  archive: Archive, q, pos, routing: Routing, *, lr_gain, lam, sigma, tau=None, impl="reference", selected=None
):
  """Eq. 9 for queries at `pos`: `(o_lr [batch, C, heads, d], selected cells [batch, C, heads, K])`.

  `selected`: cells already chosen `[batch, C, heads, K]` (by FS-B's forest cache), else chosen here.
  """
  cell_idx = selected
  if cell_idx is None:
    cell_idx = archive_select(archive, q, pos, routing, lam=lam, sigma=sigma, tau=tau, impl=impl)
  k, v = archive.tokens.k, archive.tokens.v
  batch, slots, heads, head_dim = k.shape
  copied = isinstance(k, LayerSlice) and cached_readout_runs_kernel(q, cell=routing.cell, impl=impl)
  groups = dispatch.cache_head_groups(batch, slots, heads, head_dim, k.dtype, copied=copied)
  readout = lambda q, k, v, cells: cached_readout(q, k, v, cells, cell=routing.cell, impl=impl)
  u = by_head_groups(readout, groups, q, k, v, cell_idx)  # the kernel's copy of the layer, a group at a time
  return rms_norm(u.astype(q.dtype), lr_gain), cell_idx


def forest_search(forests: forest.Forest, q, pos, routing: Routing, *, lam, sigma, forest_sets=1, impl="reference"):
  """Beam search (Eq. 11) of queries `[batch, C, heads, d]` at `pos` `[batch, C]`, all in the block the forests
  were advanced to: `[batch, C, heads, forest_sets · beam]` cells (NO_NODE pad), set by set. The forests form
  `forest_sets` sets, and query head h searches forest `h // group` of each (see `ops.forest_beam_search`)."""
  if isinstance(forests.root, LayerSlice):  # the kernel reads the stacks in place; `read` would copy the layer
    nodes, layer = {name: x.stack for name, x in forests.nodes.items()}, forests.root.layer
    roots, counts = forests.root.stack, forests.count.stack
  else:
    nodes, layer, roots, counts = forests.nodes, None, forests.root, forests.count
  return ops.forest_beam_search(
    q,
    pos,
    roots,
    counts,
    nodes,
    lam,
    sigma,
    beam=routing.beam,
    steps=forest.num_levels_of(forests),
    bound_c=routing.bound_c,
    cell=routing.cell,
    forest_sets=forest_sets,
    layer=layer,
    impl=impl,
  )


def forest_select(cache: ForestCache, q, pos, routing: Routing, *, lam, sigma, impl="reference", rerank=True):
  """FS-B's top-K cells (Eq. 11-12) for queries `[batch, C, heads, d]` at `pos`, all in the block the forests
  were advanced to: `[batch, C, heads, top_k]` int32, NO_NODE in unused slots. No gradient. The rerank reads at
  most 2·beam cells per query and stays in XLA; `rerank=False` returns the candidates it would rerank, `[batch,
  C, heads, 2·beam]` (forest 0's beam, then forest τ's), for a kernel that reranks them as it reads them. The
  forests are per key/value head: forest 0 of each, then its forest τ (two sets), `group` query heads apiece."""
  q = jax.lax.stop_gradient(q).astype(cache.forests.nodes["mu"].dtype)
  candidates = forest_search(cache.forests, q, pos, routing, lam=lam, sigma=sigma, forest_sets=2, impl=impl)
  if not rerank:
    return candidates
  archive = cache.archive
  # The keys stay in the archive's dtype: the rerank converts only the ≤ 2·beam cells it gathers.
  return forest_ref.rerank_candidates(
    q,
    pos,
    read(archive.tokens.k),
    read(archive.max_norms).astype(q.dtype),
    candidates,
    lam=lam,
    sigma=sigma,
    cell=routing.cell,
    top_k=routing.top_k,
  )


def streaming_select(
  cache: ForestCache, q, positions, valid, routing: Routing, *, lam, sigma, tau, impl="reference", rerank=True
):
  """FS-B through the forest cache: `(cache advanced past the chunk's complete blocks, cells [batch, C, heads,
  K])`. A one-token step advances the forests to its own block (unless the cache says the model did so already,
  `ForestCache.advanced`) and beam-searches them (`rerank=False`: the candidates, see `forest_select`); a longer
  chunk (its queries consecutive in each row) goes block by block (`blockwise_select`)."""
  cell, block = routing.cell, routing.block
  if q.shape[1] > 1:
    return blockwise_select(cache, q, positions, valid, routing, lam=lam, sigma=sigma, tau=tau, impl=impl)
  if not cache.advanced:  # else the model advanced every layer's forests before the layers (`advance_forests`)
    cache = forest.advance_for_token(cache, positions, valid, tau, cell=cell, block=block)
  return cache, forest_select(cache, q, positions, routing, lam=lam, sigma=sigma, impl=impl, rerank=rerank)


def blockwise_select(cache: ForestCache, q, positions, valid, routing: Routing, *, lam, sigma, tau, impl="reference"):
  """FS-B's cells (Eq. 10-12) for a chunk of consecutive positions per row, one block at a time: the forests
  advance to the start of each block the chunk touches (block-boundary availability, as in training) and
  beam-search that block's queries. A chunk thus costs its own blocks, where rebuilding every forest over the
  archive (the prefill formulation, `fsb_archive_select`) costs the whole context per chunk. The forests never
  advance past the cells a row's valid tokens completed, so padding reaches no state.

  Returns:
    (cache advanced past the chunk's complete blocks, cells `[batch, C, heads, K]` int32, -1 for none).
  """
  cell, block = routing.cell, routing.block
  batch, count, heads, _ = q.shape
  last = forest.eligible_after(positions, valid, cache.admitted, cell=cell, block=block)
  first_block = positions[:, 0] // block
  offset = first_block * block - positions[:, 0] + block  # where each row's first block starts, chunk padded by a block
  pad = lambda x: jnp.pad(x, [(0, 0), (block, block)] + [(0, 0)] * (x.ndim - 2))
  window = jax.vmap(lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, block, axis=0))
  put = jax.vmap(lambda x, update, start: jax.lax.dynamic_update_slice_in_dim(x, update, start, axis=0))
  q_padded, positions_padded = pad(q), pad(positions)

  def one_block(carry, j):
    cache, cells = carry
    start = offset + j * block  # [batch]
    target = jnp.minimum((first_block + j) * (block // cell), last)
    cache = forest.advance(cache, target, tau, cell=cell, block=block)
    chosen = forest_select(
      cache, window(q_padded, start), window(positions_padded, start), routing, lam=lam, sigma=sigma, impl=impl
    )
    index = start[:, None] + jnp.arange(block) - block  # each window slot's index in the chunk
    inside = (index >= 0) & (index < count)
    chosen = jnp.where(inside[:, :, None, None], chosen, window(cells, start))
    return (cache, put(cells, chosen, start)), None

  blocks = (count + block - 2) // block + 1  # the most blocks `count` consecutive positions touch
  cells = jnp.full((batch, count + 2 * block, heads, routing.top_k), NO_CELL, jnp.int32)
  (cache, cells), _ = jax.lax.scan(one_block, (cache, cells), jnp.arange(blocks))
  return forest.advance(cache, last, tau, cell=cell, block=block), cells[:, block : block + count]


def archive_chunk(
  cache,
  q,
  k,
  v,
  positions,
  valid,
  routing: Routing,
  *,
  rope_theta,
  lam,
  sigma,
  lr_gain,
  alpha,
  tau=None,
  out_dtype=None,
  impl="reference",
  rope_table=None,
):
  """One chunk through an FS `Archive` or FS-B `ForestCache`: `(o, cells, new cache)`, o `[batch, C, heads, d]` the
  mixed branches (Eq. 2) in `out_dtype` (default q's) and the cells `[batch, C, heads, K]`. One token per row runs
  `pallas_kernels.archive_decode` after the selection where `impl` picks it ("archive_decode"). `lam`, `sigma`
  `[heads]`, `alpha` `[heads]` and `lr_gain` `[d]`, or (a scanned model's step) `LayerSlice`s of their `[layers,
  ...]` stacks at the cache's layer, which the kernels read where they lie. `rope_table`: the `RotaryTable` for
  `positions`, if made beforehand (a one-token step's, shared by the layers)."""
  out_dtype = q.dtype if out_dtype is None else out_dtype
  streaming = isinstance(cache, ForestCache)
  archive = cache.archive if streaming else cache
  q_rot, k_rot = apply_rope(q, positions, rope_theta, rope_table), apply_rope(k, positions, rope_theta, rope_table)
  facts = dict(tokens=q.shape[1], cell=routing.cell, head_dim=q.shape[-1])
  if q.shape[1] == 1 and dispatch.resolve("archive_decode", impl, **facts) == "pallas":
    return archive_token_kernel(
      cache,
      q,
      q_rot,
      k,
      k_rot,
      v,
      positions,
      valid,
      routing,
      dict(lam=lam, sigma=sigma, tau=tau, alpha=alpha, lr_gain=lr_gain),
      out_dtype=out_dtype,
      impl=impl,
    )
  lam, sigma = read(lam), read(sigma)
  lr_gain, alpha = (read(x).astype(q.dtype) for x in (lr_gain, alpha))
  local = archive_local(archive, q_rot, k_rot, v, positions, valid, window=routing.window)
  written_at = after(positions, local)  # the ring's write below updates the ring this read, in place
  archive = archive_cache.extend(archive, k, k_rot, v, written_at, valid, routing.cell)
  selected = None
  if streaming:
    cache, selected = streaming_select(
      cache.replace(archive=archive), q, positions, valid, routing, lam=lam, sigma=sigma, tau=tau, impl=impl
    )
  else:
    cache = archive
  long_range, cell_idx = archive_long_range(
    archive, q, positions, routing, lr_gain=lr_gain, lam=lam, sigma=sigma, tau=tau, impl=impl, selected=selected
  )
  return mix_branches(local.astype(q.dtype), long_range, alpha).astype(out_dtype), cell_idx, cache


def archive_token_kernel(cache, q, q_rot, k, k_rot, v, pos, valid, routing: Routing, weights, *, out_dtype, impl):
  """`archive_chunk` for one token per row through `pallas_kernels.archive_decode`: the selection first (FS's
  scoring kernel over the summaries, or FS-B's search of its forests, advanced to the token's block), then one
  kernel writes the token into the archive and its ring, recomputes its cell's summary and computes both
  branches, and a second mixes them. `weights`: lam, sigma, tau, alpha, lr_gain as `archive_chunk`
  takes them. The selection never reads the token's cell (Eq. 6: only cells of earlier blocks), so it may run
  before the write. FS's scoring kernel hands the kernel its cell ranges' candidates unmerged (the kernel ranks
  them); the step's returned cells merge them in XLA, which drops that merge unless the cells are used. FS-B's
  beams hand it their 2·beam leaf cells, which it reads and reranks (Eq. 12) itself."""
  streaming = isinstance(cache, ForestCache)
  archive = cache.archive if streaming else cache
  lam, sigma, tau = weights["lam"], weights["sigma"], weights["tau"]
  scores = None
  if streaming:
    cache, cells = streaming_select(
      cache, q, pos, valid, routing, lam=read(lam), sigma=read(sigma), tau=tau, impl=impl, rerank=False
    )
  else:
    cells, scores = archive_select(archive, q, pos, routing, lam=lam, sigma=sigma, tau=tau, impl=impl, ranges=True)
  fields = dict(ring_k=archive.ring.k, ring_v=archive.ring.v, ring_pos=archive.ring.pos)
  fields.update(tokens_k=archive.tokens.k, tokens_v=archive.tokens.v, tokens_pos=archive.tokens.pos)
  fields.update(mean_keys=archive.mean_keys, max_norms=archive.max_norms)
  fields, layer = kernel_arrays(fields)
  alpha, lr_gain = (_at_layer(weights[name], layer) for name in ("alpha", "lr_gain"))
  prior = tuple(_at_layer(weights[name], layer) for name in ("lam", "sigma")) if streaming else None
  o, written, reranked = archive_decode.archive_decode(
    q[:, 0],
    q_rot[:, 0],
    k_rot[:, 0],
    k[:, 0],
    v[:, 0],
    pos[:, 0],
    valid[:, 0],
    cells[:, 0],
    alpha,
    lr_gain,
    fields,
    window=routing.window,
    cell=routing.cell,
    eps=READOUT_NORM_EPS,
    out_dtype=jnp.dtype(out_dtype),
    scores=None if scores is None else scores[:, 0],
    top_k=routing.top_k,
    rerank_prior=prior,
    layer=layer,
  )
  if scores is not None:
    cells = cell_scoring.merge_ranges(cells, scores, routing.top_k)
  if streaming:
    cells = reranked[:, None]
  ring, tokens = archive.ring, archive.tokens
  archive = archive.replace(
    ring=ring.replace(**{f: rewritten(getattr(ring, f), written[f"ring_{f}"]) for f in ("k", "v", "pos")}),
    tokens=tokens.replace(**{f: rewritten(getattr(tokens, f), written[f"tokens_{f}"]) for f in ("k", "v", "pos")}),
    mean_keys=rewritten(archive.mean_keys, written["mean_keys"]),
    max_norms=rewritten(archive.max_norms, written["max_norms"]),
  )
  return o[:, None], cells, cache.replace(archive=archive) if streaming else archive


def fill(cache, k, v, positions, valid, routing: Routing, *, rope_theta, tau=None):
  """The cache after an empty one takes a prompt's first chunk (positions `0..C-1` in every row, `valid` marking
  each row's prompt), written in bulk: the state that chunk-by-chunk extension (`archive_chunk`,
  `bounded_chunk`) reaches. The chunk's outputs come from the training operator, which is causal, so the
  padding after a row's prompt changes none of them.

  Args:
    cache: an empty `Archive`, `ForestCache` or `BoundedCache`; k, v: `[batch, C, heads, d]` unrotated, in the
      compute dtype; positions, valid: `[batch, C]`.
  """
  k_rot = apply_rope(k, positions, rope_theta)
  if isinstance(cache, bounded.BoundedCache):
    return bounded.fill(cache, k_rot, k, v, positions, valid)
  streaming = isinstance(cache, ForestCache)
  archive = archive_cache.extend(cache.archive if streaming else cache, k, k_rot, v, positions, valid, routing.cell)
  if not streaming:
    return archive
  target = forest.eligible_after(positions, valid, cache.admitted, cell=routing.cell, block=routing.block)
  return forest.advance(cache.replace(archive=archive), target, tau, cell=routing.cell, block=routing.block)


def bounded_long_range(cache: bounded.BoundedCache, q, pos, routing: Routing, *, lam, sigma, lr_gain):
  """Eq. 7-9 for queries at `pos` over `pool ∪ recent` (Eq. 8): (o_lr `[batch, C, heads, d]`, cells `[.., K]`).
  The cache's cells are per key/value head; each query head scores its key/value head's candidates (their ids
  and summaries read per query head, small) and gathers only the K cells it selected, from where they lie."""
  ids, mean, norm, source = bounded.candidates(cache)  # [batch, kv_heads, N, ..]
  _, _, heads, head_dim = q.shape
  kv_of = kv_head_of(heads, ids.shape[1])
  ids, mean, norm, source = (per_query_head(x, heads, axis=1) for x in (ids, mean, norm, source))
  q_sel = jax.lax.stop_gradient(q)
  content = jnp.einsum("bthd,bhnd->bthn", q_sel, mean, precision=PRECISION) / math.sqrt(head_dim)
  distance = pos.astype(q.dtype)[:, :, None, None] - (ids.astype(q.dtype)[:, None] + 0.5) * routing.cell
  prior = jax.scipy.special.erf(distance / (2.0 * sigma[:, None]))  # [batch, C, heads, N]
  scores = content + lam[:, None] * norm[:, None] * prior  # Eq. 7
  available = jnp.broadcast_to((ids >= 0)[:, None], scores.shape)
  slots = cells_ref.top_k_cells(scores, available, routing.top_k)  # slots sorted by cell id: ties → lower id
  at_slots = lambda x: jnp.take_along_axis(jnp.broadcast_to(x[:, None], scores.shape), jnp.maximum(slots, 0), -1)
  selected = jnp.where(slots >= 0, at_slots(ids), NO_CELL)
  k_sel, v_sel = bounded.cell_keys_values(cache, at_slots(source), kv_of)  # [batch, C, heads, K, s, d]
  logits = jnp.einsum("bthd,bthksd->bthks", q, k_sel, precision=PRECISION) / math.sqrt(head_dim)
  probs = masked_softmax(logits, (slots >= 0)[..., None], axis=(-2, -1))
  u = jnp.einsum("bthks,bthksd->bthd", probs, v_sel, precision=PRECISION)  # Eq. 9
  return rms_norm(u, lr_gain), selected


def _kernel_fields(cache: bounded.BoundedCache):
  """The bounded cache's arrays as `pallas_kernels.bounded_decode` takes them, and the layer (None unless they
  are views into a scanned model's stacks, which the kernel then reads where they lie)."""
  fields = dict(ring_k=cache.ring.k, ring_v=cache.ring.v, ring_pos=cache.ring.pos)
  fields.update(block_k=cache.block_k, block_v=cache.block_v)
  for name in ("ids", "mean", "norm", "k", "v"):
    fields[f"pool_{name}"], fields[f"recent_{name}"] = getattr(cache, f"pool_{name}"), getattr(cache, f"recent_{name}")
  return kernel_arrays(fields)


def _at_layer(x, layer):
  """λ or σ for the kernel beside a cache read at `layer`: a scanned model's stack `[layers, heads]` (the kernel
  reads it at `layer` where it lies) or `[heads]`; read out of its stack where the cache is not stacked."""
  if not isinstance(x, LayerSlice):
    return x
  return x.stack if layer is not None else read(x)


def _with_written(cache: bounded.BoundedCache, written):
  """`cache` holding the arrays the kernel wrote (`bounded_decode.WRITTEN`; stacks where the cache holds views)."""
  ring = cache.ring
  ring = ring.replace(**{f: rewritten(getattr(ring, f), written[f"ring_{f}"]) for f in ("k", "v", "pos")})
  return cache.replace(
    ring=ring,
    block_k=rewritten(cache.block_k, written["block_k"]),
    block_v=rewritten(cache.block_v, written["block_v"]),
  )


def bounded_token_kernel(
  cache: bounded.BoundedCache, q, k, v, pos, valid, routing: Routing, weights, *, rope_theta, out_dtype, rope_table=None
):
  """`bounded_segment` for one token per row through `pallas_kernels.bounded_decode`: one kernel writes the token
  into the ring and the block buffer and computes both branches and the selection, a second mixes them; a
  completed block is merged after them (or after the last layer, where the cache defers merges). `weights`: the
  layer's lam, sigma, alpha and lr_gain, as `bounded_segment` takes them; `rope_table` as there."""
  q_rot, k_rot = apply_rope(q, pos, rope_theta, rope_table), apply_rope(k, pos, rope_theta, rope_table)
  fields, layer = _kernel_fields(cache)
  lam, sigma, alpha, lr_gain = (_at_layer(weights[name], layer) for name in ("lam", "sigma", "alpha", "lr_gain"))
  o, selected, written = bounded_decode.bounded_decode(
    q[:, 0],
    q_rot[:, 0],
    k_rot[:, 0],
    k[:, 0],
    v[:, 0],
    pos[:, 0],
    valid[:, 0],
    lam,
    sigma,
    alpha,
    lr_gain,
    fields,
    window=routing.window,
    cell=routing.cell,
    top_k=routing.top_k,
    eps=READOUT_NORM_EPS,
    out_dtype=jnp.dtype(out_dtype),
    layer=layer,
  )
  cache = _with_written(cache, written)
  o = o[:, None]
  if cache.defer_merge:
    return o, selected[:, None], cache
  pos = after(pos, o)  # the merge updates the pool the kernel read, in place: order it after the read
  return o, selected[:, None], bounded.merge_completed(cache, pos, valid)


def bounded_segment(
  cache: bounded.BoundedCache,
  q,
  k,
  v,
  pos,
  valid,
  routing: Routing,
  *,
  rope_theta,
  lam,
  sigma,
  lr_gain,
  alpha,
  out_dtype=None,
  impl="reference",
  rope_table=None,
):
  """Queries/keys at `pos` `[batch, L]`, every row's valid tokens inside one query block, in order:
  `(o, cells, new cache)` (the cache merged at the end of a completed block), o `[batch, L, heads, d]` the mixed
  branches (Eq. 2) in `out_dtype` (default q's). One token per row runs the fused kernels where `impl` picks them
  (`fsjax.ops.dispatch`, "bounded_decode"). `lam`, `sigma` `[heads]`, `alpha` `[heads]` and `lr_gain` `[d]`, or
  (a scanned model's step) `LayerSlice`s of their `[layers, ...]` stacks at the cache's layer, which the kernels
  read where they lie. `rope_table`: the `RotaryTable` for `pos`, if made beforehand (a one-token step's, shared
  by the layers)."""
  out_dtype = q.dtype if out_dtype is None else out_dtype
  facts = dict(tokens=q.shape[1], cell=routing.cell, head_dim=q.shape[-1])
  if q.shape[1] == 1 and dispatch.resolve("bounded_decode", impl, **facts) == "pallas":
    weights = dict(lam=lam, sigma=sigma, alpha=alpha, lr_gain=lr_gain)
    return bounded_token_kernel(
      cache, q, k, v, pos, valid, routing, weights, rope_theta=rope_theta, out_dtype=out_dtype, rope_table=rope_table
    )
  lam, sigma = read(lam), read(sigma)
  lr_gain, alpha = (read(x).astype(q.dtype) for x in (lr_gain, alpha))
  q_rot, k_rot = apply_rope(q, pos, rope_theta, rope_table), apply_rope(k, pos, rope_theta, rope_table)
  local = attend(q_rot, pos, *bounded.concat_ring(cache, k_rot, v, pos, valid), window=routing.window)
  long_range, selected = bounded_long_range(cache, q, pos, routing, lam=lam, sigma=sigma, lr_gain=lr_gain)
  o = mix_branches(local.astype(q.dtype), long_range, alpha).astype(out_dtype)
  pos = after(pos, o)  # the writes below update the buffers these read in place
  return o, selected, bounded.write_segment(cache, k_rot, k, v, pos, valid)


def bounded_chunk(
  cache: bounded.BoundedCache,
  q,
  k,
  v,
  positions,
  valid,
  routing: Routing,
  *,
  rope_theta,
  lam,
  sigma,
  lr_gain,
  alpha,
  out_dtype=None,
  impl="reference",
  rope_table=None,
):
  """A chunk of one token or whole query blocks through FS-L's bounded cache, block by block (availability
  changes at block boundaries): `(o, cells, new cache)`, o the mixed branches (Eq. 2) as `bounded_segment` gives
  them. The blocks run in a `lax.scan`, so a chunk compiles one block's program whatever its length.
  `rope_table`: the `RotaryTable` for `positions` if made beforehand, used by a chunk of one block or less."""
  chunk, block = q.shape[1], routing.block
  if chunk > 1 and chunk % block:
    raise ValueError(
      f"a chunk for the FS-L bounded cache must be 1 token or whole blocks, got {chunk} tokens with block={block}"
    )
  segment = functools.partial(
    bounded_segment,
    routing=routing,
    rope_theta=rope_theta,
    lam=lam,
    sigma=sigma,
    lr_gain=lr_gain,
    alpha=alpha,
    out_dtype=out_dtype,
    impl=impl,
  )
  if chunk <= block:
    return segment(cache, q, k, v, positions, valid, rope_table=rope_table)
  # [batch, chunk, ...] -> [chunk // block, batch, block, ...]: the scan's leading axis is the block.
  by_block = lambda x: jnp.moveaxis(x.reshape(x.shape[0], chunk // block, block, *x.shape[2:]), 1, 0)
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], chunk, *x.shape[3:])

  def one_block(cache, inputs):
    *outputs, cache = segment(cache, *inputs)
    return cache, outputs

  cache, outputs = jax.lax.scan(one_block, cache, tuple(by_block(x) for x in (q, k, v, positions, valid)))
  o, cell_idx = (unblock(x) for x in outputs)
  return o, cell_idx, cache
