"""Hugging Face checkpoints (Llama 3.x, Qwen2.5, Qwen3 dense) in and out of fsjax workdirs.

    python -m fsjax.convert import HF_DIR --workdir runs/qwen3 [--param-dtype float32] [--no-scan-layers]
    python -m fsjax.convert export runs/qwen3 --out qwen3_hf/ [--max-shard-gb 5]

`import` reads a local directory (config.json and model.safetensors or its sharded index; nothing is fetched)
into a new workdir that `train.init_from`, `python -m fsjax.generate` and the evaluations accept; `export` writes
a TF++ checkpoint back as config.json + safetensors. An unsupported architecture or field is refused in one
line, exit status 2, before anything is written.
"""

import sys
import time

import jax

from fsjax import cli
from fsjax.config import ConfigError
from fsjax.convert import ConversionError, export_checkpoint, import_checkpoint
from fsjax.train.checkpoint import CheckpointError

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv):
  parser = cli.parser(__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  imp = commands.add_parser("import", help="Hugging Face directory → fsjax workdir")
  imp.add_argument("source", help="a local Hugging Face checkpoint directory")
  imp.add_argument("--workdir", required=True, help="the new fsjax workdir")
  imp.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the model's activation dtype")
  imp.add_argument(
    "--param-dtype", default=None, choices=DTYPES, help="parameter dtype (default: the checkpoint's own)"
  )
  imp.add_argument("--no-scan-layers", action="store_true", help="unrolled layers (layer_0 .. layer_{L-1})")
  exp = commands.add_parser("export", help="fsjax TF++ checkpoint → Hugging Face directory")
  exp.add_argument("checkpoint", help="a workdir (its newest step) or one step's directory")
  exp.add_argument("--out", required=True, help="the Hugging Face directory to write")
  exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard, GiB")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  start = time.perf_counter()
  try:
    if args.command == "import":
      config = import_checkpoint(
        args.source,
        args.workdir,
        dtype=args.dtype,
        param_dtype=args.param_dtype,
        scan_layers=not args.no_scan_layers,
      )
      m = config.model
      print(
        f"{args.source} -> {args.workdir}: {m.num_layers} layers x {m.d_model}, {m.num_heads} heads "
        f"({m.num_kv_heads or m.num_heads} KV) of {m.head_dim}, {m.param_dtype} parameters "
        f"in {time.perf_counter() - start:.1f} s"
      )
    else:
      if args.max_shard_gb <= 0:
        raise ConversionError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
      hf = export_checkpoint(args.checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
      print(f"{args.checkpoint} -> {args.out}: {hf['architectures'][0]} in {time.perf_counter() - start:.1f} s")
  except (ConversionError, ConfigError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  # Converting is host work (reading, transposing on the CPU device, writing). A GPU backend would cost seconds,
  # host memory for its runtime and, with JAX's default preallocation, most of the GPU's memory.
  jax.config.update("jax_platforms", "cpu")
  sys.exit(main())
