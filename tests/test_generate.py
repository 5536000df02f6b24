"""The generation CLI on a checkpoint written by the training loop."""

import json
import re

import pytest

from fsjax import generate

from helpers import record_batch_sizes


def test_generates_from_a_training_workdir_and_a_step_directory(micro_workdir, capsys, tmp_path):
  workdir = micro_workdir
  assert generate.main(["--checkpoint", str(workdir), "--prompt", "The sea was", "--max-new-tokens", "5"]) == 0
  out, err = capsys.readouterr()
  assert out.startswith("The sea was")
  assert re.search(r"prefill of 3 tokens, then up to 5 new \(compiling first\): [\d.]+ s", err)  # not silent
  prompt_file = tmp_path / "prompt.txt"
  prompt_file.write_text("In 1842 the")
  step_dir = workdir / "checkpoints" / "2"
  assert (
    generate.main(
      [
        "--checkpoint",
        str(step_dir),
        "--prompt-file",
        str(prompt_file),
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--max-new-tokens",
        "4",
      ]
    )
    == 0
  )
  assert capsys.readouterr().out.startswith("In 1842 the")


def test_missing_checkpoint_is_one_clear_error(capsys, tmp_path):
  assert generate.main(["--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
  assert "checkpoint path does not exist" in capsys.readouterr().err


def test_a_file_given_as_checkpoint_is_called_a_file_not_missing(capsys, tmp_path):
  """`generate --checkpoint README.md` said "checkpoint path does not exist" of a file that exists."""
  (tmp_path / "README.md").write_text("# not a checkpoint\n")
  assert generate.main(["--checkpoint", str(tmp_path / "README.md"), "--prompt", "x"]) == 2
  err = capsys.readouterr().err
  assert "not a checkpoint" in err and "README.md is a file" in err and err.count("\n") == 1


def test_loading_a_checkpoint_logs_no_orbax_warnings(micro_workdir, caplog):
  """Each load printed three `WARNING:absl ... read_only` lines, cutting through progress bars."""
  with caplog.at_level("WARNING"):
    assert generate.main(["--checkpoint", str(micro_workdir), "--prompt", "The sea", "--max-new-tokens", "2"]) == 0
  read_only = [r.getMessage() for r in caplog.records if "read only" in r.getMessage() or "read_only" in r.getMessage()]
  assert read_only == []


def test_a_prompts_file_is_served_in_batches_each_row_equal_to_its_prompt_alone(
  micro_workdir, capsys, tmp_path, monkeypatch
):
  """Five prompts of different lengths, caps of their own, in batches of 2 (longest first): every record equals
  the same prompt generated alone with its cap (greedy), in the file's order, stopping at EOS or the cap; with
  --compact too."""
  prompts = [("The sea was", 3), ("In 1842 the old house on the hill", 6), ("A", 1), ("She said that", None)]
  prompts.append(("Once upon a time there was a king who had three daughters", 2))
  lines = [json.dumps({"prompt": p} if n is None else {"prompt": p, "max_new_tokens": n}) for p, n in prompts]
  path, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
  path.write_text("\n".join(lines) + "\n\n")  # a blank line is skipped
  argv = ["--checkpoint", str(micro_workdir), "--prompts-file", str(path), "--batch-size", "2"]
  assert generate.main([*argv, "--max-new-tokens", "4", "--out", str(out)]) == 0
  halving, sizes = tmp_path / "halving.jsonl", record_batch_sizes(monkeypatch)  # batches halving: the same records
  assert generate.main([*argv, "--max-new-tokens", "4", "--out", str(halving), "--compact"]) == 0
  assert halving.read_text() == out.read_text() and 1 in sizes
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["prompt"] for r in records] == [p for p, _ in prompts]
  for (prompt, cap), record in zip(prompts, records):
    cap = 4 if cap is None else cap
    assert record["new_tokens"] <= cap and record["stop"] in ("eos", "limit")
    assert (record["stop"] == "limit") == (record["new_tokens"] == cap)
    assert generate.main(["--checkpoint", str(micro_workdir), "--prompt", prompt, "--max-new-tokens", str(cap)]) == 0
    assert capsys.readouterr().out == prompt + record["completion"] + "\n"


@pytest.mark.parametrize(
  "content,message",
  [
    ('{"prompt": "a"}\nnot json\n', "prompts.jsonl:2: not JSON"),
    ('{"text": "a"}\n', 'prompts.jsonl:1: needs "prompt", a non-empty string'),
    ('{"prompt": "a", "max_new_tokens": 0}\n', 'prompts.jsonl:1: "max_new_tokens" must be an integer >= 1, got 0'),
    ("\n", "prompts.jsonl: no prompts"),
  ],
)
def test_a_bad_prompts_file_is_one_line_naming_file_and_line(capsys, tmp_path, content, message):
  path = tmp_path / "prompts.jsonl"
  path.write_text(content)
  assert generate.main(["--checkpoint", str(tmp_path / "nothing"), "--prompts-file", str(path)]) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1  # before the checkpoint is even looked at
