"""Training batches are stacked ahead in a background thread (`fsjax.data.pipeline.prefetched_batches`); the
state a checkpoint stores must still be the consumer's, not the thread's: restored, an iterator yields exactly
the batches that followed the last one taken, however far the thread had run ahead."""

import json
import time

import numpy as np
import pytest

from fsjax.data.associative import make_associative_iterator
from fsjax.data.pipeline import BATCHES_AHEAD, make_train_iterator
from fsjax.data.random_rows import make_random_iterator

TASK = dict(pairs=3, keys=(3, 40), values=(40, 80), filler_ids=(80, 200))
WORDS = ("apple", "river", "stone", "cloud", "tiger", "horse")


def _text_corpus(path):
  path.write_text("".join(json.dumps({"text": " ".join([w] * (5 + i))}) + "\n" for i, w in enumerate(WORDS)))
  return path


MAKERS = {
  "associative": lambda tmp_path: make_associative_iterator(seq_len=31, batch_size=3, seed=2, task=TASK),
  "random": lambda tmp_path: make_random_iterator(seq_len=15, batch_size=3, seed=2, vocab=(3, 99)),
  "text": lambda tmp_path: make_train_iterator(
    path=_text_corpus(tmp_path / "words.jsonl"),
    tokenizer_path=None,
    seq_len=8,
    batch_size=2,
    seed=2,
    shuffle_window_tokens=30,
  ),
}


def _settled(iterator):
  """Gives the background thread time to fill its buffer of `BATCHES_AHEAD` batches."""
  time.sleep(0.3)
  return iterator


@pytest.mark.parametrize("source", sorted(MAKERS))
def test_a_restored_iterator_continues_after_the_last_batch_taken(source, tmp_path):
  make = lambda: MAKERS[source](tmp_path)
  straight = make()
  expected = [next(straight)["tokens"] for _ in range(3 + BATCHES_AHEAD + 3)]

  iterator = make()
  for batch in expected[:3]:
    np.testing.assert_array_equal(next(_settled(iterator))["tokens"], batch)
  state = json.loads(json.dumps(_settled(iterator).get_state()))  # as a checkpoint stores it
  for batch in expected[3:]:  # the thread's buffer does not change what the consumer gets
    np.testing.assert_array_equal(next(iterator)["tokens"], batch)

  resumed = make()
  resumed.set_state(state)
  for batch in expected[3:]:
    np.testing.assert_array_equal(next(_settled(resumed))["tokens"], batch)
