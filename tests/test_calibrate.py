"""FS-B on a trained FS checkpoint: τ calibration, then generation and RULER through two forests."""

import json

import numpy as np
import pytest

from fsjax import calibrate, generate, loading
from fsjax.config import override_model
from fsjax.eval import ruler
from fsjax.train import checkpoint
from fsjax.train.checkpoint import CheckpointError


def test_calibrate_then_run_the_checkpoint_as_fsb(micro_workdir, tmp_path, capsys):
  as_fsb = ["--set", "attention.kind=fsb", "--set", "attention.beam=2"]
  prompt = ["--checkpoint", str(micro_workdir), "--prompt", "The sea was", "--max-new-tokens", "3"]
  assert generate.main([*prompt, *as_fsb]) == 2
  assert "an FS-B model needs τ: run `python -m fsjax.calibrate" in capsys.readouterr().err

  assert (
    calibrate.main(["--checkpoint", str(micro_workdir), "--batches", "2", "--batch-size", "2", "--length", "64"]) == 0
  )
  assert "τ for 1 layers x 2 heads" in capsys.readouterr().out
  with open(micro_workdir / "calibration.json") as f:
    saved = json.load(f)
  assert saved["step"] == 2 and saved["windows"] == 4
  tau = np.asarray(saved["tau"])
  assert tau.shape == (1, 2) and np.all(tau > 0)  # one layer, two heads

  assert generate.main([*prompt, *as_fsb]) == 0
  assert capsys.readouterr().out.startswith("The sea was")
  assert (
    ruler.main(
      [
        "--checkpoint",
        str(micro_workdir),
        "--tasks",
        "niah_single_1",
        "--lengths",
        "384",
        "--num-samples",
        "2",
        "--batch-size",
        "2",
        "--out",
        str(tmp_path / "ruler"),
        *as_fsb,
      ]
    )
    == 0
  )


def test_a_calibration_of_another_step_is_refused(micro_workdir, tmp_path):
  (tmp_path / "checkpoints").symlink_to(micro_workdir / "checkpoints")
  (tmp_path / "calibration.json").write_text(json.dumps(dict(step=1, length=64, windows=4, tau=[[1.0, 1.0]])))
  config, _, frozen, _ = checkpoint.load(str(tmp_path))
  with pytest.raises(CheckpointError, match="computed for step 1, the checkpoint is step 2"):
    loading.attach_tau(override_model(config.model, ["attention.kind=fsb"]), frozen, str(tmp_path))
  with pytest.raises(CheckpointError, match="computed for step 1, the checkpoint is step 2"):
    loading.load_model(str(tmp_path), ["attention.kind=fsb"])
