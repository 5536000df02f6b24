"""The lm_eval adapter (fsjax.eval.harness): its scores against the model's own forward pass, rolling scores
against the perplexity evaluation, generation cut at the requested strings, and the CLI on a local task."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm_eval.api.instance import Instance

from fsjax import kinds
from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.eval import harness, perplexity
from fsjax.loading import load_model

from helpers import assert_close, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _forward_logprob(model, variables, seq):
  """log p(seq[t] | seq[:t]) for t >= 1 by the full forward pass, and the argmax at each position: `[T - 1]` each.
  The input is right-padded to whole 64-token blocks, which causality keeps out of the positions read."""
  inputs = np.zeros((1, -(-(len(seq) - 1) // 64) * 64), np.int32)
  inputs[0, : len(seq) - 1] = seq[:-1]
  logits = model.apply(variables, jnp.asarray(inputs))
  logprobs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)[0, : len(seq) - 1]
  return np.asarray(logprobs[jnp.arange(len(seq) - 1), jnp.asarray(seq[1:])]), np.asarray(logprobs.argmax(-1))


@pytest.mark.parametrize("kind", list(kinds.names()))
def test_scores_equal_the_forward_pass_for_every_kind(rng, kind):
  """Sums of continuation log-probabilities and greedy flags through prefill equal the full forward's, for
  contexts ending mid-cell and mid-block, a short last batch and a pair cut to `max_length + 1` tokens."""
  config, model, variables = tiny_model(kind)
  lm = harness.FsjaxLM(model, variables, tokenizer=None, eos=0, batch_size=2, max_length=64)
  sizes = [(5, 1), (37, 3), (70, 9)]  # the last is cut to its final 65 tokens
  pairs = [
    (rng.integers(1, config.vocab_size, c).tolist(), rng.integers(1, config.vocab_size, n).tolist()) for c, n in sizes
  ]
  greedy_seq = pairs[0][0] + pairs[0][1]
  _, argmax = _forward_logprob(model, variables, greedy_seq)
  pairs.append((pairs[0][0], [int(argmax[len(pairs[0][0]) - 1])]))  # the greedy next token: is_greedy holds
  got = lm.score(pairs)
  for (context, continuation), (logprob, greedy) in zip(pairs, got):
    seq = (context + continuation)[-65:]
    scores, argmax = _forward_logprob(model, variables, seq)
    n = len(continuation)
    assert_close(logprob, scores[-n:].sum(), jnp.float32)
    assert greedy == bool((argmax[-n:] == np.asarray(seq[-n:])).all())
  assert got[-1][1]


def test_loglikelihood_splits_context_and_continuation_as_lm_eval_does(micro_workdir):
  loaded = load_model(micro_workdir)
  tokenizer = load_tokenizer(loaded.tokenizer_path)
  lm = harness.FsjaxLM(loaded.model, loaded.variables, tokenizer, eos=eos_id(tokenizer), batch_size=2, max_length=64)
  context, continuation = "The river ran past the mill and ", "the old bridge."
  (logprob, _), (moved, _), (empty, _) = lm.loglikelihood(
    [
      Instance("loglikelihood", {}, (context, continuation), 0),
      Instance("loglikelihood", {}, (context.rstrip(), " " + continuation), 1),  # the same text, space moved
      Instance("loglikelihood", {}, ("", continuation), 2),
    ]
  )
  head = tokenizer.encode(context.rstrip(), add_special_tokens=False).ids
  whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
  scores, _ = _forward_logprob(loaded.model, loaded.variables, whole)
  assert_close(logprob, scores[len(head) - 1 :].sum(), jnp.float32)
  assert moved == pytest.approx(logprob, rel=1e-6)
  alone = [eos_id(tokenizer)] + tokenizer.encode(continuation, add_special_tokens=False).ids
  assert_close(empty, _forward_logprob(loaded.model, loaded.variables, alone)[0].sum(), jnp.float32)


def test_rolling_loglikelihood_equals_the_perplexity_evaluation(micro_workdir):
  loaded = load_model(micro_workdir)
  tokenizer = load_tokenizer(loaded.tokenizer_path)
  eos = eos_id(tokenizer)
  lm = harness.FsjaxLM(loaded.model, loaded.variables, tokenizer, eos=eos, batch_size=2, max_length=64)
  text = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness."
  ids = tokenizer.encode(text, add_special_tokens=False).ids
  assert len(ids) <= 64  # one window: its first token predicted from the end-of-text id
  (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
  losses, _ = perplexity.position_losses(loaded.model, loaded.variables, [np.asarray([[eos] + ids], np.int32)])
  assert_close(-rolling, losses.sum(), jnp.float32)
  (twice,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (" ".join([text] * 3),), 0)])
  assert twice < rolling  # three copies span several windows, each adding its tokens' (negative) log-probs


def test_generate_until_stops_at_the_requested_strings(micro_workdir):
  loaded = load_model(micro_workdir)
  tokenizer = load_tokenizer(loaded.tokenizer_path)
  lm = harness.FsjaxLM(loaded.model, loaded.variables, tokenizer, eos=eos_id(tokenizer), batch_size=2, max_length=64)
  contexts = ["Once upon a time", "The ship sailed", "In the morning the"]
  free = lm.generate_until(
    [Instance("generate_until", {}, (c, {"max_gen_toks": 12}), i) for i, c in enumerate(contexts)]
  )
  assert all(isinstance(text, str) and text for text in free)
  stops = [text[len(text) // 2 : len(text) // 2 + 2] for text in free]
  cut = lm.generate_until(
    [
      Instance("generate_until", {}, (c, {"until": [s], "max_gen_toks": 12}), i)
      for i, (c, s) in enumerate(zip(contexts, stops))
    ]
  )
  assert cut == [text[: text.index(stop)] for text, stop in zip(free, stops)]


def _write_task(directory, docs):
  (directory / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  (directory / "fsjax_tiny_choice.yaml").write_text(
    "task: fsjax_tiny_choice\n"
    "dataset_path: json\n"
    f"dataset_kwargs:\n  data_files:\n    test: {directory / 'docs.jsonl'}\n"
    "test_split: test\n"
    "output_type: multiple_choice\n"
    "doc_to_text: '{{question}}'\n"
    "doc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\n"
    "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
  )


def test_cli_evaluates_a_local_task_and_its_accuracy_is_the_argmax_of_the_scores(micro_workdir, tmp_path):
  docs = [
    {"question": "The sun rises in the", "choices": ["east", "west", "sea"], "answer": 0},
    {"question": "Water is", "choices": ["wet", "dry"], "answer": 1},
    {"question": "She opened the", "choices": ["door", "window", "book", "box"], "answer": 2},
  ]
  _write_task(tmp_path, docs)
  out = tmp_path / "harness"
  cmd = [sys.executable, "-m", "fsjax.eval.harness", "--checkpoint", str(micro_workdir), "--tasks"]
  cmd += ["fsjax_tiny_choice,no_such_task,hellaswag", "--include-path", str(tmp_path), "--batch-size", "2"]
  hf = tmp_path / "hf"  # an empty Hugging Face cache: HellaSwag's data is missing, and nothing is downloaded
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "HF_HOME": str(hf)}
  run = subprocess.run([*cmd, "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-2000:]
  left_out = [line for line in run.stderr.splitlines() if ": left out" in line]
  assert [line.split(":")[0] for line in left_out] == ["no_such_task", "hellaswag"], left_out
  loaded = load_model(micro_workdir)
  tokenizer = load_tokenizer(loaded.tokenizer_path)
  lm = harness.FsjaxLM(loaded.model, loaded.variables, tokenizer, eos=eos_id(tokenizer), max_length=64)
  correct = []
  for doc in docs:  # lm_eval's prompt: question, then " " + choice is the continuation (target_delimiter)
    scores = lm.loglikelihood(
      [Instance("loglikelihood", {}, (doc["question"], " " + c), i) for i, c in enumerate(doc["choices"])]
    )
    correct.append(int(np.argmax([s for s, _ in scores])) == doc["answer"])
  record = json.loads((out.with_suffix(".json")).read_text())
  name = next(iter(record["results"]))
  assert record["results"][name]["fsjax_tiny_choice"]["acc"] == pytest.approx(np.mean(correct))
  assert sorted(record["left_out"]) == ["hellaswag", "no_such_task"]
  header, row = (out.with_suffix(".csv")).read_text().splitlines()
  assert header.startswith("model,fsjax_tiny_choice (acc_norm)") and row.startswith(name)
  assert f"{100 * record['results'][name]['fsjax_tiny_choice']['acc_norm']:.1f}" in run.stdout


def test_cli_with_no_loadable_task_is_one_line_each_and_exit_2(micro_workdir, capsys):
  assert harness.main(["--checkpoint", str(micro_workdir), "--tasks", "no_such_task"]) == 2
  lines = capsys.readouterr().err.splitlines()
  assert lines[0].startswith("no_such_task: left out") and lines[-1] == "error: none of the tasks could be loaded"


def test_lm_eval_builds_the_adapter_from_its_model_args(micro_workdir):
  lm = harness.FsjaxLM.create_from_arg_string(
    f"checkpoint={micro_workdir},batch_size=3,max_length=32,set=attention.top_k=1;attention.window=48"
  )
  assert (lm.batch_size, lm.max_length) == (3, 32)
  assert (lm.model.config.attention.top_k, lm.model.config.attention.window) == (1, 48)
  with pytest.raises(ValueError, match="needs checkpoint=DIR"):
    harness.FsjaxLM.create_from_arg_string("batch_size=3")
