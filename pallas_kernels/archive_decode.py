"""FS's and FS-B's attention for one decode token over the archive (FS Sec. 3.3 "Inference", Eq. 3-4 and 9), given
the cells its selection chose, in one launch per layer that also writes the token into the archive and its ring.
The grid is (batch row, query head, part), T + K parts per head:

  - parts 0 .. T-1: the local branch (Eq. 3-4) over one tile of the archive's ring of rotated keys each, the token
    in its slot (`pallas_kernels.decode_parts.ring_part`, as FS-L's kernel reads its own ring);
  - parts T .. T+K-1: the readout (Eq. 9) of the selected cell of that rank, its s keys and values read from the
    archive where they lie (slot = position), none where the selection found fewer than K cells.

A second launch merges the parts and mixes the branches (`decode_parts.mix_branches`). The selection is not here:
FS scores the archive's cell summaries with `pallas_kernels.cell_scoring` (every cell, its own launch), FS-B
beam-searches its forests. FS hands over the scoring's candidates unmerged, each cell range's top-K with their
scores, and the part of rank r takes the r-th best of them (`_ranked`), where `lax.top_k` would take two launches
per layer to merge the ranges first. The jnp specification is `fsjax.attention.freesolo_step.archive_chunk` for
one token: `attend` over the ring and the token, the readout of `archive_long_range`, `mix_branches`, and the
writes of `fsjax.cache.archive.extend`: the token into the tokens and the ring, the summary of its cell (Eq. 5).

The token's writes happen here, in place (the arrays are aliased to outputs): its raw key, value and position into
archive slot `pos`, its rotated key, value and position into ring slot `pos mod R`, and its cell's mean key and max
key norm; part 0 of the first query head of each key/value head writes them. A selected cell lies in a block
before the token's, so no cell part reads the slot being written; the ring parts take the token from their inputs
in place of ring slot `pos mod R` (which held position `pos - R`, outside the window), as FS-L's do.

The arrays are read where they lie: a scanned model's stacks `[layers, batch, ...]` with the layer index, so no
layer of the archive (gigabytes at long contexts) is copied out per token (`fsjax.cache.layered`). Grouped-query
attention: query head h reads key/value head `h // group` through its index maps.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import default_interpret, erf, group_size, layer_stack
from pallas_kernels.decode_parts import StepParts, per_layer, ring_part, softmax_part, token_operands

# The archive's arrays the kernel reads and writes in place (summaries: only the token's cell is written).
FIELDS = ("ring_k", "ring_v", "ring_pos", "tokens_k", "tokens_v", "tokens_pos", "mean_keys", "max_norms")


def _ranked(scores):
  """`[n]` int32: each candidate's rank by its score `[n]`, descending, the lower position first among equal
  scores: `lax.top_k`'s order (strict and total, so each rank below n belongs to one candidate)."""
  position = jnp.arange(scores.shape[0])
  before = position[None, :] < position[:, None]
  ahead = (scores[None, :] > scores[:, None]) | ((scores[None, :] == scores[:, None]) & before)
  return jnp.sum(ahead.astype(jnp.int32), axis=1)


def _cell_part(rank, q, layer, scale, cells_ref, scores_ref, tokens_refs, o_ref, lse_ref, *, cell):
  """The long-range branch's part for the `rank`-th selected cell (`cells_ref` `[K']`, -1 for none; or, with
  `scores_ref`, the `rank`-th best of the candidates `cells_ref`, `scores_ref` `[n']`): the softmax of q against
  the cell's s archived keys, over its values (Eq. 9 before the merge of the K parts). Returns the cell and the
  part's log-sum-exp."""
  tokens_k_ref, tokens_v_ref = tokens_refs
  chosen = cells_ref[...]
  order = jnp.arange(chosen.shape[0]) if scores_ref is None else _ranked(scores_ref[...])
  index = jnp.max(jnp.where(order == rank, chosen, -1))
  first = jnp.maximum(index, 0) * cell
  keys = tokens_k_ref[layer, pl.ds(first, cell), :].astype(jnp.float32)  # [s, d]
  values = tokens_v_ref[layer, pl.ds(first, cell), :].astype(jnp.float32)
  logits = jnp.sum(keys * q[None, :], axis=1) * scale
  return index, softmax_part(logits, jnp.broadcast_to(index >= 0, logits.shape), values, o_ref, lse_ref)


