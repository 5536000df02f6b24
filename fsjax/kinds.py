"""The registry of attention kinds: for each kind, its config section, its Flax module, its decode cache and the
cache's capacity rule. Everything that depends on the kind (config validation, `fsjax.model`, `fsjax.cache`,
`fsjax.decode`) asks here, so adding a kind means one entry below plus the kind's own module, cache and
reference.
"""

import dataclasses
import math
from collections.abc import Callable

from fsjax.attention import DenseAttention, FreeSoloAttention, ZHAAttention
from fsjax.cache.archive import empty_archive
from fsjax.cache.bounded import empty_bounded
from fsjax.cache.forest import empty_forest_cache
from fsjax.cache.store import empty_store
from fsjax.cache.zha import empty_zha

FAMILIES = ("freesolo", "dense", "zha")


@dataclasses.dataclass(frozen=True)
class Kind:
  """One attention kind.

  Attributes:
    name: the `attention.kind` value.
    family: "freesolo" (shares FS parameters and routing buffers), "dense" (RoPE baselines) or "zha".
    section: the `AttentionConfig` sub-config the kind reads besides the shared fields ("moba", "zha"), or None.
    validate: `(attention_config, prefix)` → None; raises ValueError naming the field.
    module: `(attention_config, **common)` → the Flax module; `common` holds num_heads, head_dim, rope_theta
      (a `fsjax.reference.rope.RoPE`), projection (a `fsjax.attention.projections.Projection`), dtype,
      param_dtype and name.
    cache: `(attention_config, batch, capacity, heads, head_dim, dtype, bounded)` → one layer's empty decode
      cache; `bounded=False` asks for the kind's unbounded reference cache where it has one.
    capacity: `(attention_config, max_len)` → token slots per layer of that cache.
    prefill_op: the `fsjax.ops.dispatch` op whose fast implementation keeps the kind's training forward linear
      in memory (so prefill may take a whole prompt as one chunk, `fsjax.decode.prefill_chunk`); None where the
      training form materializes query-by-key masks (MoBA, ZHA) or rebuilds forests per block (FS-B).
    grouped_kv: the kind's module, references and cache read fewer key/value heads than query heads
      (`model.num_kv_heads`, grouped-query attention); the others refuse it in config validation.
    bounded_chunks: the cache path takes a chunk in memory linear in the chunk and independent of the context
      (FS-L's bounded cache, block by block), so a prompt's later chunks may be as long as its first; the other
      caches' chunks attend to every cached slot at once, so prefill keeps their later chunks short.
  """

  name: str
  family: str
  section: str | None
  validate: Callable
  module: Callable
  cache: Callable
  capacity: Callable
  prefill_op: str | None = None
  bounded_chunks: bool = False
  grouped_kv: bool = False


def _routing_rules(att, prefix):
  att.routing.validate(prefix)


def _zha_rules(att, prefix):
  att.zha.tree.validate(f"{prefix}zha.")


def _no_rules(att, prefix):
  del att, prefix


def _whole_units(max_len, *units):
  """max_len rounded up to whole cells and blocks (a chunk of the cache path holds whole query blocks)."""
  unit = math.lcm(*units)
  return -(-max_len // unit) * unit


def _block_capacity(att, max_len):
  return _whole_units(max_len, att.cell, att.block)


def _freesolo_module(att, **common):
  return FreeSoloAttention(routing=att.routing, lam=att.lam, sigma=att.sigma, impl=att.impl, **common)


def _dense_module(att, **common):
  return DenseAttention(
    kind=att.kind, window=att.window, moba_block=att.moba.block, moba_top_k=att.moba.top_k, impl=att.impl, **common
  )


def _zha_module(att, **common):
  return ZHAAttention(tree=att.zha.tree, distill=att.zha.distill, impl=att.impl, **common)


def _archive(att, batch, capacity, heads, head_dim, dtype, bounded):
  del bounded
  return empty_archive(batch, capacity, heads, head_dim, att.cell, att.window, dtype)


def _fsl_cache(att, batch, capacity, heads, head_dim, dtype, bounded):
  """FS-L's bounded cache, whose size ignores the capacity; the archive (the reference) when not bounded."""
  if not bounded:
    return _archive(att, batch, capacity, heads, head_dim, dtype, bounded)
  return empty_bounded(batch, heads, head_dim, att.routing, dtype)


def _fsb_cache(att, batch, capacity, heads, head_dim, dtype, bounded):
  """FS-B's streaming forests over the archive; the plain archive (forests rebuilt every step) when not bounded."""
  if not bounded:
    return _archive(att, batch, capacity, heads, head_dim, dtype, bounded)
  return empty_forest_cache(batch, capacity, heads, head_dim, att.cell, att.window, dtype)


def _store(att, batch, capacity, heads, head_dim, dtype, bounded):
  del att, bounded
  return empty_store(batch, capacity, heads, head_dim, dtype)


def _zha_cache(att, batch, capacity, heads, head_dim, dtype, bounded):
  del bounded
  return empty_zha(batch, capacity, heads, head_dim, att.zha.tree, dtype)


_FREESOLO = dict(
  family="freesolo",
  section=None,
  validate=_routing_rules,
  module=_freesolo_module,
  capacity=_block_capacity,
  grouped_kv=True,
)
_DENSE = dict(family="dense", validate=_no_rules, module=_dense_module, cache=_store, grouped_kv=True)

REGISTRY = {
  kind.name: kind
  for kind in (
    Kind("fs", cache=_archive, prefill_op="freesolo_long_range", **_FREESOLO),
    Kind("fsl", cache=_fsl_cache, prefill_op="freesolo_long_range", bounded_chunks=True, **_FREESOLO),
    Kind("fsb", cache=_fsb_cache, **_FREESOLO),
    Kind("tfpp", section=None, capacity=_block_capacity, prefill_op="tfpp_attention", **_DENSE),
    Kind(  # a ring of w + 1 slots
      "swa", section=None, capacity=lambda att, max_len: att.window + 1, prefill_op="swa_attention", **_DENSE
    ),
    Kind(
      "moba",
      section="moba",
      capacity=lambda att, max_len: _whole_units(max_len, att.cell, att.block, att.moba.block),
      **_DENSE,
    ),
    Kind(
      "zha",
      family="zha",
      section="zha",
      validate=_zha_rules,
      module=_zha_module,
      cache=_zha_cache,
      capacity=_block_capacity,
      grouped_kv=True,
    ),
  )
}


def names(family=None, grouped_kv=None):
  """Kind names, in registry order; only those of `family`, and those whose `grouped_kv` is that, when given."""
  return tuple(
    name
    for name, kind in REGISTRY.items()
    if (family is None or kind.family == family) and (grouped_kv is None or kind.grouped_kv == grouped_kv)
  )


def get(name):
  """The registry entry of kind `name`; ValueError naming the known kinds otherwise."""
  if name not in REGISTRY:
    raise ValueError(f"attention kind must be one of {names()}, got {name!r}")
  return REGISTRY[name]
