"""The one dispatch table of fsjax: which implementations each op has, and which one an `impl` picks.

`impl` (a module's or config's `attention.impl`, or an op's keyword):
  "reference": the pure-jnp specification (`fsjax.reference`), on every platform.
  "pallas": the op's Pallas kernel: compiled on a GPU, interpreted anywhere else (how the CPU tests run the
    kernels). Asking it of an op that has no Pallas kernel raises `UnsupportedImpl`.
  "auto": the op's first fast implementation that this platform and these inputs allow (Pallas kernels on a GPU
    when Triton can tile the geometry; cuDNN on a GPU for half-precision inputs), else the reference.

A composite (a module, or FreeSolo's local branch inside `freesolo_attention`) hands its `impl` to the ops it
calls through `for_op`, which turns a "pallas" that an op lacks into "auto": a model configured with
`impl: pallas` runs every kernel it has and the fastest path elsewhere.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from fsjax.ops import query_blocks
from pallas_kernels import common as kernel_common
from pallas_kernels import decode_parts, matvec, store_decode, zha_routing

IMPLS = ("reference", "auto", "pallas")
HALF_DTYPES = (jnp.bfloat16, jnp.float16)


class UnsupportedImpl(ValueError):
  """An `impl` that is not one of IMPLS, or that the op does not have."""


@dataclasses.dataclass(frozen=True)
class Implementation:
  """A fast implementation of an op: its name and whether "auto" may pick it for these inputs here."""

  name: str
  usable: Callable[..., bool]


def on_gpu():
  return jax.default_backend() == "gpu"


def _half(dtype):
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in HALF_DTYPES]


def _cudnn(*, dtype, **_):
  """cuDNN flash attention needs a GPU and fp16/bf16 inputs."""
  return on_gpu() and _half(dtype)


def _cell_kernels(*, cell, head_dim, **_):
  """Triton tiles cells of a power of two >= 16 and head_dim >= 16."""
  return on_gpu() and kernel_common.compilable(cell=cell, head_dim=head_dim)


def _scoring_kernel(*, variant, cell, head_dim, **_):
  return variant in ("fs", "fsl") and _cell_kernels(cell=cell, head_dim=head_dim)


def _beam_kernel(*, cell, head_dim, beam, **_):
  return beam & (beam - 1) == 0 and _cell_kernels(cell=cell, head_dim=head_dim)


def _decode_step_kernel(*, tokens, cell, head_dim, **_):
  return on_gpu() and tokens == 1 and decode_parts.compilable(cell=cell, head_dim=head_dim)


def _matvec_kernel(*, rows, k, ns, **_):
  """A step of at most `matvec.MAX_ROWS` rows whose sizes Triton tiles (XLA strength-reduces such a dot into a
  multiply and a reduction that run far below the memory bandwidth; docs/notes.md)."""
  return on_gpu() and matvec.compilable(rows=rows, k=k, ns=ns)


def _zha_kernels(*, chunk, refs, **_):
  return on_gpu() and zha_routing.compilable(chunk=chunk, refs=refs)


def _several_query_blocks(*, batch, heads, tokens, **_):
  """An operator over blocks of queries pays for its scan only where the queries span more than one block."""
  return query_blocks.query_block_for(batch, heads, tokens) < tokens


def _one_token(*, tokens, **_):
  return tokens == 1


def _store_decode_kernel(*, tokens, head_dim, **_):
  return on_gpu() and tokens == 1 and store_decode.compilable(head_dim=head_dim)


def _cudnn_chunk(*, dtype, cache_dtype, tokens, **_):
  return tokens > 1 and _cudnn(dtype=dtype) and _cudnn(dtype=cache_dtype)


# op -> its fast implementations, in the order "auto" tries them. Every op also has "reference".
TABLE = {
  # FreeSolo (FS Eq. 5-9): fused scoring + top-K, and the tile-union readout with its own backward.
  "freesolo_long_range": (Implementation("pallas", _cell_kernels),),
  "select_cells": (Implementation("pallas", _scoring_kernel),),
  "select_from_summaries": (Implementation("pallas", _scoring_kernel),),
  "sparse_readout": (Implementation("pallas", _cell_kernels),),
  # FS-B's beam search over a decode step's streaming forests (FS Eq. 11).
  "forest_search": (Implementation("pallas", _beam_kernel),),
  # FS-L's one-token step over its bounded cache: local branch, scoring, top-K and readout in one kernel.
  "bounded_decode": (Implementation("pallas", _decode_step_kernel),),
  # FS's and FS-B's one-token step over the archive, given the selected cells: local branch, readout and mix.
  "archive_decode": (Implementation("pallas", _decode_step_kernel),),
  # A decode step's projections of a few rows, the weights read where they lie (`fsjax.layer_weights`).
  "matvec": (Implementation("pallas", _matvec_kernel),),
  # Local and dense RoPE attention: cuDNN's fused kernel.
  "local_attention": (Implementation("cudnn", _cudnn),),
  "tfpp_attention": (Implementation("cudnn", _cudnn),),
  "swa_attention": (Implementation("cudnn", _cudnn),),
  # MoBA: its training form over blocks of queries (the reference's rows, in bounded memory).
  "moba_attention": (Implementation("blocked", _several_query_blocks),),
  # Decode over a key/value store: a chunk attending a half-precision dense cache through cuDNN (TF++); one token
  # written and attending the store in one kernel (TF++'s cache, SWA's ring), or read in place by XLA (TF++).
  "cache_attention": (
    Implementation("cudnn", _cudnn_chunk),
    Implementation("pallas", _store_decode_kernel),
    Implementation("one_token", _one_token),
  ),
  # ZHA: the training-form operator and the distillation loss run over query blocks in bounded memory; capped
  # decode routing has kernels.
  "zha_attention": (Implementation("blocked", _several_query_blocks),),
  "zha_kl_loss": (Implementation("blocked", _several_query_blocks),),
  "zha_route": (Implementation("pallas", _zha_kernels),),
}


# Bytes of keys and values one cuDNN call or Pallas kernel over a scanned model's cache may be handed: both read
# buffers of their own, so they get a copy of the layer's (`fsjax.cache.layered`), which must fit beside a cache
# that fills the device (TF++ at 32 × 32k: 4 GiB per layer, with 4 GiB in the largest free block; FS-B's readout
# at 32 × 32k: 4 GiB per layer, 5.2 GiB in the largest free block).
CACHE_COPY_BYTES = 2**30


def head_groups(heads, per_head_bytes, budget):
  """The fewest groups (a divisor of `heads`) that split a per-head buffer of `per_head_bytes` into shares of at
  most `budget` bytes, evaluated one group after another; `heads` where even one head exceeds it."""
  for groups in range(1, heads):
    if heads % groups == 0 and per_head_bytes * (heads // groups) <= budget:
      return groups
  return heads


def cache_head_groups(batch, capacity, heads, head_dim, dtype, copied=True):
  """How many calls (cuDNN over a dense cache, the readout kernel over an FS archive) a chunk's attention is
  split into, by heads: the fewest (a divisor of `heads`) whose share of the layer's keys and values is at most
  `CACHE_COPY_BYTES`; 1 where the cache is not `copied` (an unstacked cache is read where it lies)."""
  if not copied:
    return 1
  return head_groups(heads, 2 * batch * capacity * head_dim * jnp.dtype(dtype).itemsize, CACHE_COPY_BYTES)


# Bytes of one float32 node table that FS-B's prefill-formulation selection (`forest_ref.fsb_select_from_summaries`,
# FS-B over a plain archive) builds per call: its forests over the whole archive live as a dozen such tables at
# once (on the H200, 9.77 GiB at 32 × 32k for every chunk size, beside a cache that left 5 GiB free).
FOREST_TABLE_BYTES = 2**28


def forest_nodes(cells):
  """Nodes of every aligned chunk tree of `cells` cells (sizes 1, 2, 4, ...: one heap of 2·size − 1 per chunk)."""
  return sum((cells // size) * (2 * size - 1) for size in (2**k for k in range(max(cells, 1).bit_length())))


def forest_head_groups(batch, cells, heads, head_dim):
  """How many groups of heads FS-B's selection over an archive of `cells` cells runs in, one after another: the
  fewest whose float32 μ table (`[batch, heads/groups, nodes, head_dim]`) is at most `FOREST_TABLE_BYTES`."""
  return head_groups(heads, batch * forest_nodes(cells) * head_dim * 4, FOREST_TABLE_BYTES)


def _check_impl(impl):
  if impl not in IMPLS:
    raise UnsupportedImpl(f"impl must be one of {IMPLS}, got {impl!r}")


def implementations(op):
  """Names of every implementation of `op`, the reference first."""
  return ("reference", *(fast.name for fast in TABLE[op]))


def resolve(op, impl, **facts):
  """The implementation of `op` that `impl` selects for inputs described by `facts` (keyword facts such as
  `cell`, `head_dim`, `dtype`, `variant`, `chunk`, `refs`, `tokens`): "reference" or a name in TABLE[op]."""
  _check_impl(impl)
  if impl == "reference":
    return "reference"
  fast = TABLE[op]
  if impl == "auto":
    return next((f.name for f in fast if f.usable(**facts)), "reference")
  if any(f.name == impl for f in fast):
    return impl
  raise UnsupportedImpl(
    f"{op} has no {impl!r} implementation (it has: {', '.join(implementations(op))}); "
    "impl='auto' takes the fastest one available"
  )


def for_op(op, impl):
  """The `impl` a composite passes to `op`: its own, unless `op` lacks that kernel, then "auto"."""
  _check_impl(impl)
  if impl in ("reference", "auto") or impl in implementations(op):
    return impl
  return "auto"
