"""FS-B's τ per layer and key/value head (FS Eq. 10): the median cell norm `a_c` over held-out windows, computed
once per checkpoint and reused at every length.

    python -m fsjax.calibrate --checkpoint runs/fs_743m [--batches 8] [--batch-size 8] [--length 4096]
        [--data FILE]

Writes `<workdir>/calibration.json` ({"step", "length", "windows", "tau": [layers][kv_heads]}), JSON like every
other artifact (no pickle). Loading a checkpoint as an FS-B model (`--set attention.kind=fsb` in the RULER and
generation CLIs) reads it through `fsjax.loading.load_model`, which refuses a file computed for another step.
`fsjax.loading.with_tau(model_config, variables, calibrate(...))` installs a τ computed in the same process.

The paper calibrates on FineWeb-Edu windows; we default to the packaged held-out books (`--data` takes any text
the training pipeline reads), and for a checkpoint trained on associative recall to test-stream rows of its task
(`fsjax.data.associative`). The norms come from the checkpoint's own forward pass (FS or FS-L): FS-B's forward
needs τ itself, and the first layer's keys do not depend on the variant at all.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from fsjax import cli
from fsjax.config import FREESOLO_KINDS, ConfigError
from fsjax.data.associative import held_out_batches, held_out_task
from fsjax.data.pipeline import DataError, default_corpus_path, make_eval_batches
from fsjax.loading import attention_entries, calibration_path, load_model
from fsjax.train.checkpoint import CheckpointError


def cell_norms(model, variables, tokens):
  """Every layer's cell max key norms for a batch: `[layers, batch·M, kv_heads]` (sown by FreeSoloAttention)."""
  _, state = model.apply(variables, tokens, mutable=["intermediates"])
  norms = [entry["cell_norms"][0] for entry in attention_entries(state["intermediates"], model.config)]
  stacked = norms[0] if model.config.scan_layers else jnp.stack(norms)  # [layers, batch, M, kv_heads]
  return stacked.reshape(stacked.shape[0], -1, stacked.shape[-1])


def calibrate(model, variables, batches):
  """τ `[layers, kv_heads]` (it thresholds a key/value head's cell norms): the median over all cells of all
  batches (tokens `[B, T]` each)."""
  apply = jax.jit(lambda tokens: cell_norms(model, variables, tokens))
  norms = np.concatenate([np.asarray(apply(jnp.asarray(tokens))) for tokens in batches], axis=1)
  return np.median(norms, axis=1)


def recall_windows(config, length, batch_size, batches):
  """Test-stream rows of the associative-recall task a checkpoint trained on (`data.associative`), `length`
  tokens each; text filler from the held-out books."""
  config.data.associative.check_length(length, "--length + 1")
  task = held_out_task(config.data.associative, length, config.data.tokenizer)
  return held_out_batches(task=task, length=length, batch_size=batch_size, batches=batches, seed=config.train.seed)


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", required=True, help="training workdir or step directory (FS or FS-L)")
  parser.add_argument("--batches", type=int, default=8, help="held-out batches whose cell norms set τ")
  parser.add_argument("--batch-size", type=int, default=8, help="windows per batch")
  parser.add_argument("--length", type=int, default=4096, help="window length in tokens")
  parser.add_argument("--data", default=None, help="held-out text (default: the packaged held-out books)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    if min(args.batches, args.batch_size, args.length) < 1:
      raise ConfigError("--batches, --batch-size and --length must be >= 1")
    loaded = load_model(args.checkpoint)
    config = loaded.config
    if config.model.attention.kind not in FREESOLO_KINDS:
      raise ConfigError(
        f"τ calibration needs a FreeSolo checkpoint, got attention kind {config.model.attention.kind!r}"
      )
    if args.length < config.model.attention.cell:
      raise ConfigError(f"--length ({args.length}) must hold at least one cell ({config.model.attention.cell})")
    if config.data.source == "associative" and args.data is None:  # τ from the task the model learned
      batches = [b["tokens"] for b in recall_windows(config, args.length + 1, args.batch_size, args.batches)]
    else:
      batches = make_eval_batches(
        path=args.data or default_corpus_path("valid"),
        tokenizer_path=loaded.tokenizer_path,  # refuses a tokenizer the model's embedding cannot read
        seq_len=args.length,
        batch_size=args.batch_size,
        max_batches=args.batches,
      )
    if not batches:
      raise ConfigError(f"the held-out text holds no full batch of {args.batch_size} x {args.length} tokens")
    tau = calibrate(loaded.model, loaded.variables, [b[:, :-1] for b in batches])
    path, step = calibration_path(args.checkpoint)
  except (ConfigError, CheckpointError, DataError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  with open(path + ".tmp", "w") as f:
    json.dump(dict(step=step, length=args.length, windows=len(batches) * args.batch_size, tau=tau.tolist()), f)
  os.replace(path + ".tmp", path)  # atomic: a reader never sees half a file
  print(f"τ for {tau.shape[0]} layers x {tau.shape[1]} heads (median {np.median(tau):.4g}) -> {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
