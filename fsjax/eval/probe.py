"""Routing probes (FS App. D.2-D.3): which cells FreeSolo reads on a prompt with a known needle.

    python -m fsjax.eval.probe --checkpoint runs/tiny_fs --length 1024 [--task niah_single_2] [--seed 0]
        [--out runs/probe]

One RULER NIAH prompt is run through the full-history masked path (the FS archive, also for FS-L, as the paper's
probes do), chunk by chunk, recording the cells every layer and head selected for every query. Outputs:
- reading distances `i - p_c` of all selections: a histogram per layer (`distances.png`, log2 bins);
- a Fig. 5-style heatmap of selections by query position and backward distance (`heatmap.png`);
- per layer and head, the FS-L retained fraction η = |A_i| / |C_i| at the last query (1 for FS);
- the rate at which the needle's cells are retained (available) and selected by the queries of the question.
`probe.json` holds the numbers; the table is printed.
"""

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fsjax.cache import init_cache
from fsjax.config import ConfigError
from fsjax.decode import extend, selected_cells
from fsjax.eval import tasks
from fsjax.ops import cells
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
    _, cache, intermediates = extend(model, variables, ids[:, start:start + chunk], cache, positions,
                                     positions < length)
    parts.append(np.asarray(selected_cells(intermediates, config))[0])
  return np.concatenate(parts)[:length], cache


def availability_at(cache, config, position):
  """`[layers, heads, M]` bool: the cells each layer and head may score at query `position` (Eq. 6, 8)."""
  att = config.attention
  if config.scan_layers:
    archives = [jax.tree_util.tree_map(lambda x, i=i: x[i], cache["layers"]) for i in range(config.num_layers)]
  else:
    archives = [cache[f"layer_{i}"] for i in range(config.num_layers)]
  return np.stack([np.asarray(cells.available_cells(
      archive.max_norms, 1, variant=att.kind, cell=att.cell, block=att.block, retain_top=att.retain_top,
      retain_recent=att.retain_recent, positions=jnp.array([[position]]))[0, 0]) for archive in archives])


def probe(model, variables, tokenizer, *, task, length, seed, chunk=2048):
  """Runs the probe. Returns a dict of summary numbers and the raw arrays for the plots."""
  config = model.config
  att = config.attention
  if att.kind not in ("fs", "fsl"):
    raise ConfigError(f"routing probes need a FreeSolo model (fs or fsl), got {att.kind!r}")
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
  eligible = ((len(tokens) - 1) // att.block) * (att.block // att.cell)
  eta = available.sum(-1) / max(eligible, 1)
  retained = available[:, :, sorted(needle_cells)].any(-1)
  positions = np.arange(len(tokens))[:, None, None, None]
  valid = selections >= 0
  distance = np.where(valid, positions - (selections + 0.5) * att.cell, np.nan)
  selected_needle = np.isin(selections[question_start:], sorted(needle_cells)).any(-1)  # [queries, layers, heads]
  summary = dict(task=task, length=int(len(tokens)), needle_tokens=[int(first), int(last)],
                 needle_cells=sorted(int(c) for c in needle_cells), question_start=int(question_start),
                 needle_retained_rate=float(retained.mean()), needle_selected_rate=float(selected_needle.mean()),
                 eta_per_layer_head=eta.round(4).tolist(),
                 median_distance=float(np.nanmedian(distance)) if valid.any() else None)
  return summary, distance


def plot(out, distance, cell):
  import matplotlib
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
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--checkpoint", required=True, help="training workdir or step directory")
  parser.add_argument("--length", type=int, required=True, help="prompt + generation budget, in tokens")
  parser.add_argument("--task", default="niah_single_2", help="a NIAH task (the first answer is the needle)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chunk", type=int, default=2048)
  parser.add_argument("--out", default="runs/probe")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    from fsjax.data.tokenizer import load_tokenizer
    from fsjax.model import Transformer
    from fsjax.train import checkpoint
    config, params, frozen, _ = checkpoint.load(args.checkpoint)
    summary, distance = probe(Transformer(config.model), {"params": params, **frozen},
                              load_tokenizer(config.data.tokenizer), task=args.task, length=args.length,
                              seed=args.seed, chunk=args.chunk)
  except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "probe.json").write_text(json.dumps(summary, indent=2))
  plot(out, distance, config.model.attention.cell)
  eta = np.asarray(summary["eta_per_layer_head"])
  print(f"{args.task} at {summary['length']} tokens; needle cells {summary['needle_cells']}")
  print("| layer | η per head (retained / eligible cells) |\n|---|---|")
  for layer, row in enumerate(eta):
    print(f"| {layer} | {' '.join(f'{x:.3f}' for x in row)} |")
  print(f"needle retained at the last query: {summary['needle_retained_rate']:.2f} of layer-heads; "
        f"selected by question queries: {summary['needle_selected_rate']:.2f} of (query, layer, head)")
  print(f"wrote {out / 'probe.json'}, {out / 'distances.png'}, {out / 'heatmap.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
