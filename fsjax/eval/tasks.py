"""All RULER tasks generated offline, each sample fitted to a target length under a given tokenizer.

A task is a sampler `(size, seed, length, count_tokens) -> (input, answer_prefix, outputs)` that grows with `size`,
with a smallest and a largest meaningful size (None: unbounded). Each sample has its own seed. Two ways to size a
sample's haystack so that its prompt (`input + answer_prefix`) plus the generation cap fits the length:

- `fit="ruler"` (default), as RULER's `prepare.py` does (c3f5e3b): one size is found for the (task, length) on a
  draw of its own (the largest that fits; fwe: the last of RULER's grid from budget/6 in steps of budget/32 that
  stays below the budget), and each sample starts from it and backs off by RULER's step (`ruler_step`) until it
  fits (where a step would go below the task's smallest size, to the largest size that fits). Samples end up
  0-17% short of the length, as RULER's do.
- `fit="exact"`: each sample gets the largest size that fits (galloping from the previous sample's size, then
  bisection), so one more unit would not fit.
"""

import functools
import random

from fsjax.eval import fitting, niah, qa, synthetic
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
FITS = ("ruler", "exact")


def ruler_step(task, length, budget):
  """RULER's haystack step ("incremental") for a task at a target length: what a sample backs off by when the
  (task, length)'s size does not fit it. `budget` is the length less the generation cap (fwe's step is a 32nd)."""
  if task in niah.TASKS:
    if niah.TASKS[task].haystack == "essay":
      return 500  # words
    return 5 if length < 4096 else 25  # noise sentences or distractor needles
  if task == "vt":
    return 5 if length < 4096 else 10
  if task == "fwe":
    return max(1, budget // 32)
  return 10  # cwe words, qa documents


def sample_seed(seed, task, length, index):
  """The seed of sample `index` of a (task, length) under the run's `seed` (index "fit": the draw RULER's fit sizes
  the haystack on): independent streams per sample."""
  return random.Random(f"{seed}/{task}/{length}/{index}").getrandbits(64)


def generate(task, length, num_samples, count_tokens, *, seed=42, tokens_to_generate=None, fit="ruler", **sources):
  """RULER-format records for one task and target length.

  Args:
    task: one of TASKS; length: target tokens (prompt + generation cap).
    count_tokens: `text -> int`, the model's tokenizer.
    seed: the run's seed (RULER: 42).
    tokens_to_generate: the generation cap; None = RULER's for the task.
    fit: "ruler" or "exact", how each sample's haystack is sized (the module docstring says how).
    sources: `corpus` (essay haystack), `squad`, `hotpotqa` (QA files).

  Returns:
    list of dicts with RULER's fields `index`, `input`, `outputs`, `length`, `length_w_model_temp`,
    `answer_prefix`, and `haystack_size`.
  """
  if fit not in FITS:
    raise ValueError(f"fit must be one of {', '.join(FITS)}, not {fit!r}")
  make, smallest, largest = sampler(task, **sources)
  cap = TOKENS_TO_GENERATE[task_family(task)] if tokens_to_generate is None else tokens_to_generate
  budget = length - cap
  prompt_tokens = lambda size, seed: count_tokens("".join(make(size, seed, length, count_tokens)[:2]))
  fits = lambda seed: lambda size: prompt_tokens(size, seed) <= budget

  def fail(reason="the target length cannot hold the smallest prompt plus the generation budget"):
    return ValueError(f"{task} at {length} tokens: {reason}")

  guess = max(smallest, budget // 2)
  if fit == "ruler":
    step = ruler_step(task, length, budget)
    fit_seed = sample_seed(seed, task, length, "fit")
    guess = _ruler_size(task, lambda size: prompt_tokens(size, fit_seed), budget, step, smallest, largest, fail)
  records = []
  for index in range(num_samples):
    this_seed = sample_seed(seed, task, length, index)
    if fit == "exact":
      try:
        guess = fitting.largest_fitting(fits(this_seed), guess, smallest, largest)
      except ValueError as e:
        raise fail(str(e)) from None
      size = guess
    else:
      size = guess
      while not fits(this_seed)(size) and size - step >= smallest:
        size -= step
      if not fits(this_seed)(size):  # the step overshoots the smallest size (short lengths, coarse steps)
        try:
          size = fitting.largest_fitting(fits(this_seed), size, smallest, size)
        except ValueError as e:
          raise fail(str(e)) from None
    text, prefix, answers = make(size, this_seed, length, count_tokens)
    used = prompt_tokens(size, this_seed) + cap
    records.append(
      dict(
        index=index,
        input=text,
        outputs=list(answers),
        length=used,
        length_w_model_temp=used,
        answer_prefix=prefix,
        haystack_size=size,
      )
    )
  return records


def _ruler_size(task, tokens, budget, step, smallest, largest, fail):
  """The haystack size RULER starts every sample of a (task, length) from, found on one draw (`tokens`: size ->
  prompt tokens)."""
  if task != "fwe":
    try:
      return fitting.largest_fitting(lambda size: tokens(size) <= budget, max(smallest, budget // 2), smallest, largest)
    except ValueError as e:
      raise fail(str(e)) from None
  # fwe: RULER counts up from budget/6 words in steps while the prompt is below the budget, then steps back once.
  start = budget // synthetic.FWE_WORD_LENGTH
  if tokens(start) >= budget:
    size = start - step
  else:
    size = start + step * fitting.largest_fitting(lambda n: tokens(start + n * step) < budget, 1, 0)
  if size < smallest:
    raise fail()
  return size


def add_source_arguments(parser):
  """The options every command that generates tasks shares: --seed, --fit, --corpus, --squad, --hotpotqa."""
  parser.add_argument("--seed", type=int, default=42, help="seed of the generated samples")
  parser.add_argument(
    "--fit",
    choices=FITS,
    default="ruler",
    help="haystack sizing: 'ruler' backs each sample off by RULER's step as its prepare.py does (prompts 0-17%% "
    "short of the length); 'exact' fills each sample to the last token",
  )
  parser.add_argument("--corpus", default=None, help="essay haystack jsonl/txt (default: packaged held-out books)")
  parser.add_argument("--squad", default=None, help="SQuAD v2 dev json, for qa_1")
  parser.add_argument("--hotpotqa", default=None, help="HotpotQA distractor dev json, for qa_2")
