"""RULER task generators, RULER file formats and scoring (fsjax.eval)."""

import collections
import json
import re

import pytest

from fsjax.data.tokenizer import load_tokenizer
from fsjax.eval import fitting, niah, records, scoring, tasks
from fsjax.eval.haystack import NEEDLE, NOISE, split_sentences
from fsjax.eval.synthetic import VT_EXAMPLE_LENGTH

_TOKENIZER = load_tokenizer()
TOKENIZERS = {
  "packaged-bpe": lambda text: len(_TOKENIZER.encode(text, add_special_tokens=False).ids),
  "whitespace": lambda text: len(text.split()),
  "bytes": lambda text: len(text.encode("utf-8")) // 3,  # a coarse third tokenizer: 3 bytes per token
}


def _needle_sentences(text):
  return re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text)


def test_generation_is_a_function_of_the_seed():
  first = tasks.generate("niah_multikey_1", 1024, 3, TOKENIZERS["packaged-bpe"], seed=42)
  assert first == tasks.generate("niah_multikey_1", 1024, 3, TOKENIZERS["packaged-bpe"], seed=42)
  other = tasks.generate("niah_multikey_1", 1024, 3, TOKENIZERS["packaged-bpe"], seed=7)
  assert [r["outputs"] for r in first] != [r["outputs"] for r in other]
  assert len({r["outputs"][0] for r in first}) == 3  # samples differ from each other


