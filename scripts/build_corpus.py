"""Builds the default corpus shipped in the package: whole public-domain books, train and valid splits.

    python scripts/build_corpus.py [SOURCE] [--seed 0] [--out fsjax/data/corpus] [--train-chars 11000000]
        [--max-chars 1000000]

SOURCE is a `.jsonl.gz` of Project Gutenberg books, one `{"id", "text"}` object per line (default
`../shared/data/gutenberg_en.jsonl.gz` relative to the repository root). Writes `train.jsonl.gz` and
`valid.jsonl.gz` under `--out`, in the same format. The selection depends only on the source and the seed:
books sorted by id are shuffled with `random.Random(seed)`, the first `VALID_BOOKS` eligible ones are held out
whole, and the following ones fill the train split until `--train-chars` (a larger budget only adds books: the
held-out ones stay the same, so every corpus built from one source and seed shares the packaged valid split).
The gzip headers carry no timestamp or file name, so rerunning reproduces the files byte for byte.
"""

import argparse
import gzip
import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO.parent / "shared" / "data" / "gutenberg_en.jsonl.gz"
DEFAULT_OUT = REPO / "fsjax" / "data" / "corpus"

# Books outside these bounds are skipped: fragments teach little about long context, and multi-megabyte tomes
# would let two or three authors fill the whole budget.
MIN_CHARS, MAX_CHARS = 100_000, 1_000_000
# About 11 MB of text (4 MB gzipped) for training; whole books for validation.
TRAIN_CHARS = 11_000_000
VALID_BOOKS = 3
# Books that share stories with another book of the source: two Wodehouse collections (34% of their 8-word
# shingles in common; every other pair of the 111 books shares < 5%) and the same Grimm tales in three
# translations. Never held out, so that validation stories cannot also appear in training.
OVERLAPPING = frozenset(
  {
    "death_at_the_excelsior",
    "the_inimitable_jeeves",
    "grimm_s_fairy_stories",
    "grimms_fairy_tales",
    "household_stories_by_the_brothers_grimm",
  }
)


def load_books(path):
  """Returns `{id: text}` for every line of a `.jsonl.gz` file."""
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return {row["id"]: row["text"] for row in map(json.loads, f)}


def select(books, seed, train_chars=TRAIN_CHARS, max_chars=MAX_CHARS):
  """Returns `(train_ids, valid_ids)`, each sorted, by the rule in the module docstring.

  Books over `max_chars` never enter either split; the held-out books are always drawn as with `MAX_CHARS`, so a
  larger bound only adds training books.
  """
  eligible = lambda bound: sorted(i for i, text in books.items() if MIN_CHARS <= len(text) <= bound)
  order = eligible(MAX_CHARS)
  random.Random(seed).shuffle(order)
  valid = [i for i in order if i not in OVERLAPPING][:VALID_BOOKS]
  order += [i for i in eligible(max_chars) if len(books[i]) > MAX_CHARS]
  train, chars = [], 0
  for i in order:
    if i in valid:
      continue
    if chars + len(books[i]) > train_chars:
      break
    train.append(i)
    chars += len(books[i])
  return sorted(train), sorted(valid)


def write_split(path, books, ids):
  """Writes `{"id", "text"}` lines, gzipped with a fixed header (mtime 0, no name) for reproducible bytes."""
  lines = "".join(json.dumps({"id": i, "text": books[i]}, ensure_ascii=False) + "\n" for i in ids)
  with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
    f.write(lines.encode("utf-8"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
  parser.add_argument("--train-chars", type=int, default=TRAIN_CHARS, help="character budget of the train split")
  parser.add_argument("--max-chars", type=int, default=MAX_CHARS, help="longest book taken, in characters")
  args = parser.parse_args(argv)

  books = load_books(args.source)
  train, valid = select(books, args.seed, args.train_chars, args.max_chars)
  args.out.mkdir(parents=True, exist_ok=True)
  for split, ids in (("train", train), ("valid", valid)):
    path = args.out / f"{split}.jsonl.gz"
    write_split(path, books, ids)
    chars = sum(len(books[i]) for i in ids)
    print(f"{path}: {len(ids)} books, {chars:,} chars, {path.stat().st_size:,} bytes gzipped")
    for i in ids:
      print(f"  {i} ({len(books[i]):,} chars)")


if __name__ == "__main__":
  main()
