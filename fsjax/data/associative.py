"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"), extended for length extrapolation.

A row holds `pairs` key-value pairs, each a key id followed by its value id, and `query_count` queries (default:
as many as pairs): a key of the row again, followed by its value, the answer. Keys come from one id range and
values from another (disjoint), keys are distinct within a row and values drawn with replacement, as in Zoology's
MQAR. Unlike Zoology, the pairs lie anywhere in a long context of filler tokens (uniform ids from a third range,
or text), the queries sit at the end of the row or each somewhere after its pair, and the distance from a pair to
its query can be bounded, so the same task runs at any length. Only the answers are predictable from the row:
`loss_mask` marks them, and training takes its loss there alone (`fsjax.train.objectives.loss_weights`), or
with `filler_loss` on the text filler as well.

Which key a query asks (`query_keys`): Zoology queries every pair once ("each"). The answers are in the row
(teacher forcing), so with every pair queried once a model can answer a query with a value of the row that no
earlier query has answered, without binding values to keys: the last query is then always right and the row's
accuracy is `H(pairs) / pairs` (21% for 16 pairs), which is what models trained on "each" rows learned
(docs/results.md, "Associative recall"). "sampled" (the default) draws each query's key uniformly, with
replacement, from the pairs that may precede it (before the query, within `distance`), so earlier answers tell
nothing about the next one: only binding answers more than `1 / pairs` of them (`fsjax.eval.recall` scores a
key's first ask only; a repeated ask finds its answer at the earlier one). Sampled keys also allow more queries
than pairs (queries at the end, no distance bound): more answers per row to learn from.

Readings (the Zoology paper leaves these open or has no filler): the distance is from the pair's key to the
query's key, `query - pair >= 2`; with text filler, the row's own keys are replaced where the text holds them (by
a uniform filler id), so a key occurs only at its pair and its queries; a pair or query never overlaps another.

Row `i` of stream `stream` is a pure function of `(seed, stream, i)`: the training stream (`TRAIN`) and the test
stream (`TEST`, `fsjax.eval.recall`) draw from different generators for every seed.

>>> row = associative_row(0, seed=0, stream=TRAIN, length=64, pairs=4)
>>> row["tokens"].shape, int(row["loss_mask"].sum())
((64,), 4)
"""

import dataclasses
import functools

import grain
import numpy as np

from fsjax.data.pipeline import ROW_READ_OPTIONS, DataError, default_corpus_path, prefetched_batches, read_documents
from fsjax.data.tokenizer import load_tokenizer

TRAIN, TEST = 0, 1  # stream tags: part of every row's generator seed, so the two streams never share one
_ROWS = 2**62  # grain needs a length; no run reads this many rows
FILLER_TOKENS = 2**21  # text filler read per corpus: windows of it fill the rows
PLACEMENT_TRIES = 100  # random placements of a row's pairs and queries before it is refused


@dataclasses.dataclass(frozen=True)
class RecallRow:
  """One row: `tokens` and `loss_mask` `[length]` (the answers); per query `[queries]` its key's position, the
  position of its pair's key, the key, the value (answer), and whether it is its key's first ask (no earlier
  query asked that key); and `pair_values` `[pairs]`, the value of every pair in the row. With sampled query
  keys a pair may be asked by several queries or by none; a repeated ask can be answered from the earlier one."""

  tokens: np.ndarray
  loss_mask: np.ndarray
  query_positions: np.ndarray
  pair_positions: np.ndarray
  keys: np.ndarray
  values: np.ndarray
  first_asks: np.ndarray
  pair_values: np.ndarray


def _place(rng, length, pairs, queries, distance, query_count):
  """`(pair positions [pairs], query positions [query_count])` of one row, or None where a random placement ran
  out of room (the caller draws again); query j's pair is pair j when `query_count == pairs`. Queries at the end
  with no distance bound are placed in one draw that never fails: sorted distinct starts plus their rank leave
  every pair two free slots."""
  if queries == "end" and distance is None:
    context = length - 2 * query_count
    starts = np.sort(rng.choice(context - pairs, pairs, replace=False)) + np.arange(pairs)
    return rng.permutation(starts), context + 2 * np.arange(query_count)
  occupied = np.zeros(length, bool)
  query_positions = np.zeros(pairs, np.int64)
  pair_positions = np.zeros(pairs, np.int64)
  low, high = (2, length) if distance is None else distance
  if queries == "end":
    query_positions[:] = length - 2 * pairs + 2 * rng.permutation(pairs)
    occupied[length - 2 * pairs :] = True
  for j in range(pairs):
    if queries == "interleaved":
      starts = _free_starts(occupied, length)
      starts = starts[starts >= low]  # room for its pair before it
      if starts.size == 0:
        return None
      query_positions[j] = rng.choice(starts)
      occupied[query_positions[j] : query_positions[j] + 2] = True
    q = query_positions[j]
    starts = _free_starts(occupied, q)
    starts = starts[(q - starts >= low) & (q - starts <= high)]
    if starts.size == 0:
      return None
    pair_positions[j] = rng.choice(starts)
    occupied[pair_positions[j] : pair_positions[j] + 2] = True
  return pair_positions, query_positions


def _free_starts(occupied, upto):
  """Starts `p < upto - 1` of two free consecutive slots."""
  free = ~occupied[: max(upto, 0)]
  return np.flatnonzero(free[:-1] & free[1:]) if free.size > 1 else np.zeros(0, np.int64)


def recall_row(
  index,
  *,
  seed,
  stream,
  length,
  pairs,
  keys=(3, 1027),
  values=(1027, 2051),
  filler_ids=(2051, 32000),
  queries="end",
  distance=None,
  query_keys="sampled",
  query_count=None,
  filler_loss=False,
  filler_tokens=None,
):
  """Row `index` of stream `stream` (`TRAIN` or `TEST`) as a `RecallRow`.

  Args:
    length: tokens in the row; pairs: key-value pairs (`2 * pairs + 2 * query_count <= length`).
    keys, values, filler_ids: `[min, max)` id ranges; keys and values must not overlap each other or the filler
      range (`filler_ids` is also what replaces a row's keys in text filler).
    queries: "end" (the last `2 * query_count` tokens) or "interleaved" (each query at a random place after its
      pair).
    distance: `(min, max)` tokens from a pair's key to its query's key, or None for anywhere before the query.
    query_keys: "sampled" (each query asks a pair drawn uniformly, with replacement, from those before it within
      `distance`) or "each" (every pair asked once, Zoology's MQAR).
    query_count: queries in the row, None for `pairs`; another count needs sampled keys asked at the end with no
      distance bound.
    filler_loss: `loss_mask` also marks the filler tokens (text filler: the language-model loss on the text), not
      the answers alone.
    filler_tokens: None for uniform filler from `filler_ids`, else a 1-D int array of text tokens (longer than
      `length`) from which the row's filler is a random window.

  Raises:
    ValueError: when `PLACEMENT_TRIES` random placements all ran out of room (too many pairs for the length, or
      no room at the distances asked); `AssociativeConfig.check_length` refuses such tasks up front.
  """
  query_count = pairs if query_count is None else query_count
  if query_count != pairs and (query_keys != "sampled" or queries != "end" or distance is not None):
    raise ValueError(f"{query_count} queries of {pairs} pairs need sampled query keys at the end, no distance bound")
  rng = np.random.default_rng([seed, stream, index])
  if filler_tokens is None:
    tokens = rng.integers(filler_ids[0], filler_ids[1], length, dtype=np.int32)
  else:
    if len(filler_tokens) < length:
      raise ValueError(f"text filler of {len(filler_tokens)} tokens is shorter than a row of {length}")
    start = rng.integers(0, len(filler_tokens) - length + 1)
    tokens = np.array(filler_tokens[start : start + length], np.int32)
  row_keys = rng.choice(np.arange(keys[0], keys[1], dtype=np.int32), pairs, replace=False)
  row_values = rng.integers(values[0], values[1], pairs, dtype=np.int32)
  if filler_tokens is not None:  # the row's keys must occur only at its pairs and queries
    taken = np.isin(tokens, row_keys)
    tokens[taken] = rng.integers(filler_ids[0], filler_ids[1], int(taken.sum()), dtype=np.int32)
  for _ in range(PLACEMENT_TRIES):
    placed = _place(rng, length, pairs, queries, distance, query_count)
    if placed is not None:
      break
  else:
    raise ValueError(
      f"could not place {pairs} pairs and their queries ({queries}, distance {distance}) in a row of {length} "
      f"tokens in {PLACEMENT_TRIES} tries: give the row more room"
    )
  pair_positions, query_positions = placed
  tokens[pair_positions], tokens[pair_positions + 1] = row_keys, row_values
  asked = np.arange(query_count)  # query j asks pair asked[j]; placement put pair j before query j
  if query_keys == "sampled":
    asked = np.array([rng.choice(_askable(pair_positions, q, distance)) for q in query_positions])
  tokens[query_positions], tokens[query_positions + 1] = row_keys[asked], row_values[asked]
  loss_mask = np.zeros(length, bool)
  if filler_loss:  # every token but the pairs' and queries' own, and the first, which nothing predicts
    loss_mask[1:] = True
    loss_mask[np.concatenate([pair_positions, pair_positions + 1, query_positions])] = False
  loss_mask[query_positions + 1] = True
  earlier = query_positions[None, :] < query_positions[:, None]  # [j, i]: query i comes before query j
  first_asks = ~np.any(earlier & (asked[None, :] == asked[:, None]), axis=1)
  return RecallRow(
    tokens,
    loss_mask,
    query_positions,
    pair_positions[asked],
    row_keys[asked],
    row_values[asked],
    first_asks,
    row_values,
  )


def _askable(pair_positions, query, distance):
  """Indices of the pairs a query at `query` may ask: before it, within `distance` (its own placed pair always
  qualifies)."""
  gap = query - pair_positions
  low, high = (2, query) if distance is None else distance
  return np.flatnonzero((gap >= low) & (gap <= high))


@functools.lru_cache(maxsize=4)
def text_tokens(path, tokenizer_path=None, max_tokens=FILLER_TOKENS):
  """The first `max_tokens` tokens of the documents at `path`, joined, as one read-only int32 array: the text
  filler of `recall_row`. Training rows take it from the training corpus, held-out rows (`fsjax.eval.recall`,
  the training loop's held-out loss) from the held-out one, so test filler is text the model never trained on.
  Remembered per arguments: every shard of a training stream shares one."""
  tokenizer, parts, count = load_tokenizer(tokenizer_path), [], 0
  for text in read_documents(path):
    parts.append(np.asarray(tokenizer.encode_batch([text])[0].ids, np.int32))
    count += parts[-1].size
    if count >= max_tokens:
      break
  tokens = np.concatenate(parts)[:max_tokens] if parts else np.zeros(0, np.int32)
  tokens.flags.writeable = False
  return tokens


def check_filler(tokens, length, path):
  """DataError naming `path` when its text filler cannot fill one row of `length` tokens."""
  if tokens.size < length:
    raise DataError(f"{path}: {tokens.size} tokens of text filler, fewer than a recall row of {length}")


def held_out_task(associative, length, tokenizer_path=None, text_path=None):
  """`recall_row` keyword arguments of `associative` (an `AssociativeConfig`) for held-out rows of up to
  `length` tokens: text filler, where the task has it, from `text_path` (default: the packaged held-out books)."""
  if associative.filler != "text":
    return associative.task()
  path = text_path or default_corpus_path("valid")
  filler = text_tokens(path, tokenizer_path, max(FILLER_TOKENS, 4 * length))
  check_filler(filler, length, path)
  return associative.task(filler)


def associative_row(index, **task):
  """`recall_row` as a training row: `{"tokens": int32 [length], "loss_mask": bool [length]}`."""
  row = recall_row(index, **task)
  return {"tokens": row.tokens, "loss_mask": row.loss_mask}


def held_out_batches(*, task, length, batch_size, batches, seed):
  """`batches` batches of the test stream (`TEST`): `{"tokens": int32, "loss_mask": bool}` `[batch_size, length]`
  each (held-out evaluation of a recall run, FS-B's τ calibration on recall rows). The mask marks the answers
  only, whatever the training loss takes (`filler_loss`): the held-out loss is the answers' loss."""
  task = dict(task, filler_loss=False)
  rows = [associative_row(i, seed=seed, stream=TEST, length=length, **task) for i in range(batches * batch_size)]
  stack = lambda part, key: np.stack([row[key] for row in part])
  return [
    {key: stack(rows[b * batch_size : (b + 1) * batch_size], key) for key in ("tokens", "loss_mask")}
    for b in range(batches)
  ]


def make_associative_iterator(*, seq_len, batch_size, seed, task, shard_index=0, shard_count=1):
  """Infinite `TrainIterator` of `{"tokens": int32, "loss_mask": bool}` batches `[batch_size, seq_len + 1]` of
  the training stream (`recall_row` with `**task`). Process `shard_index` of `shard_count` reads rows
  `shard_index, shard_index + shard_count, ...`."""
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
  rows = grain.MapDataset.range(_ROWS)[shard_index::shard_count].map(
    lambda i: associative_row(i, seed=seed, stream=TRAIN, length=seq_len + 1, **task)
  )
  return prefetched_batches(rows.to_iter_dataset(ROW_READ_OPTIONS), batch_size)
