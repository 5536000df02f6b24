"""Short-context quality through the Language Model Evaluation Harness: FreeSolo's Table 2 (FS §4.3).

    python -m fsjax.eval.harness --checkpoint runs/a [runs/b ...] [--tasks hellaswag,piqa,...]
        [--include-path DIR] [--limit N] [--num-fewshot 0] [--batch-size 8] [--max-length N]
        [--out runs/harness] [--set KEY=VALUE ...]

Each checkpoint runs every task through `FsjaxLM`, an `lm_eval` model (registered as "fsjax") that scores and
generates through the same `fsjax.decode.prefill` and decode loop that `generate` runs, so FS-L reads its bounded
cache and FS-B its calibrated τ. Prints the paper's layout (a row per model; per task the paper's metric:
acc_norm for HellaSwag, ARC-c and OBQA, acc for the rest; Avg their mean), and writes `<out>.json` (every
metric lm_eval reports) and `<out>.csv` (the table). No network: datasets are read from the local Hugging Face
cache (or local task files under `--include-path`); a task whose data is missing is named in one line and left
out. Needs the `harness` extra (`pip install fsjax[harness]`).
"""

import csv
import json
import os
import sys
from pathlib import Path

# Set before `datasets` is imported: never reach for the network, fail fast on data that is not cached.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import simple_evaluate
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from fsjax import cli
from fsjax.cache import init_cache
from fsjax.config import ConfigError
from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.decode import generate_each, prefill
from fsjax.loading import load_model
from fsjax.train.checkpoint import CheckpointError

# FreeSolo Table 2: the eight tasks and the metric the paper reports for each (FS §4.3, App. A).
TABLE2 = {
  "hellaswag": "acc_norm",
  "piqa": "acc",
  "arc_easy": "acc",
  "arc_challenge": "acc_norm",
  "winogrande": "acc",
  "openbookqa": "acc_norm",
  "sciq": "acc",
  "boolq": "acc",
}
MIN_WIDTH = 64  # the narrowest padded batch: widths are powers of two from here, so few programs compile


def paper_metric(task, metrics):
  """The metric the table shows for `task`: the paper's for its eight tasks, else acc_norm, acc or the first."""
  if task in TABLE2:
    return TABLE2[task]
  return next((m for m in ("acc_norm", "acc") if m in metrics), next(iter(metrics), None))


@jax.jit
def _continuation_scores(logits, targets, scored):
  """Per row: the sum of log p(target) over the `scored` positions and whether each was the argmax.
  logits `[batch, T, vocab]`; targets `[batch, T]` int32; scored `[batch, T]` bool."""
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
  hits = jnp.argmax(logprobs, axis=-1) == targets
  return jnp.sum(jnp.where(scored, picked, 0.0), axis=1), jnp.all(hits | ~scored, axis=1)


