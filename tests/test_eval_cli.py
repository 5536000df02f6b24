"""The RULER CLI end to end on a tiny checkpoint written by the training loop (an untrained model: the point is
the pipeline — generation, predictions, RULER scores, CSV, plot — not the scores)."""

import csv
import json
import re

import pytest
from conftest import MICRO_CONFIG

import train as train_cli
from fsjax.data.tokenizer import load_tokenizer
from fsjax.eval import make_data, records, ruler, tasks


def test_two_tasks_at_two_lengths_write_predictions_scores_and_plot(micro_workdir, tmp_path, capsys):
  workdir = micro_workdir
  out = tmp_path / "ruler"
  assert (
    ruler.main(
      [
        "--checkpoint",
        str(workdir),
        "--tasks",
        "niah_single_1,niah_multivalue",
        "--lengths",
        "384,512",
        "--num-samples",
        "3",
        "--batch-size",
        "2",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  with (out / "scores.csv").open() as f:
    rows = list(csv.DictReader(f))
  assert {(r["task"], r["length"]) for r in rows} == {
    (t, n) for t in ("niah_single_1", "niah_multivalue") for n in ("384", "512")
  }
  assert all(r["samples"] == "3" and 0.0 <= float(r["score"]) <= 100.0 for r in rows)
  assert (out / "scores.png").stat().st_size > 0
  predictions = records.read_jsonl(out / f"{workdir.name}@2" / "512" / "niah_multivalue.jsonl")
  assert len(predictions) == 3 and all(isinstance(p["pred"], str) for p in predictions)
  # RULER's evaluate.py reads `others` (a KeyError on files without it) beside `pred`, as its call_api.py writes
  assert all(p["others"] == {} and p["truncation"] == -1 for p in predictions)
  captured = capsys.readouterr()
  assert "| niah_multivalue |" in captured.out
  assert re.search(rf"{workdir.name}@2: niah_multivalue at 512 tokens: [\d.]+ s", captured.err)  # cli.stage


def test_ruler_files_are_read_and_scored(micro_workdir, tmp_path):
  """A RULER-generated file (non-sequential index) is evaluated as given."""
  workdir = micro_workdir
  data = tmp_path / "data" / "384" / "qa_1" / "validation.jsonl"
  records.write_jsonl(
    data,
    [
      dict(
        index=40 + i,
        input=f"Question {i}?",
        outputs=["Paris", "paris"],
        length=20,
        length_w_model_temp=20,
        answer_prefix=" Answer:",
      )
      for i in range(2)
    ],
  )
  out = tmp_path / "out"
  assert (
    ruler.main(
      [
        "--checkpoint",
        str(workdir),
        "--tasks",
        "qa_1",
        "--lengths",
        "384",
        "--num-samples",
        "5",
        "--ruler-data",
        str(tmp_path / "data"),
        "--out",
        str(out),
      ]
    )
    == 0
  )
  scored = records.read_jsonl(out / f"{workdir.name}@2" / "384" / "qa_1.jsonl")
  assert [r["index"] for r in scored] == [40, 41]


def test_qa_without_its_dataset_is_skipped_with_a_message(micro_workdir, tmp_path, capsys):
  assert (
    ruler.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--tasks",
        "fwe,qa_1",
        "--lengths",
        "384",
        "--num-samples",
        "1",
        "--out",
        str(tmp_path),
      ]
    )
    == 0
  )
  captured = capsys.readouterr()
  assert "skipping qa_1: it needs --squad" in captured.err
  assert "| fwe |" in captured.out and "qa_1" not in captured.out


@pytest.mark.parametrize(
  "args,message",
  [
    (["--tasks", "needle_9"], "is not a RULER task"),
    (["--lengths", "100"], "leaves no room for a prompt"),
    (["--num-samples", "0"], "--num-samples and --batch-size must be >= 1"),
  ],
)
def test_bad_arguments_are_one_clear_error(tmp_path, capsys, args, message):
  assert ruler.main(["--checkpoint", str(tmp_path), *args]) == 2
  assert message in capsys.readouterr().err


def test_training_reports_s_niah_at_one_and_four_times_its_length(tmp_path, capsys):
  overrides = ["train.steps=1", "data.seq_len=256", "eval.niah_samples=2", "checkpoint.async_save=false"]
  assert (
    train_cli.main(
      ["--config", MICRO_CONFIG, "--workdir", str(tmp_path / "run"), *(arg for o in overrides for arg in ("--set", o))]
    )
    == 0
  )
  summary = json.loads((tmp_path / "run" / "eval.json").read_text())
  assert list(summary)[-2:] == ["s_niah_1@256", "s_niah_1@1024"]
  assert all(0.0 <= summary[k] <= 100.0 for k in ("s_niah_1@256", "s_niah_1@1024"))
  assert "| s_niah_1@256 | s_niah_1@1024 |" in capsys.readouterr().out


def test_task_files_written_offline_are_read_back_by_the_evaluator(micro_workdir, tmp_path):
  data = tmp_path / "data"
  assert (
    make_data.main(["--tasks", "niah_multikey_3,cwe", "--lengths", "1024", "--num-samples", "2", "--out", str(data)])
    == 0
  )
  written = records.read_jsonl(data / "1024" / "cwe" / "validation.jsonl")
  assert len(written) == 2 and all(r["length"] <= 1024 for r in written)
  count = lambda text: len(load_tokenizer().encode(text, add_special_tokens=False).ids)
  assert written == tasks.generate("cwe", 1024, 2, count, fit="ruler")  # RULER's sizing is the default
  exact = ["--tasks", "cwe", "--lengths", "1024", "--num-samples", "2", "--fit", "exact", "--out", str(tmp_path / "e")]
  assert make_data.main(exact) == 0
  assert records.read_jsonl(tmp_path / "e" / "1024" / "cwe" / "validation.jsonl") == tasks.generate(
    "cwe", 1024, 2, count, fit="exact"
  )
  assert (
    ruler.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--tasks",
        "niah_multikey_3,cwe",
        "--lengths",
        "1024",
        "--num-samples",
        "2",
        "--ruler-data",
        str(data),
        "--out",
        str(tmp_path / "out"),
      ]
    )
    == 0
  )
  assert make_data.main(["--tasks", "qa_1", "--out", str(data)]) == 2


def test_plot_keeps_each_models_color_across_panels_and_lists_every_model():
  """A model missing from the first panel is still in the legend, and no panel shifts another model's color."""
  import matplotlib.pyplot as plt

  rows = [
    dict(model="a", task="t1", length=1024, score=10.0),
    dict(model="a", task="t2", length=1024, score=20.0),
    dict(model="b", task="t2", length=1024, score=30.0),
    dict(model="b", task="t2", length=4096, score=0.0),
  ]
  chart = ruler.figure(rows)
  try:
    colors = {}
    for ax in chart.axes:
      for line in ax.get_lines():
        assert colors.setdefault(line.get_label(), line.get_color()) == line.get_color()
    assert set(colors) == {"a", "b"} and colors["a"] != colors["b"]
    legend = chart.legends[0]
    assert [text.get_text() for text in legend.get_texts()] == ["a", "b"]
    assert [handle.get_color() for handle in legend.legend_handles] == [colors["a"], colors["b"]]
  finally:
    plt.close(chart)
