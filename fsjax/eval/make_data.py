"""Write RULER task files offline, in RULER's layout, for any tokenizer.

    python -m fsjax.eval.make_data --tasks niah_single_1,vt,cwe --lengths 4096,16384 --num-samples 100 \\
        --out data/ruler [--tokenizer tokenizer.json] [--corpus ../shared/data/pg_essays.jsonl] [--squad FILE]

Writes `<out>/<length>/<task>/validation.jsonl` (the layout `python -m fsjax.eval.ruler --ruler-data` reads).
The tokenizer (default: the packaged one) decides how much haystack fits each length.
"""

import sys
from pathlib import Path

from fsjax import cli
from fsjax.data.tokenizer import load_tokenizer
from fsjax.eval import records, tasks


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument(
    "--tasks",
    default=",".join(t for t in tasks.TASKS if not t.startswith("qa")),
    type=lambda s: [t for t in s.split(",") if t],
    help="comma-separated RULER task names",
  )
  parser.add_argument(
    "--lengths", default="4096", type=lambda s: [int(n) for n in s.split(",") if n], help="comma-separated tokens"
  )
  parser.add_argument("--num-samples", type=int, default=100, help="samples per task and length")
  parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the packaged one)")
  tasks.add_source_arguments(parser)
  parser.add_argument("--out", required=True, help="directory for the JSONL files, one per task and length")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  try:
    unknown = [t for t in args.tasks if t not in tasks.TASKS]
    if unknown or args.num_samples < 1:
      raise ValueError(f"--tasks must be RULER tasks ({', '.join(tasks.TASKS)}) and --num-samples >= 1")
    tokenizer = load_tokenizer(args.tokenizer)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    for length in args.lengths:
      for task in args.tasks:
        data = tasks.generate(
          task,
          length,
          args.num_samples,
          count,
          seed=args.seed,
          fit=args.fit,
          corpus=args.corpus,
          squad=args.squad,
          hotpotqa=args.hotpotqa,
        )
        path = Path(args.out) / str(length) / task / "validation.jsonl"
        records.write_jsonl(path, data)
        print(
          f"{path}: {len(data)} samples, {min(r['length'] for r in data)}-{max(r['length'] for r in data)} "
          "tokens with the generation budget"
        )
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
