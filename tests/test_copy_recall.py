"""The long-range copy-recall probe (fsjax.eval.copy_recall): its samples and its scoring."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax.eval import copy_recall


def test_samples_end_in_a_copy_of_an_early_span_and_controls_differ_only_there():
  stream = np.random.default_rng(0).integers(3, 1000, 5000).astype(np.int32)
  copies, controls, sources = copy_recall.make_samples(stream, 400, 6, span=16, seed=1)
  assert copies.shape == controls.shape == (6, 400) and copies.dtype == np.int32
  for row, s in enumerate(sources):
    assert 0 <= s < copy_recall.SOURCE_RANGE
    np.testing.assert_array_equal(copies[row, -16:], copies[row, s : s + 16])
    np.testing.assert_array_equal(controls[row, -16:], copies[row, -16:])
    differs = np.flatnonzero(copies[row] != controls[row])
    assert differs.size and differs.min() >= s and differs.max() < s + 16
  again = copy_recall.make_samples(stream, 400, 6, span=16, seed=1)
  np.testing.assert_array_equal(again[0], copies)


def test_needle_samples_plant_random_ids_as_the_source_in_the_same_windows():
  stream = np.random.default_rng(0).integers(1000, 2000, 5000).astype(np.int32)
  plain, _, plain_sources = copy_recall.make_samples(stream, 400, 6, span=16, seed=1)
  copies, controls, sources = copy_recall.make_samples(stream, 400, 6, span=16, seed=1, needle_ids=(3, 50))
  np.testing.assert_array_equal(sources, plain_sources)
  for row, s in enumerate(sources):
    needle, decoy = copies[row, s : s + 16], controls[row, s : s + 16]
    assert needle.min() >= 3 and needle.max() < 50 and decoy.min() >= 3 and decoy.max() < 50
    assert not np.array_equal(needle, decoy)
    np.testing.assert_array_equal(copies[row, -16:], needle)
    np.testing.assert_array_equal(controls[row, -16:], needle)
    outside = np.ones(400, bool)
    outside[s : s + 16] = outside[-16:] = False
    np.testing.assert_array_equal(copies[row, outside], plain[row, outside])  # the haystack is the plain window
    np.testing.assert_array_equal(controls[row, outside], plain[row, outside])


class _NextTokenModel:
  """Logits peaked on a chosen next token: the sequence's true continuation, or a token it never holds."""

  def __init__(self, right):
    self.right = right

  def apply(self, variables, tokens):
    target = jnp.roll(tokens, -1, axis=1) if self.right else jnp.zeros_like(tokens)
    return jax.nn.one_hot(target, 1000) * 30.0


@pytest.mark.parametrize("right", [True, False])
def test_scores_count_only_the_copy_tokens_after_the_cue(right):
  stream = np.random.default_rng(2).integers(3, 1000, 3000).astype(np.int32)
  copies, _, _ = copy_recall.make_samples(stream, 300, 3, span=12, seed=0)
  hits, losses = copy_recall.score_copies(_NextTokenModel(right), {}, copies, span=12, cue=4, batch_size=2)
  assert hits.shape == losses.shape == (3, 8)
  assert hits.all() if right else not hits.any()
  assert (losses < 1e-3).all() if right else (losses > 29).all()


@pytest.mark.parametrize(
  "argv,message",
  [
    (["--lengths", "100"], "--lengths: 100 is below"),
    (["--lengths", "1024", "--span", "4", "--cue", "4"], "--span must be > --cue"),
    (["--lengths", "1024", "--samples", "0"], "--samples"),
    (["--lengths", "1024", "--random-ids", "9,9"], "--random-ids must be MIN,MAX with 0 <= MIN < MAX"),
    (["--lengths", "1024", "--random-ids", "3,99", "--data", "x.txt"], "--random-ids and --data"),
    (["--lengths", "1024", "--needle-ids", "9"], "--needle-ids must be MIN,MAX with 0 <= MIN < MAX"),
    (["--lengths", "1024", "--needle-ids", "3,99", "--random-ids", "3,99"], "no needle stands out"),
  ],
)
def test_bad_arguments_get_one_clear_error(argv, message, capsys):
  assert copy_recall.main(["--checkpoint", "nowhere", *argv]) == 2
  assert message in capsys.readouterr().err


def test_cli_scores_each_length_and_writes_csv(micro_workdir, tmp_path, capsys):
  out = tmp_path / "copy.csv"
  assert (
    copy_recall.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--lengths",
        "160",
        "--samples",
        "3",
        "--span",
        "8",
        "--cue",
        "2",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  (row,) = list(csv.DictReader(out.open()))
  assert row["length"] == "160" and row["source"] == "text" and int(row["distance"]) < 160 - 8
  assert float(row["recall"]) == pytest.approx(float(row["copy_accuracy"]) - float(row["control_accuracy"]))
  assert f"| {micro_workdir.name}@2 | 160 |" in capsys.readouterr().out


def test_random_id_samples_and_their_vocabulary_check(micro_workdir, tmp_path, capsys):
  """`--random-ids`: windows of a seeded uniform stream (so the control's accuracy is chance), ids checked
  against the model's vocabulary before scoring."""
  stream = copy_recall.random_stream((3, 40), 300, seed=0)
  assert stream.shape == (1200,) and stream.min() >= 3 and stream.max() < 40
  np.testing.assert_array_equal(stream, copy_recall.random_stream((3, 40), 300, seed=0))
  out = tmp_path / "copy.csv"
  args = ["--checkpoint", str(micro_workdir), "--lengths", "160", "--samples", "2", "--span", "8", "--cue", "2"]
  assert copy_recall.main([*args, "--random-ids", "3,40", "--out", str(out)]) == 0
  (row,) = list(csv.DictReader(out.open()))
  assert row["length"] == "160" and row["source"] == "random ids"
  assert copy_recall.main([*args, "--random-ids", "3,100000"]) == 2
  assert "--random-ids must lie below the model's vocab_size=" in capsys.readouterr().err
  assert copy_recall.main([*args, "--needle-ids", "3,100000"]) == 2
  assert "--needle-ids must lie below the model's vocab_size=" in capsys.readouterr().err


def test_needle_samples_from_the_cli(micro_workdir, tmp_path):
  out = tmp_path / "copy.csv"
  assert (
    copy_recall.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--lengths",
        "160",
        "--samples",
        "2",
        "--span",
        "8",
        "--cue",
        "2",
        "--needle-ids",
        "3,40",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  (row,) = list(csv.DictReader(out.open()))
  assert row["source"] == "needle ids" and row["length"] == "160"
