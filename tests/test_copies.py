"""The long-range copy curriculum: spliced copies of earlier spans, the original text intact and in order."""

import doctest

import numpy as np
import pytest

from fsjax.config import ConfigError, DataConfig
from fsjax.data import copies as copies_module
from fsjax.data.copies import insert_copies
from fsjax.data.pipeline import Encode, make_train_iterator

SPAN, DISTANCE = (4, 9), (20, 50)


def _runs(out):
  """Splits the output of `insert_copies(np.arange(n), ...)` into the original tokens and the copies.

  With strictly increasing ids an inserted token is one below the running maximum; a copy is a maximal run of
  consecutive values there, and the next original token is its insertion point.

  Returns:
    (original tokens, list of (source start, length, insertion point)).
  """
  original, runs, high = [], [], -1
  for i, token in enumerate(out.tolist()):
    if token > high:
      original.append(token)
      high = token
    elif runs and runs[-1][2] is None and token == runs[-1][0] + runs[-1][1] and out[i - 1] < high:
      runs[-1][1] += 1
    else:
      runs.append([token, 1, None])
    if token == high:
      for run in runs:
        if run[2] is None:
          run[2] = token
  return original, [tuple(r) for r in runs]


def test_copies_are_earlier_spans_spliced_into_the_intact_text():
  ids = np.arange(2000, dtype=np.int32)
  total = 0
  for seed in range(20):
    out = insert_copies(ids, np.random.default_rng(seed), rate=0.02, span=SPAN, distance=DISTANCE)
    assert out.dtype == np.int32
    original, runs = _runs(out)
    assert original == ids.tolist()
    assert out.size == ids.size + sum(length for _, length, _ in runs)
    for source, length, destination in runs:
      # Two copies spliced at one point read as one run; every run is then at most twice the longest span.
      assert SPAN[0] <= length <= 2 * SPAN[1]
      assert DISTANCE[0] <= destination - source <= DISTANCE[1] + SPAN[1]
    total += len(runs)
  # About rate * n = 40 copies per document, minus those whose destination would leave the text.
  assert 20 * 30 < total < 20 * 45


def test_same_generator_state_same_copies_and_rate_zero_is_identity():
  ids = np.random.default_rng(0).integers(0, 100, 500)
  a = insert_copies(ids, np.random.default_rng(7), rate=0.05, span=SPAN, distance=DISTANCE)
  b = insert_copies(ids, np.random.default_rng(7), rate=0.05, span=SPAN, distance=DISTANCE)
  np.testing.assert_array_equal(a, b)
  assert a.size > ids.size
  np.testing.assert_array_equal(
    insert_copies(ids, np.random.default_rng(7), rate=0.0, span=SPAN, distance=DISTANCE), ids
  )


@pytest.mark.parametrize(
  "fields,message",
  [
    (dict(copy_rate=1.0), "data.copy_rate must be in"),
    (dict(copy_rate=0.1, copy_span=(8,)), "data.copy_span must be"),
    (dict(copy_rate=0.1, copy_span=(9, 8)), "data.copy_span must be"),
    (dict(copy_rate=0.1, copy_span=(8, 32), copy_distance=(16, 64)), "data.copy_distance min must be >="),
  ],
)
def test_config_rules(fields, message):
  with pytest.raises(ConfigError, match=message):
    DataConfig(**fields)
  assert DataConfig().copies is None
  assert DataConfig(copy_rate=0.01).copies == dict(rate=0.01, span=(8, 32), distance=(160, 960))


def test_training_rows_carry_copies_deterministically(tmp_path):
  words = " ".join(f"w{i}" for i in range(400))
  path = tmp_path / "doc.txt"
  path.write_text(words, encoding="utf-8")
  kwargs = dict(path=path, tokenizer_path=None, seq_len=64, batch_size=2, seed=0, shuffle_window_tokens=0)
  take = lambda it: np.concatenate([next(it)["tokens"] for _ in range(4)])
  curriculum = dict(rate=0.05, span=(4, 8), distance=(16, 40))
  first = take(make_train_iterator(copies=curriculum, **kwargs))
  np.testing.assert_array_equal(first, take(make_train_iterator(copies=curriculum, **kwargs)))
  assert not np.array_equal(first, take(make_train_iterator(**kwargs)))
  with pytest.raises(ValueError, match="random_map"):
    Encode(None, copies=curriculum)("some text")


def test_docstring_example():
  failures, attempted = doctest.testmod(copies_module)
  assert attempted > 0 and failures == 0
