"""Document readers and the grain pipelines that turn documents into packed token rows.

Every document is tokenized and followed by EOS, the token stream is concatenated and split into rows of
`seq_len + 1` tokens (inputs `row[:-1]`, targets `row[1:]`), and rows are batched. Training shuffles documents
per epoch, repeats forever, shards documents across processes and mixes rows of different documents within a
window; evaluation keeps the held-out documents in order. Optional recall/switch masks are computed per
document and packed alongside the tokens, so they stay aligned with them.
"""

import functools
import gzip
import itertools
import json
import weakref
from pathlib import Path

import grain
import numpy as np

from fsjax.data.copies import insert_copies
from fsjax.data.jsonl import json_lines
from fsjax.data.recall import recall_masks
from fsjax.data.tokenizer import eos_id, load_tokenizer

SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")
MASK_KEYS = ("recall", "switch")
# Rows are shuffled within windows of about this many tokens. A book spans dozens of consecutive rows, so
# without it a whole batch would often come from one book; a window covers about ten books of the default
# corpus (100k tokens each on average), at the cost of packing one window ahead when starting or restoring.
SHUFFLE_WINDOW_TOKENS = 1 << 20
# Tokenizing a book takes up to half a second: a couple of threads, a few documents ahead, hide it.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
# Generated rows (recall, random ids): two threads keep a few batches of rows ready. Grain's default, sixteen
# threads, contend for the GIL with the consumer: a batch of 64 recall rows then cost it 45-55 ms (two cores).
ROW_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=256)
# Batches assembled ahead in a background thread, while the device runs the step.
BATCHES_AHEAD = 2


def default_corpus_path(split):
  """Path of the packaged `train` or `valid` corpus (`.jsonl.gz`, whole public-domain books)."""
  if split not in ("train", "valid"):
    raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
  return Path(__file__).parent / "corpus" / f"{split}.jsonl.gz"


def document_files(path):
  """The document files at `path`: the file itself, or the `.jsonl`, `.jsonl.gz` and `.txt` files of a directory,
  sorted by name. Raises FileNotFoundError naming the path when there are none."""
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"corpus path not found: {path}")
  if path.is_dir():
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
      raise FileNotFoundError(f"no {', '.join(SUFFIXES)} files in corpus directory {path}")
    return files
  if not path.name.endswith(SUFFIXES):
    raise ValueError(f"corpus file must end with one of {SUFFIXES}: {path}")
  return [path]


class DataError(ValueError):
  """A document file that cannot be read as documents; the message names the file, the line and the rule."""


def _jsonl_texts(file):
  """The `text` of every non-blank line of a `.jsonl` / `.jsonl.gz` file, or DataError at the first bad line."""
  opener = gzip.open if file.name.endswith(".gz") else open
  try:
    for lineno, record in json_lines(file, DataError, opener):
      if not isinstance(record, dict) or "text" not in record:
        raise DataError(f'{file}:{lineno}: no "text" field (each line must be a JSON object with one)')
      if not isinstance(record["text"], str):
        raise DataError(f'{file}:{lineno}: "text" must be a string, got {type(record["text"]).__name__}')
      yield record["text"]
  except (gzip.BadGzipFile, EOFError) as error:
    raise DataError(f"{file}: not a complete gzip file ({error})") from None


def read_documents(path):
  """Iterator over the text of every document at `path`, in file order.

  `.jsonl` / `.jsonl.gz` files hold one JSON object per line with the text in field `text`; a `.txt` file is one
  document. Empty documents are skipped. The path is checked now, not on the first `next`; a malformed line
  raises DataError naming the file and the line when it is reached.
  """
  files = document_files(path)

  def texts():
    for file in files:
      docs = [file.read_text(encoding="utf-8")] if file.name.endswith(".txt") else _jsonl_texts(file)
      yield from (doc for doc in docs if doc)

  return texts()


