"""All RULER tasks generated offline, each sample fitted to a target length under a given tokenizer.

A task is a sampler `(size, seed, length, count_tokens) -> (input, answer_prefix, outputs)` that grows with `size`,
with a smallest and a largest meaningful size (None: unbounded). Each sample has its own seed and is fitted on its
own: the largest size whose prompt (`input + answer_prefix`) plus the generation cap fits the length (galloping
from the previous sample's size, then bisection), so one more unit would not fit.
"""

import functools
import random

from fsjax.eval import niah, qa, synthetic
from fsjax.eval.scoring import TOKENS_TO_GENERATE, task_family


def _niah_sampler(task, corpus):
  return lambda size, seed, length, count_tokens: niah.make_sample(task, size, seed, corpus)


def sampler(task, *, corpus=None, squad=None, hotpotqa=None):
  """`(sampler, smallest size, largest size or None)` of a RULER task name. QA needs its dataset file."""
  if task in niah.TASKS:
    return _niah_sampler(task, corpus), 0, None
  if task == "vt":
    return synthetic.vt_sample, synthetic.VT_HOPS + 1, None
  if task == "cwe":
    return synthetic.cwe_sample, synthetic.CWE_COMMON + 1, len(synthetic.cwe_words(0))
  if task == "fwe":
    return synthetic.fwe_sample, 1, None
  if task in ("qa_1", "qa_2"):
    path, name = (
      (squad, "--squad (SQuAD v2 dev json)")
      if task == "qa_1"
      else (hotpotqa, "--hotpotqa (HotpotQA distractor dev json)")
    )
    if path is None:
      raise FileNotFoundError(f"{task} needs {name}, which is not available offline")
    dataset = qa.load(path, "squad" if task == "qa_1" else "hotpotqa")
    return functools.partial(qa.sample, dataset), 1, len(dataset[1])
  raise ValueError(f"unknown RULER task {task!r}")


TASKS = (*niah.TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")


def sample_seed(seed, task, length, index):
  """The seed of sample `index` of a (task, length) under the run's `seed`: independent streams per sample."""
  return random.Random(f"{seed}/{task}/{length}/{index}").getrandbits(64)


def largest_fitting(fits, guess, smallest=0, largest=None):
  """The largest n in [smallest, largest] with `fits(n)`, for `fits` true up to some n and false beyond;
  galloping from `guess`. Raises ValueError when `smallest` does not fit."""
  if not fits(smallest):
    raise ValueError("the target length cannot hold the smallest prompt plus the generation budget")
  if largest is not None and fits(largest):
    return largest
  guess = max(guess, smallest) if largest is None else min(max(guess, smallest), largest)
  lo, step = smallest, max(1, guess // 32)
  if fits(guess):
    lo = guess
    while (largest is None or lo + step < largest) and fits(lo + step):
      lo, step = lo + step, 2 * step
    hi = lo + step if largest is None else min(lo + step, largest)
  else:
    hi = guess
    while hi - step > smallest and not fits(hi - step):
      hi, step = hi - step, 2 * step
    lo = max(smallest, hi - step)
  while hi - lo > 1:  # fits(lo), not fits(hi)
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def generate(task, length, num_samples, count_tokens, *, seed=42, tokens_to_generate=None, **sources):
  """RULER-format records for one task and target length.

  Args:
    task: one of TASKS; length: target tokens (prompt + generation cap).
    count_tokens: `text -> int`, the model's tokenizer.
    seed: the run's seed (RULER: 42).
    tokens_to_generate: the generation cap; None = RULER's for the task.
    sources: `corpus` (essay haystack), `squad`, `hotpotqa` (QA files).

  Returns:
    list of dicts with RULER's fields `index`, `input`, `outputs`, `length`, `length_w_model_temp`,
    `answer_prefix`, and `haystack_size`.
  """
  make, smallest, largest = sampler(task, **sources)
  cap = TOKENS_TO_GENERATE[task_family(task)] if tokens_to_generate is None else tokens_to_generate
  budget = length - cap
  records, guess = [], max(smallest, budget // 2)
  for index in range(num_samples):
    this_seed = sample_seed(seed, task, length, index)
    prompt_tokens = lambda size: count_tokens("".join(make(size, this_seed, length, count_tokens)[:2]))
    try:
      guess = largest_fitting(lambda size: prompt_tokens(size) <= budget, guess, smallest, largest)
    except ValueError as e:
      raise ValueError(f"{task} at {length} tokens: {e}") from None
    text, prefix, answers = make(guess, this_seed, length, count_tokens)
    used = prompt_tokens(guess) + cap
    records.append(
      dict(
        index=index,
        input=text,
        outputs=list(answers),
        length=used,
        length_w_model_temp=used,
        answer_prefix=prefix,
        haystack_size=guess,
      )
    )
  return records


def add_source_arguments(parser):
  """The options every command that generates tasks shares: --seed, --corpus, --squad, --hotpotqa."""
  parser.add_argument("--seed", type=int, default=42, help="seed of the generated samples")
  parser.add_argument("--corpus", default=None, help="essay haystack jsonl/txt (default: packaged held-out books)")
  parser.add_argument("--squad", default=None, help="SQuAD v2 dev json, for qa_1")
  parser.add_argument("--hotpotqa", default=None, help="HotpotQA distractor dev json, for qa_2")