@pytest.mark.parametrize("tokenizer", sorted(TOKENIZERS))
@pytest.mark.parametrize(
  "task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"]
)
@pytest.mark.parametrize("length", [1024, 4096])
def test_exact_fit_fills_the_token_budget(task, length, tokenizer):
  """Prompt + generation budget fits the length, and one more haystack unit would not."""
  count = TOKENIZERS[tokenizer]
  for record in tasks.generate(task, length, 2, count, fit="exact"):
    cap = scoring.TOKENS_TO_GENERATE[scoring.task_family(task)]
    assert record["length"] == count(records.prompt(record)) + cap <= length
    seed = tasks.sample_seed(42, task, length, record["index"])
    make, _, largest = tasks.sampler(task)
    if record["haystack_size"] != largest:
      larger = make(record["haystack_size"] + 1, seed, length, count)
      assert count(larger[0] + larger[1]) + cap > length


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe"])
@pytest.mark.parametrize("length", [1024, 4096])
def test_ruler_fit_starts_every_sample_from_one_size_and_backs_off_by_rulers_step(task, length):
  """RULER's prepare.py: one size per (task, length), found on a draw of its own; a sample that does not fit it
  backs off by the task's step, so it holds the first size on that grid that fits."""
  count = TOKENIZERS["packaged-bpe"]
  cap = scoring.TOKENS_TO_GENERATE[scoring.task_family(task)]
  budget, (make, smallest, _) = length - cap, tasks.sampler(task)
  step = tasks.ruler_step(task, length, budget)
  tokens = lambda size, seed: count("".join(make(size, seed, length, count)[:2]))
  fit_seed = tasks.sample_seed(42, task, length, "fit")
  found = tasks.generate(task, length, 4, count)
  start = max(r["haystack_size"] for r in found)
  if task == "fwe":  # the last of RULER's grid from budget/6 words whose prompt is below the budget
    assert (start - budget // 6) % step == 0 and tokens(start, fit_seed) < budget <= tokens(start + step, fit_seed)
  else:  # the largest size the sizing draw holds
    assert tokens(start, fit_seed) <= budget < tokens(start + 1, fit_seed)
  for record in found:
    seed = tasks.sample_seed(42, task, length, record["index"])
    size = record["haystack_size"]
    assert record["length"] == count(records.prompt(record)) + cap <= length and size >= smallest
    if size - step >= smallest or tokens(start, seed) <= budget:
      assert (start - size) % step == 0 and (size == start or tokens(size + step, seed) > budget)
    else:  # a step would overshoot: the largest size that fits
      assert tokens(size + 1, seed) > budget
  assert found == tasks.generate(task, length, 4, count, fit="ruler")  # the default


def test_ruler_fit_leaves_prompts_shorter_than_exact_fit():
  count = TOKENIZERS["packaged-bpe"]
  ruler = tasks.generate("niah_single_2", 4096, 4, count)
  exact = tasks.generate("niah_single_2", 4096, 4, count, fit="exact")
  assert all(4096 - 64 <= r["length"] for r in exact)
  assert sum(r["length"] for r in ruler) < sum(r["length"] for r in exact)
  assert all(0.8 * 4096 <= r["length"] <= 4096 for r in ruler)
  with pytest.raises(ValueError, match="fit must be one of ruler, exact"):
    tasks.generate("vt", 4096, 1, count, fit="snug")


def test_64k_prompt_fits_under_the_packaged_tokenizer():
  (record,) = tasks.generate("niah_single_2", 65536, 1, TOKENIZERS["packaged-bpe"], fit="exact")
  assert 65536 - 64 <= record["length"] <= 65536


@pytest.mark.parametrize("task", sorted(niah.TASKS))
def test_each_asked_needle_appears_exactly_once(task):
  spec = niah.TASKS[task]
  for record in tasks.generate(task, 2048, 3, TOKENIZERS["packaged-bpe"]):
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
  ruler_style = [
    dict(index=17, input="ctx", outputs=["1"], length=30, length_w_model_temp=30, answer_prefix=" Answer:"),
    dict(index=3, input="c2", outputs=["2", "3"], length=9, length_w_model_temp=9, answer_prefix=" The"),
  ]
  path = tmp_path / "niah_single_1" / "validation.jsonl"
  records.write_jsonl(path, ruler_style)
  assert records.read_jsonl(path) == ruler_style
  assert records.prompt(ruler_style[0]) == "ctx Answer:"
  (tmp_path / "old.jsonl").write_text(json.dumps(dict(index=0, input="x The answer is", outputs=["1"])) + "\n")
  assert records.prompt(records.read_jsonl(tmp_path / "old.jsonl")[0]) == "x The answer is"
  (tmp_path / "bad.jsonl").write_text(json.dumps(dict(index=0, input="x", answer_prefix="")) + "\n")
  with pytest.raises(ValueError, match="bad.jsonl:1: record lacks RULER field"):
    records.read_jsonl(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("length", [1024, 4096])
def test_variable_tracking_answers_are_the_chain_of_the_asked_value(length):
  count = TOKENIZERS["packaged-bpe"]
  for record in tasks.generate("vt", length, 2, count):
    example, main = record["input"].rsplit("\n\nMemorize", 1)  # RULER: the one-shot example, "\n", the task
    value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
    assigned = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", main))
    chain, frontier = set(), {value}
    while frontier:
      new = {name for name, source in assigned.items() if source.removeprefix("VAR ") in frontier} - chain
      chain |= new
      frontier = new
    assert chain == set(record["outputs"]) and len(chain) == 5
    assert record["answer_prefix"].endswith(f"variables are assigned the value {value}, they are: ")
    # RULER c3f5e3b's layout: one noise sentence or statement per line, after the question's header.
    lines = main.split("\n")[2:-1]
    assert all(line == NOISE or re.fullmatch(r"VAR [A-Z]{5} = (VAR [A-Z]{5} |\d{5})", line) for line in lines)
    assert sum(line != NOISE for line in lines) == 5
    # The one-shot example: 3-letter names, answered, as many noise lines as fit its 500 tokens.
    prompt, answer = example.rsplit("they are: ", 1)
    assert re.fullmatch(r" [A-Z]{3}( [A-Z]{3}){4}", answer)  # RULER joins prompt and answer with one more space
    example_tokens = count(prompt + "they are: ")
    assert VT_EXAMPLE_LENGTH - count("\n" + NOISE) < example_tokens <= VT_EXAMPLE_LENGTH


@pytest.mark.parametrize("length,common,uncommon", [(1024, 6, 1), (4096, 30, 3)])
def test_common_words_are_the_ten_most_frequent_in_the_main_list(length, common, uncommon):
  (record,) = tasks.generate("cwe", length, 1, TOKENIZERS["packaged-bpe"])
  main = record["input"].split("\n")[-2]  # the main numbered list (the example comes first)
  counts = collections.Counter(re.findall(r"\d+\. (\S+)", main))
  assert {w for w, n in counts.items() if n == common} == set(record["outputs"]) and len(record["outputs"]) == 10
  assert all(n == uncommon for w, n in counts.items() if w not in record["outputs"])


def test_frequent_words_are_the_three_most_frequent_coded_words():
  (record,) = tasks.generate("fwe", 2048, 1, TOKENIZERS["packaged-bpe"])
  context = record["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0]
  counts = collections.Counter(w for w in context.split() if w != "...")
  top = [w for w, _ in counts.most_common(4)]
  assert top[:3] == record["outputs"] and counts[top[2]] > counts[top[3]]


def test_qa_reads_squad_and_hotpotqa_files_and_hides_the_gold_document(tmp_path):
  squad = {
    "data": [
      {
        "paragraphs": [
          {
            "context": f"Paragraph {a}-{p} about topic {a}.",
            "qas": [
              {"question": f"What is {a}-{p}?", "answers": [{"text": f"answer {a}-{p}"}], "is_impossible": False},
              {"question": "Unanswerable?", "answers": [], "is_impossible": True},
            ],
          }
          for p in range(3)
        ]
      }
      for a in range(4)
    ]
  }
  hotpot = [
    {"question": f"Q{i}?", "answer": f"A{i}", "context": [[f"T{i}", [f"S{i}a. ", f"S{i}b."]], [f"U{i}", [f"R{i}."]]]}
    for i in range(5)
  ]
  (tmp_path / "squad.json").write_text(json.dumps(squad))
  (tmp_path / "hotpot.json").write_text(json.dumps(hotpot))
  count = TOKENIZERS["packaged-bpe"]
  for record in tasks.generate("qa_1", 512, 3, count, squad=tmp_path / "squad.json"):
    name = re.search(r"Question: What is (\d-\d)\?", record["input"]).group(1)
    assert record["outputs"] == [f"answer {name}"] and f"Paragraph {name} about" in record["input"]
    assert record["answer_prefix"] == " Answer:" and record["length"] <= 512
  (record,) = tasks.generate("qa_2", 512, 1, count, hotpotqa=tmp_path / "hotpot.json")
  i = record["outputs"][0][1:]
  assert f"T{i}\nS{i}a. S{i}b." in record["input"] and f"U{i}\nR{i}." in record["input"]
  with pytest.raises(FileNotFoundError, match="qa_1 needs --squad"):
    tasks.generate("qa_1", 512, 1, count)


@pytest.mark.parametrize("limit", [None, 40])
def test_largest_fitting_finds_the_boundary_from_any_guess(limit):
  boundary = 37
  for guess in (0, 1, 36, 37, 38, 500):
    found = fitting.largest_fitting(lambda n: n <= boundary, guess, smallest=0, largest=limit)
    assert found == boundary
  assert fitting.largest_fitting(lambda n: True, 3, smallest=0, largest=40) == 40
  with pytest.raises(ValueError, match="cannot hold the smallest prompt"):
    fitting.largest_fitting(lambda n: n < 5, 10, smallest=5)