def check_documents(path, field):
  """Reads every document at `path` (the config field `field` names it) and returns how many there are; raises
  DataError at the first malformed line, or when there is no non-empty document at all."""
  count = sum(1 for _ in read_documents(path))
  if count == 0:
    raise DataError(f"{field}: {path} holds no documents (every file is empty or has only empty texts)")
  return count


class Encode:
  """Grain map from a document's text to `{"tokens": int32 [n + 1]}`: its n tokens, then EOS.

  With `masks` (keyword arguments of `fsjax.data.recall.recall_masks`, `{}` for the paper's) also `recall` and
  `switch`, float32 `[n + 1]` from `recall_masks` on the document's tokens, 0 at the EOS. With `copies` (keyword
  arguments of `fsjax.data.copies.insert_copies`) the copy curriculum is applied to the tokens first, so the masks
  see the copies; the map then needs a random generator (`MapDataset.random_map`).
  """

  def __init__(self, tokenizer_path, masks=None, copies=None):
    self._tokenizer = load_tokenizer(tokenizer_path)
    self._eos = eos_id(self._tokenizer)
    self._copies = copies
    self._recall_masks = None
    if masks is not None:
      self._recall_masks = functools.partial(recall_masks, **masks)

  def __call__(self, text, rng=None):
    # `encode_batch` releases the GIL (`encode` holds it), so tokenizing a book in a grain thread does not
    # stall the training loop.
    ids = np.asarray(self._tokenizer.encode_batch([text])[0].ids, np.int32)
    if self._copies is not None:
      if rng is None:
        raise ValueError("Encode with copies needs a random generator: use it through MapDataset.random_map")
      ids = insert_copies(ids, rng, **self._copies)
    features = {"tokens": np.append(ids, np.int32(self._eos))}
    if self._recall_masks is not None:
      for key, mask in zip(MASK_KEYS, self._recall_masks(ids)):
        mask = np.asarray(mask)
        if mask.shape != ids.shape:
          raise ValueError(f"recall_masks returned {key} of shape {mask.shape} for {ids.shape[0]} tokens")
        features[key] = np.append(mask, False).astype(np.float32)
    return features


def feature_keys(masks):
  """Keys of every element: `tokens`, plus the mask keys when `masks` (recall-mask arguments) is not None."""
  return ("tokens", *MASK_KEYS) if masks is not None else ("tokens",)


def pack(dataset, *, seq_len, keys):
  """Concatenates the elements of an `IterDataset` of 1-D features and splits the stream into rows.

  Args:
    dataset: `IterDataset` of dicts with exactly `keys`, each `[n]` with n varying per element (equal within).
    seq_len: rows hold `seq_len + 1` positions, so inputs and targets are both `seq_len` long.
    keys: feature names.

  Returns:
    `IterDataset` of dicts `{key: [seq_len + 1]}`: consecutive slices of the concatenated stream. The trailing
    partial row of a finite dataset is dropped rather than padded.
  """
  packed = grain.experimental.ConcatThenSplitIterDataset(dataset, length_struct={k: seq_len + 1 for k in keys})
  # Grain pads only the last row; its segment ids end in 0 there. Documents are separated by EOS tokens, so the
  # segment ids and positions grain adds are dropped.
  packed = packed.filter(lambda row: row[f"{keys[0]}_segment_ids"][-1] != 0)
  return packed.map(lambda row: {k: row[k] for k in keys})


class TrainIterator:
  """Infinite iterator of training batches with a JSON-serialisable state.

  Yields dicts of numpy arrays: `tokens` int32 `[batch_size, seq_len + 1]`, and with recall masks also `recall`
  and `switch` float32 `[batch_size, seq_len + 1]`. `get_state()` returns a dict of plain JSON values;
  `set_state(state)` (also after a JSON round trip) makes the next batch the one that followed `get_state()`.
  """

  def __init__(self, iterator):
    # Held through a list the finalizer empties: at exit it closes grain's prefetch threads and lets the iterator
    # go while the modules it uses still exist (grain's own `__del__` fails noisily during interpreter teardown).
    self._held = [iterator]
    weakref.finalize(self, _close_held, self._held)

  @property
  def _iterator(self):
    return self._held[0]

  def __iter__(self):
    return self

  def __next__(self):
    return next(self._iterator)

  def get_state(self):
    # Through JSON now, so the caller may keep the dict after the iterator moves on.
    return json.loads(json.dumps(self._iterator.get_state()))

  def set_state(self, state):
    self._iterator.set_state(_slices_as_tuples(state))


