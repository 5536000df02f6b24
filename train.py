"""Train a model from a config: `python train.py --config configs/NAME.yaml [--set key.sub=value ...]`.

Re-running with the same --workdir resumes from its latest checkpoint (params, optimizer, data position). SIGTERM
(a preemption notice, `timeout`) to any process ends the run after the step in flight, saved, with exit status 143.
At the end the held-out loss and perplexity, and with `eval.niah_samples` RULER's S-NIAH-1 at 1x and 4x the
training length, are printed and written to `<workdir>/eval.json`.
"""

import os
import signal
import sys

from fsjax import cli
from fsjax.config import ConfigError, load_config
from fsjax.data.pipeline import DataError
from fsjax.eval.runner import niah_scores
from fsjax.train import sharding
from fsjax.train.checkpoint import CheckpointError
from fsjax.train.loop import TrainingInterrupted, TrainingStopped, train


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
  cli.add_set_argument(parser, "override config fields, e.g. --set train.steps=100 mesh.data=4 (or --set repeated)")
  parser.add_argument(
    "--workdir", help="checkpoints, metrics.jsonl and eval.json go here (default: runs/<config name>)"
  )
  parser.add_argument(
    "--allow-config-change",
    action="store_true",
    help="resume a workdir whose checkpoint was trained with other model, data or optimizer settings "
    "(refused by default; the change is recorded in <workdir>/config_changes.jsonl)",
  )
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    config = load_config(args.config, args.set)
    workdir = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
    for line in config.warnings():
      print(f"warning: {line}", file=sys.stderr)
    try:
      train(config, workdir, final_evals=(niah_scores,), allow_config_change=args.allow_config_change)
    except TrainingInterrupted as e:
      print(e, file=sys.stderr)
      return 128 + signal.SIGTERM  # the shell's status for a process ended by SIGTERM
    except TrainingStopped as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  except (ConfigError, CheckpointError, DataError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except Exception as e:
    sharding.exit_after_error(e)  # a multi-process run's process ends here; the others stop at their next step
    raise
  return 0


if __name__ == "__main__":
  sys.exit(main())
