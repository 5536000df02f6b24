"""RULER NIAH generators, RULER file formats and scoring (fsjax.eval)."""

import json
import re

import pytest

from fsjax.data.tokenizer import load_tokenizer
from fsjax.eval import niah, records, scoring
from fsjax.eval.haystack import NEEDLE, split_sentences

_TOKENIZER = load_tokenizer()
TOKENIZERS = {
    "packaged-bpe": lambda text: len(_TOKENIZER.encode(text, add_special_tokens=False).ids),
    "whitespace": lambda text: len(text.split()),
    "bytes": lambda text: len(text.encode("utf-8")) // 3,  # a coarse third tokenizer: 3 bytes per token
}


def _needle_sentences(text):
  return re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text)


def test_generation_is_a_function_of_the_seed():
  first = niah.generate("niah_multikey_1", 1024, 3, TOKENIZERS["packaged-bpe"], seed=42)
  assert first == niah.generate("niah_multikey_1", 1024, 3, TOKENIZERS["packaged-bpe"], seed=42)
  other = niah.generate("niah_multikey_1", 1024, 3, TOKENIZERS["packaged-bpe"], seed=7)
  assert [r["outputs"] for r in first] != [r["outputs"] for r in other]
  assert len({r["outputs"][0] for r in first}) == 3  # samples differ from each other


@pytest.mark.parametrize("tokenizer", sorted(TOKENIZERS))
@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multikey_3"])
@pytest.mark.parametrize("length", [1024, 4096])
def test_haystack_fills_the_token_budget_exactly(task, length, tokenizer):
  """Prompt + generation budget fits the length, and one more haystack unit would not."""
  count = TOKENIZERS[tokenizer]
  for record in niah.generate(task, length, 2, count):
    assert record["length"] == count(records.prompt(record)) + niah.TOKENS_TO_GENERATE <= length
    seed = niah.sample_seed(42, task, length, record["index"])
    larger = niah.make_sample(task, record["haystack_size"] + 1, seed)
    assert count(larger[0] + larger[1]) + niah.TOKENS_TO_GENERATE > length


def test_64k_prompt_fits_under_the_packaged_tokenizer():
  (record,) = niah.generate("niah_single_2", 65536, 1, TOKENIZERS["packaged-bpe"])
  assert 65536 - 64 <= record["length"] <= 65536


@pytest.mark.parametrize("task", sorted(niah.TASKS))
def test_each_asked_needle_appears_exactly_once(task):
  spec = niah.TASKS[task]
  for record in niah.generate(task, 2048, 3, TOKENIZERS["packaged-bpe"]):
    text = record["input"]
    assert len(record["outputs"]) == spec.num_queries * spec.num_values
    for value in record["outputs"]:
      assert text.count(value) == 1, value
    needles = _needle_sentences(text)
    asked = [key for key, value in needles if value in record["outputs"]]
    assert len(asked) == len(record["outputs"])
    for key in set(asked):
      assert key in record["answer_prefix"] and key in text.split("\n")[-1]  # the question names it
    assert record["answer_prefix"].startswith(" The special magic")
    assert text.startswith("Some special magic" if len(record["outputs"]) > 1 else "A special magic")


def test_noise_haystack_is_rulers_sentence_and_needle_haystack_is_distractor_needles():
  text, _, _ = niah.make_sample("niah_single_1", 5, seed=1)
  assert text.count("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.") == 5
  text, _, answers = niah.make_sample("niah_multikey_2", 5, seed=1)
  assert len(_needle_sentences(text)) == 6 and NEEDLE.split("{")[0] in text


def test_sentence_splitter_keeps_text_and_quotes():
  text = 'He said "Stop." Then it ended! Did it? Yes.  3 cats.'
  sentences = split_sentences(text)
  assert sentences == ['He said "Stop."', "Then it ended!", "Did it?", "Yes.", "3 cats."]
  assert " ".join(sentences) == re.sub(r"\s+", " ", text)


def test_scoring_matches_rulers_metrics_on_crafted_predictions():
  refs = [["1234567"], ["a", "b"], ["x", "y"]]
  preds = [" The number is 1234567.", "A only", "nothing\x00here"]
  assert scoring.string_match_all(preds, refs) == round(100 * (1 + 0.5 + 0) / 3, 2)
  assert scoring.string_match_part(preds, refs) == round(100 * (1 + 1 + 0) / 3, 2)
  assert scoring.postprocess("  ab\x01cd \n") == "ab\ncd"
  assert scoring.score("niah_multivalue", preds, refs) == 50.0
  assert scoring.score("qa_2", preds, refs) == 66.67
  with pytest.raises(ValueError, match="unknown RULER task"):
    scoring.score("needle", preds, refs)


def test_ruler_jsonl_round_trip_keeps_order_and_index(tmp_path):
  ruler_style = [dict(index=17, input="ctx", outputs=["1"], length=30, length_w_model_temp=30,
                      answer_prefix=" Answer:"), dict(index=3, input="c2", outputs=["2", "3"], length=9,
                                                      length_w_model_temp=9, answer_prefix=" The")]
  path = tmp_path / "niah_single_1" / "validation.jsonl"
  records.write_jsonl(path, ruler_style)
  assert records.read_jsonl(path) == ruler_style
  assert records.prompt(ruler_style[0]) == "ctx Answer:"
  (tmp_path / "bad.jsonl").write_text(json.dumps(dict(index=0, input="x", outputs=["1"])) + "\n")
  with pytest.raises(ValueError, match="bad.jsonl:1: record lacks RULER field"):
    records.read_jsonl(tmp_path / "bad.jsonl")
