"""Greedy batched generation over RULER records with a fsjax model (RULER's protocol: the prompt is
`input + answer_prefix`, greedy decoding, EOS stops, a generation cap per task family)."""

import warnings

import numpy as np

from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.decode import generate
from fsjax.eval import records, scoring, tasks
from fsjax.eval.records import prompt


def predict(
  model, variables, tokenizer, task_records, *, max_new_tokens, eos_id, max_len, batch_size=1, chunk=None, progress=None
):
  """Predictions (decoded text up to EOS) for records of one task and length.

  Args:
    tokenizer: a `tokenizers.Tokenizer` (no special tokens are added to prompts).
    max_new_tokens: the task's generation cap; max_len: cache length (the target length), the same for every
      batch so each (task, length) compiles once.
    batch_size: prompts per generate call, right-padded to `max_len - max_new_tokens` tokens.
    chunk: prefill chunk in tokens; None chooses it from the prompt length (`fsjax.decode.prefill_chunk`).
    progress: optional callable(n) told after every batch how many records it finished.

  Returns:
    list of str, one per record, in order.
  """
  width = max_len - max_new_tokens  # every batch has the same shape: one compile per (task, length)
  predictions = []
  for start in range(0, len(task_records), batch_size):
    batch = task_records[start : start + batch_size]
    ids = [tokenizer.encode(prompt(r), add_special_tokens=False).ids for r in batch]
    if max(map(len, ids)) > width:
      raise ValueError(
        f"a prompt of {max(map(len, ids))} tokens + {max_new_tokens} new tokens exceeds max_len={max_len}"
      )
    ids += [ids[0]] * (batch_size - len(ids))  # a short last batch is filled with copies, then dropped
    tokens = np.zeros((batch_size, width), np.int32)
    for row, row_ids in enumerate(ids):
      tokens[row, : len(row_ids)] = row_ids
    with warnings.catch_warnings():  # on CPU XLA cannot alias the donated cache: a copy, not a problem
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      out = np.asarray(
        generate(
          model,
          variables,
          tokens,
          [len(i) for i in ids],
          max_new_tokens=max_new_tokens,
          eos_id=eos_id,
          chunk=chunk,
          max_len=max_len,
        )
      )
    for row in out[: len(batch)]:
      row = [int(t) for t in row]
      predictions.append(tokenizer.decode(row[: row.index(eos_id)] if eos_id in row else row))
    if progress is not None:
      progress(len(batch))
  return predictions


def run_task(
  model,
  variables,
  tokenizer,
  task,
  length,
  *,
  eos_id,
  num_samples=None,
  task_records=None,
  seed=42,
  fit="ruler",
  batch_size=1,
  chunk=None,
  progress=None,
  **sources,
):
  """Generates (or takes) one task's records at one length, predicts and scores them.

  Args:
    task_records: RULER records to use as given; None generates `num_samples` samples offline, their haystacks
      sized by `fit` (`fsjax.eval.tasks.generate`).
    sources: `corpus`, `squad`, `hotpotqa` for `tasks.generate`.

  Returns:
    (RULER score 0-100, records with their prediction in `pred`).
  """
  cap = scoring.TOKENS_TO_GENERATE[scoring.task_family(task)]
  if task_records is None:
    count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    task_records = tasks.generate(
      task, length, num_samples, count_tokens, seed=seed, tokens_to_generate=cap, fit=fit, **sources
    )
  predictions = predict(
    model,
    variables,
    tokenizer,
    task_records,
    max_new_tokens=cap,
    eos_id=eos_id,
    max_len=length,
    batch_size=batch_size,
    chunk=chunk,
    progress=progress,
  )
  score = scoring.score(task, predictions, [r["outputs"] for r in task_records])
  return score, [records.prediction(r, p) for r, p in zip(task_records, predictions)]


def niah_scores(config, model, variables):
  """RULER S-NIAH-1 scores of a trained model at 1x and 4x its training length, on `config.eval.niah_samples`
  generated samples each: `{"s_niah_1@<length>": score}`, empty when that is 0. A `final_evals` hook of
  `fsjax.train.loop.train` (train.py passes it).

  Args:
    config: the training config (its tokenizer, `data.seq_len` and `eval.niah_samples`).
    model, variables: the trained model.
  """
  if not config.eval.niah_samples:
    return {}
  tokenizer = load_tokenizer(config.data.tokenizer)
  return {
    f"s_niah_1@{length}": run_task(
      model,
      variables,
      tokenizer,
      "niah_single_1",
      length,
      eos_id=eos_id(tokenizer),
      num_samples=config.eval.niah_samples,
    )[0]
    for length in (config.data.seq_len, 4 * config.data.seq_len)
  }
