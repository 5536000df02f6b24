"""Random-id rows with spliced copies: a warm-up that teaches a model to copy before it reads text.

Every row is a sequence of uniformly random token ids into which the copy curriculum (`fsjax.data.copies`)
splices earlier spans of the same row, at random distances. The copies are the only predictable tokens, and only
by finding the earlier occurrence of the current token and reading what followed it: the content-based induction
that copying and needle retrieval rest on. Random distances rule out the shortcut of a fixed relative offset
(a row that repeats with one period is solved by a head attending exactly one period back, which does not carry
over to text: docs/results.md). Natural text with spliced copies lets a model lower its loss by local
statistics first, for a long time before copying pays off (docs/results.md).

Tiled rows (`period`) are the dense variant: one random sequence of a per-row random length, repeated, so after
its first period every token is a copy. The period differs from row to row, so no fixed offset solves them; a
model has to find the current token's previous occurrence. They are meant as the first stage of a curriculum
(tiled rows, then sparse copies or text): docs/results.md says what they did on CPU.

The rows are generic: no text, no template, no evaluation content. Row `i` is a pure function of `(seed, i)`, so
the iterator's state is one index and a resumed run sees the same rows.

>>> import numpy as np
>>> row = random_row(0, seed=0, length=64, vocab=(3, 1000), copies=dict(rate=0.05, span=(4, 4), distance=(8, 16)))
>>> row.shape, row.dtype, bool(row.min() >= 3)
((64,), dtype('int32'), True)
"""

import grain
import numpy as np

from fsjax.data.copies import insert_copies
from fsjax.data.pipeline import ROW_READ_OPTIONS, prefetched_batches

_ROWS = 2**62  # grain needs a length; no run reads this many rows


def random_row(index, *, seed, length, vocab, copies=None, period=None):
  """Row `index`: `length` ids drawn uniformly from `[vocab[0], vocab[1])`, with copies spliced in by
  `insert_copies(**copies)` (None = no copies) and the result cut back to `length`; or, with `period` `(min, max)`,
  one random sequence of a length drawn from `[min, max]`, repeated until the row is full. int32 `[length]`."""
  if period is not None and copies is not None:
    raise ValueError("random_row takes copies or period, not both (a row is one kind of task)")
  rng = np.random.default_rng([seed, index])
  if period is not None:
    base = rng.integers(vocab[0], vocab[1], rng.integers(period[0], period[1] + 1), dtype=np.int32)
    return np.resize(base, length)  # repeats base cyclically
  ids = rng.integers(vocab[0], vocab[1], length, dtype=np.int32)
  return ids if copies is None else insert_copies(ids, rng, **copies)[:length]


def make_random_iterator(*, seq_len, batch_size, seed, vocab, copies=None, period=None, shard_index=0, shard_count=1):
  """Infinite `TrainIterator` of `{"tokens": int32 [batch_size, seq_len + 1]}` random-id batches (`random_row`).

  Process `shard_index` of `shard_count` reads rows `shard_index, shard_index + shard_count, ...`.
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
  rows = grain.MapDataset.range(_ROWS)[shard_index::shard_count].map(
    lambda i: {"tokens": random_row(i, seed=seed, length=seq_len + 1, vocab=vocab, copies=copies, period=period)}
  )
  return prefetched_batches(rows.to_iter_dataset(ROW_READ_OPTIONS), batch_size)
