"""Every Pallas kernel lowers to Triton for a CUDA GPU, also on a machine without one (CI).

Interpret mode, which the CPU kernel tests run, never meets Pallas's Triton lowering rules, so a kernel that uses
an operation Triton cannot lower (an element of a vector, `x[-1]`, is a `slice` there) passes every CPU test and
fails at its first compile on a GPU. `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` runs those
rules here (JAX assumes compute capability 9.0 without a GPU). It does not run Triton's own compiler to PTX:
that, and the results, are the compiled kernel tests' part on the H200.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (
  archive_decode,
  bounded_decode,
  cell_scoring,
  forest_search,
  matvec,
  sparse_readout,
  store_decode,
  zha_routing,
)

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
shape = jax.ShapeDtypeStruct


def _lowers_for_cuda(fn, *args, kernels):
  """Lowers `fn(*args)` for CUDA and checks that each named kernel became a Triton call (an interpreted kernel
  would lower to plain HLO and name none)."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") >= len(kernels)
  for name in kernels:
    assert name in text, f"{name} is not a Triton call in the lowered module"


def test_zha_scoring_and_selection_lower():
  q = shape((1, 2, 64), f32)
  index = shape((1, 2, 32), i32)
  _lowers_for_cuda(
    lambda *a: zha_routing.score_candidates(*a, interpret=False),
    q,
    shape((1, 12, 2, 4, 64), bf16),
    shape((1, 12, 2, 4), bf16),
    index,
    kernels=["zha_score_candidates"],
  )
  _lowers_for_cuda(
    lambda q, k, b, i, layer: zha_routing.score_candidates(q, k, b, i, layer=layer, interpret=False),
    q,
    shape((3, 1, 12, 2, 4, 64), bf16),
    shape((3, 1, 12, 2, 4), bf16),
    index,
    shape((), i32),
    kernels=["zha_score_candidates"],
  )
  _lowers_for_cuda(
    lambda q, k, b, i, pos: zha_routing.score_candidates(q, k, b, i, position=pos, span=64, interpret=False),
    q,
    shape((1, 12, 2, 1, 64), bf16),
    shape((1, 12, 2, 1), bf16),
    index,
    shape((1,), i32),
    kernels=["zha_score_candidates"],
  )
  _lowers_for_cuda(
    lambda q, k, b, i, pos: zha_routing.score_candidates(q, k, b, i, position=pos, span=64, interpret=False),
    q,
    shape((1, 12, 2, 4, 64), bf16),
    shape((1, 12, 2, 4), bf16),
    shape((32,), i32),
    shape((1,), i32),
    kernels=["zha_score_candidates"],
  )  # the top level's shared list
  for width in (16, 4096):
    _lowers_for_cuda(
      lambda s, i: zha_routing.keep_top_p(s, i, p=0.9, max_nodes=8, interpret=False),
      shape((1, 2, width), f32),
      shape((1, 2, width), i32),
      kernels=["zha_keep_top_p"],
    )
    _lowers_for_cuda(
      lambda s, i: zha_routing.keep_top_p(s, i, p=0.9, max_nodes=8, interpret=False),
      shape((1, 2, width), f32),
      shape((width,), i32),
      kernels=["zha_keep_top_p"],
    )
  _lowers_for_cuda(
    lambda s, i: zha_routing.keep_top_p(s, i, p=1.0, max_nodes=8, interpret=False),
    shape((1, 2, 64), f32),
    shape((1, 2, 64), i32),
    kernels=["zha_keep_top_p"],
  )
  for stacked in (False, True):  # a lower level's list, built in the kernel from the kept row above
    layer = dict(layer=jnp.int32(1)) if stacked else {}
    _lowers_for_cuda(
      lambda q, k, b, parents, pos: zha_routing.score_children(
        q, k, b, parents, pos, parents_kept=8, chunk=8, span=8, interpret=False, **layer
      ),
      q,
      shape((3, 1, 64, 2, 4, 64) if stacked else (1, 64, 2, 4, 64), bf16),
      shape((3, 1, 64, 2, 4) if stacked else (1, 64, 2, 4), bf16),
      shape((1, 2, 16), i32),
      shape((1,), i32),
      kernels=["zha_score_children"],
    )


