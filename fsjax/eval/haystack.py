"""Haystacks and needle values for RULER-style tasks (NVIDIA RULER, commit c3f5e3b, scripts/data/synthetic).

Everything runs offline: essay haystacks come from a text corpus (by default the held-out public-domain books
the package ships), word keys from the `wonderwords` lists RULER uses, and sentences are split by a rule that
needs no downloaded data (RULER calls NLTK's punkt, which this replaces; see `split_sentences`).
"""

import functools
import re
import uuid
from importlib import resources

from fsjax.data.pipeline import default_corpus_path, read_documents

# RULER's noise haystack sentence and its needle sentence, verbatim.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NEEDLE_TYPES = ("numbers", "words", "uuids")

# A sentence ends at . ! or ? (and any closing quotes or brackets) followed by whitespace and an upper-case
# letter, digit or opening quote. Punkt also knows abbreviations; this rule splits after "Mr." too, which only
# moves where a needle may be inserted.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s+[\"'(\[]?[A-Z0-9])")


@functools.lru_cache(maxsize=None)
def wonderwords_list(name):
  """A wonderwords word list (e.g. "nounlist.txt"), sorted and deduplicated."""
  assets = resources.files("wonderwords") / "assets"
  return sorted({w.strip() for w in (assets / name).read_text(encoding="utf-8").splitlines() if w.strip()})


def random_value(kind, rng):
  """A needle key or value: a 7-digit number, an adjective-noun word, or a UUID (RULER's three types).

  Args:
    kind: one of NEEDLE_TYPES; rng: a `random.Random`.
  """
  if kind == "numbers":
    return str(rng.randint(10**6, 10**7 - 1))
  if kind == "words":
    # RULER draws uniformly from the list of all adjective-noun pairs; drawing the two parts independently
    # is the same distribution without materializing six million strings.
    adjectives, nouns = wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt")
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  raise ValueError(f"needle type must be one of {NEEDLE_TYPES}, got {kind!r}")


@functools.lru_cache(maxsize=4)
def essay_words(path=None):
  """The words of a corpus as RULER's essay haystack: all documents joined, whitespace runs collapsed, split
  on spaces. `path`: a jsonl (field `text`) / txt file or directory; None = the packaged held-out books."""
  text = " ".join(read_documents(default_corpus_path("valid") if path is None else path))
  return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def split_sentences(text):
  """Sentences of `text` by `_SENTENCE_END` (an offline stand-in for NLTK's `sent_tokenize`); joining them
  with single spaces gives back `text` with its whitespace runs between sentences collapsed."""
  text = text.strip()
  ends = [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]
  starts = [0] + ends[:-1]
  return [text[a:b].strip() for a, b in zip(starts, ends) if text[a:b].strip()]
