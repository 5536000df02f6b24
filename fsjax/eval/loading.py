"""Loading a checkpoint for evaluation: config overrides from the command line, FS-B's τ, a display name."""

from pathlib import Path

from fsjax.config import override_model


def load_for_eval(path, assignments=()):
  """The model of a training checkpoint, as the evaluation CLIs run it.

  Args:
    path: a training workdir or one of its step directories.
    assignments: `KEY=VALUE` overrides of model config fields (e.g. `attention.kind=fsb`); τ is inserted from
      the checkpoint's calibration file when they make it an FS-B model.

  Returns:
    (name, config, model, variables): `name` is `<workdir>@<step>` followed by `[field=value]` per override;
    `config` is the training config as saved (its data section says how the model was trained); `model` is
    built from the overridden model config (`model.config`).
  """
  from fsjax.calibrate import attach_tau
  from fsjax.model import Transformer
  from fsjax.train import checkpoint

  config, params, frozen, step = checkpoint.load(path)
  model_config = override_model(config.model, list(assignments))
  variables = {"params": params, **attach_tau(model_config, frozen, path)}
  name = f"{Path(path).name}@{step}" + "".join(
      f"[{key.split('.')[-1]}={value}]" for key, value in (a.split("=", 1) for a in assignments))
  return name, config, Transformer(model_config), variables
