"""Held-out loss by position: where, along a sequence longer than the training context, the loss rises.

    python -m fsjax.eval.perplexity --checkpoint runs/tiny_fs [more ...] --length 1024 [--buckets 8]
        [--batches 4 --batch-size 2] [--data PATH] [--out runs/perplexity.csv]

Sequences of `--length` tokens are packed from held-out books (default: the packaged held-out split), run
through the full forward pass, and the next-token loss is averaged per position over all sequences, then over
`--buckets` equal spans of positions. Prints loss and perplexity per bucket and model; writes a CSV.
"""

import argparse
import csv
import math
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from fsjax.config import ConfigError
from fsjax.train.checkpoint import CheckpointError


def position_losses(model, variables, batches):
  """Mean next-token NLL at each position over every row of `batches` (int arrays `[B, T + 1]`).

  Returns:
    `[T]` float64.
  """
  @jax.jit
  def nll(tokens):
    logits = model.apply(variables, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum(axis=0)

  total, rows = 0.0, 0
  for tokens in batches:
    total, rows = total + np.asarray(nll(tokens), np.float64), rows + tokens.shape[0]
  return total / rows


def buckets(losses, count):
  """`count` equal spans of positions: list of (first, last, mean loss)."""
  edges = np.linspace(0, len(losses), count + 1).round().astype(int)
  return [(int(a), int(b) - 1, float(losses[a:b].mean())) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--checkpoint", nargs="+", required=True, help="training workdirs or step directories")
  parser.add_argument("--length", type=int, required=True, help="tokens per sequence")
  parser.add_argument("--buckets", type=int, default=8)
  parser.add_argument("--batches", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=2)
  parser.add_argument("--data", default=None, help="held-out jsonl/txt file or directory (default: packaged)")
  parser.add_argument("--out", default=None, help="CSV path (default: none)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    if min(args.length, args.buckets, args.batches, args.batch_size) < 1 or args.buckets > args.length:
      raise ConfigError("--length, --buckets, --batches and --batch-size must be >= 1, --buckets <= --length")
    from fsjax.data.pipeline import default_corpus_path, make_eval_batches
    from fsjax.model import Transformer
    from fsjax.train import checkpoint
    rows = []
    for path in args.checkpoint:
      config, params, frozen, step = checkpoint.load(path)
      batches = make_eval_batches(path=args.data or default_corpus_path("valid"), tokenizer_path=config.data.tokenizer,
                                  seq_len=args.length, batch_size=args.batch_size, max_batches=args.batches)
      if not batches:
        raise ConfigError(f"--data holds fewer than {args.batch_size} sequences of {args.length} tokens")
      losses = position_losses(Transformer(config.model), {"params": params, **frozen}, batches)
      name = f"{Path(path).name}@{step}"
      rows += [dict(model=name, train_length=config.data.seq_len, first=a, last=b, loss=loss,
                    perplexity=math.exp(min(loss, 50.0))) for a, b, loss in buckets(losses, args.buckets)]
  except (ConfigError, CheckpointError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("| model | trained at | positions | loss | perplexity |\n|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['model']} | {r['train_length']} | {r['first']}-{r['last']} | {r['loss']:.3f} | {r['perplexity']:.1f} |")
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
