"""Progress line, `metrics.jsonl` in the workdir, and TensorBoard summaries when tensorboardX is installed."""

import json
import os
import sys


class MetricsLog:
  """Appends one JSON object per logged step to `<workdir>/metrics.jsonl` and prints a progress line. With
  `write=False` (every process of a multi-process run but the first) it only prints."""

  def __init__(self, workdir, total_steps, write=True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.total_steps = total_steps
    self.write_files = write
    self.tensorboard = _tensorboard_writer(os.path.join(workdir, "tensorboard")) if write else None

  def truncate_after(self, step):
    """Drops entries past `step` (all of them for 0: a run that starts over), so after a restart the file
    describes the trajectory actually kept. A line torn by a kill mid-write is dropped too. Rewritten atomically."""
    if not self.write_files or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      kept = [line for line in f if (record := _parse(line)) is not None and record["step"] <= step]
    with open(self.path + ".tmp", "w") as f:
      f.writelines(kept)
    os.replace(self.path + ".tmp", self.path)

  def write(self, step, metrics):
    record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
    if self.write_files:
      with open(self.path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if self.tensorboard is not None:
      for name, value in metrics.items():
        self.tensorboard.add_scalar(name, float(value), step)
    print(
      f"step {step:>6}/{self.total_steps} | loss {record['loss']:.4f} | lr {record['learning_rate']:.2e} | "
      f"{record['tokens_per_s']:,.0f} tok/s | skipped {int(record['skipped'])}",
      flush=True,
    )


def _parse(line):
  """A metrics line as a dict, or None for a torn line (no newline, or not JSON)."""
  if not line.endswith("\n"):
    return None
  try:
    return json.loads(line)
  except json.JSONDecodeError:
    return None


def _tensorboard_writer(logdir):
  try:
    from tensorboardX import SummaryWriter  # optional: summaries only where a writer is installed
  except ImportError:
    return None
  return SummaryWriter(logdir)


def print_table(rows, file=None):
  """Prints a list of dicts with the same keys as a Markdown table to `file` (default: the current stdout)."""
  file = file or sys.stdout
  keys = list(rows[0])
  cells = [[_format(row[k]) for k in keys] for row in rows]
  widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
  line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"
  print(line(keys), file=file)
  print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=file)
  for c in cells:
    print(line(c), file=file)


def _format(value):
  if isinstance(value, float):
    return f"{value:.4g}"
  if isinstance(value, int):
    return f"{value:,}"
  return str(value)