def _close_held(held):
  held.pop().close()


def _slices_as_tuples(state):
  """Copy of `state` with grain's packing slices back as tuples.

  JSON turns the `(start, stop)` slices of a split document into lists; grain compares them with the tuple
  `(-1, -1)`, so a list would restore a phantom remainder and silently skip a document.
  """
  if not isinstance(state, dict):
    return state
  return {
    k: ({f: tuple(sl) for f, sl in v.items()} if k == "remainder_slices" else _slices_as_tuples(v))
    for k, v in state.items()
  }


def prefetched_batches(rows, batch_size):
  """`TrainIterator` over `rows` (a grain `IterDataset` of row dicts) in batches of `batch_size`, stacked
  `BATCHES_AHEAD` ahead in a background thread. Its state is the consumer's: restored, it yields the batch that
  followed the last one taken, whatever the thread had already stacked."""
  batches = rows.batch(batch_size)
  return TrainIterator(iter(grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=BATCHES_AHEAD)))


def make_train_iterator(
  *,
  path,
  tokenizer_path,
  seq_len,
  batch_size,
  seed,
  shard_index=0,
  shard_count=1,
  recall_masks=None,
  copies=None,
  shuffle_window_tokens=SHUFFLE_WINDOW_TOKENS,
):
  """Infinite, deterministic, shardable iterator of packed training batches (see `TrainIterator`).

  Process `shard_index` of `shard_count` reads every `shard_count`-th document of `path` (disjoint slices of
  whole documents), reshuffles its documents every epoch from `seed`, packs them and shuffles rows within
  consecutive windows of `max(batch_size, shuffle_window_tokens // (seq_len + 1))` rows. The same arguments give
  the same batches. `tokenizer_path=None` is the packaged tokenizer. `recall_masks`: keyword arguments of
  `fsjax.data.recall.recall_masks` (`{}` for the paper's) to add the Eq. 13 masks, or None. `copies`: those of
  `fsjax.data.copies.insert_copies` for the copy curriculum (drawn afresh per document and epoch from `seed`),
  or None.
  """
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
  docs = list(read_documents(path))
  if len(docs) < shard_count:
    raise ValueError(f"{len(docs)} documents in {path} cannot feed {shard_count} shards")
  dataset = grain.MapDataset.source(docs)[shard_index::shard_count]
  # Shuffle before repeat: grain then draws a new permutation for every epoch.
  dataset = dataset.seed(seed).shuffle().repeat()
  encode = Encode(tokenizer_path, recall_masks, copies)
  dataset = (dataset.random_map(encode) if copies else dataset.map(encode)).to_iter_dataset(READ_OPTIONS)
  dataset = pack(dataset, seq_len=seq_len, keys=feature_keys(recall_masks))
  dataset = grain.experimental.WindowShuffleIterDataset(
    dataset, window_size=max(batch_size, shuffle_window_tokens // (seq_len + 1)), seed=seed
  )
  return prefetched_batches(dataset, batch_size)


def make_eval_batches(*, path, tokenizer_path, seq_len, batch_size, max_batches):
  """Evaluation batches: the documents of `path` in order, packed like training, no shuffling.

  Returns:
    list of at most `max_batches` int32 arrays `[batch_size, seq_len + 1]`; complete batches of complete rows
    only, so every position is real text or EOS.
  """
  dataset = grain.MapDataset.source(list(read_documents(path))).map(Encode(tokenizer_path))
  dataset = pack(dataset.to_iter_dataset(READ_OPTIONS), seq_len=seq_len, keys=("tokens",))
  dataset = dataset.map(lambda row: row["tokens"]).batch(batch_size, drop_remainder=True)
  return list(itertools.islice(dataset, max_batches))
