"""The packaged tokenizer: a 32,000-token byte-level BPE with LLaMA's special tokens and digit splitting.

`scripts/train_tokenizer.py` builds `tokenizer.json` from the packaged train corpus. Byte-level BPE covers
every string, so `decode(encode(text).ids) == text`; each digit is a token of its own; special tokens are never
parsed from text.
"""

from pathlib import Path

from tokenizers import Tokenizer

# Special tokens in id order: the trainer assigns them ids 0, 1, 2 as LLaMA does.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def default_tokenizer_path():
  """Path of the packaged `tokenizer.json`."""
  return Path(__file__).parent / "tokenizer.json"


def load_tokenizer(path=None):
  """Loads a HF `tokenizers` JSON file; `None` means the packaged one. Raises FileNotFoundError naming it."""
  path = Path(default_tokenizer_path() if path is None else path)
  if not path.is_file():
    raise FileNotFoundError(f"tokenizer file not found: {path}")
  tokenizer = Tokenizer.from_file(str(path))
  # Text is text: a literal "</s>" in a book must not become a document boundary (and must round-trip).
  # Special tokens enter token streams only by id. Not saved in the JSON file, so set on every load.
  tokenizer.encode_special_tokens = True
  return tokenizer


def _special_id(tokenizer, token):
  token_id = tokenizer.token_to_id(token)
  if token_id is None:
    raise ValueError(f"tokenizer has no {token} token")
  return token_id


def bos_id(tokenizer):
  """Id of `<s>` in `tokenizer` (1 for the packaged one)."""
  return _special_id(tokenizer, "<s>")


def eos_id(tokenizer):
  """Id of `</s>` in `tokenizer` (2 for the packaged one): the separator appended to every document."""
  return _special_id(tokenizer, "</s>")
