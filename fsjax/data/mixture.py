"""Training batches whose rows come from several iterators, each giving a fixed number of rows per batch: text,
or random rows with copies, with a share of tiled random rows (`data.tiled_rows`)."""

import numpy as np


class RowMixture:
  """Batches of the rows of each `TrainIterator` in `parts`, in order: a dict of `[sum of rows, seq_len + 1]`
  arrays. Every part must yield the same keys. `get_state()` is the list of the parts' JSON states;
  `set_state(state)` restores them all, so a resumed run sees the same batches."""

  def __init__(self, *parts):
    self._parts = parts

  def __iter__(self):
    return self

  def __next__(self):
    batches = [next(part) for part in self._parts]
    keys = set(batches[0])
    if any(set(batch) != keys for batch in batches):
      raise ValueError(f"the mixed iterators yield different keys: {[sorted(batch) for batch in batches]}")
    return {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]}

  def get_state(self):
    return {"parts": [part.get_state() for part in self._parts]}

  def set_state(self, state):
    for part, part_state in zip(self._parts, state["parts"], strict=True):
      part.set_state(part_state)
