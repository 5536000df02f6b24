"""One set of cases run against every implementation of an op (the pattern of tokamax's `test_base`).

For each op of `fsjax.ops.dispatch.TABLE` that has a fast implementation, every case below runs through each of
its implementations that this machine can run (Pallas interpreted on a CPU and compiled on a GPU; cuDNN on a GPU
only) and through the reference, on the same fresh random inputs, and compares forward values and, where the op
is differentiable, gradients. Discrete outputs (selected cells) are compared as sets, forgiving only swaps between
cells whose reference scores tie within float32 rounding. Shapes are awkward on purpose: sequences ending mid-cell
and mid-block, ragged decode positions, head dims that are not powers of two, and selections with -1 sentinels.

Kernel-specific properties (tile sizes, cell-range splits, ties inside a kernel) stay in `test_kernel_*.py`.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.ops import dispatch
from fsjax.ops.freesolo import cached_readout
from fsjax.reference import cells as cells_ref
from fsjax.reference.routing import Routing

from helpers import assert_close, assert_same_cells

ON_GPU = jax.default_backend() == "gpu"
SCORE_ATOL = 1e-4  # float32 rounding of one Eq. 7 score computed in two orders


@dataclasses.dataclass(frozen=True)
class Case:
  """An input of one op: `make(rng)` → (args, kwargs); `output` "values" (compared with assert_close, and by
  gradient when `grads`) or "cells" (compared as sets with the reference's scores)."""

  op: str
  make: Callable
  output: str = "values"
  grads: bool = False
  dtype: object = jnp.float32


def _qkv(rng, shape, dtype=jnp.float32):
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))


def _per_head(rng, heads, low, high):
  return jnp.asarray(rng.uniform(low, high, heads), jnp.float32)


def _attention(variant, batch, seq, heads, dim, **geometry):
  def make(rng):
    q, k, v = _qkv(rng, (batch, seq, heads, dim))
    kw = dict(
      variant=variant,
      alpha=_per_head(rng, heads, 0.5, 1.5),
      lam=_per_head(rng, heads, 0.3, 1.2),
      sigma=_per_head(rng, heads, 2.0, 6.0),
      lr_gain=1.0,
      **geometry,
    )
    if variant == "fsb":  # τ = the median cell norm, so both forests hold cells
      kw["tau"] = jnp.median(cells_ref.cell_summaries(k, geometry["cell"])[1], axis=(0, 1))
    return (q, k, v), kw

  return make


def _selection(batch, seq, heads, dim, *, decode=False, **geometry):
  def make(rng):
    q, k, _ = _qkv(rng, (batch, seq, heads, dim))
    kw = dict(lam=_per_head(rng, heads, 0.3, 1.2), sigma=_per_head(rng, heads, 2.0, 6.0), **geometry)
    if not decode:
      return (q, k), kw
    # Decode form: a few queries per row at ragged positions over the summaries of the whole sequence.
    mean_keys, max_norms, _ = cells_ref.cell_summaries(k, geometry["cell"])
    positions = jnp.asarray(np.sort(rng.integers(0, seq, (batch, 5)), axis=1), jnp.int32)
    routing = Routing(**{name: kw.pop(name) for name in list(kw) if name not in ("lam", "sigma")})
    return (q[:, :5], positions, mean_keys, max_norms), dict(routing=routing, **kw)

  return make


