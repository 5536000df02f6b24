"""The packaged tokenizer: a 32,000-token byte-level BPE with LLaMA's special tokens and digit splitting.

`scripts/train_tokenizer.py` builds `tokenizer.json` from the packaged train corpus. Byte-level BPE covers
every string, so `decode(encode(text).ids) == text`; each digit is a token of its own; special tokens are never
parsed from text.

Any other tokenizer file loads too (`data.tokenizer`). Its BOS and EOS tokens are the ones a
`tokenizer_config.json` beside it names (`bos_token`, `eos_token`: Hugging Face's convention, which an imported
checkpoint's workdir follows, `fsjax.convert`), else LLaMA's `<s>` and `</s>` as the packaged one has them.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer

# Special tokens in id order: the trainer assigns them ids 0, 1, 2 as LLaMA does.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKENIZER_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json: names its special tokens


def default_tokenizer_path():
  """Path of the packaged `tokenizer.json`."""
  return Path(__file__).parent / "tokenizer.json"


def load_tokenizer(path=None):
  """Loads a HF `tokenizers` JSON file; `None` means the packaged one. Raises FileNotFoundError naming it.

  The tokenizer's `bos_token` and `eos_token` attributes (strings, or None for a token it has not) are what
  `bos_id` and `eos_id` look up: see the module docstring."""
  path = Path(default_tokenizer_path() if path is None else path)
  if not path.is_file():
    raise FileNotFoundError(f"tokenizer file not found: {path}")
  tokenizer = Tokenizer.from_file(str(path))
  # Text is text: a literal "</s>" in a book must not become a document boundary (and must round-trip).
  # Special tokens enter token streams only by id. Not saved in the JSON file, so set on every load.
  tokenizer.encode_special_tokens = True
  tokenizer.bos_token, tokenizer.eos_token = special_tokens(path)
  return tokenizer


def special_tokens(path):
  """`(bos_token, eos_token)` of the tokenizer file at `path`: those its `tokenizer_config.json` names (None
  where it names none), else `("<s>", "</s>")`. Raises ValueError for a tokenizer_config.json that is not JSON."""
  config_path = Path(path).parent / TOKENIZER_CONFIG
  if not config_path.is_file():
    return SPECIAL_TOKENS[1:]
  try:
    config = json.loads(config_path.read_text(encoding="utf-8"))
  except ValueError as e:
    raise ValueError(f"{config_path}: not JSON ({e})") from None
  # transformers writes a token as its string, or as an AddedToken dict with the string under "content".
  name = lambda token: token.get("content") if isinstance(token, dict) else token
  return name(config.get("bos_token")), name(config.get("eos_token"))


def _special_id(tokenizer, kind, default):
  token = getattr(tokenizer, f"{kind}_token", default)  # a tokenizer not from load_tokenizer: LLaMA's names
  if token is None:
    raise ValueError(f"tokenizer has no {kind.upper()} token (its {TOKENIZER_CONFIG} names none)")
  token_id = tokenizer.token_to_id(token)
  if token_id is None:
    raise ValueError(f"tokenizer has no {token} token")
  return token_id


def bos_id(tokenizer):
  """Id of the BOS token of `tokenizer` (`<s>`, 1 for the packaged one)."""
  return _special_id(tokenizer, "bos", SPECIAL_TOKENS[1])


def eos_id(tokenizer):
  """Id of the EOS token of `tokenizer` (`</s>`, 2 for the packaged one): the separator appended to every
  document, and where generation stops."""
  return _special_id(tokenizer, "eos", SPECIAL_TOKENS[2])
