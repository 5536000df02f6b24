"""RULER's scoring (scripts/eval/synthetic/constants.py and evaluate.py): post-processing of a prediction and
the two metrics, on a 0-100 scale."""

import re

_CONTROL = re.compile(r"[\x00-\x1f]")

# Generation caps per task family (FS App. A "RULER evaluation"); every NIAH task takes 128.
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


def postprocess(prediction):
  """RULER's `postprocess_pred`: strip, turn control characters into newlines, strip again."""
  return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(predictions, references):
  """Mean over samples of the fraction of a sample's references found (case-insensitively) in its
  prediction, x100, rounded to 2 decimals. Used for every non-QA task."""
  per_sample = [sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references)]
  return round(100 * sum(per_sample) / len(per_sample), 2)


def string_match_part(predictions, references):
  """Mean over samples of 1 if any reference occurs (case-insensitively) in the prediction, x100, rounded to
  2 decimals. Used for QA."""
  per_sample = [max(float(r.lower() in p.lower()) for r in refs) for p, refs in zip(predictions, references)]
  return round(100 * sum(per_sample) / len(per_sample), 2)


def task_family(task):
  """ "niah", "vt", "cwe", "fwe" or "qa" for a RULER task name such as niah_multikey_2 or qa_1."""
  family = task.split("_")[0]
  if family not in TOKENS_TO_GENERATE:
    raise ValueError(f"unknown RULER task {task!r}")
  return family


def score(task, predictions, references):
  """The task's RULER metric on post-processed predictions: string_match_part for QA, else string_match_all."""
  if not predictions:
    raise ValueError(f"no predictions to score for task {task!r}")
  metric = string_match_part if task_family(task) == "qa" else string_match_all
  return metric([postprocess(p) for p in predictions], references)
