"""Collects what `scripts/repro.sh` wrote into the tables and plots of docs/results.md.

    python scripts/repro_results.py [--runs runs | --runs docs/results/<run>.json] [--plot docs/results_ruler.png]
        [--loss-plot docs/results_loss.png] [--summary docs/results/<run>.json]

`--runs` is either a runs directory as `scripts/repro.sh` leaves it (`repro_<model>/{eval.json,metrics.jsonl}` and
`repro_eval/{copy_*.csv, needles_*.csv, ruler_*/scores.csv, ppl_*.csv, steps_*.tsv}`) or the summary JSON of one
run that `--summary` wrote from such a directory (docs/results/ keeps one per run). Prints markdown: training
(steps, tokens, tokens/s, held-out loss at 1x), copy recall in its text and needle forms (model x length), RULER
scores (model x task x length), loss by position at the perplexity length, and the wall time of every step. Writes
the accuracy-vs-length plot (one panel per RULER task and one per copy-recall form, in points, a line per model)
and the loss-by-position plot, as 256-colour PNGs; `--plot ''` or `--loss-plot ''` skips one.

A summary holds, per section, the rows the tables are made from, with the raw files' values unrounded:
`training` (per model: eval.json, the median tokens/s, the last logged loss and the loss curve at 4 decimals),
`copy`, `needles`, `ruler`, `ppl` (the CSVs' rows, as {"columns", "rows"}) and `steps` ([name, seconds, exit
status]). Other keys (docs/results/'s summaries describe the run and keep its other outputs under `files`) are
left to the reader.
"""

import argparse
import csv
import json
import math
from pathlib import Path

from fsjax.eval.ruler import format_table, plot

MODELS = ("tfpp", "swa", "fs", "fsl", "fsb", "zha")
SECTIONS = ("training", "copy", "needles", "ruler", "ppl", "steps")
ROW_SECTIONS = ("copy", "needles", "ruler", "ppl")  # stored as {"columns": [...], "rows": [[...], ...]}


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def typed(value):
  """A CSV cell as int, finite float, None (empty) or the string itself ("nan" stays a string: JSON has no NaN)."""
  if value == "":
    return None
  for kind in (int, float):
    try:
      number = kind(value)
    except ValueError:
      continue
    return number if math.isfinite(number) else value
  return value


def typed_rows(path):
  return [{key: typed(value) for key, value in row.items()} for row in read_csv(path)]