@pytest.mark.parametrize("stacked", [False, True], ids=["plain", "stacked"])
def test_zha_leaf_attention_lowers(stacked):
  cache = shape((3, 1, 1024, 2, 64) if stacked else (1, 1024, 2, 64), bf16)
  _lowers_for_cuda(
    lambda q, k, v, leaves, pos, layer: zha_routing.leaf_attention(
      q, k, v, leaves, pos, chunk=8, layer=layer if stacked else None, interpret=False
    ),
    shape((1, 2, 64), f32),
    cache,
    cache,
    shape((1, 2, 64), i32),
    shape((1,), i32),
    shape((), i32),
    kernels=["zha_leaf_attention", "decode_merge_parts"],
  )


def test_fsb_beam_search_lowers():
  batch, heads, nodes, dim = 1, 2, 62, 64  # a streaming forest's table of 5 levels
  table = {
    "mu": shape((batch, heads, nodes, dim), f32),
    **{name: shape((batch, heads, nodes), f32) for name in ("rho", "amax", "pmin")},
    **{name: shape((batch, heads, nodes), i32) for name in ("first", "leaf", "child0", "child1")},
  }
  _lowers_for_cuda(
    lambda q, pos, counts, nodes, lam, sigma: forest_search.beam_search(
      q, pos, counts, nodes, lam, sigma, beam=4, steps=5, bound_c=8.0, interpret=False
    ),
    shape((batch, 8, heads, dim), f32),
    shape((batch, 8), i32),
    shape((batch, heads), i32),
    table,
    shape((heads,), f32),
    shape((heads,), f32),
    kernels=["fsb_beam_search"],
  )


@pytest.mark.parametrize(
  "variant,summaries,stacked", [("fs", f32, False), ("fsl", f32, False), ("fs", bf16, False), ("fs", bf16, True)]
)
def test_cell_scoring_lowers(variant, summaries, stacked):
  """Summaries in float32 (training) or a decode cache's bf16, and a scanned model's stack of them (a layer read
  where it lies). Neither 66 cells nor 8 fill whole chunks of 16: the last chunk's loads are masked."""
  sizes = cell_scoring.BlockSizes(queries=32, cells=16)
  cells = 66 if stacked else 128 // 16
  lead = (3,) if stacked else ()
  death = shape((1, cells, 2), i32) if variant == "fsl" else None
  _lowers_for_cuda(
    lambda q, mean_keys, max_norms, death, layer: cell_scoring.select_from_summaries(
      q,
      None,
      mean_keys,
      max_norms,
      death,
      variant=variant,
      cell=16,
      block=32,
      top_k=4,
      block_sizes=sizes,
      layer=layer,
      interpret=False,
    ),
    shape((1, 128, 2, 64), bf16),
    shape((*lead, 1, cells, 2, 64), summaries),
    shape((*lead, 1, cells, 2), summaries),
    death,
    shape((), i32) if stacked else None,
    kernels=["freesolo_cell_topk"],
  )


def test_sparse_readout_and_its_gradient_lower():
  q = shape((1, 64, 2, 64), bf16)
  cells = shape((1, 64, 2, 4), i32)
  sizes = sparse_readout.BlockSizes(queries=16)
  readout = lambda q, k, v, idx: sparse_readout.sparse_readout(
    q, k, v, idx, cell=16, block_sizes=sizes, interpret=False
  )
  _lowers_for_cuda(readout, q, q, q, cells, kernels=["freesolo_sparse_readout_fwd"])
  loss = lambda q, k, v, idx: jnp.sum(readout(q, k, v, idx).astype(f32))
  _lowers_for_cuda(
    jax.grad(loss, argnums=(0, 1, 2)),
    q,
    q,
    q,
    cells,
    kernels=["freesolo_sparse_readout_fwd", "freesolo_sparse_readout_bwd_dq", "freesolo_sparse_readout_bwd_dkv"],
  )