def _rerank_score(rank, index, lse, pos, layer, cells_ref, prior_refs, out_refs, *, cell):
  """FS-B's Eq. 12 score of candidate `rank` (cell `index`, log-sum-exp `lse` of its keys' logits: the mass of
  `fsjax.reference.forest.token_rerank`), plus its max key norm times the Eq. 7 prior, into out_refs (score,
  cell) `[1]`; −inf for no cell or a repeat of an earlier candidate's, so each cell counts once."""
  lam_ref, sigma_ref, norm_ref = prior_refs
  score_ref, cell_out_ref = out_refs
  chosen = cells_ref[...]
  earlier = (jnp.arange(chosen.shape[0]) < rank) & (chosen == index)
  repeat = jnp.sum(earlier.astype(jnp.int32)) > 0  # a sum: Triton lowers no `any` (reduce_or)
  safe = jnp.maximum(index, 0)
  norm = jnp.max(norm_ref[layer, pl.ds(safe, 1)].astype(jnp.float32))
  distance = pos.astype(jnp.float32) - (safe.astype(jnp.float32) + 0.5) * cell
  prior = norm * lam_ref[layer] * erf(distance / (2.0 * sigma_ref[layer]))
  score_ref[...] = jnp.full(score_ref.shape, jnp.where((index >= 0) & ~repeat, lse + prior, -jnp.inf))
  cell_out_ref[...] = jnp.full(cell_out_ref.shape, index)


