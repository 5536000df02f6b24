"""Routing probes (FS App. D.2-D.3): which cells FreeSolo reads on a prompt with a known needle.

    python -m fsjax.eval.probe --checkpoint runs/tiny_fs --length 1024 [--task niah_single_2] [--seed 0]
        [--out runs/probe]
    python -m fsjax.eval.probe --checkpoint runs/tiny_fs --length 1024 --copies 20 [--span 24] [--cue 4]
        [--data FILE | --random-ids MIN,MAX] [--needle-ids MIN,MAX] [--out runs/probe]

One RULER NIAH prompt is run through the full-history masked path (the FS archive, also for FS-L, as the paper's
probes do), chunk by chunk, recording the cells every layer and head selected for every query. Outputs:
- reading distances `i - p_c` of all selections: a histogram per layer (`distances.png`, log2 bins);
- a Fig. 5-style heatmap of selections by query position and backward distance (`heatmap.png`);
- per layer and head, the FS-L retained fraction η = |A_i| / |C_i| at the last query (1 for FS);
- the rate at which the needle's cells are retained (available) and selected by the queries of the question.
`probe.json` holds the numbers; the table is printed.

With `--copies N`, the prompts are instead copy samples drawn by `fsjax.eval.copy_recall`'s sampler (with the
same seed, span and cue, the samples of `copy_recall --samples N`), and the probe asks whether the copy's scored
queries select the cell holding the token they should copy next, and the cells around it (`copy_target_hits`),
against the same cells in the control twins, where the source is replaced and only position can draw the read.
The rates per layer and head, and per offset and layer, go to `copies.json`.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fsjax import cli
from fsjax.cache import init_cache
from fsjax.config import ConfigError
from fsjax.data.pipeline import default_corpus_path
from fsjax.data.tokenizer import load_tokenizer
from fsjax.decode import extend, selected_cells
from fsjax.eval import copy_recall, tasks
from fsjax.loading import load_model
from fsjax.reference import cells
from fsjax.train.checkpoint import CheckpointError


def needle_token_span(tokenizer, prompt, value):
  """Token positions `[first, last]` of `value` in the tokenized `prompt` (character offsets mapped)."""
  start = prompt.index(value)
  end = start + len(value)
  offsets = tokenizer.encode(prompt, add_special_tokens=False).offsets
  covered = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
  return covered[0], covered[-1]


def record_selections(model, variables, tokens, chunk):
  """Cells selected by every layer/head for every position: `[T, layers, heads, K]` (-1 = none), and the
  archive caches after the prompt."""
  config = model.config
  length = tokens.shape[0]
  block = config.attention.block
  chunk = -(-min(chunk, length) // block) * block
  padded = -(-length // chunk) * chunk
  cache = init_cache(config, 1, padded, bounded=False)
  ids = jnp.pad(jnp.asarray(tokens, jnp.int32), (0, padded - length))[None]
  parts = []
  for start in range(0, padded, chunk):
    positions = start + jnp.arange(chunk, dtype=jnp.int32)[None]
    _, cache, intermediates = extend(
      model, variables, ids[:, start : start + chunk], cache, positions, positions < length
    )
    parts.append(np.asarray(selected_cells(intermediates, config))[0])
  return np.concatenate(parts)[:length], cache


def availability_at(cache, config, position):
  """`[layers, heads, M]` bool: the cells each layer and head may score at query `position` (Eq. 6, 8)."""
  att = config.attention
  if config.scan_layers:
    archives = [jax.tree_util.tree_map(lambda x, i=i: x[i], cache["layers"]) for i in range(config.num_layers)]
  else:
    archives = [cache[f"layer_{i}"] for i in range(config.num_layers)]
  return np.stack(
    [
      np.asarray(
        cells.available_cells(
          archive.max_norms,
          1,
          variant=att.kind,
          cell=att.cell,
          block=att.block,
          retain_top=att.retain_top,
          retain_recent=att.retain_recent,
          positions=jnp.array([[position]]),
        )[0, 0]
      )
      for archive in archives
    ]
  )


def eligible_cell_count(position, att):
  """Cells in a query's eligible prefix at `position`: every cell of the blocks before its own, the count of c with
  (c + 1)·s <= B⌊i/B⌋ (FS Eq. 6; B is a multiple of s)."""
  return (position // att.block) * (att.block // att.cell)


def check_freesolo(config):
  if config.attention.kind not in ("fs", "fsl"):
    raise ConfigError(f"routing probes need a FreeSolo model (fs or fsl), got {config.attention.kind!r}")


def probe(model, variables, tokenizer, *, task, length, seed, chunk=2048):
  """Runs the probe. Returns a dict of summary numbers and the raw arrays for the plots."""
  config = model.config
  att = config.attention
  check_freesolo(config)
  count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
  (record,) = tasks.generate(task, length, 1, count, seed=seed)
  prompt = record["input"] + record["answer_prefix"]
  tokens = np.asarray(tokenizer.encode(prompt, add_special_tokens=False).ids)
  first, last = needle_token_span(tokenizer, prompt, record["outputs"][0])
  needle_cells = set(range(first // att.cell, last // att.cell + 1))
  question = prompt.rindex("\n") + 1  # the question and answer prefix follow the last newline
  question_start = len(tokenizer.encode(prompt[:question], add_special_tokens=False).ids)
  selections, cache = record_selections(model, variables, tokens, chunk)  # [T, layers, heads, K]
  available = availability_at(cache, config, len(tokens) - 1)  # [layers, heads, M]
  eta = available.sum(-1) / max(eligible_cell_count(len(tokens) - 1, att), 1)
  retained = available[:, :, sorted(needle_cells)].any(-1)
  positions = np.arange(len(tokens))[:, None, None, None]
  valid = selections >= 0
  distance = np.where(valid, positions - (selections + 0.5) * att.cell, np.nan)
  selected_needle = np.isin(selections[question_start:], sorted(needle_cells)).any(-1)  # [queries, layers, heads]
  summary = dict(
    task=task,
    length=int(len(tokens)),
    needle_tokens=[int(first), int(last)],
    needle_cells=sorted(int(c) for c in needle_cells),
    question_start=int(question_start),
    needle_retained_rate=float(retained.mean()),
    needle_selected_rate=float(selected_needle.mean()),
    eta_per_layer_head=eta.round(4).tolist(),
    median_distance=float(np.nanmedian(distance)) if valid.any() else None,
  )
  return summary, distance


OFFSET_CELLS = tuple(range(-2, 4))  # cells around the next source token's, for the copy probe's profile


def copy_target_hits(selections, sources, *, span, cue, cell, block, offset=0):
  """Whether each scored query of a copy sample selected the cell of the token it should copy next.

  A copy sample's last `span` positions repeat the tokens at `source … source + span - 1`. The query at
  `length - span + t` reads copy token t (source token `source + t`), so an induction read fetches source token
  `source + t + 1`, in cell `(source + t + 1) // cell`. The queries are those `fsjax.eval.copy_recall` scores:
  t = cue - 1 … span - 2. With `offset`, the target is the cell of source token `source + t + 1 + offset`.

  Args:
    selections: int `[n, length, layers, heads, K]` selected cells (-1 = none).
    sources: int `[n]` source positions.
    span, cue, cell, block: copy span and cue; FS cell `s` and block `B`.
    offset: tokens from the next source token to the target.

  Returns:
    (hits bool `[n, span - cue, layers, heads]`, eligible bool `[n, span - cue]`): `eligible` says whether the
    target cell lies in the query's eligible prefix at all (Eq. 6); a target inside the local branch's reach is
    not.
  """
  length = selections.shape[1]
  t = np.arange(cue - 1, span - 1)
  queries = length - span + t  # [Q]
  targets = (np.asarray(sources)[:, None] + t + 1 + offset) // cell  # [n, Q]
  hits = (selections[:, queries] == targets[:, :, None, None, None]).any(-1)
  eligible = cells.first_eligible_block(targets, cell=cell, block=block) <= queries // block  # Eq. 6
  return hits, eligible


def probe_copies(model, variables, stream, *, length, count, span=24, cue=4, seed=0, chunk=2048, needle_ids=None):
  """The copy-sample probe (`--copies`): how often the scored queries select the copy's next source cell.

  Args:
    stream: int32 `[N]` held-out tokens (`fsjax.eval.copy_recall.heldout_stream`, or `random_stream`).
    length, count, span, cue, seed, needle_ids: as in `fsjax.eval.copy_recall` (`count` is its `--samples`:
      the same arguments draw the same samples).

  Returns:
    A dict: per layer and head the selection rate of the target cell over the scored (sample, query) pairs whose
    target is eligible, in the copies and in their controls; the same rates over all layers and heads; the
    chance rate of a uniform choice among the available cells; the share of eligible targets; the share of
    (eligible target cell, layer, head) still available at the last scored query (below 1 only for FS-L) and the
    share a pool of the same size drawn uniformly from the eligible cells would keep (`retained_chance_rate`); and
    per offset in `OFFSET_CELLS` (cells from the target's), the rate per layer in copies and controls
    (`copy_by_offset_layer`, `control_by_offset_layer`: `[offsets][layers]`, None where no target is eligible).
  """
  config = model.config
  att = config.attention
  check_freesolo(config)
  copies, controls, sources = copy_recall.make_samples(stream, length, count, span, seed, needle_ids)
  last_block = (length - 2) // att.block
  eligible_cells = eligible_cell_count(length - 2, att)
  selections, chance, retained, retained_chance = {}, [], [], []
  for name, rows in (("copy", copies), ("control", controls)):
    recorded = []
    for row, source in zip(rows, sources):
      picked, cache = record_selections(model, variables, row, chunk)
      recorded.append(picked)
      if name == "copy":
        available = availability_at(cache, config, length - 2)  # [layers, heads, M]
        counts = available.sum(-1)
        chance.append(np.minimum(att.top_k, counts) / np.maximum(counts, 1))
        retained_chance.append(counts / max(eligible_cells, 1))  # a uniform pool of the same size
        target_cells = np.arange(source + cue, source + span) // att.cell
        target_cells = target_cells[
          cells.first_eligible_block(target_cells, cell=att.cell, block=att.block) <= last_block
        ]
        if target_cells.size:
          retained.append(available[:, :, target_cells].mean())
    selections[name] = np.stack(recorded)
  # A model need not read the next token's own cell (the CPU pilot of docs/results.md read two cells later), so
  # the cells around it are scored too. Per name and offset: the rate per (layer, head) over the scored (sample,
  # query) pairs whose target is eligible, None where none is.
  rates, eligible = {}, None
  for name in selections:
    for offset in OFFSET_CELLS:
      hits, ok = copy_target_hits(
        selections[name], sources, span=span, cue=cue, cell=att.cell, block=att.block, offset=offset * att.cell
      )
      rates[name, offset] = hits[ok].mean(axis=0) if ok.any() else None
      if offset == 0:
        eligible = ok
  head_rate = lambda name: (
    rates[name, 0] if rates[name, 0] is not None else np.full(selections[name].shape[2:4], np.nan)
  )
  layer_rate = lambda name, offset: (
    None if rates[name, offset] is None else rates[name, offset].mean(-1).round(4).tolist()
  )
  return dict(
    length=int(length),
    samples=int(count),
    span=int(span),
    cue=int(cue),
    mean_distance=float(np.mean(length - span - sources)),
    target_eligible_rate=float(eligible.mean()),
    chance_rate=float(np.mean(chance)),
    target_retained_rate=float(np.mean(retained)) if retained else None,
    retained_chance_rate=float(np.mean(retained_chance)),
    copy_selected_rate=float(np.mean(head_rate("copy"))),
    control_selected_rate=float(np.mean(head_rate("control"))),
    copy_per_layer_head=head_rate("copy").round(4).tolist(),
    control_per_layer_head=head_rate("control").round(4).tolist(),
    offset_cells=list(OFFSET_CELLS),
    copy_by_offset_layer=[layer_rate("copy", offset) for offset in OFFSET_CELLS],
    control_by_offset_layer=[layer_rate("control", offset) for offset in OFFSET_CELLS],
  )


def plot(out, distance, cell):
  import matplotlib  # here, not at module top: the Agg backend is chosen only when a plot is drawn, before pyplot

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  layers = distance.shape[1]
  finite = distance[np.isfinite(distance)]
  bins = 2.0 ** np.arange(np.floor(np.log2(cell / 2)), np.ceil(np.log2(max(finite.max(), cell))) + 1)
  figure, ax = plt.subplots(figsize=(6, 3.5))
  for layer in range(layers):
    values = distance[:, layer][np.isfinite(distance[:, layer])]
    ax.hist(values, bins=bins, histtype="step", label=f"layer {layer}")
  ax.set(xscale="log", xlabel="reading distance i - p_c (tokens)", ylabel="selections")
  ax.legend(fontsize="small")
  figure.tight_layout()
  figure.savefig(out / "distances.png", dpi=120)
  plt.close(figure)

  positions = np.broadcast_to(np.arange(distance.shape[0])[:, None, None, None], distance.shape)
  keep = np.isfinite(distance)
  figure, ax = plt.subplots(figsize=(5, 4))
  counts, x_edges, y_edges, image = ax.hist2d(positions[keep], distance[keep], bins=(48, 48), cmin=1)
  figure.colorbar(image, ax=ax, label="selections (all layers, heads)")
  ax.set(xlabel="query position", ylabel="backward distance (tokens)")
  figure.tight_layout()
  figure.savefig(out / "heatmap.png", dpi=120)
  plt.close(figure)


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", required=True, help="training workdir or step directory")
  parser.add_argument("--length", type=int, required=True, help="prompt + generation budget, in tokens")
  parser.add_argument("--task", default="niah_single_2", help="a NIAH task (the first answer is the needle)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the haystack sample")
  parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk in tokens")
  parser.add_argument("--out", default="runs/probe", help="directory for the probe's JSON")
  parser.add_argument(
    "--copies",
    type=int,
    default=0,
    help="probe this many copy-recall samples instead of a NIAH prompt (0: the NIAH probe)",
  )
  parser.add_argument("--span", type=int, default=24, help="copy samples: tokens per copy")
  parser.add_argument("--cue", type=int, default=4, help="copy samples: leading copy tokens left unscored")
  parser.add_argument("--data", default=None, help="copy samples: held-out jsonl/txt (default: packaged)")
  parser.add_argument(
    "--random-ids",
    default=None,
    type=copy_recall.id_range,
    help="copy samples: MIN,MAX: random ids in [MIN, MAX) instead of held-out text",
  )
  parser.add_argument(
    "--needle-ids",
    default=None,
    type=copy_recall.id_range,
    help="copy samples: MIN,MAX: the copied span is random ids in [MIN, MAX) planted in the text",
  )
  return parser.parse_args(argv)


def check_copy_args(args):
  """One clear error per bad copy-sample argument, before any model is loaded."""
  if args.copies < 0:
    raise ConfigError(f"--copies must be >= 0, got {args.copies}")
  if args.copies and not 1 <= args.cue < args.span:
    raise ConfigError(f"--cue must be >= 1 and < --span, got cue={args.cue}, span={args.span}")
  if args.copies and args.length < copy_recall.SOURCE_RANGE + 2 * args.span:
    raise ConfigError(
      f"--length: {args.length} is below {copy_recall.SOURCE_RANGE + 2 * args.span} (copy "
      "samples: source range + 2 spans)"
    )
  for flag, value in (("--random-ids", args.random_ids), ("--needle-ids", args.needle_ids)):
    if value is not None and not args.copies:
      raise ConfigError(f"{flag} needs --copies (it draws copy samples)")
  copy_recall.check_sample_source(args.random_ids, args.needle_ids, args.data)


def print_copies(summary):
  print(
    f"copy samples at {summary['length']} tokens (source {summary['mean_distance']:.0f} back on average); "
    f"target cell eligible for {summary['target_eligible_rate']:.2f} of scored queries"
  )
  print("| layer | target cell selected, copy / control, per head |\n|---|---|")
  for layer, (copy, control) in enumerate(zip(summary["copy_per_layer_head"], summary["control_per_layer_head"])):
    print(f"| {layer} | {' '.join(f'{a:.2f}/{b:.2f}' for a, b in zip(copy, control))} |")
  print(
    f"selected: {summary['copy_selected_rate']:.3f} in copies, {summary['control_selected_rate']:.3f} in "
    f"controls, {summary['chance_rate']:.3f} by a uniform choice"
  )
  if summary["target_retained_rate"] is not None:
    print(
      f"eligible targets retained: {summary['target_retained_rate']:.3f}, by a uniform pool of the same size: "
      f"{summary['retained_chance_rate']:.3f}"
    )
  print(
    "| cells past the next token's | "
    + " | ".join(f"layer {i}, copy / control" for i in range(len(summary["copy_per_layer_head"])))
    + " |"
  )
  print("|---|" + "---|" * len(summary["copy_per_layer_head"]))
  for offset, copy, control in zip(
    summary["offset_cells"], summary["copy_by_offset_layer"], summary["control_by_offset_layer"]
  ):
    cells = " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(copy, control)) if copy and control else "not eligible"
    print(f"| {offset:+d} | {cells} |")


def main(argv=None):
  args = parse_args(argv)
  try:
    check_copy_args(args)
    loaded = load_model(args.checkpoint)
    config, model, variables = loaded.config, loaded.model, loaded.variables
    check_freesolo(config.model)
    if args.copies:
      copy_recall.check_sample_source(args.random_ids, args.needle_ids, None, config.model.vocab_size)
      if args.random_ids is not None:
        stream = copy_recall.random_stream(args.random_ids, args.length, args.seed)
      else:
        stream = copy_recall.heldout_stream(args.data or default_corpus_path("valid"), loaded.tokenizer_path)
      with cli.stage(f"{loaded.name}: copy probe, {args.copies} samples at {args.length} tokens"):
        summary = probe_copies(
          model,
          variables,
          stream,
          length=args.length,
          count=args.copies,
          span=args.span,
          cue=args.cue,
          seed=args.seed,
          chunk=args.chunk,
          needle_ids=args.needle_ids,
        )
    else:
      with cli.stage(f"{loaded.name}: {args.task} probe at {args.length} tokens"):
        summary, distance = probe(
          model,
          variables,
          load_tokenizer(loaded.tokenizer_path),
          task=args.task,
          length=args.length,
          seed=args.seed,
          chunk=args.chunk,
        )
  except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.copies:
    (out / "copies.json").write_text(json.dumps(summary, indent=2))
    print_copies(summary)
    print(f"wrote {out / 'copies.json'}")
    return 0
  (out / "probe.json").write_text(json.dumps(summary, indent=2))
  plot(out, distance, config.model.attention.cell)
  eta = np.asarray(summary["eta_per_layer_head"])
  print(f"{args.task} at {summary['length']} tokens; needle cells {summary['needle_cells']}")
  print("| layer | η per head (retained / eligible cells) |\n|---|---|")
  for layer, row in enumerate(eta):
    print(f"| {layer} | {' '.join(f'{x:.3f}' for x in row)} |")
  print(
    f"needle retained at the last query: {summary['needle_retained_rate']:.2f} of layer-heads; "
    f"selected by question queries: {summary['needle_selected_rate']:.2f} of (query, layer, head)"
  )
  print(f"wrote {out / 'probe.json'}, {out / 'distances.png'}, {out / 'heatmap.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
