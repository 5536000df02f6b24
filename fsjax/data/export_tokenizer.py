"""Export a tokenizer as a Hugging Face tokenizer directory that older `tokenizers` releases load, e.g. the one
NVIDIA RULER pins (transformers 4.44.2 with tokenizers 0.19, which predates the `[left, right]` merge pairs the
packaged `tokenizer.json` is saved with).

    python -m fsjax.data.export_tokenizer OUT_DIR [--tokenizer tokenizer.json]

Writes `OUT_DIR/tokenizer.json` (merges as "left right" strings: the same merges in the same order, so the same
ids) and `OUT_DIR/tokenizer_config.json` (a `PreTrainedTokenizerFast` with `<s>`, `</s>`, `<unk>`), so that
`AutoTokenizer.from_pretrained(OUT_DIR)` works, e.g. `--tokenizer_type hf --tokenizer_path OUT_DIR` in RULER's
`prepare.py`. One difference stays: fsjax never parses special tokens out of text (`load_tokenizer`), while a
Hugging Face tokenizer turns a literal "</s>" in the text into the special token; the haystacks hold none.
"""

import json
import sys
from pathlib import Path

from fsjax import cli
from fsjax.data.tokenizer import SPECIAL_TOKENS, default_tokenizer_path

UNK, BOS, EOS = SPECIAL_TOKENS


def legacy_merges(tokenizer_json):
  """The tokenizer JSON (a dict) with its BPE merges as "left right" strings. Raises ValueError for a merge part
  that holds a space, which that format cannot express."""
  model = dict(tokenizer_json["model"])
  merges = []
  for merge in model.get("merges", []):
    if isinstance(merge, str):
      merges.append(merge)
      continue
    if any(" " in part for part in merge):
      raise ValueError(f"merge {merge!r} holds a space: the older merge format cannot express it")
    merges.append(" ".join(merge))
  model["merges"] = merges
  return {**tokenizer_json, "model": model}


def export(out_dir, tokenizer_path=None):
  """Writes `tokenizer.json` and `tokenizer_config.json` under `out_dir` (created); returns the directory."""
  source = Path(default_tokenizer_path() if tokenizer_path is None else tokenizer_path)
  if not source.is_file():
    raise FileNotFoundError(f"tokenizer file not found: {source}")
  try:
    tokenizer_json = json.loads(source.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{source}: not a tokenizer JSON file ({e})") from None
  if tokenizer_json.get("model", {}).get("type") != "BPE":
    raise ValueError(f"{source}: only BPE tokenizers are exported")
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "tokenizer.json").write_text(json.dumps(legacy_merges(tokenizer_json), ensure_ascii=False), encoding="utf-8")
  config = dict(
    tokenizer_class="PreTrainedTokenizerFast",
    unk_token=UNK,
    bos_token=BOS,
    eos_token=EOS,
    clean_up_tokenization_spaces=False,
  )
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return out


def main(argv=None):
  parser = cli.parser(__doc__)
  parser.add_argument("out_dir", help="directory to write tokenizer.json and tokenizer_config.json into")
  parser.add_argument("--tokenizer", default=None, help="tokenizer.json to export (default: the packaged one)")
  args = parser.parse_args(argv)
  try:
    out = export(args.out_dir, args.tokenizer)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer_config.json'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