def _decode_token():
  """A one-token step's q, q_rot `[2, 4, 64]`, k_rot, k, v `[2, 2, 64]` (two rows, grouped heads), pos and valid."""
  q, kv = shape((2, 4, 64), f32), shape((2, 2, 64), f32)
  return q, q, kv, kv, kv, shape((2,), i32), shape((2,), jnp.bool_)


def _ring(lead):
  """The 341M geometry's ring of 513 rotated keys (window 512), as a decode kernel reads it."""
  return dict(
    ring_k=shape((*lead, 2, 513, 2, 64), bf16),
    ring_v=shape((*lead, 2, 513, 2, 64), bf16),
    ring_pos=shape((*lead, 2, 513), i32),
  )


@pytest.mark.parametrize("stacked", [False, True])
def test_fsl_bounded_decode_lowers(stacked):
  """The 341M geometry (ring 513, pool 64, recent 8, cell 32, d 64, K 4), grouped heads, a layer stack or not."""
  lead = (3,) if stacked else ()
  cache = dict(
    **_ring(lead),
    block_k=shape((*lead, 2, 64, 2, 64), bf16),
    block_v=shape((*lead, 2, 64, 2, 64), bf16),
    pool_ids=shape((*lead, 2, 2, 64), i32),
    pool_mean=shape((*lead, 2, 2, 64, 64), bf16),
    pool_norm=shape((*lead, 2, 2, 64), bf16),
    pool_k=shape((*lead, 2, 2, 64, 32, 64), bf16),
    pool_v=shape((*lead, 2, 2, 64, 32, 64), bf16),
    recent_ids=shape((*lead, 2, 8), i32),
    recent_mean=shape((*lead, 2, 2, 8, 64), bf16),
    recent_norm=shape((*lead, 2, 2, 8), bf16),
    recent_k=shape((*lead, 2, 2, 8, 32, 64), bf16),
    recent_v=shape((*lead, 2, 2, 8, 32, 64), bf16),
  )
  run = lambda q, q_rot, k_rot, k, v, pos, valid, lam, sigma, alpha, gain, cache, layer: bounded_decode.bounded_decode(
    *(q, q_rot, k_rot, k, v, pos, valid, lam, sigma, alpha, gain, cache),
    window=512,
    cell=32,
    top_k=4,
    eps=1e-8,
    out_dtype=bf16,
    layer=layer,
    interpret=False,
  )
  _lowers_for_cuda(
    run,
    *_decode_token(),
    shape((*lead, 4), f32),
    shape((*lead, 4), f32),
    shape((*lead, 4), bf16),
    shape((*lead, 64), bf16),
    cache,
    shape((), i32) if stacked else None,
    kernels=["fsl_bounded_decode", "decode_mix_branches"],
  )


