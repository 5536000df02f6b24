"""Random-id rows with spliced copies or one tiled sequence (fsjax.data.random_rows), tiled rows mixed into text
batches (data.tiled_rows, fsjax.data.mixture), and their config rules."""

import json
import pathlib

import numpy as np
import pytest

from fsjax.config import Config, ConfigError, DataConfig, TrainConfig, load_config, model_preset
from fsjax.data.copies import insert_copies
from fsjax.data.random_rows import make_random_iterator, random_row
from fsjax.train.loop import train_iterator

COPIES = dict(rate=0.02, span=(8, 16), distance=(20, 60))


def test_a_row_is_random_ids_with_the_curriculums_copies():
  row = random_row(7, seed=3, length=300, vocab=(3, 5000), copies=COPIES)
  rng = np.random.default_rng([3, 7])
  ids = rng.integers(3, 5000, 300, dtype=np.int32)
  np.testing.assert_array_equal(row, insert_copies(ids, rng, **COPIES)[:300])
  assert row.shape == (300,) and row.dtype == np.int32 and row.min() >= 3 and row.max() < 5000
  # The copies are there: some 8-gram occurs twice (random ids over 5000 would almost never repeat one).
  grams = [tuple(row[i : i + 8]) for i in range(len(row) - 7)]
  assert len(set(grams)) < len(grams)
  assert not np.array_equal(row, random_row(8, seed=3, length=300, vocab=(3, 5000), copies=COPIES))


def test_a_tiled_row_repeats_one_random_sequence_of_a_per_row_length():
  periods = set()
  for index in range(20):
    row = random_row(index, seed=1, length=200, vocab=(3, 5000), period=(5, 40))
    assert row.shape == (200,) and row.dtype == np.int32 and row.min() >= 3 and row.max() < 5000
    period = next(n for n in range(1, 201) if np.array_equal(row[n:], row[:-n]))  # the smallest shift that fits
    assert 5 <= period <= 40
    periods.add(period)
  assert len(periods) > 5  # the period is drawn per row, so no single offset solves every row
  with pytest.raises(ValueError, match="copies or period, not both"):
    random_row(0, seed=1, length=200, vocab=(3, 5000), copies=COPIES, period=(5, 40))


def test_a_tiled_config_trains_from_random_rows():
  """`--set data.random_period=[..]` parses and reaches the iterator the training loop builds."""
  config = load_config(
    pathlib.Path(__file__).parents[1] / "configs" / "tiny_tfpp.yaml",
    [
      "data.seq_len=64",
      "data.source=random",
      "data.random_ids=[3,512]",
      "data.random_period=[4,12]",
      "train.batch_size=2",
      "eval.niah_samples=0",
    ],
  )
  tokens = next(train_iterator(config, 1))["tokens"]
  assert tokens.shape == (2, 65)
  assert all(any(np.array_equal(r[n:], r[:-n]) for n in range(4, 13)) for r in tokens)


def _is_tiled(row, periods):
  return any(np.array_equal(row[n:], row[:-n]) for n in periods)


@pytest.mark.parametrize("main_rows", ["text", "random copies"])
def test_tiled_rows_end_every_batch_and_resume_from_the_json_state(main_rows):
  """`data.tiled_rows`: the last rows of each batch are tiled random rows, the others the rows the main source
  gives a batch of that smaller size (text, or random rows with copies); beside random copy rows the tiled rows
  draw from seed + 1 (from the same seed they would repeat the copy rows' first ids). A restored state continues
  both streams."""
  main = ["data.seq_len=64", "data.random_ids=[3,512]", "eval.niah_samples=0"]
  if main_rows == "random copies":
    main += ["data.source=random", "data.copy_rate=0.02", "data.copy_span=[4,8]", "data.copy_distance=[8,40]"]
  tiny = pathlib.Path(__file__).parents[1] / "configs" / "tiny_tfpp.yaml"
  config = load_config(tiny, [*main, "data.tiled_rows=2", "data.random_period=[4,12]", "train.batch_size=5"])
  iterator = train_iterator(config, 1)
  first = next(iterator)["tokens"]
  assert first.shape == (5, 65) and first.dtype == np.int32
  assert all(_is_tiled(row, range(4, 13)) for row in first[3:])
  assert not any(_is_tiled(row, range(4, 13)) for row in first[:3])
  smaller = load_config(tiny, [*main, "train.batch_size=3"])
  np.testing.assert_array_equal(first[:3], next(train_iterator(smaller, 1))["tokens"])
  tiled_seed = config.train.seed + (1 if main_rows == "random copies" else 0)
  for index, row in enumerate(first[3:]):
    np.testing.assert_array_equal(row, random_row(index, seed=tiled_seed, length=65, vocab=(3, 512), period=(4, 12)))

  state = json.loads(json.dumps(iterator.get_state()))
  expected = [next(iterator)["tokens"] for _ in range(2)]
  resumed = train_iterator(config, 1)
  resumed.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(next(resumed)["tokens"], batch)


