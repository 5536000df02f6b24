"""The tokenizer export for older Hugging Face stacks (NVIDIA RULER's pinned transformers 4.44 / tokenizers 0.19).
Checked by hand with those versions: `AutoTokenizer.from_pretrained` on the exported directory gives the packaged
tokenizer's ids on 41 texts (484K characters); here, what the current `tokenizers` can check."""

import json

import pytest
from tokenizers import Tokenizer

from fsjax.data import export_tokenizer
from fsjax.data.tokenizer import load_tokenizer

TEXTS = [
  "The grass is green. The sky is blue. VAR ABC = 12345 \n",
  "1. apple 2. über naïve — “quoted” 3.14159\t\ttabs  two  spaces",
  "Some special magic numbers are hidden within the following text.",
]


def test_export_keeps_every_merge_in_the_older_format_and_the_same_ids(tmp_path, capsys):
  assert export_tokenizer.main([str(tmp_path / "hf")]) == 0
  assert "tokenizer_config.json" in capsys.readouterr().out
  exported = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
  packaged = json.loads(export_tokenizer.default_tokenizer_path().read_text())
  assert exported["model"]["merges"] == [" ".join(pair) for pair in packaged["model"]["merges"]]
  assert all(isinstance(merge, str) for merge in exported["model"]["merges"])
  ours, theirs = load_tokenizer(), Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
  for text in TEXTS:
    assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text, add_special_tokens=False).ids
  config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
  assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == "</s>"


def test_a_merge_with_a_space_is_refused_and_bad_files_are_one_line(tmp_path, capsys):
  with pytest.raises(ValueError, match="holds a space"):
    export_tokenizer.legacy_merges({"model": {"type": "BPE", "merges": [["a b", "c"]]}})
  (tmp_path / "bad.json").write_text("{not json")
  assert export_tokenizer.main([str(tmp_path / "out"), "--tokenizer", str(tmp_path / "bad.json")]) == 2
  assert "bad.json: not a tokenizer JSON file" in capsys.readouterr().err
  assert export_tokenizer.main([str(tmp_path / "out"), "--tokenizer", str(tmp_path / "missing.json")]) == 2
  assert "tokenizer file not found" in capsys.readouterr().err
