"""Associative recall against length: does a model trained on multi-query associative recall at one length
still answer at 1× to 64× it?

    python -m fsjax.eval.recall --checkpoint runs/recall_fs [more ...] --lengths 512,2048,8192,32768
        [--samples 64] [--batch-size 8] [--pairs N] [--distance MIN,MAX] [--seed 0] [--set KEY=VALUE ...]
        [--out recall]

Each sample is a row of the *test* stream of `fsjax.data.associative` (its generator never shares a seed with
the training stream's) built from the checkpoint's own `data.associative` task at the evaluated length: the same
key, value and filler ranges, query placement and pair count (`--pairs` and `--distance` override them; text
filler comes from the held-out corpus). A row is read through `fsjax.decode.prefill` into a fresh decode cache,
the path generation runs (FS-L with its bounded cache, FS-B with its forest cache, ZHA with its tree), keeping
the logits at the query keys only. A query is answered when the argmax over the whole vocabulary at its key is
its value. Reading: the queries' answers are in the row (teacher forcing, as Zoology scores MQAR in one forward
pass), so a query sees the earlier answers; every answer is one token, which a decode step would emit from the
same logits (prefill equals the masked forward and one-token decode for every kind: tests/test_decode.py). Only a
key's first ask is scored: where query keys are sampled with replacement, a repeated ask finds its answer at the
earlier ask, a few tokens back, which says nothing about reaching the pair.

Prints a table (model × length: accuracy, the share of queries answered with some value of their row, and
chance = 1 / values); writes PREFIX.csv (a row per model, length and distance bucket, plus an "all" bucket) and
PREFIX.png (accuracy against length) with `--out`. Distance buckets are powers of two of the tokens from a
pair's key to its query's key. A model that has learned to copy a value but not which one answers nearly every
query from its row and about 1/pairs of them right: the in-row share tells that apart from one that does not
recall at all.

`--probe` (FS, FS-L, FS-B, ZHA; queries at the end) explains the outcome: per layer, how often the cell holding a
query's value is among the cells the query selects, and for FS-L how often it is in the bounded cache's
`pool ∪ recent` when the queries begin, against the rate a random set of as many cells would reach; for ZHA the
fraction of its visible keys a query reads and how often its value is among them (`probe_rows`). Checkpoints of
other kinds are evaluated without a probe.
"""

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fsjax import cli
from fsjax.cache import init_cache
from fsjax.config import ConfigError, ModelConfig, override_model
from fsjax.data.associative import TEST, held_out_task, recall_row
from fsjax.decode import extend, prefill, sown_by_layer
from fsjax.eval.records import write_csv
from fsjax.loading import load_model
from fsjax.memory import DeviceMemoryError
from fsjax.reference import zha as zha_ref
from fsjax.reference.common import compute_dtype
from fsjax.train.checkpoint import CheckpointError

PROBED_KINDS = ("fs", "fsl", "fsb", "zha")  # kinds whose routing `probe_rows` records


def recall_rows(task, length, samples, seed):
  """`samples` test-stream rows of `length` tokens (`recall_row` with `task`): a list of `RecallRow`."""
  return [recall_row(i, seed=seed, stream=TEST, length=length, **task) for i in range(samples)]


def predict_answers(model, variables, rows, batch_size):
  """The model's answer to each query of each row: the argmax over the vocabulary at the query key, int
  `[samples, pairs]`.

  Rows go `batch_size` at a time through `prefill` into a fresh cache of their length, logits at the query
  keys only."""
  answers = []
  for start in range(0, len(rows), batch_size):
    batch = rows[start : start + batch_size]
    tokens = np.stack([r.tokens for r in batch])
    queries = np.stack([r.query_positions for r in batch]).astype(np.int32)
    cache = init_cache(model.config, len(batch), tokens.shape[1], dtype=jnp.dtype(model.config.dtype))
    logits, _ = prefill(
      model, variables, tokens, np.full(len(batch), tokens.shape[1], np.int32), cache, logits_at=queries
    )
    answers.append(np.asarray(jnp.argmax(logits, axis=-1)))
  return np.concatenate(answers)


