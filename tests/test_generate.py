"""The generation CLI on a checkpoint written by the training loop."""

import re

from fsjax import generate


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