@register_model("fsjax")
class FsjaxLM(LM):
  """An fsjax model as an `lm_eval` LM.

  Args:
    model, variables: a `fsjax.model.Transformer` and its variables (with FS-B's τ where the kind needs it).
    tokenizer: a `tokenizers.Tokenizer`; eos: its end-of-text id, which also stands before an empty context
      (as lm_eval's Hugging Face model does with its prefix token).
    batch_size: rows per prefill or generation call (a short last scoring batch is filled with copies).
    max_length: tokens a request may hold; longer contexts lose their oldest tokens.
    chunk: prefill chunk (None: `fsjax.decode.prefill` chooses).
  """

  def __init__(self, model, variables, tokenizer, *, eos, batch_size=8, max_length=2048, chunk=None):
    super().__init__()
    if batch_size < 1 or max_length < 2:
      raise ValueError(f"batch_size must be >= 1 and max_length >= 2, got {batch_size} and {max_length}")
    self.model, self.variables, self.tokenizer = model, variables, tokenizer
    self.eos, self.batch_size, self.max_length, self.chunk = eos, batch_size, max_length, chunk

  @classmethod
  def create_from_arg_string(cls, arg_string, additional_config=None):
    """The adapter for `lm_eval.simple_evaluate(model="fsjax", model_args=...)` once this module is imported:
    `checkpoint=DIR[,batch_size=8][,max_length=N][,set=KEY=VALUE;KEY=VALUE]` (max_length: data.seq_len)."""
    args = dict(arg.split("=", 1) for arg in arg_string.split(",") if arg)
    if "checkpoint" not in args:
      raise ValueError("--model_args needs checkpoint=DIR")
    overrides = [s for s in args.get("set", "").split(";") if s]
    loaded = load_model(args["checkpoint"], overrides)
    tokenizer = load_tokenizer(loaded.tokenizer_path)
    return cls(
      loaded.model,
      loaded.variables,
      tokenizer,
      eos=eos_id(tokenizer),
      batch_size=int(args.get("batch_size", 8)),
      max_length=int(args.get("max_length", loaded.config.data.seq_len)),
    )

  def _encode(self, text):
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def _encode_pair(self, context, continuation):
    """Context and continuation ids as lm_eval's Hugging Face model splits them: the context's trailing spaces
    move to the continuation, and the continuation's ids are those of the whole text after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
      context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, head = self._encode(context + continuation), self._encode(context)
    return (head or [self.eos]), whole[len(head) :]

  def score(self, pairs):
    """Sum of log-probabilities and greedy agreement of each continuation after its context.

    Args:
      pairs: list of (context ids, continuation ids), each context non-empty; the joined sequence is cut to its
        last `max_length + 1` tokens.

    Returns:
      list of (float, bool) in the order of `pairs`.
    """
    out = [None] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    for start in range(0, len(order), self.batch_size):
      rows = order[start : start + self.batch_size]
      seqs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :] for i in rows]
      width = min(self.max_length, max(MIN_WIDTH, 1 << (max(map(len, seqs)) - 2).bit_length()))
      tokens, targets = (np.zeros((self.batch_size, width), np.int32) for _ in range(2))
      scored = np.zeros((self.batch_size, width), bool)
      lengths = np.full((self.batch_size,), len(seqs[0]) - 1, np.int32)  # rows past the pairs repeat the first
      for row, (i, seq) in enumerate(zip(rows, seqs)):
        inputs = len(seq) - 1
        tokens[row, :inputs], targets[row, :inputs], lengths[row] = seq[:-1], seq[1:], inputs
        scored[row, inputs - min(len(pairs[i][1]), inputs) : inputs] = True  # positions predicting the continuation
      cache = init_cache(self.model.config, self.batch_size, width)
      logits, _ = prefill(self.model, self.variables, tokens, lengths, cache, self.chunk, all_logits=True)
      sums, greedy = (np.asarray(x) for x in _continuation_scores(logits, targets, scored))
      for row, i in enumerate(rows):
        out[i] = (float(sums[row]), bool(greedy[row]))
    return out

  def loglikelihood(self, requests, disable_tqdm=False):
    return self.score([self._encode_pair(*request.args) for request in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    """Each text's total log-probability in disjoint windows of `max_length` tokens (lm_eval's rolling windows:
    the first token is predicted from the end-of-text id, every later window sees one token of context)."""
    windows, owner = [], []
    for index, request in enumerate(requests):
      (text,) = request.args
      for window in lm_utils.get_rolling_token_windows(
        token_list=self._encode(text), prefix_token=self.eos, max_seq_len=self.max_length, context_len=1
      ):
        windows.append(lm_utils.make_disjoint_window(window))
        owner.append(index)
    totals = [0.0] * len(requests)
    for index, (logprob, _) in zip(owner, self.score(windows)):
      totals[index] += logprob
    return totals

  def generate_until(self, requests, disable_tqdm=False):
    """Greedy continuations (sampled where a task asks for `do_sample` with a temperature), each cut before the
    first of its `until` strings; a row also stops at the end-of-text id and at its `max_gen_toks` tokens.
    Requests with the same temperature are generated together, longest contexts first
    (`fsjax.decode.generate_each`)."""
    plans, groups = [], {}
    for index, request in enumerate(requests):
      context, kwargs = request.args
      until = kwargs.get("until") or []
      new = int(kwargs.get("max_gen_toks", 256))
      temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
      ids = (self._encode(context) or [self.eos])[-max(1, self.max_length - new) :]
      plans.append((ids, new, [until] if isinstance(until, str) else list(until)))
      groups.setdefault(temperature, []).append(index)
    out = [None] * len(requests)
    for temperature, members in groups.items():
      results = generate_each(
        self.model,
        self.variables,
        [plans[i][0] for i in members],
        [plans[i][1] for i in members],
        eos_id=self.eos,
        batch_size=self.batch_size,
        temperature=temperature,
        chunk=self.chunk,
      )
      for i, (ids, _) in zip(members, results):
        text = self.tokenizer.decode(ids)
        cuts = [text.index(stop) for stop in plans[i][2] if stop and stop in text]
        out[i] = text[: min(cuts)] if cuts else text
    return out


def loadable_tasks(names, manager):
  """The task names whose definitions and data are at hand (`manager` a `lm_eval.tasks.TaskManager`), and
  `{name: reason}` for the others (a task lm_eval does not know, or data not in the local cache)."""
  found, missing = [], {}
  for name in names:
    try:
      manager.load(name)
      found.append(name)
    except Exception as error:  # lm_eval and datasets raise many types; each is one line and the task is left out
      missing[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
  return found, missing


def evaluate(lm, names, manager, *, num_fewshot=0, limit=None):
  """lm_eval's results for `lm` on the tasks `names`: `{task: {metric: value}}`."""
  if not names:
    return {}
  results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager)
  table = {}
  for task, metrics in results["results"].items():
    table[task] = {
      key.split(",")[0]: float(value)
      for key, value in metrics.items()
      if "," in key and "_stderr" not in key and isinstance(value, (int, float))
    }
  return table


