"""The one dispatch table (`fsjax.ops.dispatch`) and the kind registry (`fsjax.kinds`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import kinds, ops
from fsjax.attention import freesolo_step
from fsjax.attention.cached import attend, by_head_groups
from fsjax.attention.freesolo_step import archive_long_range
from fsjax.cache import cache_capacity, init_cache
from fsjax.cache.archive import Archive
from fsjax.cache.layered import LayerSlice
from fsjax.cache.store import KVStore
from fsjax.config import AttentionConfig, ConfigError, ZHAConfig, model_preset
from fsjax.model import make_attention
from fsjax.ops import dispatch
from fsjax.reference.freesolo import rms_norm
from fsjax.reference.routing import Routing

from helpers import random_qkv

ON_GPU = jax.default_backend() == "gpu"
FACTS = dict(
  variant="fs",
  cell=32,
  head_dim=64,
  beam=16,
  dtype=jnp.bfloat16,
  cache_dtype=jnp.bfloat16,
  tokens=2,
  chunk=8,
  refs=16,
  rows=1,
  k=64,
  ns=(32, 16),
  batch=1,
  heads=4,
)


@pytest.mark.parametrize("op", sorted(dispatch.TABLE))
def test_every_op_resolves_each_impl_to_one_it_has(op):
  assert dispatch.resolve(op, "reference", **FACTS) == "reference"
  assert dispatch.resolve(op, "auto", **FACTS) in dispatch.implementations(op)
  if "pallas" in dispatch.implementations(op):
    assert dispatch.resolve(op, "pallas", **FACTS) == "pallas"
  else:
    with pytest.raises(dispatch.UnsupportedImpl, match=f"{op} has no 'pallas' implementation"):
      dispatch.resolve(op, "pallas", **FACTS)
    assert dispatch.for_op(op, "pallas") == "auto"


def test_auto_takes_the_kernels_only_on_a_gpu_and_for_geometries_they_tile():
  assert dispatch.resolve("freesolo_long_range", "auto", **FACTS) == ("pallas" if ON_GPU else "reference")
  assert dispatch.resolve("freesolo_long_range", "auto", **{**FACTS, "cell": 24}) == "reference"
  assert dispatch.resolve("select_cells", "auto", **{**FACTS, "variant": "fsb"}) == "reference"
  assert dispatch.resolve("local_attention", "auto", dtype=jnp.float32) == "reference"
  assert dispatch.resolve("cache_attention", "auto", **FACTS) == ("cudnn" if ON_GPU else "reference")
  assert dispatch.resolve("cache_attention", "auto", **{**FACTS, "cache_dtype": jnp.float32}) == "reference"
  one_token = {**FACTS, "tokens": 1}
  assert dispatch.resolve("cache_attention", "auto", **one_token) == ("pallas" if ON_GPU else "one_token")
  assert dispatch.resolve("cache_attention", "auto", **{**one_token, "head_dim": 48}) == "one_token"
  assert dispatch.resolve("matvec", "auto", **FACTS) == ("pallas" if ON_GPU else "reference")
  assert dispatch.resolve("matvec", "auto", **{**FACTS, "rows": 17}) == "reference"
  assert dispatch.resolve("matvec", "auto", **{**FACTS, "ns": (1024, 24)}) == "reference"
  assert dispatch.resolve("matvec", "pallas", **FACTS) == "pallas"


def test_unknown_impl_is_one_clear_error_everywhere(rng):
  q, k, v = (jnp.asarray(x, jnp.float32) for x in random_qkv(rng, (1, 64, 2, 16)))
  for call in (
    lambda: ops.freesolo_attention(q, k, v, alpha=1.0, window=63, cell=8, block=32, impl="triton"),
    lambda: ops.tfpp_attention(q, k, v, impl="fast"),
    lambda: dispatch.for_op("sparse_readout", "cuda"),
  ):
    with pytest.raises(dispatch.UnsupportedImpl, match="impl must be one of"):
      call()
  with pytest.raises(dispatch.UnsupportedImpl, match="zha_attention has no 'pallas'"):
    ops.zha_attention(q, k, v, jnp.zeros((2, 4, 16)), chunk=4, levels=2, top_p=0.9, impl="pallas")


def test_interpreted_kernels_equal_the_reference_through_the_table(rng):
  """impl="pallas" runs the kernels (interpreted off a GPU) and "reference" the specification: same result."""
  q, k, v = (jnp.asarray(x, jnp.float32) for x in random_qkv(rng, (1, 96, 2, 16)))
  kw = dict(
    variant="fsl", alpha=jnp.asarray([0.5, 2.0]), window=40, cell=16, block=32, top_k=2, retain_top=2, retain_recent=1
  )
  reference = ops.freesolo_attention(q, k, v, impl="reference", **kw)
  kernels = ops.freesolo_attention(q, k, v, impl="pallas", **kw)
  assert jnp.max(jnp.abs(kernels - reference)) < 1e-4 * jnp.max(jnp.abs(reference))


@pytest.mark.parametrize("name", kinds.names())
def test_every_registered_kind_builds_its_module_cache_and_capacity(name):
  config = model_preset("tiny", kind=name)
  entry = kinds.get(name)
  assert entry.family in kinds.FAMILIES
  assert type(make_attention(config)).__name__ in ("FreeSoloAttention", "DenseAttention", "ZHAAttention")
  capacity = cache_capacity(config, 100)
  assert capacity >= (config.attention.window + 1 if name == "swa" else 100)
  cache = init_cache(config, 1, 100)
  assert set(cache) == {f"layer_{i}" for i in range(config.num_layers)}


def test_config_validates_through_the_registry():
  with pytest.raises(ConfigError, match="attention.kind must be one of"):
    AttentionConfig(kind="dense")
  with pytest.raises(ConfigError, match="attention.block must be a multiple of attention.cell"):
    AttentionConfig(kind="fs", cell=24, block=64)
  AttentionConfig(kind="tfpp", cell=24, block=64)  # FreeSolo geometry is not a dense kind's rule
  with pytest.raises(ConfigError, match="attention.zha.chunk must be >= 2"):
    AttentionConfig(kind="zha", zha=ZHAConfig(chunk=1))


def test_routing_object_is_built_once_from_the_config_and_hashable():
  att = AttentionConfig(kind="fsl", window=64, cell=8, block=32, top_k=2, retain_top=4, retain_recent=2)
  assert att.routing == Routing(variant="fsl", window=64, cell=8, block=32, top_k=2, retain_top=4, retain_recent=2)
  assert hash(att.routing) == hash(
    Routing(variant="fsl", window=64, cell=8, block=32, top_k=2, retain_top=4, retain_recent=2)
  )
  with pytest.raises(ValueError, match="window must be >= block - 1"):
    Routing(window=8, block=32).validate()


def test_cache_head_groups_bound_each_cudnn_copy_and_divide_the_heads():
  heads, head_dim, dtype = 16, 64, jnp.bfloat16
  per_head = lambda batch, capacity: 2 * batch * capacity * head_dim * 2
  for batch, capacity in [(1, 4224), (64, 4224), (128, 4224), (32, 32896), (1, 2**22), (8, 2**22)]:
    groups = dispatch.cache_head_groups(batch, capacity, heads, head_dim, dtype)
    assert heads % groups == 0
    share = per_head(batch, capacity) * heads // groups
    if groups < heads:  # the fewest such groups: one fewer (divisor) would exceed the bound
      assert share <= dispatch.CACHE_COPY_BYTES
      fewer = [g for g in range(1, groups) if heads % g == 0]
      assert all(per_head(batch, capacity) * heads // g > dispatch.CACHE_COPY_BYTES for g in fewer)
  assert dispatch.cache_head_groups(1, 4224, heads, head_dim, dtype) == 1
  assert dispatch.cache_head_groups(32, 32896, heads, head_dim, dtype) == 8  # 4 GiB per layer; 4 heads: 1.004 GiB
  assert dispatch.cache_head_groups(8, 2**22, heads, head_dim, dtype) == heads  # even one head is over the bound
  assert dispatch.cache_head_groups(32, 32896, heads, head_dim, dtype, copied=False) == 1


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_attention_by_head_groups_equals_one_call(rng, groups):
  q, k, v = (jnp.asarray(x) for x in random_qkv(rng, (2, 12, 4, 8), np.float32))
  positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
  attend_heads = lambda q, k, v: attend(q, positions, k, v, positions)  # stands in for cuDNN
  expected = attend_heads(q, k, v)
  np.testing.assert_allclose(by_head_groups(attend_heads, groups, q, k, v), expected, rtol=1e-6, atol=1e-6)
  stacked = [LayerSlice(jnp.stack([jnp.zeros_like(x), x]), jnp.int32(1)) for x in (k, v)]  # a scanned cache's layer
  grouped = jax.jit(lambda q, k, v: by_head_groups(attend_heads, groups, q, k, v))(q, *stacked)
  np.testing.assert_allclose(grouped, expected, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="groups must divide the 4 key/value heads, got 3"):
    by_head_groups(attend_heads, 3, q, k, v)


@pytest.mark.parametrize("copy_bytes,groups", [(2**30, 1), (2 * 2 * 128 * 16 * 4 * 2, 2), (1, 4)])
def test_archive_readout_by_head_groups_equals_one_call(rng, monkeypatch, copy_bytes, groups):
  """A chunk's readout over a scanned archive runs the kernel (which is handed a copy of the layer's keys and
  values) on groups of heads whose copy fits `CACHE_COPY_BYTES` (FS-B at 32 × 32k: 4 GiB per layer, 5.2 GiB free
  in one block); the output and cells are one call's."""
  batch, slots, heads, head_dim, chunk, cell = 2, 128, 4, 16, 32, 16
  routing = Routing(variant="fs", window=32, cell=cell, block=32, top_k=3)
  k, v = (jnp.asarray(rng.standard_normal((2, batch, slots, heads, head_dim)), jnp.float32) for _ in range(2))
  pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (2, batch, slots))
  layer = lambda x: LayerSlice(x, jnp.int32(1))
  archive = Archive(tokens=KVStore(k=layer(k), v=layer(v), pos=layer(pos)), ring=None, mean_keys=None, max_norms=None)
  q = jnp.asarray(rng.standard_normal((batch, chunk, heads, head_dim)), jnp.float32)
  q_pos = jnp.broadcast_to(96 + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
  # Distinct cells of the six complete ones per query and head, some slots unused (-1).
  cells = np.argsort(rng.random((batch, chunk, heads, 6)), axis=-1)[..., : routing.top_k]
  cells = jnp.asarray(np.where(rng.random(cells.shape) < 0.2, -1, cells), jnp.int32)
  assert dispatch.cache_head_groups(batch, slots, heads, head_dim, jnp.float32) == 1
  monkeypatch.setattr(dispatch, "CACHE_COPY_BYTES", copy_bytes)
  assert dispatch.cache_head_groups(batch, slots, heads, head_dim, jnp.float32) == groups
  calls = []
  readout = freesolo_step.cached_readout
  monkeypatch.setattr(
    freesolo_step, "cached_readout", lambda q, *args, **kw: calls.append(q.shape[2]) or readout(q, *args, **kw)
  )
  run = jax.jit(
    lambda archive, q: archive_long_range(
      archive, q, q_pos, routing, lr_gain=jnp.ones(head_dim), lam=None, sigma=None, impl="pallas", selected=cells
    )
  )
  out, chosen = run(archive, q)
  assert calls == [heads // groups] * groups  # one kernel call per group, each over its share of the heads
  np.testing.assert_array_equal(chosen, cells)
  expected = ops.sparse_readout(q, k[1], v[1], cells, cell=cell, impl="reference")
  np.testing.assert_allclose(out, rms_norm(expected, jnp.ones(head_dim)), rtol=2e-5, atol=2e-5)
