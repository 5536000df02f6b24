"""A batch whose rows stop at different caps: the fixed batch against the one that halves as rows finish.

    python benchmarks/ragged.py [--kinds fsl,tfpp] [--lengths 4096] [--batch 16] [--decode-tokens 256]
        [--preset fs_341m]

Random weights, bf16, scanned layers; each (kind, context) in its own subprocess. `--batch` rows of `context`
random prompt tokens; row i's cap is `(i + 1) * decode_tokens / batch`, so the rows finish one after another and
the batch's work is half of `batch × decode_tokens` steps. `fsjax.decode.generate` runs it with `compact=False`
(every row rides along to the last cap) and `compact=True` (`fsjax.compaction`); each is timed on its second call,
so compiles are excluded (the halving batch compiles one loop per size it reaches). Prints generated tokens/s
(the caps' sum over the time) and the ratio; greedy, so both must generate the same tokens (`same` in the JSON;
where they do not, `first_difference` gives each row's first differing token and `repeatable` whether each form
gives its own tokens again).
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from fsjax.config import model_preset
from fsjax.decode import generate

from cases import case_parser, random_model, run_cases


def run_case(kind, length, batch, decode_tokens, preset):
  vocab_size = model_preset(preset, kind=kind).vocab_size
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 0, vocab_size)
  _, model, variables = random_model(kind, preset, tokens[:1])
  limits = [(i + 1) * decode_tokens // batch for i in range(batch)]
  run = lambda compact: np.asarray(
    generate(
      model,
      variables,
      tokens,
      jnp.full((batch,), length),
      max_new_tokens=decode_tokens,
      eos_id=-1,
      limits=limits,
      compact=compact,
    )
  )
  seconds, outputs, repeats = {}, {}, {}
  for compact in (False, True):
    repeats[compact] = run(compact)  # compiles
    start = time.perf_counter()
    outputs[compact] = run(compact)
    seconds[compact] = time.perf_counter() - start
  tok_s = {compact: sum(limits) / s for compact, s in seconds.items()}
  differ = outputs[False] != outputs[True]
  return dict(
    kind=kind,
    length=length,
    batch=batch,
    fixed_tok_s=tok_s[False],
    halving_tok_s=tok_s[True],
    same=bool(not differ.any()),
    # where they differ: each row's first generated token that does (None: none), and whether each form gives
    # its own tokens again on a second run
    first_difference=[int(np.argmax(row)) if row.any() else None for row in differ],
    repeatable={name: bool((outputs[c] == repeats[c]).all()) for name, c in (("fixed", False), ("halving", True))},
    device=jax.devices()[0].device_kind,
  )


def main():
  parser = case_parser(__doc__, "4096")
  parser.set_defaults(kinds=["fsl", "tfpp"])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--decode-tokens", type=int, default=256)
  args = parser.parse_args()
  if args.case:
    kind, length = args.case
    print(json.dumps(run_case(kind, length, args.batch, args.decode_tokens, args.preset)), flush=True)
    return
  extra = ["--batch", str(args.batch), "--decode-tokens", str(args.decode_tokens), "--preset", args.preset]
  results = run_cases(__file__, args.kinds, args.lengths, extra, args.case_timeout)
  print(f"\n{args.preset}, bf16, scanned layers, {args.batch} rows, caps {args.decode_tokens // args.batch}..")
  print("| kind | context | fixed batch tok/s | halving batch tok/s | ratio | same tokens |")
  print("|---|---|---|---|---|---|")
  for r in results:
    if "error" in r:
      print(f"| {r['kind']} | {r['length']:,} | {r['error']} | | | |")
      continue
    ratio = r["halving_tok_s"] / r["fixed_tok_s"]
    print(
      f"| {r['kind']} | {r['length']:,} | {r['fixed_tok_s']:,.0f} | {r['halving_tok_s']:,.0f} | {ratio:.2f}x | "
      f"{r['same']} |"
    )


if __name__ == "__main__":
  main()
