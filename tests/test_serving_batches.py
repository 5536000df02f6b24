"""Every kind prefills and decodes at serving batches on a GPU: 128 prompts of 4k and 32 of 32k tokens, 341M
shape, bf16 parameters and caches, scanned layers, random weights (issue #40). The prompts are ragged, and two rows
hold the same prompt: their logits must agree, so no row reads another's state at these batch sizes. A case
whose cache alone exceeds the free device memory is skipped with both sizes named (the dense caches at 32 × 32k
take 94 GiB; XLA's default share of an H200 is 105 GiB, XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 gives 133).
Skipped without a GPU: the shapes are the point."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import calibrate, kinds, loading, memory
from fsjax.cache import init_cache
from fsjax.config import model_preset
from fsjax.decode import decode_loop, extend, prefill, sample
from fsjax.model import Transformer, init_variables
from fsjax.ops import dispatch

from helpers import assert_close

pytestmark = pytest.mark.skipif(not dispatch.on_gpu(), reason="serving batches of the 341M shape need a GPU")

DECODE_STEPS = 4


def _config(kind):
  return dataclasses.replace(
    model_preset("fs_341m", kind=kind), dtype="bfloat16", param_dtype="bfloat16", scan_layers=True
  )


def _stacks_in_another_layout(hlo, cache_shapes):
  """Instructions of optimized HLO whose result is a whole stacked cache array in another layout than the
  cache's own row-major one: a permutation of its shape, or its shape with a layout that is not descending."""
  found = []
  for match in re.finditer(r"= ([a-z0-9]+)\[([0-9,]+)\](?:\{([0-9,]*)\})? ([a-z-]+)\(", hlo):
    dims = tuple(int(d) for d in match.group(2).split(","))
    layout = match.group(3)
    for shape in cache_shapes:
      if sorted(dims) != sorted(shape):
        continue
      descending = layout is None or [int(d) for d in layout.split(",")] == list(range(len(dims)))[::-1]
      if dims != shape or not descending:
        found.append(match.group(0))
  return found


@pytest.mark.parametrize("kind", list(kinds.names()))
def test_chunk_programs_keep_the_stacked_cache_in_its_layout(kind):
  """A scanned model's chunk programs read and write the stacked cache in place, in its own layout (8 × 4k,
  chunks of 512). A matrix product's preferred operand layout, carried up to the loop-carried stack, made XLA
  transpose whole stacks around the scan (MoBA, SWA, FS-L, ZHA): a second cache's worth of memory."""
  config, batch, size = _config(kind), 8, 512
  cache = jax.eval_shape(lambda: init_cache(config, batch, 4096, dtype=jnp.bfloat16))
  variables = jax.eval_shape(lambda: init_variables(config, jax.random.PRNGKey(0), 128))
  ints, valid = jax.ShapeDtypeStruct((batch, size), jnp.int32), jax.ShapeDtypeStruct((batch, size), jnp.bool_)
  shapes = {x.shape for x in jax.tree_util.tree_leaves(cache) if x.ndim >= 3}
  for first_chunk in (True, False):
    compiled = extend.lower(
      Transformer(config),
      variables,
      ints,
      cache,
      ints,
      valid,
      first_chunk=first_chunk,
      logits_at=jax.ShapeDtypeStruct((batch,), jnp.int32),
    ).compile()
    assert _stacks_in_another_layout(compiled.as_text(), shapes) == [], first_chunk


@pytest.mark.parametrize("batch,length", [(128, 4096), (32, 32768)], ids=["128x4k", "32x32k"])
@pytest.mark.parametrize("kind", list(kinds.names()))
def test_kind_prefills_and_decodes_at_a_serving_batch(kind, batch, length):
  config = _config(kind)
  make_cache = lambda: init_cache(config, batch, length + DECODE_STEPS, dtype=jnp.bfloat16)
  cache_bytes, free = memory.tree_bytes(jax.eval_shape(make_cache)), memory.free_bytes()
  if cache_bytes > free:
    pytest.skip(f"the {kind} cache takes {memory.gib(cache_bytes)}; XLA may take {memory.gib(free)} more")
  model = Transformer(config)
  variables = jax.jit(lambda: init_variables(config, jax.random.PRNGKey(0), 128))()
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 0, config.vocab_size)
  tokens = tokens.at[1].set(tokens[0])
  if kind == "fsb":
    fs_model = Transformer(dataclasses.replace(config, attention=model_preset("fs_341m", kind="fs").attention))
    variables = loading.with_tau(config, variables, calibrate.calibrate(fs_model, variables, [tokens[:2, :4096]]))
  lengths = length - (jnp.arange(batch) * 997) % (length // 4)  # ragged; rows 0 and 1 both full length
  lengths = lengths.at[1].set(length)
  last, cache = prefill(model, variables, tokens, lengths, make_cache(), all_logits=False)
  last = np.asarray(last, np.float32)
  assert np.isfinite(last).all()
  assert_close(last[1], last[0], jnp.bfloat16)
  first = sample(jnp.asarray(last), jax.random.PRNGKey(2))
  out = decode_loop(
    model,
    variables,
    cache,
    first,
    lengths,
    jax.random.PRNGKey(3),
    max_new_tokens=DECODE_STEPS,
    eos_id=-1,
    temperature=0.0,
    top_p=1.0,
  )
  out = np.asarray(out)
  assert out.shape == (batch, DECODE_STEPS) and ((out >= 0) & (out < config.vocab_size)).all()
