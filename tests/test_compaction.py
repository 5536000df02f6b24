"""A decode batch that halves as its rows finish (`fsjax.compaction`) generates what the fixed batch does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import kinds
from fsjax.cache import cache_rows, init_cache
from fsjax.config import model_preset
from fsjax.decode import generate

from helpers import jitted_init, record_batch_sizes, tiny_model


@pytest.mark.parametrize("kind,scan_layers,short_conv", [("fsl", True, 0), ("zha", False, 3)])
def test_a_halving_batch_generates_what_the_fixed_batch_does(kind, scan_layers, short_conv, rng, monkeypatch):
  """Six ragged rows, ended by their caps and by EOS: greedy tokens equal the fixed batch's. Three rows end at the
  second token, so the loop goes on with three running rows and one finished row as padding (4 rows), and then
  on fewer."""
  config, model, variables = tiny_model(kind, scan_layers)
  if short_conv:
    config = dataclasses.replace(config, short_conv=short_conv)
    model, variables = type(model)(config), jitted_init(config)
  lengths = [30, 21, 45, 9, 33, 17]
  tokens = np.zeros((6, 48), np.int32)
  for row, n in enumerate(lengths):
    tokens[row, :n] = rng.integers(3, config.vocab_size, n)
  run = lambda eos_id, limits, compact: np.asarray(
    generate(
      model, variables, tokens, lengths, max_new_tokens=14, eos_id=eos_id, max_len=64, limits=limits, compact=compact
    )
  )
  free = run(-1, None, False)
  # EOS: a token row 3 generates before its cap that no row generates among its first three, so only the caps end
  # rows there
  eos_id = int(next(t for t in free[3, 3:8] if t not in free[:, :3]))
  limits = [2, 14, 2, 9, 14, 2]

  sizes = record_batch_sizes(monkeypatch)
  fixed, halving = run(eos_id, limits, False), run(eos_id, limits, True)
  np.testing.assert_array_equal(halving, fixed)
  assert eos_id in fixed[3, :9]
  assert sizes[:2] == [6, 4] and sizes == sorted(sizes, reverse=True) and len(sizes) >= 3, sizes
  for row, limit in enumerate(limits):
    ended = list(fixed[row]).index(eos_id) if eos_id in fixed[row] else limit
    np.testing.assert_array_equal(fixed[row, :ended], free[row, :ended])


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("kind", list(kinds.names()))
def test_cache_rows_takes_each_array_along_its_batch_axis(kind, scan_layers):
  """Every cache array of every kind, stacked or not, with a convolution history: the rows taken are the rows
  asked for, in their order. An array's batch axis is the one that grows with the batch."""
  config = dataclasses.replace(model_preset("tiny", kind=kind, scan_layers=scan_layers), short_conv=3)
  four, five = (jax.eval_shape(lambda b=b: init_cache(config, b, 96)) for b in (4, 5))
  axes = jax.tree_util.tree_map(lambda x, y: [a != b for a, b in zip(x.shape, y.shape)].index(True), four, five)
  row_ids = lambda x, axis: jnp.broadcast_to(
    jnp.arange(4).reshape([4 if i == axis else 1 for i in range(x.ndim)]), x.shape
  ).astype(x.dtype)  # every element holds its batch row
  taken = cache_rows(jax.tree_util.tree_map(row_ids, four, axes), jnp.asarray([3, 1, 3]))
  for x, axis in zip(jax.tree_util.tree_leaves(taken), jax.tree_util.tree_leaves(axes)):
    rows = np.moveaxis(np.asarray(x), axis, 0).reshape(3, -1)
    np.testing.assert_array_equal(rows, np.broadcast_to(np.asarray([3, 1, 3])[:, None], rows.shape))


def test_a_halving_batch_refuses_to_record_cells_before_compiling():
  _, model, variables = tiny_model("fs")
  with pytest.raises(ValueError, match="return_cells needs compact=False"):
    generate(
      model, variables, np.ones((2, 8), np.int32), [8, 5], max_new_tokens=4, eos_id=-1, return_cells=True, compact=True
    )
