"""Data: packaged corpus and tokenizer, document readers, packing, and the grain train/eval pipelines."""

import gzip
import importlib.util
import json
from pathlib import Path

import grain
import numpy as np
import pytest

from fsjax.config import ConfigError, DataConfig
from fsjax.data.pipeline import (
  Encode,
  default_corpus_path,
  make_eval_batches,
  make_train_iterator,
  pack,
  read_documents,
)
from fsjax.data.recall import recall_masks
from fsjax.data.tokenizer import BOS_ID, EOS_ID, UNK_ID, bos_id, default_tokenizer_path, eos_id, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
# Distinct words, one token each with a leading space, so decoded rows tell which document they came from.
WORDS = ("apple", "river", "stone", "cloud", "tiger", "horse")


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer()


def _load_script(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write_jsonl(path, texts):
  lines = "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
  if path.name.endswith(".gz"):
    with gzip.open(path, "wt", encoding="utf-8") as f:
      f.write(lines)
  else:
    path.write_text(lines, encoding="utf-8")
  return path


def _word_docs(repeats):
  """One document per word: `repeats` copies of it."""
  return [" ".join([w] * repeats) + "." for w in WORDS]


def _stream(tokenizer, texts):
  """Every document's tokens followed by EOS, concatenated: what packing must cut into rows."""
  return np.concatenate([tokenizer.encode(t).ids + [EOS_ID] for t in texts]).astype(np.int32)


def _words(tokenizer, rows):
  return {w for row in rows for w in tokenizer.decode(row.tolist()).split() if w in WORDS}


# Tokenizer.


@pytest.mark.parametrize(
  "text",
  [
    "Hello, world!",
    "  two  spaces\n\n\ttab",
    "naïve café — “quoted” 日本語 🙂",
    "a literal </s> and <s> stay text",
    "line\r\nbreaks\r\n",
    " 3.14159 ",
  ],
)
def test_tokenizer_round_trips(tokenizer, text):
  ids = tokenizer.encode(text).ids
  assert tokenizer.decode(ids) == text
  assert not {UNK_ID, BOS_ID, EOS_ID} & set(ids)  # byte-level BPE never needs <unk>; specials come only by id


def test_tokenizer_splits_digits(tokenizer):
  assert tokenizer.encode("1234567").tokens == list("1234567")
  assert tokenizer.encode("in 1859").tokens[-4:] == list("1859")


def test_tokenizer_vocab_and_special_ids(tokenizer):
  assert tokenizer.get_vocab_size() == 32_000
  assert [tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
  assert (bos_id(tokenizer), eos_id(tokenizer)) == (BOS_ID, EOS_ID) == (1, 2)


def test_load_tokenizer_missing_path(tmp_path):
  missing = tmp_path / "nope.json"
  with pytest.raises(FileNotFoundError, match="nope.json"):
    load_tokenizer(missing)


def test_packaged_tokenizer_is_reproducible(tmp_path):
  out = tmp_path / "tokenizer.json"
  _load_script("train_tokenizer").main(["--out", str(out)])
  assert out.read_bytes() == default_tokenizer_path().read_bytes()


# Packaged corpus.


def test_packaged_corpus_holds_out_whole_books():
  ids = {}
  for split in ("train", "valid"):
    with gzip.open(default_corpus_path(split), "rt", encoding="utf-8") as f:
      ids[split] = [json.loads(line)["id"] for line in f]
  assert len(ids["train"]) >= 20 and 2 <= len(ids["valid"]) <= 3
  assert not set(ids["train"]) & set(ids["valid"])
  size = sum(default_corpus_path(s).stat().st_size for s in ("train", "valid"))
  assert 3_500_000 < size < 5_500_000


@pytest.mark.skipif(not (REPO.parent / "shared/data/gutenberg_en.jsonl.gz").exists(), reason="no source books")
def test_packaged_corpus_is_reproducible(tmp_path):
  _load_script("build_corpus").main(["--out", str(tmp_path)])
  for split in ("train", "valid"):
    assert (tmp_path / f"{split}.jsonl.gz").read_bytes() == default_corpus_path(split).read_bytes()


# Readers.


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz"])
def test_read_jsonl(tmp_path, name):
  path = _write_jsonl(tmp_path / name, ["first doc", "", "second\ndoc"])
  assert list(read_documents(path)) == ["first doc", "second\ndoc"]  # the empty document is skipped


def test_read_txt_and_directory(tmp_path):
  (tmp_path / "b.txt").write_text("whole file\n\nis one document", encoding="utf-8")
  _write_jsonl(tmp_path / "a.jsonl.gz", ["gz one", "gz two"])
  _write_jsonl(tmp_path / "c.jsonl", ["plain"])
  (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
  assert list(read_documents(tmp_path / "b.txt")) == ["whole file\n\nis one document"]
  assert list(read_documents(tmp_path)) == ["gz one", "gz two", "whole file\n\nis one document", "plain"]


def test_read_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    read_documents(tmp_path / "missing.jsonl")  # raised by the call, before iteration
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    read_documents(tmp_path)  # a directory without documents
  (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
  with pytest.raises(ValueError, match="data.csv"):
    read_documents(tmp_path / "data.csv")


def test_packaged_corpora_read():
  valid = list(read_documents(default_corpus_path("valid")))
  assert len(valid) in (2, 3) and all(len(book) > 100_000 for book in valid)
  with pytest.raises(ValueError, match="split"):
    default_corpus_path("test")


# Packing.


def test_pack_cuts_the_document_stream_in_order(tokenizer):
  texts = _word_docs(repeats=7)
  seq_len = 10
  docs = grain.MapDataset.source(texts).map(Encode(None)).to_iter_dataset()
  rows = np.stack([row["tokens"] for row in pack(docs, seq_len=seq_len, keys=("tokens",))])
  stream = _stream(tokenizer, texts)
  assert rows.dtype == np.int32 and rows.shape == (len(stream) // (seq_len + 1), seq_len + 1)
  np.testing.assert_array_equal(rows.reshape(-1), stream[: rows.size])  # the partial last row is dropped
  # One EOS per document, right after its last token.
  doc_ends = np.cumsum([len(tokenizer.encode(t).ids) + 1 for t in texts]) - 1
  np.testing.assert_array_equal(np.flatnonzero(stream == EOS_ID), doc_ends)


def test_pack_keeps_features_aligned():
  lengths = [5, 13, 2, 9, 20]
  offsets = np.cumsum([0] + lengths)
  elements = [
    {"tokens": np.arange(o, o + n, dtype=np.int32), "recall": np.arange(o, o + n, dtype=np.float32)}
    for o, n in zip(offsets, lengths)
  ]
  rows = list(pack(grain.MapDataset.source(elements).to_iter_dataset(), seq_len=7, keys=("tokens", "recall")))
  assert len(rows) == sum(lengths) // 8
  for i, row in enumerate(rows):
    assert set(row) == {"tokens", "recall"}
    np.testing.assert_array_equal(row["tokens"], np.arange(8 * i, 8 * (i + 1)))
    np.testing.assert_array_equal(row["recall"], row["tokens"].astype(np.float32))


# Training iterator.


@pytest.fixture
def word_corpus(tmp_path):
  return _write_jsonl(tmp_path / "words.jsonl", _word_docs(repeats=30))


def _train(path, **overrides):
  kwargs = dict(path=path, tokenizer_path=None, seq_len=16, batch_size=4, seed=0, shuffle_window_tokens=200)
  return make_train_iterator(**(kwargs | overrides))


def _take(iterator, n):
  return [next(iterator)["tokens"] for _ in range(n)]


def test_train_batches_shape_and_content(tokenizer, word_corpus):
  batches = _take(_train(word_corpus), 20)
  assert all(b.dtype == np.int32 and b.shape == (4, 17) for b in batches)
  tokens = np.concatenate(batches)
  assert (tokens >= 0).all() and (tokens < 32_000).all() and (tokens == EOS_ID).any()
  # 20 batches of 68 tokens cover the 6 documents (about 33 tokens each) several times over: it repeats.
  assert _words(tokenizer, tokens) == set(WORDS)


def test_train_is_deterministic_per_seed(word_corpus):
  first, again, other = (_take(_train(word_corpus, seed=s), 6) for s in (0, 0, 1))
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def test_train_reshuffles_documents_each_epoch(tokenizer, tmp_path):
  # Each document is 3 tokens + EOS = seq_len + 1, and a window of one row does not shuffle rows: every row is
  # one whole document, so the rows show the document order of each epoch.
  texts = [f" {w} {w} {w}" for w in WORDS]
  assert {len(tokenizer.encode(t).ids) for t in texts} == {3}
  rows = np.concatenate(
    _take(
      _train(_write_jsonl(tmp_path / "w.jsonl", texts), seq_len=3, batch_size=1, shuffle_window_tokens=0),
      4 * len(WORDS),
    )
  )
  names = [tokenizer.decode(row.tolist()).split()[0] for row in rows]
  orders = [tuple(names[i : i + len(WORDS)]) for i in range(0, len(names), len(WORDS))]
  assert all(sorted(order) == sorted(WORDS) for order in orders)  # each epoch reads every document once
  assert len(set(orders)) > 1


def test_train_shards_are_disjoint(tokenizer, word_corpus):
  seen = [
    _words(tokenizer, np.concatenate(_take(_train(word_corpus, shard_index=i, shard_count=2), 10))) for i in range(2)
  ]
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(WORDS)
  with pytest.raises(ValueError, match="shard_index"):
    _train(word_corpus, shard_index=2, shard_count=2)
  with pytest.raises(ValueError, match="7 shards"):
    _train(word_corpus, shard_count=7)


def test_train_state_restores_the_next_batches(word_corpus):
  iterator = _train(word_corpus)
  states, expected = [], []
  for _ in range(6):
    next(iterator)
    states.append(json.loads(json.dumps(iterator.get_state())))  # as a checkpoint stores it
    expected.append(_take(iterator, 2))
    iterator = _train(word_corpus)
    iterator.set_state(states[-1])
    np.testing.assert_array_equal(np.stack(_take(iterator, 2)), np.stack(expected[-1]))
  # Some states were taken inside a split document, the case JSON would break without the tuple repair.
  assert any(sl != [-1, -1] for s in states for sl in s["parent_window_start_state"]["remainder_slices"].values())


def test_train_default_window_mixes_books(tokenizer):
  books = list(read_documents(default_corpus_path("valid")))
  iterator = make_train_iterator(
    path=default_corpus_path("valid"), tokenizer_path=None, seq_len=128, batch_size=8, seed=0
  )
  rows = np.concatenate(_take(iterator, 2))
  assert rows.shape == (16, 129)
  # The default window holds about 1M tokens, more than these books: rows come from all over them, not from
  # the first book in order. Rows spanning two books match none and are ignored.
  sources = [[i for i, book in enumerate(books) if tokenizer.decode(row.tolist()) in book] for row in rows]
  assert len({s[0] for s in sources if s}) >= 2


# Recall masks.


def _recall_text(rng):
  """900 random words, then the first 120 again: a copy far enough back (> 512 tokens) for recall."""
  vocab = [f"w{a}{b}" for a in "bcdfghjklm" for b in "aeiou"]
  words = list(rng.choice(vocab, size=900))
  return " ".join(words + ["zebra"] + words[:120])


def test_encode_recall_masks_align_with_tokens(tokenizer, rng):
  text = _recall_text(rng)
  element = Encode(None, masks={})(text)
  ids = np.asarray(tokenizer.encode(text).ids)
  recall, switch = recall_masks(ids)
  assert set(element) == {"tokens", "recall", "switch"}
  np.testing.assert_array_equal(element["tokens"], np.append(ids, EOS_ID))
  np.testing.assert_array_equal(element["recall"], np.append(recall, False).astype(np.float32))
  np.testing.assert_array_equal(element["switch"], np.append(switch, False).astype(np.float32))
  assert element["recall"].dtype == np.float32 and element["recall"].sum() > 50


def test_encode_recall_distance_reaches_the_masks(tokenizer):
  # One short sentence three times: its repeats are recall targets only when a match may lie closer than 512.
  text = "the quick brown fox jumps over the lazy dog near a red barn " * 3
  ids = np.asarray(tokenizer.encode(text).ids)
  near = Encode(None, masks=dict(min_distance=8, switch_window=4))(text)
  np.testing.assert_array_equal(
    near["recall"][:-1], np.asarray(recall_masks(ids, min_distance=8, switch_window=4)[0], np.float32)
  )
  assert near["recall"].sum() > 0 and Encode(None, masks={})(text)["recall"].sum() == 0


def test_train_recall_masks(tmp_path, rng):
  path = _write_jsonl(tmp_path / "recall.jsonl", [_recall_text(rng), "a short document without repeats"])
  iterator = _train(path, recall_masks={}, seq_len=64)
  batches = [next(iterator) for _ in range(30)]
  for batch in batches:
    assert set(batch) == {"tokens", "recall", "switch"}
    for key in ("recall", "switch"):
      assert batch[key].dtype == np.float32 and batch[key].shape == batch["tokens"].shape
      assert np.isin(batch[key], (0.0, 1.0)).all()
      assert (batch[key][batch["tokens"] == EOS_ID] == 0).all()
    assert (batch["switch"] <= batch["recall"]).all()
  assert sum(b["recall"].sum() for b in batches) > 0


# Evaluation batches.


def test_eval_batches_in_order_and_deterministic(tokenizer, word_corpus):
  kwargs = dict(path=word_corpus, tokenizer_path=None, seq_len=8, batch_size=3)
  batches = make_eval_batches(**kwargs, max_batches=100)
  stream = _stream(tokenizer, _word_docs(repeats=30))
  rows = len(stream) // 9
  assert len(batches) == rows // 3  # complete batches of complete rows only
  assert all(b.dtype == np.int32 and b.shape == (3, 9) for b in batches)
  np.testing.assert_array_equal(np.concatenate(batches).reshape(-1), stream[: len(batches) * 27])
  again = make_eval_batches(**kwargs, max_batches=2)
  assert len(again) == 2
  for a, b in zip(again, batches):
    np.testing.assert_array_equal(a, b)


def test_data_config_recall_arguments():
  assert DataConfig().recall is None
  assert DataConfig(recall_masks=True).recall == dict(min_distance=512, switch_window=64)
  assert DataConfig(recall_masks=True, recall_distance=128, recall_switch_window=16).recall == dict(
    min_distance=128, switch_window=16
  )
  with pytest.raises(ConfigError, match="data.recall_distance must be positive"):
    DataConfig(recall_distance=0)