def probe_rows(model, variables, rows, chunk=512):
  """Where a FreeSolo or ZHA model's routing looks when it answers (rows of one length, queries at the end).

  The rows run through the cache path chunk by chunk (the bounded cache for FS-L, the forest cache for FS-B, the
  tree for ZHA), recording what every layer and head selects (ZHA: reads) at each query key. The context is cut
  at the start of the first query's block, where FS-L's pool and recent cells are those every query scores
  (Eq. 8, 15).

  Returns a dict: `selected` `[layers]`, how often the cell holding a query's value (the token to read) is among
  the query's selected cells, over queries and heads; for FS-L also `retained` `[layers]`, how often that cell is
  in `pool ∪ recent`, and `random_pool`, the rate a random set of as many eligible cells would reach. For ZHA,
  instead, `keys_read` `[layers]`: the mean fraction of its visible keys a query key attends, and `value_read`
  `[layers]`: how often the query's value is among the keys it attends (in a leaf its descent reached, in its own
  chunk, or key 0), over queries and heads. Rates about a query's value count each key's first ask only, as the
  accuracy does (`score_rows`); `keys_read`, a cost, counts every query.
  """
  config, att = model.config, model.config.attention
  if att.kind not in PROBED_KINDS:
    raise ConfigError(f"the routing probe needs an FS, FS-L, FS-B or ZHA model, got attention kind {att.kind!r}")
  tokens = np.stack([r.tokens for r in rows]) if len({r.tokens.size for r in rows}) == 1 else None
  count = rows[0].query_positions.size
  at_end = lambda r: np.array_equal(np.sort(r.query_positions), r.tokens.size - 2 * count + 2 * np.arange(count))
  if tokens is None or not all(at_end(r) for r in rows):
    raise ConfigError("the routing probe needs rows of one length with their queries at the end")
  batch, length = tokens.shape
  split = (length - 2 * count) // att.block * att.block
  chunk = max(att.block, min(chunk, length) // att.block * att.block)
  bounds = [*range(0, split, chunk), split, *range(split, length, chunk), length]
  bounds = sorted(set(bounds))
  padded = -(-length // att.block) * att.block
  cache = init_cache(config, batch, padded, dtype=jnp.dtype(config.dtype))
  ids = np.pad(tokens, ((0, 0), (0, padded - length)))
  values_at = jnp.asarray(np.stack([r.pair_positions + 1 for r in rows]), jnp.int32)  # [batch, Q]
  selections, retained, values_read = [], None, []
  for start, end in zip(bounds[:-1], bounds[1:]):
    if start == split and att.kind == "fsl":
      retained = _retained_cells(cache, config)  # [layers, batch, heads, P + W]
    size = -(-(end - start) // att.block) * att.block
    positions = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (batch, size))
    chunk_ids = jnp.asarray(ids[:, start : start + size])
    if att.kind == "zha" and start >= split:  # the queries' chunks: also which keys they read
      cache, intermediates, read = _zha_extend_reading(
        model, variables, chunk_ids, cache, positions, positions < end, values_at
      )
      values_read.append(np.asarray(read)[:, : end - start])
    else:
      _, cache, intermediates = extend(model, variables, chunk_ids, cache, positions, positions < end)
    sown = "attended_fraction" if att.kind == "zha" else "selected_cells"
    selections.append(np.asarray(sown_by_layer(intermediates, config, sown))[:, : end - start])
  selections = np.concatenate(selections, axis=1)  # [batch, length, layers, heads(, K)]
  queries = np.stack([r.query_positions for r in rows])  # [batch, Q]
  first = np.stack([r.first_asks for r in rows])  # [batch, Q]
  if att.kind == "zha":
    read = np.take_along_axis(selections, queries[:, :, None, None], axis=1)  # [batch, Q, layers, heads]
    own = np.take_along_axis(np.concatenate(values_read, axis=1), (queries - split)[:, :, None, None, None], axis=1)
    own = own[:, np.arange(count), :, :, np.arange(count)]  # query i's own value: [Q, batch, layers, heads]
    return dict(
      kind=att.kind,
      length=int(length),
      keys_read=read.mean(axis=(0, 1, 3)).round(4).tolist(),
      value_read=np.moveaxis(own, 0, 1)[first].mean(axis=(0, 2)).round(4).tolist(),
    )
  targets = np.stack([(r.pair_positions + 1) // att.cell for r in rows])  # the cells holding the values
  chosen = np.take_along_axis(selections, queries[:, :, None, None, None], axis=1)  # [batch, Q, layers, heads, K]
  hit = (chosen == targets[:, :, None, None, None]).any(-1)  # [batch, Q, layers, heads]
  summary = dict(kind=att.kind, length=int(length), selected=hit[first].mean(axis=(0, 2)).round(4).tolist())
  if retained is not None:
    held = (retained[:, :, :, None, :] == targets[None, :, None, :, None]).any(-1)  # [layers, batch, heads, Q]
    eligible = split // att.cell
    summary.update(
      retained=np.moveaxis(held, (1, 3), (0, 1))[first].mean(axis=(0, 2)).round(4).tolist(),
      random_pool=float(np.mean((retained >= 0).sum(-1)) / max(eligible, 1)),
    )
  return summary


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _zha_extend_reading(model, variables, tokens, cache, positions, valid, values_at):
  """A ZHA model's cache step over one chunk (`extend`), also telling whether each of its queries reads the keys
  at `values_at` `[batch, V]`: `(cache, intermediates, read [batch, C, layers, heads, V] bool)`.

  Each layer's queries are captured where they leave the projection (`q_proj`, or `q_norm` with `qk_norm`) and
  routed over the layer's cached tree after the chunk is written, as `fsjax.attention.zha_step.attend` routes them
  (`fsjax.reference.zha.route`, then `key_mask`)."""
  config = model.config
  tree = config.attention.zha.tree
  query_module = "q_norm" if config.qk_norm else "q_proj"
  (_, cache), state = model.apply(
    variables,
    tokens,
    cache,
    positions,
    valid,
    mutable=["intermediates"],
    capture_intermediates=lambda module, method: module.name == query_module,
  )
  intermediates = state["intermediates"]
  if config.scan_layers:
    layers = [(intermediates["layers"]["layer"]["attention"], cache["layers"], i) for i in range(config.num_layers)]
  else:
    layers = [(intermediates[f"layer_{i}"]["attention"], cache[f"layer_{i}"], None) for i in range(config.num_layers)]
  reads = []
  for attention, layer, i in layers:
    at = (lambda x: x[i]) if i is not None else (lambda x: x)
    q = at(attention[query_module]["__call__"][0])  # [batch, C, heads, d]
    dtype = compute_dtype(q.dtype)
    q_rot = zha_ref.rotate(q.astype(dtype), positions, config.attention.rope)
    nodes = [(at(keys).astype(dtype), at(bias).astype(dtype)) for keys, bias in zip(layer.keys, layer.bias)]
    scores = [zha_ref.node_scores(q_rot, *level) for level in nodes]
    leaves = zha_ref.route(scores, positions, chunk=tree.chunk, top_p=tree.level_top_p, max_nodes=tree.max_nodes)
    reads.append(jnp.moveaxis(zha_ref.key_mask(leaves, positions, values_at, tree.chunk), 1, 2))  # [b, C, h, V]
  return cache, intermediates, jnp.stack(reads, axis=2)


def _retained_cells(cache, config):
  """FS-L's `pool ∪ recent` cell ids in a bounded cache: `[layers, batch, heads, P + W]`, -1 for none."""
  layers = [cache["layers"]] if config.scan_layers else [cache[f"layer_{i}"] for i in range(config.num_layers)]
  parts = []
  for layer in layers:
    pool, recent = np.asarray(layer.pool_ids), np.asarray(layer.recent_ids)  # [(L,) b, h, P], [(L,) b, W]
    recent = np.broadcast_to(recent[..., None, :], (*pool.shape[:-1], recent.shape[-1]))
    parts.append(np.concatenate([pool, recent], axis=-1))
  return parts[0] if config.scan_layers else np.stack(parts)


def distance_bucket(distance):
  """The power-of-two bucket `[2^k, 2^(k+1))` of a pair-to-query distance, as its lower end `2^k`."""
  return 1 << (int(distance).bit_length() - 1)


def score_rows(rows, answers):
  """`{bucket: (answered, in_row, queries)}` over distance buckets, with "all": the queries answered with their
  value, and those answered with any value of their row (a model that copies values but does not bind them to
  their keys scores about 1/pairs of its in-row answers). Only each key's first ask counts: a repeated key's
  answer is in the row at its earlier ask, a few tokens back, whatever the distance to its pair."""
  first = np.concatenate([r.first_asks for r in rows])
  distances = np.concatenate([r.query_positions - r.pair_positions for r in rows])[first]
  answered = np.concatenate([a == r.values for a, r in zip(answers, rows)])[first]
  in_row = np.concatenate([np.isin(a, r.pair_values) for a, r in zip(answers, rows)])[first]
  scores = {"all": (int(answered.sum()), int(in_row.sum()), answered.size)}
  for bucket in sorted({distance_bucket(d) for d in distances}):
    inside = np.array([distance_bucket(d) == bucket for d in distances])
    scores[bucket] = (int(answered[inside].sum()), int(in_row[inside].sum()), int(inside.sum()))
  return scores


def task_for(config, pairs=None, distance=None, length=None, text_path=None):
  """The checkpoint's recall task (`config.data.associative`) with the evaluation's overrides: `(its
  AssociativeConfig, recall_row keyword arguments for rows of up to length tokens)`, text filler from `text_path`
  (default: the held-out books); ConfigError when the checkpoint was not trained on associative recall."""
  if config.data.source != "associative":
    raise ConfigError(f"the checkpoint was trained on data.source {config.data.source!r}, not associative recall")
  associative = config.data.associative
  if pairs is not None:
    associative = dataclasses.replace(associative, pairs=pairs)
  if distance is not None:  # a distance bound asks one query per pair (the only placement that bounds it)
    associative = dataclasses.replace(associative, distance=distance, query_count=None)
  return associative, held_out_task(associative, length or 0, config.data.tokenizer, text_path)


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", nargs="+", required=True, help="training workdirs or step directories")
  parser.add_argument(
    "--lengths", required=True, type=lambda s: [int(n) for n in s.split(",")], help="comma-separated lengths"
  )
  parser.add_argument("--samples", type=int, default=64, help="rows per length")
  parser.add_argument("--batch-size", type=int, default=8, help="rows per prefill")
  parser.add_argument("--pairs", type=int, default=None, help="pairs per row (default: the checkpoint's)")
  parser.add_argument(
    "--distance",
    type=lambda s: tuple(int(n) for n in s.split(",")),
    default=None,
    help="MIN,MAX tokens from a pair to its query (default: the checkpoint's)",
  )
  parser.add_argument("--seed", type=int, default=0, help="seed of the test stream")
  parser.add_argument("--data", default=None, help="held-out text for text filler (default: the packaged valid split)")
  parser.add_argument(
    "--probe",
    action="store_true",
    help="also record, for FS, FS-L and FS-B, how often the routing selects (FS-L: retains) the cell of a "
    "query's value, for ZHA the fraction of keys a query reads and how often its value is among them, on the first "
    "--batch-size rows of each length (queries at the end): PREFIX_probe.json; other kinds are evaluated unprobed",
  )
  cli.add_set_argument(parser, "override model config fields of every checkpoint, e.g. --set attention.kind=fsl")
  parser.add_argument("--out", default=None, help="PREFIX for PREFIX.csv and PREFIX.png (default: none)")
  return parser.parse_args(argv)


def check_args(args):
  """One clear error per bad argument, before any model is loaded."""
  if min(args.samples, args.batch_size) < 1 or not args.lengths or min(args.lengths) < 4:
    raise ConfigError("--samples and --batch-size must be >= 1 and --lengths must name lengths >= 4")
  if args.pairs is not None and args.pairs < 1:
    raise ConfigError(f"--pairs must be >= 1, got {args.pairs}")
  if args.probe and args.out is None:
    raise ConfigError("--probe writes PREFIX_probe.json: give --out PREFIX")
  if args.distance is not None and (len(args.distance) != 2 or not 2 <= args.distance[0] <= args.distance[1]):
    raise ConfigError(f"--distance must be MIN,MAX with 2 <= MIN <= MAX, got {args.distance}")
  for assignment in args.set:
    override_model(ModelConfig(), [assignment])


def plot(path, rows):
  """Accuracy against length, one line per model, on a log-2 length axis."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  overall = [r for r in rows if r["bucket"] == "all"]
  for name in dict.fromkeys(r["model"] for r in overall):
    mine = [r for r in overall if r["model"] == name]
    ax.plot([r["length"] for r in mine], [r["accuracy"] for r in mine], marker="o", label=name)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("evaluation length (tokens)")
  ax.set_ylabel("queries answered")
  ax.set_ylim(0, 1)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  try:
    check_args(args)
    rows, probes = [], []
    for path in args.checkpoint:
      loaded = load_model(path, args.set)
      associative, task = task_for(loaded.config, args.pairs, args.distance, max(args.lengths), args.data)
      for length in args.lengths:
        associative.check_length(length, "--lengths")
        samples = recall_rows(task, length, args.samples, args.seed)
        with cli.stage(f"{loaded.name}: {args.samples} recall rows of {length} tokens"):
          answers = predict_answers(loaded.model, loaded.variables, samples, args.batch_size)
        scores = score_rows(samples, answers)
        for bucket, (answered, in_row, queries) in scores.items():
          rows.append(
            dict(
              model=loaded.name,
              kind=loaded.model.config.attention.kind,
              train_length=loaded.config.data.seq_len,
              length=length,
              pairs=associative.pairs,
              bucket=bucket,
              queries=queries,
              accuracy=answered / queries,
              in_row=in_row / queries,
              chance=1.0 / (associative.values[1] - associative.values[0]),
            )
          )
        print(rows[-len(scores)], file=sys.stderr, flush=True)  # the "all" bucket
        if args.probe and loaded.model.config.attention.kind not in PROBED_KINDS:
          print(f"{loaded.name}: no routing probe for kind {loaded.model.config.attention.kind}", file=sys.stderr)
        elif args.probe:
          with cli.stage(f"{loaded.name}: routing probe at {length} tokens"):
            probed = probe_rows(loaded.model, loaded.variables, samples[: args.batch_size])
          probes.append(dict(model=loaded.name, **probed))
          print(probes[-1], file=sys.stderr, flush=True)
          if args.out:
            Path(f"{args.out}_probe.json").write_text(json.dumps(probes, indent=1) + "\n")
        if args.out:
          write_csv(Path(f"{args.out}.csv"), rows)
    if args.out:
      plot(Path(f"{args.out}.png"), rows)
  except (ConfigError, CheckpointError, DeviceMemoryError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("| model | train length | length | pairs | accuracy | a value of its row | chance |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    if r["bucket"] == "all":
      print(
        f"| {r['model']} | {r['train_length']} | {r['length']} | {r['pairs']} | {r['accuracy']:.3f} | "
        f"{r['in_row']:.3f} | {r['chance']:.5f} |"
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