@pytest.mark.parametrize(
  "stacked,candidates", [(False, None), (True, None), (True, "scoring ranges"), (True, "fsb beams")]
)
def test_fs_archive_decode_lowers(stacked, candidates):
  """The 341M geometry (ring 513, cell 32, d 64, K 4) over an archive of 1,056 slots, grouped heads, a layer
  stack or not; given K cells, FS's 16 scoring ranges of 4 candidates with their scores, or FS-B's 2 × 16 beam
  candidates, which the kernel reranks."""
  lead = (3,) if stacked else ()
  count = {None: 4, "scoring ranges": 64, "fsb beams": 32}[candidates]
  extra = {}
  if candidates == "scoring ranges":
    extra = dict(scores=jnp.zeros((2, 4, count), f32), top_k=4)
  elif candidates == "fsb beams":
    extra = dict(rerank_prior=(jnp.ones((3, 4), f32), jnp.ones((3, 4), f32)), top_k=4)
  archive = dict(
    **_ring(lead),
    tokens_k=shape((*lead, 2, 1056, 2, 64), bf16),
    tokens_v=shape((*lead, 2, 1056, 2, 64), bf16),
    tokens_pos=shape((*lead, 2, 1056), i32),
    mean_keys=shape((*lead, 2, 33, 2, 64), bf16),
    max_norms=shape((*lead, 2, 33, 2), bf16),
  )
  run = lambda q, q_rot, k_rot, k, v, pos, valid, cells, alpha, gain, archive, layer: archive_decode.archive_decode(
    *(q, q_rot, k_rot, k, v, pos, valid, cells, alpha, gain, archive),
    window=512,
    cell=32,
    eps=1e-8,
    out_dtype=bf16,
    layer=layer,
    interpret=False,
    **extra,
  )
  _lowers_for_cuda(
    run,
    *_decode_token(),
    shape((2, 4, count), i32),
    shape((*lead, 4), bf16),
    shape((*lead, 64), bf16),
    archive,
    shape((), i32) if stacked else None,
    kernels=["fs_archive_decode", "decode_mix_branches"],
  )


@pytest.mark.parametrize("stacked", [False, True])
def test_kv_store_decode_lowers(stacked):
  """TF++'s dense cache of the 341M geometry at 4,160 slots (d 64: 33 tiles of 128), grouped heads, a layer stack
  or not; and SWA's ring of 513 slots with its window."""
  lead = (3,) if stacked else ()
  q_rot, _, k_rot, _, v, pos, valid = _decode_token()
  for slots, window in ((4160, None), (513, 512)):
    store = dict(k=shape((*lead, 2, slots, 2, 64), bf16), v=shape((*lead, 2, slots, 2, 64), bf16))
    store["pos"] = shape((*lead, 2, slots), i32)
    run = lambda q, k, v, pos, valid, store, layer, window=window: store_decode.store_decode(
      q, k, v, pos, valid, store, window=window, out_dtype=bf16, layer=layer, interpret=False
    )
    layer = shape((), i32) if stacked else None
    kernels = ["kv_store_decode", "decode_merge_parts"]
    _lowers_for_cuda(run, q_rot, k_rot, v, pos, valid, store, layer, kernels=kernels)


@pytest.mark.parametrize("rows", [1, 4], ids=["elementwise", "dot"])
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rms-normed"])
def test_matvec_lowers(rows, normed):
  """W_gate and W_up of the 341M shape as layer stacks, one row or four (tl.dot), with the RMSNorm prologue or not."""
  norm = shape((24, 1024), f32) if normed else None
  _lowers_for_cuda(
    lambda x, gate, up, scale, layer: matvec.matvec(
      x, [gate, up], layer=layer, dtype=bf16, norm_scale=scale, norm_eps=1e-5, interpret=False
    ),
    shape((rows, 1024), bf16),
    shape((24, 1024, 2816), bf16),
    shape((24, 1024, 2816), bf16),
    norm,
    shape((), i32),
    kernels=["matvec"],
  )


@pytest.mark.parametrize("rows", [1, 4], ids=["elementwise", "dot"])
def test_swiglus_two_matvec_launches_lower(rows):
  """The 341M shape's MLP as a decode step runs it: the gate/up launch's partial sums into the down launch, which
  forms `silu(gate) * up` in its prologue."""

  def mlp(x, gate, up, down, layer):
    partials = matvec.matvec(x, [gate, up], layer=layer, dtype=bf16, partial_sums=True, interpret=False)
    return matvec.matvec(partials, [down], layer=layer, dtype=bf16, gated=True, interpret=False)

  stack = lambda k, n: shape((24, k, n), bf16)
  x = shape((rows, 1024), bf16)
  _lowers_for_cuda(mlp, x, stack(1024, 2816), stack(1024, 2816), stack(2816, 1024), shape((), i32), kernels=["matvec"])