def table_rows(results, tasks):
  """Per model: its name, each task's paper metric (0-100, None where missing) and their mean."""
  rows = []
  for name, per_task in results.items():
    scores = []
    for task in tasks:
      metric = paper_metric(task, per_task.get(task, {}))
      value = per_task.get(task, {}).get(metric)
      scores.append(None if value is None else 100 * value)
    present = [s for s in scores if s is not None]
    rows.append((name, scores, sum(present) / len(present) if present else None))
  return sorted(rows, key=lambda row: -(row[2] if row[2] is not None else -1))


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", nargs="+", required=True, help="training workdirs or step directories")
  parser.add_argument("--tasks", default=",".join(TABLE2), help="comma-separated lm_eval task names")
  parser.add_argument("--include-path", default=None, help="a directory of extra task YAML files")
  parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
  parser.add_argument("--num-fewshot", type=int, default=0, help="examples in each prompt (the paper: 0)")
  parser.add_argument("--batch-size", type=int, default=8, help="rows per prefill or generation call")
  parser.add_argument("--max-length", type=int, default=None, help="tokens per request (default: data.seq_len)")
  parser.add_argument("--out", default=None, help="writes OUT.json and OUT.csv (default: none)")
  cli.add_set_argument(parser, "override a model config field of every checkpoint, e.g. --set attention.kind=fsb")
  args = parser.parse_args(argv)
  for flag in ("limit", "batch_size", "max_length"):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1")
  if args.num_fewshot < 0:
    parser.error("--num-fewshot must be >= 0")
  if args.include_path is not None and not Path(args.include_path).is_dir():
    parser.error(f"--include-path {args.include_path} is not a directory")
  return args


def main(argv=None):
  args = parse_args(argv)
  names = [t for t in args.tasks.split(",") if t]
  manager = TaskManager(include_path=args.include_path)
  tasks, missing = loadable_tasks(names, manager)
  for name, reason in missing.items():
    print(f"{name}: left out, its definition or data is not available offline ({reason})", file=sys.stderr)
  if not tasks:
    print("error: none of the tasks could be loaded", file=sys.stderr)
    return 2
  results = {}
  for checkpoint in args.checkpoint:
    try:
      loaded = load_model(checkpoint, args.set)
    except (CheckpointError, ConfigError) as error:
      print(f"error: {error}", file=sys.stderr)
      return 2
    tokenizer = load_tokenizer(loaded.tokenizer_path)
    lm = FsjaxLM(
      loaded.model,
      loaded.variables,
      tokenizer,
      eos=eos_id(tokenizer),
      batch_size=args.batch_size,
      max_length=args.max_length or loaded.config.data.seq_len,
    )
    with cli.stage(f"{loaded.name}: {len(tasks)} task(s)"):
      results[loaded.name] = evaluate(lm, tasks, manager, num_fewshot=args.num_fewshot, limit=args.limit)
  order = [name for name in names if name in tasks]
  rows = table_rows(results, order)
  header = ["model"] + [f"{task} ({paper_metric(task, next(iter(results.values())).get(task, {}))})" for task in order]
  print("\t".join(header + ["avg"]))
  show = lambda v: "-" if v is None else f"{v:.1f}"
  for name, scores, avg in rows:
    print("\t".join([name] + [show(s) for s in scores] + [show(avg)]))
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({"tasks": order, "left_out": missing, "results": results}, indent=1))
    with open(f"{args.out}.csv", "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(header + ["avg"])
      writer.writerows([name] + [show(s) for s in scores] + [show(avg)] for name, scores, avg in rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
