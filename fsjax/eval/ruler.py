"""RULER-style evaluation of one or more checkpoints across tasks and lengths.

    python -m fsjax.eval.ruler --checkpoint runs/tiny_fs --tasks niah_single_1,niah_single_2 \\
        --lengths 1024,4096 --num-samples 50 [--out runs/ruler] [--batch-size 4]
    python -m fsjax.eval.ruler --checkpoint A B --ruler-data DIR ...   # score RULER's own files

RULER's 13 tasks are generated offline under each model's tokenizer, seed 42 by default: niah_single_1/2/3,
niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe, and qa_1 / qa_2 when `--squad` /
`--hotpotqa` name their dataset files (otherwise they are skipped with a message). `--ruler-data DIR` reads
RULER-generated files `DIR/<length>/<task>/validation.jsonl` instead. Greedy decoding with EOS stopping and
RULER's generation caps; scores are RULER's (string_match_all, string_match_part for QA) on 0-100.

Writes `<out>/<model>/<length>/<task>.jsonl` (records with `pred`), `<out>/scores.csv`, `<out>/scores.png`
(accuracy vs length per task, a line per model) and prints the table.
"""

import csv
import sys
from pathlib import Path

from tqdm import tqdm

from fsjax import cli
from fsjax.config import ConfigError, ModelConfig, override_model
from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.eval import records, scoring, tasks
from fsjax.eval.runner import run_task
from fsjax.loading import load_model
from fsjax.train.checkpoint import CheckpointError


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", nargs="+", required=True, help="training workdirs or step directories")
  parser.add_argument(
    "--tasks",
    default="niah_single_1,niah_single_2,niah_single_3",
    type=lambda s: [t for t in s.split(",") if t],
    help="comma-separated RULER task names",
  )
  parser.add_argument(
    "--lengths", default="4096", type=lambda s: [int(n) for n in s.split(",") if n], help="comma-separated tokens"
  )
  parser.add_argument("--num-samples", type=int, default=50, help="samples per task and length")
  parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
  tasks.add_source_arguments(parser)
  parser.add_argument("--ruler-data", default=None, help="read RULER-generated files instead of generating")
  parser.add_argument("--out", default="runs/ruler", help="directory for predictions, scores and the table")
  parser.add_argument(
    "--chunk", type=int, default=None, help="prefill chunk in tokens (default: chosen from the prompt length)"
  )
  cli.add_set_argument(
    parser,
    "override a model config field of every checkpoint, e.g. --set attention.zha.top_p=0.8 "
    "(repeatable; the model's name in the results records it)",
  )
  return parser.parse_args(argv)


def check_args(args):
  """One clear error per bad argument, before any model is loaded."""
  if args.num_samples < 1 or args.batch_size < 1:
    raise ConfigError("--num-samples and --batch-size must be >= 1")
  if not args.tasks or not args.lengths:
    raise ConfigError("--tasks and --lengths must each name at least one value")
  for task in args.tasks:
    if task not in tasks.TASKS:
      raise ConfigError(f"--tasks: {task!r} is not a RULER task (one of {', '.join(tasks.TASKS)})")
  for length in args.lengths:
    if length <= scoring.TOKENS_TO_GENERATE["niah"]:
      raise ConfigError(f"--lengths: {length} leaves no room for a prompt")
  for assignment in args.set:
    override_model(ModelConfig(), [assignment])


def task_source(task):
  """The CLI option naming a QA task's dataset file."""
  return "squad" if task == "qa_1" else "hotpotqa"


def evaluate_checkpoint(args, path, progress, scored=None):
  """Scores of one checkpoint: list of dicts (model, task, length, samples, score).

  `scored`, when given, is called with each row as soon as its task and length are done.
  """
  loaded = load_model(path, args.set)
  tokenizer = load_tokenizer(loaded.tokenizer_path)
  rows = []
  for length in args.lengths:
    for task in args.tasks:
      if args.ruler_data is None and task in ("qa_1", "qa_2") and getattr(args, task_source(task)) is None:
        print(
          f"skipping {task}: it needs --{task_source(task)} (the dataset file is not available offline)",
          file=sys.stderr,
        )
        continue
      given = None
      if args.ruler_data is not None:
        given = records.read_jsonl(Path(args.ruler_data) / str(length) / task / "validation.jsonl")
        given = given[: args.num_samples]
      with cli.stage(f"{loaded.name}: {task} at {length} tokens"):
        score, predicted = run_task(
          loaded.model,
          loaded.variables,
          tokenizer,
          task,
          length,
          eos_id=eos_id(tokenizer),
          num_samples=args.num_samples,
          task_records=given,
          seed=args.seed,
          fit=args.fit,
          batch_size=args.batch_size,
          chunk=args.chunk,
          progress=progress,
          corpus=args.corpus,
          squad=args.squad,
          hotpotqa=args.hotpotqa,
        )
      records.write_jsonl(Path(args.out) / loaded.name / str(length) / f"{task}.jsonl", predicted)
      rows.append(dict(model=loaded.name, task=task, length=length, samples=len(predicted), score=score))
      if scored is not None:
        scored(rows[-1])
  return rows


