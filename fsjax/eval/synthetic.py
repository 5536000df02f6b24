"""RULER's other synthetic tasks (NVIDIA RULER c3f5e3b, scripts/data/synthetic): variable tracking (vt),
common-word extraction (cwe) and frequent-word extraction (fwe), with RULER's templates, answer prefixes and task
arguments (vt: 1 chain of 4 hops over the noise haystack, with a one-shot example; cwe: 10 common words x 30
against uncommon x 3, x6 / x1 below 4k tokens, with a one-shot example; fwe: zeta(2) over a coded vocabulary of
(length - 50)/50 six-letter words, the top word replaced by '...').

A sampler is `(size, seed, length, count_tokens) -> (input, answer_prefix, outputs)`, a pure function of its
arguments and growing with `size` (noise sentences, listed words, coded words), so `tasks.generate` can fit
each sample to the length by binary search.
"""

import functools
import random
import string

import numpy as np
import scipy.special

from fsjax.eval import fitting
from fsjax.eval.haystack import NOISE, wonderwords_list
from fsjax.eval.scoring import TOKENS_TO_GENERATE

VT_TEMPLATE = (
  "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
  "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
  " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
  "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
  "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
  "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
  "list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
  "Read the following coded text and track the frequency of each coded word. Find the three most "
  "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
  "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

VT_CHAINS, VT_HOPS, VT_EXAMPLE_LENGTH = 1, 4, 500
CWE_COMMON, CWE_FREQ_COMMON, CWE_FREQ_UNCOMMON = 10, 30, 3
FWE_WORD_LENGTH, FWE_ALPHA = 6, 2.0


def split_prefix(text, prefix):
  """`(input, answer_prefix)`: `text` cut at the last occurrence of the prefix's first ten characters (RULER)."""
  cut = text.rfind(prefix[:10])
  return text[:cut], text[cut:]


# Variable tracking --------------------------------------------------------------------------------------------


def _chains(rng, example):
  """Variable names `[chains][hops + 1]` and chains of assignment statements; the example uses 3-letter names."""
  letters = 3 if example else 5
  names = []
  while len(names) < VT_CHAINS * (VT_HOPS + 1):
    name = "".join(rng.choices(string.ascii_uppercase, k=letters))
    if name not in names:
      names.append(name)
  groups = [names[i : i + VT_HOPS + 1] for i in range(0, len(names), VT_HOPS + 1)]
  chains = [
    [f"VAR {group[0]} = {rng.randint(10000, 99998)}"]
    + [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(VT_HOPS)]
    for group in groups
  ]
  return groups, chains


def _vt_text(size, rng, example):
  """The prompt (template + answer prefix) over `size` noise sentences, one per line, with the chain statements
  inserted among them at random (RULER's noise layout), and the chain's names."""
  groups, chains = _chains(rng, example)
  sentences = [NOISE] * size
  for chain in chains:
    slots = sorted(rng.sample(range(len(sentences)), len(chain)))
    for offset, (slot, statement) in enumerate(zip(slots, chain)):
      sentences.insert(slot + offset, statement)
  context = "\n".join(sentences).replace(". \n", ".\n")
  value = chains[0][0].split("=")[-1].strip()
  text = (VT_TEMPLATE + VT_PREFIX).format(context=context, query=value, num_v=VT_HOPS + 1)
  return text, groups[0]


def _vt_example(rng, count_tokens):
  """RULER's one-shot example: the most noise sentences whose prompt stays within VT_EXAMPLE_LENGTH tokens (no
  generation budget, as RULER sizes it), answered, ending in a newline."""
  state = rng.getstate()

  def drawn(size):
    rng.setstate(state)
    return _vt_text(size, rng, example=True)

  fits = lambda size: count_tokens(drawn(size)[0]) <= VT_EXAMPLE_LENGTH
  prompt, answer = drawn(fitting.largest_fitting(fits, VT_EXAMPLE_LENGTH // 40, VT_HOPS + 1))
  return prompt + " " + " ".join(answer) + "\n"


def vt_sample(size, seed, length, count_tokens):
  """Variable tracking with `size` noise sentences (at least VT_HOPS + 1), after the one-shot example and a
  newline (RULER: example, "\\n", then the task)."""
  del length
  rng = random.Random(seed)
  example = _vt_example(rng, count_tokens)
  text, answer = _vt_text(size, random.Random(rng.getrandbits(64)), example=False)
  return (*split_prefix(example + "\n" + text, VT_PREFIX), answer)


# Common-word extraction ------------------------------------------------------------------------------------------


def _cwe_list(rng, words, seed, num_words, common_repeats, uncommon_repeats):
  chosen = rng.sample(words, num_words)
  common, uncommon = chosen[:CWE_COMMON], chosen[CWE_COMMON:]
  listed = common * common_repeats + uncommon * uncommon_repeats
  random.Random(seed).shuffle(listed)  # RULER shuffles with a fresh generator on the seed
  return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), common


@functools.lru_cache(maxsize=8)
def cwe_words(seed):
  """RULER's CWE vocabulary: the wonderwords nouns, adjectives and verbs, sorted, deduplicated, shuffled."""
  words = sorted(
    set(wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt") + wonderwords_list("verblist.txt"))
  )
  random.Random(seed).shuffle(words)
  return tuple(words)


def cwe_sample(size, seed, length, count_tokens):
  """Common-word extraction over `size` distinct words (at least CWE_COMMON + 1), with a one-shot example."""
  del count_tokens
  rng, words = random.Random(seed), cwe_words(seed)
  if length < 4096:
    example_args, main_args = (20, 3, 1), (size, 6, 1)
  else:
    example_args, main_args = (40, 10, 3), (size, CWE_FREQ_COMMON, CWE_FREQ_UNCOMMON)
  example_context, example_answer = _cwe_list(rng, words, seed, *example_args)
  context, answer = _cwe_list(rng, words, seed, *main_args)
  example = (
    (CWE_TEMPLATE + CWE_PREFIX).format(context=example_context)
    + " "
    + " ".join(f"{i + 1}. {word}" for i, word in enumerate(example_answer))
  )
  return (*split_prefix(example + "\n" + (CWE_TEMPLATE + CWE_PREFIX).format(context=context), CWE_PREFIX), answer)


# Frequent-word extraction ----------------------------------------------------------------------------------------


def fwe_sample(size, seed, length, count_tokens):
  """Frequent-word extraction over about `size` coded words drawn by a zeta(2) law."""
  del count_tokens
  rng = random.Random(seed)
  vocab_size = max((length - TOKENS_TO_GENERATE["fwe"]) // 50, 4)  # RULER: a 50th of the prompt budget
  vocab = set()
  while len(vocab) < vocab_size:
    vocab.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH)))
  vocab = sorted(vocab)
  random.Random(seed).shuffle(vocab)
  vocab[0] = "..."  # the most frequent word is noise
  rank = np.arange(1, len(vocab) + 1)
  counts = (size * rank**-FWE_ALPHA / scipy.special.zeta(FWE_ALPHA)).astype(int)
  words = [word for word, count in zip(vocab, counts) for _ in range(count)]
  random.Random(seed).shuffle(words)
  text = (FWE_TEMPLATE + FWE_PREFIX).format(context=" ".join(words))
  return (*split_prefix(text, FWE_PREFIX), vocab[1:4])
