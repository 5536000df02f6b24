"""Long-range copy recall by distance: does a model copy a span it read far back? A generic retrieval probe.

    python -m fsjax.eval.copy_recall --checkpoint runs/repro_fs [more ...] --lengths 1024,4096,16384
        [--samples 50] [--span 24] [--cue 4] [--batch-size 2] [--random-ids 3,2051 | --needle-ids 3,32000]
        [--set KEY=VALUE ...] [--out copy_recall.csv]

RULER's NIAH needs a model that follows its question format; a small model can retrieve long before it can do
that. This probe asks only for retrieval, in the form the copy curriculum (`fsjax.data.copies`) trains, on
held-out text, with no template. A sample is `length` tokens of held-out books (the packaged valid split; window
starts drawn with `--seed`) whose last `span` tokens are replaced by a copy of the `span` tokens at a source
position in the first 128, so the copy's source lies `length - span - source` tokens back. One full forward pass
reads the sequence; the copy's tokens after its first `cue` (which only tell which span is being copied) are
scored: greedy accuracy (the argmax is the copied token) and mean loss. In the *control* twin of every sample
the source span is replaced by other held-out text, so nothing earlier predicts the copy; its accuracy is what
local context alone gives. `recall = accuracy(copy) - accuracy(control)` is the part owed to retrieval.

`--random-ids MIN,MAX` draws the samples from uniformly random ids in `[MIN, MAX)` instead of text: the form of a
random-row copying warm-up (`data.source: random`), at any distance. There the control's accuracy is chance, so
recall is all retrieval.

`--needle-ids MIN,MAX` keeps the held-out text but plants random ids in `[MIN, MAX)` as the source span (and so as
the copy), and other random ids at the control's source: a needle that stands out of its haystack, as RULER's
do. The arbitrary text span of the default form gives a model no reason to mark it before the copy begins, so a
query-independent retention rule (FS-L's key norm, FS Eq. 8) favors it only as it favors any span like it; a
needle it can single out.

Prints a table (model x length: recall, copy and control accuracy); writes a CSV (its `source` column: text,
random ids or needle ids).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsjax import cli
from fsjax.config import ConfigError, ModelConfig, override_model
from fsjax.data.pipeline import default_corpus_path, read_documents
from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.eval.records import write_csv
from fsjax.loading import load_model
from fsjax.train.checkpoint import CheckpointError

SOURCE_RANGE = 128  # copy sources start in the first SOURCE_RANGE tokens of a sample


def heldout_stream(path, tokenizer_path):
  """The held-out documents at `path` tokenized and joined by EOS: int32 `[n]`."""
  tokenizer = load_tokenizer(tokenizer_path)
  encoded = tokenizer.encode_batch(list(read_documents(path)))
  eos = eos_id(tokenizer)
  return np.concatenate([np.append(np.asarray(e.ids, np.int32), np.int32(eos)) for e in encoded])


def random_stream(ids, length, seed):
  """Uniform random ids in `[ids[0], ids[1])`, int32 `[4 · length]`: a stream `make_samples` draws windows from."""
  return np.random.default_rng([seed, length]).integers(ids[0], ids[1], 4 * length, dtype=np.int32)


def make_samples(stream, length, count, span, seed, needle_ids=None):
  """`count` copy samples of `length` tokens and their controls.

  Args:
    needle_ids: None, or `(MIN, MAX)`: the source span is planted as random ids in `[MIN, MAX)`, and the
      control's source as other random ids. The windows and source positions are those drawn without it.

  Returns:
    (copies, controls, sources): int32 `[count, length]` twice (equal except over each copy's source span) and
    the source positions `[count]`. In both, tokens `length - span:` equal `copies[i, s:s + span]`.
  """
  if length < SOURCE_RANGE + 2 * span:
    raise ValueError(f"length {length} must be >= {SOURCE_RANGE + 2 * span} (source range + source + copy)")
  if stream.size < length + span:
    raise ValueError(f"the held-out text has {stream.size} tokens, fewer than length + span = {length + span}")
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, stream.size - length + 1, count)
  sources = rng.integers(0, SOURCE_RANGE, count)
  fillers = rng.integers(0, stream.size - span + 1, count)
  copies = np.stack([stream[a : a + length] for a in starts])
  if needle_ids is None:
    replacements = np.stack([stream[f : f + span] for f in fillers])
  else:
    needles, replacements = rng.integers(*needle_ids, (2, count, span), dtype=np.int32)
    for row, s in enumerate(sources):
      copies[row, s : s + span] = needles[row]
  for row, s in enumerate(sources):
    copies[row, length - span :] = copies[row, s : s + span]
  controls = copies.copy()
  for row, s in enumerate(sources):
    controls[row, s : s + span] = replacements[row]
  return copies, controls, sources


def score_copies(model, variables, tokens, span, cue, batch_size):
  """Greedy hits and losses on the copied tokens after the cue.

  Args:
    tokens: int `[n, length]`, each ending in a `span`-token copy.

  Returns:
    (hits bool `[n, span - cue]`, losses float64 `[n, span - cue]`).
  """
  length = tokens.shape[1]
  first = length - span + cue  # first scored target; predicted at position first - 1

  @jax.jit
  def score(batch):
    logits = model.apply(variables, batch)[:, first - 1 : length - 1].astype(jnp.float32)
    targets = batch[:, first:]
    return jnp.argmax(logits, -1) == targets, optax.softmax_cross_entropy_with_integer_labels(logits, targets)

  hits, losses = [], []
  for start in range(0, tokens.shape[0], batch_size):
    batch = tokens[start : start + batch_size]
    padded = np.concatenate([batch, np.repeat(batch[:1], batch_size - batch.shape[0], 0)])  # one compile
    hit, loss = score(jnp.asarray(padded))
    hits.append(np.asarray(hit)[: batch.shape[0]])
    losses.append(np.asarray(loss, np.float64)[: batch.shape[0]])
  return np.concatenate(hits), np.concatenate(losses)


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", nargs="+", required=True, help="training workdirs or step directories")
  parser.add_argument(
    "--lengths", required=True, type=lambda s: [int(n) for n in s.split(",") if n], help="comma-separated tokens"
  )
  parser.add_argument("--samples", type=int, default=50, help="sequences per length")
  parser.add_argument("--span", type=int, default=24, help="tokens per copy")
  parser.add_argument("--cue", type=int, default=4, help="leading copy tokens left unscored")
  parser.add_argument("--batch-size", type=int, default=2, help="sequences per forward pass")
  parser.add_argument("--seed", type=int, default=0, help="seed of the copy positions and ids")
  parser.add_argument("--data", default=None, help="held-out jsonl/txt file or directory (default: packaged)")
  parser.add_argument(
    "--random-ids",
    default=None,
    type=id_range,
    help="MIN,MAX: samples of random ids in [MIN, MAX) instead of held-out text",
  )
  parser.add_argument(
    "--needle-ids",
    default=None,
    type=id_range,
    help="MIN,MAX: held-out text whose copied span is random ids in [MIN, MAX) (a needle)",
  )
  parser.add_argument("--out", default=None, help="CSV path, rewritten after every length (default: none)")
  cli.add_set_argument(parser, "override a model config field of every checkpoint, e.g. --set attention.kind=fsb")
  return parser.parse_args(argv)


def id_range(text):
  return tuple(int(n) for n in text.split(","))


def check_id_range(flag, ids, vocab_size=None):
  """A `MIN,MAX` id range: `0 <= MIN < MAX`, and `MAX <= vocab_size` when given."""
  if ids is None:
    return
  if len(ids) != 2 or not 0 <= ids[0] < ids[1]:
    raise ConfigError(f"{flag} must be MIN,MAX with 0 <= MIN < MAX, got {ids}")
  if vocab_size is not None and ids[1] > vocab_size:
    raise ConfigError(f"{flag} must lie below the model's vocab_size={vocab_size}, got {ids}")


def check_sample_source(random_ids, needle_ids, data, vocab_size=None):
  """The rules of `--random-ids`, `--needle-ids` and `--data`, shared by this CLI and the probe's `--copies`."""
  check_id_range("--random-ids", random_ids, vocab_size)
  check_id_range("--needle-ids", needle_ids, vocab_size)
  if random_ids is not None and data is not None:
    raise ConfigError("--random-ids and --data both name the samples' source: give one")
  if random_ids is not None and needle_ids is not None:
    raise ConfigError(
      "--needle-ids plants random ids in held-out text; with --random-ids the whole sample is "
      "random and no needle stands out: give one"
    )


def check_args(args):
  """One clear error per bad argument, before any model is loaded."""
  if min(args.samples, args.batch_size, args.cue) < 1 or not args.lengths:
    raise ConfigError("--samples, --batch-size and --cue must be >= 1 and --lengths must name a length")
  if args.span <= args.cue:
    raise ConfigError(f"--span must be > --cue, got span={args.span}, cue={args.cue}")
  for length in args.lengths:
    if length < SOURCE_RANGE + 2 * args.span:
      raise ConfigError(f"--lengths: {length} is below {SOURCE_RANGE + 2 * args.span} (source range + 2 spans)")
  check_sample_source(args.random_ids, args.needle_ids, args.data)
  for assignment in args.set:
    override_model(ModelConfig(), [assignment])


def main(argv=None):
  args = parse_args(argv)
  try:
    check_args(args)
    rows, streams = [], {}
    source = "random ids" if args.random_ids else "needle ids" if args.needle_ids else "text"
    for path in args.checkpoint:
      loaded = load_model(path, args.set)
      check_sample_source(args.random_ids, args.needle_ids, args.data, loaded.config.model.vocab_size)
      key = loaded.tokenizer_path
      if args.random_ids is None and key not in streams:
        streams[key] = heldout_stream(args.data or default_corpus_path("valid"), key)
      for length in args.lengths:
        stream = streams[key] if args.random_ids is None else random_stream(args.random_ids, length, args.seed)
        copies, controls, sources = make_samples(stream, length, args.samples, args.span, args.seed, args.needle_ids)
        # Copies and controls in one call: `score_copies` compiles once per call and length.
        with cli.stage(f"{loaded.name}: {args.samples} copies and controls at {length} tokens"):
          hits, losses = score_copies(
            loaded.model, loaded.variables, np.concatenate([copies, controls]), args.span, args.cue, args.batch_size
          )
        (copy_hits, control_hits), copy_losses = np.split(hits, 2), losses[: args.samples]
        rows.append(
          dict(
            model=loaded.name,
            source=source,
            train_length=loaded.config.data.seq_len,
            length=length,
            samples=args.samples,
            distance=int(np.mean(length - args.span - sources)),
            recall=float(copy_hits.mean() - control_hits.mean()),
            copy_accuracy=float(copy_hits.mean()),
            control_accuracy=float(control_hits.mean()),
            copy_loss=float(copy_losses.mean()),
          )
        )
        print(rows[-1], file=sys.stderr, flush=True)
        if args.out:
          write_csv(Path(args.out), rows)
  except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("| model | length | mean distance | recall | copy accuracy | control accuracy | copy loss |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['model']} | {r['length']} | {r['distance']} | {r['recall']:.3f} | {r['copy_accuracy']:.3f} | "
      f"{r['control_accuracy']:.3f} | {r['copy_loss']:.3f} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