def write_csv(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["model", "task", "length", "samples", "score"])
    writer.writeheader()
    writer.writerows(rows)


def plot(path, rows):
  """Writes `figure(rows)` to `path`."""
  chart = figure(rows)  # selects the Agg backend before pyplot is imported
  import matplotlib.pyplot as plt

  chart.savefig(path, dpi=120)
  plt.close(chart)


def figure(rows):
  """Accuracy vs length, one panel per task (four per row), one line per model (log2 length axis). A model keeps
  its color in every panel and is in the legend even where it has no points in the first panel."""
  import matplotlib  # here, not at module top: the Agg backend is chosen only when a plot is drawn, before pyplot

  matplotlib.use("Agg")
  import matplotlib.lines
  import matplotlib.pyplot as plt

  names = sorted({r["task"] for r in rows})
  models = sorted({r["model"] for r in rows})
  colors = {model: f"C{i % 10}" for i, model in enumerate(models)}
  columns = min(4, len(names))
  grid_rows = -(-len(names) // columns)
  chart, axes = plt.subplots(grid_rows, columns, figsize=(4 * columns, 3.2 * grid_rows), squeeze=False)
  for ax in axes.flat[len(names) :]:
    ax.set_visible(False)
  for ax, task in zip(axes.flat, names):
    for model in models:
      points = sorted((r["length"], r["score"]) for r in rows if r["task"] == task and r["model"] == model)
      if points:
        ax.plot(*zip(*points), marker="o", color=colors[model], label=model)
    ax.set_xscale("log", base=2)
    ax.set(title=task, xlabel="length (tokens)", ylabel="score (0-100)", ylim=(-5, 105))
  # One legend right of the panels: inside a panel it hides the long-length points of a many-model plot.
  handles = [matplotlib.lines.Line2D([], [], color=colors[model], marker="o") for model in models]
  legend_inches = 0.075 * max(map(len, models)) + 0.6
  chart.set_figwidth(chart.get_figwidth() + legend_inches)
  chart.legend(handles, models, loc="center right", fontsize="small", frameon=False)
  chart.tight_layout(rect=(0, 0, 1 - legend_inches / chart.get_figwidth(), 1))
  return chart


def format_table(rows):
  lengths = sorted({r["length"] for r in rows})
  lines = ["| model | task | " + " | ".join(map(str, lengths)) + " |", "|---|---|" + "---|" * len(lengths)]
  for model, task in sorted({(r["model"], r["task"]) for r in rows}):
    scores = {r["length"]: r["score"] for r in rows if r["model"] == model and r["task"] == task}
    lines.append(f"| {model} | {task} | " + " | ".join(f"{scores.get(n, float('nan')):.1f}" for n in lengths) + " |")
  return "\n".join(lines)


def main(argv=None):
  args = parse_args(argv)
  try:
    check_args(args)
    total = len(args.checkpoint) * len(args.tasks) * len(args.lengths) * args.num_samples
    out, done = Path(args.out), []
    scored = lambda row: (done.append(row), write_csv(out / "scores.csv", done))  # a killed run keeps its scores
    with tqdm(total=total, desc="RULER", unit="sample", file=sys.stderr) as bar:
      rows = [row for path in args.checkpoint for row in evaluate_checkpoint(args, path, bar.update, scored)]
  except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not rows:
    print("error: no task could be evaluated", file=sys.stderr)
    return 2
  plot(out / "scores.png", rows)
  print(format_table(rows))
  print(f"wrote {out / 'scores.csv'} and {out / 'scores.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
