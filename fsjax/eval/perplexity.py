"""Held-out loss by position: where, along a sequence longer than the training context, the loss rises.

    python -m fsjax.eval.perplexity --checkpoint runs/tiny_fs [more ...] --length 1024 [--buckets 8]
        [--batches 4 --batch-size 2] [--data PATH] [--out runs/perplexity.csv] [--set KEY=VALUE ...]

Sequences of `--length` tokens are packed from held-out books (default: the packaged held-out split), run
through the full forward pass, and the next-token loss is averaged per position over all sequences, then over
`--buckets` equal spans of positions. Prints loss and perplexity per bucket and model; writes a CSV. For ZHA
models the table also gives the mean fraction of visible keys the queries of each bucket attended.
"""

import csv
import math
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from fsjax import cli
from fsjax.config import ConfigError, ModelConfig, override_model
from fsjax.data.pipeline import default_corpus_path, make_eval_batches
from fsjax.loading import load_model
from fsjax.train.checkpoint import CheckpointError


def position_losses(model, variables, batches):
  """Mean next-token NLL at each position over every row of `batches` (int arrays `[B, T + 1]`).

  Returns:
    (`[T]` float64 losses, `[T]` float64 attended fractions or None): the second is the mean over rows, layers
    and heads of the fraction of visible keys a query attended, for models that sow `attended_fraction` (ZHA).
  """

  @jax.jit
  def nll(tokens):
    logits, state = model.apply(variables, tokens[:, :-1], mutable=["intermediates"])
    fractions = [
      leaf
      for path, leaf in jax.tree_util.tree_leaves_with_path(state)
      if "attended_fraction" in jax.tree_util.keystr(path)
    ]
    # Each is [batch, seq, heads], with a leading layer axis under scanned layers: keep only the positions.
    fraction = (
      (
        sum(f.astype(np.float32).mean(axis=tuple(a for a in range(f.ndim) if a != f.ndim - 2)) for f in fractions)
        / len(fractions)
      )
      if fractions
      else None
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum(axis=0), fraction

  total, attended = 0.0, 0.0
  for tokens in batches:
    loss, fraction = nll(tokens)
    total = total + np.asarray(loss, np.float64)
    attended = None if fraction is None else attended + np.asarray(fraction, np.float64)
  rows = sum(tokens.shape[0] for tokens in batches)
  return total / rows, None if attended is None else attended / len(batches)


def buckets(values, count):
  """`count` equal spans of positions: list of (first, last, mean of `values` there)."""
  edges = np.linspace(0, len(values), count + 1).round().astype(int)
  return [(int(a), int(b) - 1, float(values[a:b].mean())) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", nargs="+", required=True, help="training workdirs or step directories")
  parser.add_argument("--length", type=int, required=True, help="tokens per sequence")
  parser.add_argument("--buckets", type=int, default=8, help="position buckets the loss is reported in")
  parser.add_argument("--batches", type=int, default=4, help="held-out batches")
  parser.add_argument("--batch-size", type=int, default=2, help="sequences per batch")
  parser.add_argument("--data", default=None, help="held-out jsonl/txt file or directory (default: packaged)")
  parser.add_argument("--out", default=None, help="CSV path (default: none)")
  cli.add_set_argument(parser, "override a model config field of every checkpoint, e.g. --set attention.kind=fsb")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    if min(args.length, args.buckets, args.batches, args.batch_size) < 1 or args.buckets > args.length:
      raise ConfigError("--length, --buckets, --batches and --batch-size must be >= 1, --buckets <= --length")
    for assignment in args.set:
      override_model(ModelConfig(), [assignment])
    rows = []
    for path in args.checkpoint:
      loaded = load_model(path, args.set)
      batches = make_eval_batches(
        path=args.data or default_corpus_path("valid"),
        tokenizer_path=loaded.tokenizer_path,
        seq_len=args.length,
        batch_size=args.batch_size,
        max_batches=args.batches,
      )
      if not batches:
        raise ConfigError(f"--data holds fewer than {args.batch_size} sequences of {args.length} tokens")
      with cli.stage(f"{loaded.name}: loss by position at {args.length} tokens, {len(batches)} batches"):
        losses, attended = position_losses(loaded.model, loaded.variables, batches)
      attended = [None] * args.buckets if attended is None else [f for _, _, f in buckets(attended, args.buckets)]
      rows += [
        dict(
          model=loaded.name,
          train_length=loaded.config.data.seq_len,
          first=a,
          last=b,
          loss=loss,
          perplexity=math.exp(min(loss, 50.0)),
          attended=fraction,
        )
        for (a, b, loss), fraction in zip(buckets(losses, args.buckets), attended)
      ]
  except (ConfigError, CheckpointError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("| model | trained at | positions | loss | perplexity | keys attended |\n|---|---|---|---|---|---|")
  for r in rows:
    attended = "–" if r["attended"] is None else f"{r['attended']:.1%}"
    print(
      f"| {r['model']} | {r['train_length']} | {r['first']}-{r['last']} | {r['loss']:.3f} | "
      f"{r['perplexity']:.1f} | {attended} |"
    )
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
      writer = csv.DictWriter(f, fieldnames=list(rows[0]))
      writer.writeheader()
      writer.writerows(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