def _write_token(pos, layer, cell, ring_slots, head, token_refs, out_refs):
  """The token into ring slot `pos mod R` (rotated key) and archive slot `pos` (raw key), with its value and
  position, and the summary (Eq. 5) of its cell recomputed: the mean of the cell's s keys and their largest norm,
  the token's key taken from its input rather than read back from the slot this program has just written."""
  k_rot_ref, k_ref, v_ref, tokens_k_ref = token_refs
  ring_k_out, ring_v_out, ring_pos_out, tokens_k_out, tokens_v_out, tokens_pos_out, mean_out, norm_out = out_refs
  slot = pos % ring_slots
  ring_k_out[layer, slot, :] = k_rot_ref[...]
  ring_v_out[layer, slot, :] = v_ref[...]
  tokens_k_out[layer, pos, :] = k_ref[...]
  tokens_v_out[layer, pos, :] = v_ref[...]
  first = pos // cell * cell
  keys = tokens_k_ref[layer, pl.ds(first, cell), :]
  keys = jnp.where((first + jnp.arange(cell) == pos)[:, None], k_ref[...][None, :], keys).astype(jnp.float32)
  mean_out[layer, pos // cell, :] = (jnp.sum(keys, axis=0) / cell).astype(mean_out.dtype)
  norm = jnp.max(jnp.sqrt(jnp.sum(keys * keys, axis=1)))
  norm_out[layer, pl.ds(pos // cell, 1)] = jnp.full((1,), norm, norm_out.dtype)

  @pl.when(head == 0)
  def _():
    ring_pos_out[layer, pl.ds(slot, 1)] = jnp.full((1,), pos, ring_pos_out.dtype)
    tokens_pos_out[layer, pl.ds(pos, 1)] = jnp.full((1,), pos, tokens_pos_out.dtype)


def _archive_decode_kernel(
  q_ref,
  q_rot_ref,
  k_rot_ref,
  k_ref,
  v_ref,
  pos_ref,
  valid_ref,
  cells_ref,
  *refs,
  window,
  cell,
  ring_slots,
  group,
  tiles,
  ranked,
  rerank,
):
  """One (row, query head, part). q_ref / q_rot_ref `[d]`; k_rot_ref, k_ref, v_ref `[d]` the token's key (rotated
  and raw) and value for this head's key/value head, in the archive's dtype; pos_ref, valid_ref, layer_ref `[1]`;
  cells_ref `[K']` this head's selected cells, or where `ranked` its candidates `[n']` with scores_ref `[n']`
  next; the archive refs `[layers, ...]`, read at layer `layer_ref[0]`: ring k/v `[R, d]`, ring pos `[R]`, tokens
  k/v `[N, d]`; tokens pos `[N]`, mean keys `[M, d]` and max norms `[M]` are written (max norms also read where
  `rerank`, at the candidates' cells, which lie in earlier blocks than the one written). Writes the part's
  o_ref `[d]` and lse_ref `[1]`; part 0 of a key/value head's first query head writes the token and its cell's
  summary into the aliased arrays (`out_refs`, in `FIELDS` order). Where `rerank`, cells_ref holds FS-B's
  candidates `[n']` (part T + i reads candidate i; repeats and -1 allowed), lam_ref and sigma_ref `[layers]` (this
  head's λ, σ) follow it, and each cell part also writes its Eq. 12 score and cell (`_rerank_score`) after lse_ref."""
  scores_ref, *refs = refs if ranked else (None, *refs)
  prior_refs, refs = (refs[:2], refs[2:]) if rerank else (None, refs)
  layer_ref, ring_k_ref, ring_v_ref, ring_pos_ref, tokens_k_ref, tokens_v_ref, *refs = refs
  # tokens pos and mean keys: aliased outputs, only written; max norms: read for the rerank's prior
  _, _, norm_ref, o_ref, lse_ref, *refs = refs
  rerank_refs, out_refs = (refs[:2], refs[2:]) if rerank else (None, refs)
  head, part = pl.program_id(1), pl.program_id(2)
  pos, valid, layer = pos_ref[0], valid_ref[0] != 0, layer_ref[0]
  scale = 1.0 / math.sqrt(q_ref.shape[0])

  @pl.when(valid & (part == 0) & (head % group == 0))
  def _():
    _write_token(pos, layer, cell, ring_slots, head, (k_rot_ref, k_ref, v_ref, tokens_k_ref), out_refs)

  @pl.when(part < tiles)
  def _():
    token = (k_rot_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32))
    ring_part(
      part,
      q_rot_ref[...].astype(jnp.float32),
      token,
      pos,
      valid,
      layer,
      scale,
      (ring_k_ref, ring_v_ref, ring_pos_ref),
      (o_ref, lse_ref),
      window=window,
      ring_slots=ring_slots,
    )

  @pl.when(part >= tiles)
  def _():
    q = q_ref[...].astype(jnp.float32)
    tokens = (tokens_k_ref, tokens_v_ref)
    rank = part - tiles
    index, lse = _cell_part(rank, q, layer, scale, cells_ref, scores_ref, tokens, o_ref, lse_ref, cell=cell)
    if rerank:
      priors = (*prior_refs, norm_ref)
      _rerank_score(rank, index, lse, pos, layer, cells_ref, priors, rerank_refs, cell=cell)


@functools.partial(jax.jit, static_argnames=("window", "cell", "eps", "out_dtype", "top_k", "interpret"))
def archive_decode(
  q,
  q_rot,
  k_rot,
  k,
  v,
  pos,
  valid,
  cells,
  alpha,
  gain,
  archive,
  *,
  window,
  cell,
  eps,
  out_dtype=jnp.float32,
  scores=None,
  top_k=None,
  rerank_prior=None,
  layer=None,
  interpret=None,
):
  """FS's (and FS-B's) one-token step given its selected cells: the token into the archive and its ring, the
  local branch, the readout of the cells and the mix of the branches (Eq. 2).

  Args:
    q, q_rot: `[batch, heads, d]` the token's query, unrotated (long-range branch) and RoPE-rotated (local).
    k_rot, k, v: `[batch, kv_heads, d]` its key, rotated (for the ring) and raw (for the archive), and value.
    pos: `[batch]` int32 its position (its archive slot); valid: `[batch]` bool (an invalid row writes nothing
      and its token is not a key).
    cells: `[batch, heads, K]` int32 the cells each query head selected (any order; -1 for none), all in blocks
      before the token's; or, with `scores` `[batch, heads, n]` float32, n candidates of which the kernel reads
      the `top_k` best (by score, the lower position first among equal ones; −inf and -1 for none), as
      `pallas_kernels.cell_scoring.merge_ranges` ranks them; or, with `rerank_prior`, FS-B's n candidates (its
      beams' leaf cells, repeats and -1 allowed), of which the `top_k` best by FS Eq. 12 are read (see Returns).
    rerank_prior: FS-B's (λ, σ), each `[heads]` (or with `layer` a `[layers, heads]` stack): the kernel reads
      every candidate cell, scores it by Eq. 12 (the log-sum-exp of its keys' logits plus its max key norm times
      the Eq. 7 prior, as `fsjax.reference.forest.token_rerank`) and the mix keeps the `top_k` best.
    alpha: `[heads]` the branch mix α (Eq. 2) and gain `[d]` the readout RMSNorm's (Eq. 9), or with `layer` the
      scanned model's parameter stacks `[layers, heads]` and `[layers, d]`, read at `layer` where they lie.
    archive: the layer's `fsjax.cache.archive.Archive` arrays before the token, as a dict: ring_k, ring_v `[batch,
      R, kv_heads, d]`, ring_pos `[batch, R]`, tokens_k, tokens_v `[batch, N, kv_heads, d]`, tokens_pos `[batch,
      N]`, mean_keys `[batch, N / s, kv_heads, d]`, max_norms `[batch, N / s, kv_heads]`. With `layer` (int32
      scalar), each is a scanned model's stack `[layers, ...]` of that shape.
    window, cell: the routing's w and s; eps: the readout RMSNorm's ε; out_dtype: the output's dtype.

  Returns:
    o `[batch, heads, d]` in `out_dtype`: local (Eq. 3-4) + α · RMSNorm(readout of the cells) (Eq. 9, 2),
    computed in float32; the `FIELDS` arrays after the token's writes (the token in the tokens and the ring,
    its cell's summary recomputed), as given (stacks with `layer`); and with `rerank_prior` the cells read
    `[batch, heads, top_k]` int32 (best first, -1 for none), else None. Under `jit` with the archive donated or
    dead after the call, XLA writes the arrays in place.
  """
  interpret = default_interpret() if interpret is None else interpret
  batch, heads, dim = q.shape
  axes = dict(ring_k=4, ring_v=4, ring_pos=2, tokens_k=4, tokens_v=4, tokens_pos=2, mean_keys=4, max_norms=3)
  stacks = {}
  for name, ndim in axes.items():
    stacks[name], layer_index = layer_stack(archive[name], layer, ndim)
  layers, _, ring_slots, kv_heads, _ = stacks["ring_k"].shape
  group = group_size(heads, kv_heads)
  ranked, rerank = scores is not None, rerank_prior is not None
  if ranked and rerank:
    raise ValueError("archive_decode takes scored candidates (scores) or FS-B's candidates (rerank_prior), not both")
  if ranked and scores.shape != cells.shape:
    raise ValueError(f"scores must match cells {cells.shape}; got {scores.shape}")
  if (ranked or rerank) and (top_k is None or not 0 < top_k <= cells.shape[-1]):
    raise ValueError(f"top_k must lie in 1..{cells.shape[-1]} (the candidates), got {top_k}")
  top_k = top_k if ranked or rerank else cells.shape[-1]
  width = pl.next_power_of_2(cells.shape[-1])
  # FS-B reads every candidate (a part each) and its mix keeps the best; FS reads its K cells only.
  split = StepParts.of(ring_slots=ring_slots, top_k=cells.shape[-1] if rerank else top_k, layers=layers)

  def spec(name):
    shape = stacks[name].shape
    if name.endswith("_pos"):
      return pl.BlockSpec((layers, None, shape[2]), lambda b, h, z: (0, b, 0))
    if name == "max_norms":
      return pl.BlockSpec((layers, None, shape[2], None), lambda b, h, z: (0, b, 0, h // group))
    return pl.BlockSpec((layers, None, shape[2], None, dim), lambda b, h, z: (0, b, 0, h // group, 0))

  token, token_specs = token_operands(
    q, q_rot, k_rot, k, v, pos, valid, ring_dtype=stacks["ring_k"].dtype, dtype=stacks["tokens_k"].dtype, group=group
  )
  padding = ((0, 0), (0, 0), (0, width - cells.shape[-1]))
  cells = jnp.pad(cells.astype(jnp.int32), padding, constant_values=-1)
  candidates = [cells]
  if ranked:
    candidates.append(jnp.pad(scores.astype(jnp.float32), padding, constant_values=-jnp.inf))
  priors = [per_layer(jnp.asarray(x, jnp.float32), layers) for x in rerank_prior] if rerank else []
  inputs = [*token, *candidates, *priors, layer_index, *(stacks[name] for name in FIELDS)]
  first_field = len(inputs) - len(FIELDS)
  part_specs, part_shapes = split.outputs(batch, heads, dim)
  if rerank:  # each cell part's score and cell, beside its lse
    part_specs += [part_specs[1]] * 2
    part_shapes += [part_shapes[1], jax.ShapeDtypeStruct(part_shapes[1].shape, jnp.int32)]
  outputs = len(part_specs)
  o, lse, *written = pl.pallas_call(
    functools.partial(
      _archive_decode_kernel,
      window=window,
      cell=cell,
      ring_slots=ring_slots,
      group=group,
      tiles=split.tiles,
      ranked=ranked,
      rerank=rerank,
    ),
    grid=(batch, heads, split.parts),
    in_specs=[
      *token_specs,
      *[pl.BlockSpec((None, None, width), lambda b, h, z: (b, h, 0))] * len(candidates),
      *[pl.BlockSpec((layers, None), lambda b, h, z: (0, h))] * len(priors),
      pl.BlockSpec((1,), lambda b, h, z: (0,)),
      *(spec(name) for name in FIELDS),
    ],
    out_specs=[*part_specs, *(spec(name) for name in FIELDS)],
    out_shape=[
      *part_shapes,
      *(jax.ShapeDtypeStruct(stacks[name].shape, stacks[name].dtype) for name in FIELDS),
    ],
    input_output_aliases={first_field + i: outputs + i for i in range(len(FIELDS))},
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    interpret=interpret,
    name="fs_archive_decode",
  )(*inputs)
  part_scores, written = written[: outputs - 2], written[outputs - 2 :]
  mix = functools.partial(split.mix, o, lse, alpha, gain, layer_index, eps=eps, out_dtype=out_dtype)
  mixed, chosen = mix(interpret=interpret, rerank=(*part_scores, top_k)) if rerank else (mix(interpret=interpret), None)
  unstack = (lambda x: x) if layer is not None else (lambda x: x[0])
  return mixed, {name: unstack(x) for name, x in zip(FIELDS, written)}, chosen