def test_iterator_resumes_from_its_json_state_and_shards_rows():
  make = lambda **kw: make_random_iterator(seq_len=64, batch_size=3, seed=0, vocab=(3, 500), copies=COPIES, **kw)
  iterator = make()
  first = next(iterator)["tokens"]
  assert first.shape == (3, 65) and first.dtype == np.int32
  state = json.loads(json.dumps(iterator.get_state()))
  expected = [next(iterator)["tokens"] for _ in range(2)]
  resumed = make()
  resumed.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(next(resumed)["tokens"], batch)
  shards = [next(make(shard_index=i, shard_count=2))["tokens"] for i in range(2)]
  np.testing.assert_array_equal(shards[0][0], first[0])  # shard 0 reads rows 0, 2, 4
  np.testing.assert_array_equal(shards[1][0], first[1])  # shard 1 reads rows 1, 3, 5


@pytest.mark.parametrize(
  "fields,message",
  [
    (dict(source="noise"), "data.source must be one of"),
    (dict(source="random", copy_rate=0.01, random_ids=(5, 5)), "data.random_ids must be"),
    (dict(source="random"), "data.source random needs exactly one of data.copy_rate > 0 and data.random_period"),
    (dict(source="random", copy_rate=0.01, random_period=(8, 16)), "needs exactly one of"),
    (dict(source="random", seq_len=64, random_period=(8, 64)), r"random_period must be \[min, max\] with 1 <= min"),
    (dict(source="random", seq_len=64, random_period=(9, 8)), "data.random_period must be"),
    (dict(random_period=(8, 16)), "data.random_period needs data.source random or data.tiled_rows > 0"),
    (dict(tiled_rows=2), "data.tiled_rows needs data.random_period"),
    (
      dict(tiled_rows=2, source="random", random_period=(8, 16)),
      "data.tiled_rows with data.source random needs data.copy_rate > 0",
    ),
    (dict(tiled_rows=2, random_period=(8, 16), recall_masks=True), "data.recall_masks must be false"),
    (dict(tiled_rows=-1), "data.tiled_rows must be >= 0"),
    (dict(source="random", copy_rate=0.01, recall_masks=True), "data.recall_masks must be false"),
    (dict(source="random", copy_rate=0.01, seq_len=128), "data.copy_distance min must be < data.seq_len=128"),
  ],
)
def test_random_source_rules(fields, message):
  with pytest.raises(ConfigError, match=message):
    DataConfig(**fields)


def test_tiled_rows_leave_text_in_every_batch_and_fit_the_vocabulary():
  data = dict(seq_len=64, tiled_rows=4, random_period=(8, 16), random_ids=(3, 512))
  with pytest.raises(ConfigError, match=r"data.tiled_rows \(4\) must be below train.batch_size \(4\)"):
    Config(model=model_preset("tiny"), data=DataConfig(**data), train=TrainConfig(batch_size=4))
  with pytest.raises(ConfigError, match="data.random_ids must lie below model.vocab_size=512"):
    Config(
      model=model_preset("tiny"), data=DataConfig(**dict(data, random_ids=(3, 600))), train=TrainConfig(batch_size=8)
    )
  Config(model=model_preset("tiny"), data=DataConfig(**data), train=TrainConfig(batch_size=8))


def test_random_ids_must_fit_the_vocabulary():
  data = dict(seq_len=64, source="random", copy_rate=0.01, copy_span=(4, 8), copy_distance=(8, 16))
  with pytest.raises(ConfigError, match="data.random_ids must lie below model.vocab_size=512"):
    Config(model=model_preset("tiny"), data=DataConfig(**data))
  Config(model=model_preset("tiny"), data=DataConfig(**data, random_ids=(3, 512)))
