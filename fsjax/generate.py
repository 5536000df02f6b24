"""Generate text from a checkpoint written by train.py.

    python -m fsjax.generate --checkpoint runs/tiny_fs --prompt "Once upon a time" [--max-new-tokens 64]
    python -m fsjax.generate --checkpoint runs/tiny_fs/checkpoints/200 --prompt-file prompt.txt

--checkpoint takes a training workdir (its latest step) or one step's directory. Greedy by default;
--temperature > 0 samples, with --top-p nucleus filtering.
"""

import sys
import warnings

import jax.numpy as jnp
import numpy as np

from fsjax import cli
from fsjax.config import ConfigError
from fsjax.data.tokenizer import eos_id, load_tokenizer
from fsjax.decode import generate
from fsjax.loading import load_model
from fsjax.memory import DeviceMemoryError
from fsjax.train.checkpoint import CheckpointError


def parse_args(argv):
  parser = cli.parser(__doc__)
  parser.add_argument("--checkpoint", required=True, help="training workdir or step directory")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="prompt text")
  source.add_argument("--prompt-file", help="file whose whole text is the prompt")
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


def main(argv=None):
  args = parse_args(argv)
  # On CPU, XLA cannot alias the donated cache buffers; that only costs a copy, so keep the output clean.
  warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
  try:
    if args.max_new_tokens < 1:
      raise ConfigError("--max-new-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
      raise ConfigError("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.prompt_file is not None:
      with open(args.prompt_file, encoding="utf-8") as f:
        args.prompt = f.read()
    loaded = load_model(args.checkpoint, args.set)
    tokenizer = load_tokenizer(loaded.tokenizer_path)
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
  new = [int(t) for t in out[0]]
  if eos_id(tokenizer) in new:
    new = new[: new.index(eos_id(tokenizer))]
  print(args.prompt + tokenizer.decode(new))
  return 0


if __name__ == "__main__":
  sys.exit(main())