def _readout(batch, seq, seq_k, heads, dim, cell, top_k, *, cached=False):
  def make(rng):
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_k, heads, dim)), jnp.float32) for _ in range(2))
    idx = np.argsort(rng.random((batch, seq, heads, seq_k // cell)), axis=-1)[..., :top_k]
    count = rng.integers(0, top_k + 1, (batch, seq, heads, 1))  # some queries select fewer cells, or none
    cell_idx = jnp.asarray(np.where(np.arange(top_k) < count, idx, -1), jnp.int32)
    return (q, k, v, cell_idx), dict(cell=cell)

  return make


def _dense(seq, heads, dim, **kw):
  def make(rng):
    return _qkv(rng, (2, seq, heads, dim), jnp.bfloat16), kw

  return make


GEOMETRY = dict(window=40, cell=16, block=32, top_k=3, retain_top=4, retain_recent=1)
CASES = {
  "fs-T100-d24": Case("freesolo_attention", _attention("fs", 1, 100, 2, 24, **GEOMETRY), grads=True),
  "fsl-B2-T200": Case("freesolo_attention", _attention("fsl", 2, 200, 2, 32, **GEOMETRY), grads=True),
  "fsb-T128": Case("freesolo_attention", _attention("fsb", 1, 128, 2, 16, beam=4, **GEOMETRY)),
  "select-fs-T203-d96": Case(
    "select_cells", _selection(1, 203, 3, 96, variant="fs", cell=16, block=32, top_k=3), output="cells"
  ),
  "select-fsl-T203": Case(
    "select_cells",
    _selection(1, 203, 3, 40, variant="fsl", cell=16, block=32, top_k=3, retain_top=4, retain_recent=1),
    output="cells",
  ),
  "decode-fsl-ragged": Case(
    "select_from_summaries",
    _selection(2, 160, 2, 32, decode=True, variant="fsl", cell=16, block=32, top_k=3, retain_top=3, retain_recent=1),
    output="cells",
  ),
  "readout-T75-Tk192-d96": Case("sparse_readout", _readout(1, 75, 192, 3, 96, 16, 3), grads=True),
  "readout-B2-K2-s32": Case("sparse_readout", _readout(2, 64, 64, 2, 32, 32, 2), grads=True),
  "cached-readout-chunk": Case("cached_readout", _readout(2, 32, 96, 2, 32, 16, 3)),
  "cached-readout-token": Case("cached_readout", _readout(2, 1, 96, 2, 32, 16, 3)),
  "tfpp-T100": Case("tfpp_attention", _dense(100, 2, 64), dtype=jnp.bfloat16),
  "swa-T100": Case("swa_attention", _dense(100, 2, 64, window=24), dtype=jnp.bfloat16),
  "local-T100": Case("local_attention", _dense(100, 2, 64, window=24), dtype=jnp.bfloat16),
}
CALLS = {
  "freesolo_attention": ops.freesolo_attention,
  "select_cells": ops.select_cells,
  "select_from_summaries": ops.select_from_summaries,
  "sparse_readout": ops.sparse_readout,
  "cached_readout": cached_readout,
  "tfpp_attention": ops.tfpp_attention,
  "swa_attention": ops.swa_attention,
  "local_attention": ops.local_attention,
}
# Composites dispatch through the table entry of their fast part.
TABLE_OP = {"cached_readout": "sparse_readout", "freesolo_attention": "freesolo_long_range"}


def _pairs():
  for name, case in CASES.items():
    for impl in dispatch.implementations(TABLE_OP.get(case.op, case.op))[1:]:
      marks = [pytest.mark.skipif(not ON_GPU, reason="cuDNN needs a GPU")] if impl == "cudnn" else []
      yield pytest.param(case, impl, id=f"{name}-{impl}", marks=marks)


def _run(case, impl, args, kwargs):
  # "pallas" names the kernels; cuDNN is what "auto" takes for half precision on a GPU.
  return CALLS[case.op](*args, **kwargs, impl="pallas" if impl == "pallas" else "auto")


@pytest.mark.parametrize("case,impl", list(_pairs()))
def test_every_implementation_equals_the_reference(rng, case, impl):
  args, kwargs = case.make(rng)
  if impl == "cudnn":
    assert dispatch.resolve(case.op, "auto", dtype=case.dtype) == "cudnn"
  # Both sides jitted: op by op, the interpreted kernels and the references dispatched every operation.
  run = lambda *xs: _run(case, impl, xs, kwargs)
  reference = lambda *xs: CALLS[case.op](*xs, **kwargs, impl="reference")
  got = jax.jit(run)(*args)
  want = jax.jit(reference)(*args)
  if case.output == "cells":
    q, k = args[0], args[1]
    if case.op == "select_cells":
      mean_keys, max_norms, centers = cells_ref.cell_summaries(k, kwargs["cell"])
      positions = None
    else:
      positions, mean_keys, max_norms = args[1], args[2], args[3]
      centers = (jnp.arange(max_norms.shape[1]) + 0.5) * kwargs["routing"].cell
    scores = cells_ref.cell_scores(
      q, mean_keys, max_norms, centers, lam=kwargs["lam"], sigma=kwargs["sigma"], positions=positions
    )
    assert got.dtype == jnp.int32 and got.shape == want.shape
    assert_same_cells(got, want, scores, SCORE_ATOL)
    assert np.any(np.asarray(want) >= 0)  # the case really selects
    return
  assert_close(got, want, case.dtype)
  if not case.grads:
    return
  weights = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
  differentiable = args[:3]
  loss = lambda run: lambda *xs: jnp.sum(run(*xs, *args[3:]).astype(jnp.float32) * weights)
  grads = jax.jit(jax.grad(loss(run), argnums=(0, 1, 2)))(*differentiable)
  expected = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(*differentiable)
  for g, e in zip(grads, expected):
    assert_close(g, e, case.dtype)
