"""Trains the packaged 32,000-token byte-level BPE tokenizer on the packaged train corpus.

    python scripts/train_tokenizer.py [--corpus fsjax/data/corpus/train.jsonl.gz] [--out fsjax/data/tokenizer.json]

LLaMA conventions: `<unk>`, `<s>`, `</s>` take ids 0, 1, 2, and every digit is its own token. Byte-level
pre-tokenization and decoding make `decode(encode(text)) == text` for any string. Training is deterministic:
rerunning on the same corpus rewrites the same file byte for byte.
"""

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fsjax.data.pipeline import default_corpus_path, read_documents
from fsjax.data.tokenizer import SPECIAL_TOKENS, default_tokenizer_path

VOCAB_SIZE = 32_000


def build_tokenizer():
  """An untrained byte-level BPE with LLaMA-style digit splitting."""
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  # Digits first, so that the ByteLevel regex (which groups runs of digits) only ever sees single digits.
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]
  )
  tokenizer.decoder = decoders.ByteLevel()
  return tokenizer


def train(corpus, vocab_size=VOCAB_SIZE):
  """Trains on every document of `corpus` (a path `read_documents` accepts) and returns the tokenizer."""
  tokenizer = build_tokenizer()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL_TOKENS),
    # All 256 bytes are in the vocabulary from the start, so no text ever needs `<unk>`.
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator(read_documents(corpus), trainer=trainer)
  return tokenizer


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--corpus", type=Path, default=default_corpus_path("train"))
  parser.add_argument("--out", type=Path, default=default_tokenizer_path())
  parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
  args = parser.parse_args(argv)

  start = time.perf_counter()
  tokenizer = train(args.corpus, args.vocab_size)
  tokenizer.save(str(args.out))
  print(f"{args.out}: {tokenizer.get_vocab_size():,} tokens, trained in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
