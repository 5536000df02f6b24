"""RULER's needle-in-a-haystack family (NVIDIA RULER c3f5e3b, scripts/data/synthetic/niah.py): S-NIAH-1/2/3,
MK-NIAH-1/2/3, MV-NIAH and MQ-NIAH, with RULER's task arguments, base template and answer prefix.

A sample is a pure function of (task, haystack size, sample seed), growing with the size (essay words, noise
sentences or distractor needles), so `tasks.generate` can fit it to a length by binary search.
"""

import dataclasses
import random

import numpy as np

from fsjax.eval.haystack import NEEDLE, NOISE, essay_words, random_value, split_sentences

TEMPLATE = (
  "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
  "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
  "{type_needle_v} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]  # needle depths, percent


@dataclasses.dataclass(frozen=True)
class NiahTask:
  """RULER's niah arguments: haystack ("noise" | "essay" | "needle"), key/value types, needle counts."""

  haystack: str
  key_type: str
  value_type: str
  num_keys: int = 1
  num_values: int = 1
  num_queries: int = 1


TASKS = {
  "niah_single_1": NiahTask("noise", "words", "numbers"),
  "niah_single_2": NiahTask("essay", "words", "numbers"),
  "niah_single_3": NiahTask("essay", "words", "uuids"),
  "niah_multikey_1": NiahTask("essay", "words", "numbers", num_keys=4),
  "niah_multikey_2": NiahTask("needle", "words", "numbers"),
  "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
  "niah_multivalue": NiahTask("essay", "words", "numbers", num_values=4),
  "niah_multiquery": NiahTask("essay", "words", "numbers", num_queries=4),
}


def _template(task):
  """The prompt template with the answer prefix; singular wording when one value is asked for (as RULER)."""
  template, type_needle_v = TEMPLATE + ANSWER_PREFIX, task.value_type
  if task.num_queries * task.num_values == 1:
    for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
      template = template.replace(plural, singular)
    type_needle_v = type_needle_v[:-1]
  return template, type_needle_v


def _context(task, needles, size, rng, corpus):
  """The haystack of `size` units with the needles inserted (RULER's insertion rules)."""
  if task.haystack == "essay":
    words = essay_words(corpus)
    text = " ".join(words[i % len(words)] for i in range(size))  # repeated when the corpus is short
    sentences = split_sentences(text)
    cuts = sorted(int(len(sentences) * depth / 100) for depth in rng.sample(DEPTHS, len(needles)))
    pieces, last = [], 0
    for cut, needle in zip(cuts, needles):
      pieces += [" ".join(sentences[last:cut]), needle]
      last = cut
    return " ".join(pieces + [" ".join(sentences[last:])])
  if task.haystack == "noise":
    sentences = [NOISE] * size
  else:  # distractor needles, drawn first so a larger haystack extends a smaller one
    sentences = [
      NEEDLE.format(
        type_needle_v=task.value_type, key=random_value(task.key_type, rng), value=random_value(task.value_type, rng)
      )
      for _ in range(size)
    ]
  slots = sorted(rng.sample(range(size), len(needles)), reverse=True) if size >= len(needles) else [0] * len(needles)
  for slot, needle in zip(slots, needles):
    sentences.insert(slot, needle)
  return "\n".join(sentences)


def make_sample(task_name, size, seed, corpus=None):
  """One sample with `size` haystack units.

  Returns:
    (input text, answer prefix, expected values); the model's prompt is `input + answer_prefix`.
  """
  task = TASKS[task_name]
  rng = random.Random(seed)
  num_keys = max(task.num_keys, task.num_queries)
  keys, values, needles = [], [], []
  for _ in range(num_keys):
    keys.append(random_value(task.key_type, rng))
    values.append([random_value(task.value_type, rng) for _ in range(task.num_values)])
    needles += [NEEDLE.format(type_needle_v=task.value_type, key=keys[-1], value=v) for v in values[-1]]
  random.Random(seed).shuffle(needles)  # RULER shuffles with a fresh generator on the seed
  asked = rng.sample(range(num_keys), task.num_queries)
  queries = [keys[i] for i in asked]
  answers = [v for i in asked for v in values[i]]
  query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
  template, type_needle_v = _template(task)
  text = template.format(type_needle_v=type_needle_v, context=_context(task, needles, size, rng, corpus), query=query)
  cut = text.rfind(ANSWER_PREFIX[:10])  # RULER locates the prefix by its first ten characters
  return text[:cut], text[cut:], answers