def summarize(runs):
  """The summary of a runs directory: every section's rows, read from the files `scripts/repro.sh` writes."""
  runs, eval_dir = Path(runs), Path(runs) / "repro_eval"
  summary = {"training": [], "copy": [], "needles": [], "ruler": [], "ppl": [], "steps": []}
  for model in MODELS:
    workdir = runs / f"repro_{model}"
    if (workdir / "eval.json").exists():
      metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
      metrics = [m for m in metrics if "tokens_per_s" in m]
      speeds = sorted(m["tokens_per_s"] for m in metrics)
      summary["training"].append(
        {
          "model": model,
          "eval": json.loads((workdir / "eval.json").read_text()),
          "tokens_per_s_median": speeds[len(speeds) // 2],
          "final_loss": metrics[-1]["loss"],
          "loss_curve": [[m["step"], round(m["loss"], 4)] for m in metrics],
        }
      )
    for prefix in ("copy", "needles", "ppl"):
      if (eval_dir / f"{prefix}_{model}.csv").exists():
        summary[prefix] += typed_rows(eval_dir / f"{prefix}_{model}.csv")
  summary["ruler"] = [row for path in sorted(eval_dir.glob("ruler_*/scores.csv")) for row in typed_rows(path)]
  for path in sorted(eval_dir.glob("steps_*.tsv")):
    for line in path.read_text().splitlines():
      name, seconds, status = line.split("\t")
      summary["steps"].append([name, typed(seconds), typed(status)])
  return summary


def load(path):
  """A run's summary: read from a summary JSON, or collected from a runs directory."""
  path = Path(path)
  if not path.is_file():
    return summarize(path)
  stored = json.loads(path.read_text())
  summary = {section: stored.get(section, []) for section in SECTIONS}
  for section in ROW_SECTIONS:
    if isinstance(summary[section], dict):
      summary[section] = [dict(zip(summary[section]["columns"], row)) for row in summary[section]["rows"]]
  return summary


def training_table(summary):
  lines = [
    "| model | steps | tokens | train tokens/s (median) | final train loss | held-out loss at 1x |",
    "|---|---|---|---|---|---|",
  ]
  for entry in summary["training"]:
    run = entry["eval"]
    lines.append(
      f"| {entry['model']} | {run['steps']} | {run['tokens_seen']:,} | "
      f"{entry['tokens_per_s_median']:,.0f} | {entry['final_loss']:.3f} | "
      f"{run.get('heldout_loss', float('nan')):.3f} |"
    )
  return "\n".join(lines)


def position_table(summary):
  rows = summary["ppl"]
  if not rows:
    return "(no perplexity files)"
  spans = sorted({(int(r["first"]), int(r["last"])) for r in rows})
  names = list(dict.fromkeys(r["model"] for r in rows))
  lines = ["| model | " + " | ".join(f"{a}-{b}" for a, b in spans) + " |", "|---|" + "---|" * len(spans)]
  for name in names:
    by_span = {(int(r["first"]), int(r["last"])): r for r in rows if r["model"] == name}
    lines.append(
      f"| {name} | " + " | ".join(f"{float(by_span[s]['loss']):.2f}" if s in by_span else "–" for s in spans) + " |"
    )
    attended = [by_span[s]["attended"] for s in spans if s in by_span and by_span[s]["attended"]]
    if attended:
      lines.append(f"| {name} keys attended | " + " | ".join(f"{float(a):.1%}" for a in attended) + " |")
  return "\n".join(lines)


def copy_rows(summary, prefix="copy"):
  """The copy-probe rows (`copy`: text copies; `needles`: random-id needles), lengths as ints."""
  return [dict(r, length=int(r["length"])) for r in summary[prefix]]


def copy_table(rows):
  """Recall (copy minus control greedy accuracy, in points) per model and length, and the two accuracies."""
  lengths = sorted({r["length"] for r in rows})
  lines = ["| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
  for name in dict.fromkeys(r["model"] for r in rows):
    by_length = {r["length"]: r for r in rows if r["model"] == name}
    cell = lambda r: (
      f"**{100 * float(r['recall']):.1f}** ({100 * float(r['copy_accuracy']):.0f}/"
      f"{100 * float(r['control_accuracy']):.0f})"
    )
    lines.append(f"| {name} | " + " | ".join(cell(by_length[n]) if n in by_length else "–" for n in lengths) + " |")
  return "\n".join(lines)


def ruler_rows(summary):
  return [dict(r, length=int(r["length"]), score=float(r["score"])) for r in summary["ruler"]]


def plot_losses(path, summary):
  """Held-out loss against position (bucket midpoints), a line per model, the training length marked."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  figure, ax = plt.subplots(figsize=(6, 3.6))
  train_length = None
  for name in dict.fromkeys(r["model"] for r in summary["ppl"]):
    rows = [r for r in summary["ppl"] if r["model"] == name]
    ax.plot(
      [(int(r["first"]) + int(r["last"]) + 1) / 2 for r in rows],
      [float(r["loss"]) for r in rows],
      marker="o",
      markersize=3,
      label=name,
    )
    train_length = int(rows[0]["train_length"])
  if train_length:
    ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
  ax.set(xlabel="position (tokens)", ylabel="held-out loss (nats)", title="held-out loss by position")
  ax.legend(fontsize="small")
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def shrink_png(path):
  """Re-saves a plot with a 256-colour palette (lines and text change by at most a few levels; a third the bytes)."""
  from PIL import Image

  with Image.open(path) as image:
    image = image.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
  image.save(path, optimize=True)


def steps_table(summary):
  lines = ["| step | wall s | exit |", "|---|---|---|"]
  lines += [f"| {name} | {seconds} | {status} |" for name, seconds, status in summary["steps"]]
  return "\n".join(lines)


def _scalar(value):
  return not isinstance(value, (dict, list))


def _dumps(value, depth=0, width=118):
  """JSON with a row per line: containers of scalars stay on one line, short rows share lines up to `width`."""
  compact = json.dumps(value, ensure_ascii=False)
  flat = _scalar(value) or all(map(_scalar, value.values() if isinstance(value, dict) else value))
  if flat or len(compact) + depth <= width // 2:
    return compact
  pad = " " * (depth + 1)
  if isinstance(value, dict):
    body = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {_dumps(v, depth + 1, width)}" for k, v in value.items()]
    return "{\n" + ",\n".join(body) + "\n" + " " * depth + "}"
  items = [_dumps(v, depth + 1, width) for v in value]
  if all(isinstance(v, list) and all(map(_scalar, v)) for v in value) and max(map(len, items)) < 64:
    lines = [""]
    for item in items:  # pack short rows (loss curves) several to a line
      if lines[-1] and len(pad) + len(lines[-1]) + len(item) + 1 > width:
        lines.append("")
      lines[-1] += ("," if lines[-1] else "") + item
    items = lines
  return "[\n" + ",\n".join(pad + item for item in items) + "\n" + " " * depth + "]"


def write_summary(path, summary):
  """Writes `summary` (any further keys, such as a run's description, included), the CSV sections as columns and
  rows."""
  stored = dict(summary)
  for section in ROW_SECTIONS:
    rows = stored.get(section)
    if rows and isinstance(rows, list):
      columns = list(dict.fromkeys(key for row in rows for key in row))
      stored[section] = {"columns": columns, "rows": [[row.get(key) for key in columns] for row in rows]}
  Path(path).write_text(_dumps(stored) + "\n")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--runs", type=Path, default=Path("runs"), help="a runs directory or a run's summary JSON")
  optional_path = lambda text: Path(text) if text else None
  parser.add_argument("--plot", type=optional_path, default=Path("docs/results_ruler.png"), help="'' for none")
  parser.add_argument("--loss-plot", type=optional_path, default=Path("docs/results_loss.png"), help="'' for none")
  parser.add_argument("--summary", type=Path, help="also write the run's summary JSON here")
  args = parser.parse_args(argv)
  if args.summary and args.runs.is_file():
    parser.error("--summary writes the summary of a runs directory, not of a summary")
  summary = load(args.runs)
  if args.summary:
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.summary, summary)
  scores = ruler_rows(summary)
  copies, needles = copy_rows(summary), copy_rows(summary, "needles")
  print("## Training\n\n" + training_table(summary))
  print(
    "\n## Copy recall: points of greedy accuracy owed to retrieval (copy / control accuracy)\n\n"
    + (copy_table(copies) if copies else "(no copy-recall files)")
  )
  print(
    "\n## Needle copy recall: the copied span is random ids (copy / control accuracy)\n\n"
    + (copy_table(needles) if needles else "(no needle files)")
  )
  print("\n## RULER (score 0-100)\n\n" + (format_table(scores) if scores else "(no RULER scores)"))
  print("\n## Held-out loss by position\n\n" + position_table(summary))
  print("\n## Wall time per step\n\n" + steps_table(summary))
  panels = scores + [
    dict(model=r["model"], task=task, length=r["length"], score=100 * float(r["recall"]))
    for task, rows in (("copy recall (points)", copies), ("needle copy recall (points)", needles))
    for r in rows
  ]
  if panels and args.plot:
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(args.plot, panels)
    shrink_png(args.plot)
    print(f"\nwrote {args.plot}")
  if summary["ppl"] and args.loss_plot:
    args.loss_plot.parent.mkdir(parents=True, exist_ok=True)
    plot_losses(args.loss_plot, summary)
    shrink_png(args.loss_plot)
    print(f"wrote {args.loss_plot}")
  if args.summary:
    print(f"wrote {args.summary}")


if __name__ == "__main__":
  main()
