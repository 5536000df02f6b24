"""A generic long-range copy curriculum: earlier spans of a document reappear later in the same document.

Plain books give a model trained at a short context little reason to look far back: most next tokens are
predictable from the last few hundred. Re-inserting spans of the same text further on rewards attention that
finds an earlier occurrence and copies what followed it, the mechanism long-context retrieval rests on, without
any evaluation template, needle or answer (FS Sec. 1 calls this the retrieval signal; the paper's own CPT
reweights natural repeats instead, Eq. 13).

Reading, with each choice named: a document of `n` tokens receives about `rate * n` copies (Poisson). Copy `i`
takes `L_i ~ U[span_min, span_max]` tokens starting at source `s_i` of the original text and inserts them
before original position `d_i = s_i + g_i`, `g_i ~ U[distance_min, distance_max]`, the distance counted in the
original text; insertions only add tokens between source and destination, so in the output every copy starts
at least `distance_min` tokens after its source. Copies whose source or destination would leave the document
are dropped. Nothing is overwritten: the original text stays in order, copies are spliced in between.

>>> import numpy as np
>>> ids = np.arange(100, 140)
>>> out = insert_copies(ids, np.random.default_rng(4), rate=0.05, span=(3, 3), distance=(10, 20))
>>> out[26:34].tolist()  # 115-117 reappear before original token 129, 14 tokens after their source
[126, 127, 128, 115, 116, 117, 129, 130]
"""

import numpy as np


def validate_copies(*, rate, span, distance, prefix=""):
  """Raises ValueError naming the first copy-curriculum argument that breaks a rule."""
  if not 0 <= rate < 1:
    raise ValueError(f"{prefix}copy_rate must be in [0, 1) (copies per token), got {rate}")
  for name, pair in (("copy_span", span), ("copy_distance", distance)):
    if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
      raise ValueError(f"{prefix}{name} must be [min, max] with 1 <= min <= max, got {list(pair)}")
  if distance[0] < span[1]:
    raise ValueError(
      f"{prefix}copy_distance min must be >= {prefix}copy_span max (a copy starts after its source "
      f"ends), got {distance[0]} < {span[1]}"
    )


def insert_copies(ids, rng, *, rate, span, distance):
  """Copy of `ids` with earlier spans re-inserted further on (see the module docstring).

  Args:
    ids: `[n]` integer token ids of one document.
    rng: a `np.random.Generator`; the same state gives the same output.
    rate: expected copies per original token.
    span: `(min, max)` copy length in tokens, inclusive.
    distance: `(min, max)` tokens from a copy's source start to its insertion point in the original text.

  Returns:
    `[n + total copied]` array of `ids.dtype`.
  """
  n = ids.shape[0]
  count = rng.poisson(rate * n)
  lengths = rng.integers(span[0], span[1] + 1, count)
  gaps = rng.integers(distance[0], distance[1] + 1, count)
  sources = rng.integers(0, max(n, 1), count)
  keep = sources + gaps < n
  lengths, sources, destinations = lengths[keep], sources[keep], (sources + gaps)[keep]
  order = np.argsort(destinations, kind="stable")
  pieces, previous = [], 0
  for source, length, destination in zip(sources[order], lengths[order], destinations[order]):
    pieces += [ids[previous:destination], ids[source : source + length]]
    previous = destination
  pieces.append(ids[previous:])
  return np.concatenate(pieces).astype(ids.dtype, copy=False)
