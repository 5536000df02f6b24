"""Collects what `scripts/repro.sh` wrote into the tables and plot of docs/results.md.

    python scripts/repro_results.py [--runs runs] [--plot docs/results_ruler.png] [--loss-plot docs/results_loss.png]

Reads `runs/repro_<model>/{eval.json,metrics.jsonl}` and `runs/repro_eval/{copy_*.csv, needles_*.csv,
ruler_*/scores.csv, ppl_*.csv, steps_*.tsv}`; prints markdown: training (steps, tokens, tokens/s, held-out loss at
1x), copy recall in its text and needle forms (model x length), RULER scores (model x task x length), loss by
position at the perplexity length, and the wall time of every step. Writes the accuracy-vs-length plot: one panel
per RULER task and one per copy-recall form (in points), a line per model.
"""

import argparse
import csv
import json
from pathlib import Path

from fsjax.eval.ruler import format_table, plot

MODELS = ("tfpp", "swa", "fs", "fsl", "fsb", "zha")


def read_csv(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def training_table(runs):
  lines = ["| model | steps | tokens | train tokens/s (median) | final train loss | held-out loss at 1x |",
           "|---|---|---|---|---|---|"]
  for model in MODELS:
    workdir = runs / f"repro_{model}"
    if not (workdir / "eval.json").exists():
      continue
    summary = json.loads((workdir / "eval.json").read_text())
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [m for m in metrics if "tokens_per_s" in m]
    speeds = sorted(m["tokens_per_s"] for m in metrics)
    lines.append(f"| {model} | {summary['steps']} | {summary['tokens_seen']:,} | "
                 f"{speeds[len(speeds) // 2]:,.0f} | {metrics[-1]['loss']:.3f} | "
                 f"{summary.get('heldout_loss', float('nan')):.3f} |")
  return "\n".join(lines)


def position_table(eval_dir):
  rows = [r for model in MODELS if (eval_dir / f"ppl_{model}.csv").exists()
          for r in read_csv(eval_dir / f"ppl_{model}.csv")]
  if not rows:
    return "(no perplexity files)"
  spans = sorted({(int(r["first"]), int(r["last"])) for r in rows})
  names = list(dict.fromkeys(r["model"] for r in rows))
  lines = ["| model | " + " | ".join(f"{a}-{b}" for a, b in spans) + " |", "|---|" + "---|" * len(spans)]
  for name in names:
    by_span = {(int(r["first"]), int(r["last"])): r for r in rows if r["model"] == name}
    lines.append(f"| {name} | " + " | ".join(f"{float(by_span[s]['loss']):.2f}" if s in by_span else "–"
                                            for s in spans) + " |")
    attended = [by_span[s]["attended"] for s in spans if s in by_span and by_span[s]["attended"]]
    if attended:
      lines.append(f"| {name} keys attended | " + " | ".join(f"{float(a):.1%}" for a in attended) + " |")
  return "\n".join(lines)


def copy_rows(eval_dir, prefix="copy"):
  """The rows of every `<prefix>_<model>.csv` (`copy`: text copies; `needles`: random-id needles)."""
  return [dict(r, length=int(r["length"])) for model in MODELS if (eval_dir / f"{prefix}_{model}.csv").exists()
          for r in read_csv(eval_dir / f"{prefix}_{model}.csv")]


def copy_table(rows):
  """Recall (copy minus control greedy accuracy, in points) per model and length, and the two accuracies."""
  lengths = sorted({r["length"] for r in rows})
  lines = ["| model | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
  for name in dict.fromkeys(r["model"] for r in rows):
    by_length = {r["length"]: r for r in rows if r["model"] == name}
    cell = lambda r: (f"**{100 * float(r['recall']):.1f}** ({100 * float(r['copy_accuracy']):.0f}/"
                      f"{100 * float(r['control_accuracy']):.0f})")
    lines.append(f"| {name} | " + " | ".join(cell(by_length[n]) if n in by_length else "–" for n in lengths) + " |")
  return "\n".join(lines)


def plot_losses(path, eval_dir):
  """Held-out loss against position (bucket midpoints), a line per model, the training length marked."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  figure, ax = plt.subplots(figsize=(6, 3.6))
  train_length = None
  for model in MODELS:
    if (eval_dir / f"ppl_{model}.csv").exists():
      rows = read_csv(eval_dir / f"ppl_{model}.csv")
      ax.plot([(int(r["first"]) + int(r["last"]) + 1) / 2 for r in rows], [float(r["loss"]) for r in rows],
              marker="o", markersize=3, label=rows[0]["model"])
      train_length = int(rows[0]["train_length"])
  if train_length:
    ax.axvline(train_length, color="gray", linestyle="--", linewidth=1)
  ax.set(xlabel="position (tokens)", ylabel="held-out loss (nats)", title="held-out loss by position")
  ax.legend(fontsize="small")
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)


def steps_table(eval_dir):
  lines = ["| step | wall s | exit |", "|---|---|---|"]
  for path in sorted(eval_dir.glob("steps_*.tsv")):
    for line in path.read_text().splitlines():
      name, seconds, status = line.split("\t")
      lines.append(f"| {name} | {seconds} | {status} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--runs", type=Path, default=Path("runs"))
  parser.add_argument("--plot", type=Path, default=Path("docs/results_ruler.png"))
  parser.add_argument("--loss-plot", type=Path, default=Path("docs/results_loss.png"))
  args = parser.parse_args(argv)
  eval_dir = args.runs / "repro_eval"
  scores = [dict(r, length=int(r["length"]), score=float(r["score"]))
            for path in sorted(eval_dir.glob("ruler_*/scores.csv")) for r in read_csv(path)]
  copies, needles = copy_rows(eval_dir), copy_rows(eval_dir, "needles")
  print("## Training\n\n" + training_table(args.runs))
  print("\n## Copy recall: points of greedy accuracy owed to retrieval (copy / control accuracy)\n\n"
        + (copy_table(copies) if copies else "(no copy-recall files)"))
  print("\n## Needle copy recall: the copied span is random ids (copy / control accuracy)\n\n"
        + (copy_table(needles) if needles else "(no needle files)"))
  print("\n## RULER (score 0-100)\n\n" + (format_table(scores) if scores else "(no RULER scores)"))
  print("\n## Held-out loss by position\n\n" + position_table(eval_dir))
  print("\n## Wall time per step\n\n" + steps_table(eval_dir))
  panels = scores + [dict(model=r["model"], task=task, length=r["length"], score=100 * float(r["recall"]))
                     for task, rows in (("copy recall (points)", copies), ("needle copy recall (points)", needles))
                     for r in rows]
  if panels:
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(args.plot, panels)
    print(f"\nwrote {args.plot}")
  if any(eval_dir.glob("ppl_*.csv")):
    args.loss_plot.parent.mkdir(parents=True, exist_ok=True)
    plot_losses(args.loss_plot, eval_dir)
    print(f"wrote {args.loss_plot}")


if __name__ == "__main__":
  main()
