"""Generate text from a checkpoint written by train.py.

    python -m fsjax.generate --checkpoint runs/tiny_fs --prompt "Once upon a time" [--max-new-tokens 64]
    python -m fsjax.generate --checkpoint runs/tiny_fs/checkpoints/200 --prompt-file prompt.txt
    python -m fsjax.generate --checkpoint runs/tiny_fs --prompts-file prompts.jsonl [--batch-size 8] [--out F]

--checkpoint takes a training workdir (its latest step) or one step's directory. Greedy by default;
--temperature > 0 samples, with --top-p nucleus filtering.

--prompts-file serves a batch: one JSON object per line, `{"prompt": "...", "max_new_tokens": 32}` (the cap is
optional, default --max-new-tokens). Prompts are generated --batch-size at a time, longest first, each row
stopping at EOS or its own cap; one JSON line per prompt, in the file's order, goes to --out (default stdout):
`{"prompt", "completion", "new_tokens", "stop": "eos" | "limit"}`. --compact halves a batch whenever at most half of
its rows are still running, so finished rows stop costing steps; each new batch size compiles the loop once
(`fsjax/compaction.py`).
"""

import json
import sys
import warnings

import jax.numpy as jnp
import numpy as np

from fsjax import cli
from fsjax.config import ConfigError
from fsjax.data.jsonl import json_lines
from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.decode import generate, generate_each
from fsjax.loading import load_model
from fsjax.memory import DeviceMemoryError
from fsjax.train.checkpoint import CheckpointError


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", required=True, help="training workdir or step directory")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="prompt text")
  source.add_argument("--prompt-file", help="file whose whole text is the prompt")
  source.add_argument("--prompts-file", help="JSONL of prompts to generate as batches (see above)")
  parser.add_argument("--batch-size", type=int, default=8, help="rows per generation call with --prompts-file")
  parser.add_argument("--out", default=None, help="JSONL output of --prompts-file (default: stdout)")
  parser.add_argument(
    "--compact", action="store_true", help="with --prompts-file: halve a batch as its rows finish (see above)"
  )
  parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate after the prompt")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
  parser.add_argument("--seed", type=int, default=0, help="sampling seed")
  parser.add_argument(
    "--chunk", type=int, default=None, help="prefill chunk in tokens (default: chosen from the prompt length)"
  )
  cli.add_set_argument(
    parser,
    "override a model config field, e.g. --set attention.kind=fsb (FS-B on an FS "
    "checkpoint, after python -m fsjax.calibrate)",
  )
  return parser.parse_args(argv)


def read_prompts(path, default_limit):
  """`[(prompt, max_new_tokens)]` from a JSONL file; a bad line is a `ConfigError` naming file, line and rule."""
  prompts = []
  for number, record in json_lines(path, ConfigError):
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
      raise ConfigError(f'{path}:{number}: needs "prompt", a non-empty string')
    limit = record.get("max_new_tokens", default_limit)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
      raise ConfigError(f'{path}:{number}: "max_new_tokens" must be an integer >= 1, got {limit!r}')
    prompts.append((record["prompt"], limit))
  if not prompts:
    raise ConfigError(f"{path}: no prompts")
  return prompts


def generate_batches(loaded, tokenizer, prompts, *, batch_size, temperature, top_p, seed, chunk, compact=False):
  """One record per `(prompt, max_new_tokens)`, in order, generated `batch_size` rows at a time
  (`fsjax.decode.generate_each`)."""
  ids = [tokenizer.encode(prompt).ids for prompt, _ in prompts]
  empty = [i for i, row in enumerate(ids) if not row]
  if empty:
    raise ConfigError(f"prompt {empty[0] + 1} encodes to no tokens")
  results = generate_each(
    loaded.model,
    loaded.variables,
    ids,
    [limit for _, limit in prompts],
    eos_id=eos_id(tokenizer),
    batch_size=batch_size,
    temperature=temperature,
    top_p=top_p,
    seed=seed,
    chunk=chunk,
    compact=compact,
  )
  return [
    {"prompt": prompt, "completion": tokenizer.decode(new), "new_tokens": len(new), "stop": "eos" if eos else "limit"}
    for (prompt, _), (new, eos) in zip(prompts, results)
  ]


def main(argv=None):
  args = parse_args(argv)
  # On CPU, XLA cannot alias the donated cache buffers; that only costs a copy, so keep the output clean.
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  try:
    if args.max_new_tokens < 1 or args.batch_size < 1:
      raise ConfigError("--max-new-tokens and --batch-size must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
      raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    prompts = None if args.prompts_file is None else read_prompts(args.prompts_file, args.max_new_tokens)
    if args.prompt_file is not None:
      with open(args.prompt_file, encoding="utf-8") as f:
        args.prompt = f.read()
    loaded = load_model(args.checkpoint, args.set)
    tokenizer = load_tokenizer(loaded.tokenizer_path)
    if prompts is not None:
      with cli.stage(f"{len(prompts)} prompts in batches of {args.batch_size} (compiling first)"):
        records = generate_batches(
          loaded,
          tokenizer,
          prompts,
          batch_size=args.batch_size,
          temperature=args.temperature,
          top_p=args.top_p,
          seed=args.seed,
          chunk=args.chunk,
          compact=args.compact,
        )
    else:
      ids = tokenizer.encode(args.prompt).ids
      if not ids:
        raise ConfigError("the prompt encodes to no tokens")
      with cli.stage(f"prefill of {len(ids)} tokens, then up to {args.max_new_tokens} new (compiling first)"):
        out = generate(
          loaded.model,
          loaded.variables,
          jnp.asarray([ids]),
          [len(ids)],
          max_new_tokens=args.max_new_tokens,
          eos_id=eos_id(tokenizer),
          temperature=args.temperature,
          top_p=args.top_p,
          seed=args.seed,
          chunk=args.chunk,
        )
        out = np.asarray(out)
  except (ConfigError, CheckpointError, DeviceMemoryError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if prompts is not None:
    lines = "".join(json.dumps(record) + "\n" for record in records)
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        f.write(lines)
    else:
      sys.stdout.write(lines)
    return 0
  new = [int(t) for t in out[0]]
  if eos_id(tokenizer) in new:
    new = new[: new.index(eos_id(tokenizer))]
  print(args.prompt + tokenizer.decode(new))
  return 0


if __name__ == "__main__":
  sys.exit(main())
