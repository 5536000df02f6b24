"""Loading a training checkpoint to run it: `--set` overrides of the model config, FS-B's τ, a display name.

One entry point, `load_model`, serves generation, the evaluation CLIs, the routing probes and τ calibration. FS-B's
τ (FS Eq. 10) is not trained: `python -m fsjax.calibrate` writes it to `<workdir>/calibration.json`, and
`load_model` inserts it when the overrides turn a checkpoint into an FS-B model.
"""

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax.numpy as jnp

from fsjax.config import Config, ConfigError, override_model
from fsjax.data.tokenizer import load_tokenizer
from fsjax.model import Transformer
from fsjax.train.checkpoint import CHECKPOINT_SUBDIR, CheckpointError, load, parameter_fault, resolve

CALIBRATION_FILE = "calibration.json"


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
  """A checkpoint ready to run.

  Attributes:
    name: `<workdir>@<step>` followed by `[field=value]` per override: how results name the model.
    config: the training config as saved (its data section says how the model was trained; its model section is
      the one before the overrides).
    model: the `Transformer` of the overridden model config (`model.config`).
    variables: `{"params": ..., **frozen collections}`, with FS-B's τ in "routing" when the model is FS-B.
    step: the checkpoint's step.
  """

  name: str
  config: Config
  model: Transformer
  variables: dict
  step: int

  @functools.cached_property
  def tokenizer_path(self):
    """The tokenizer the model was trained with (None: the packaged one), for reading text into the model.
    ConfigError when it has ids the model's embedding lacks (an associative-recall model's small vocabulary):
    such ids would embed as NaN and every score would come out NaN."""
    size = load_tokenizer(self.config.data.tokenizer).get_vocab_size()
    if size > self.model.config.vocab_size:
      raise ConfigError(
        f"{self.name} reads no text: its model.vocab_size is {self.model.config.vocab_size}, its tokenizer has "
        f"{size} ids (it was trained on data.source {self.config.data.source!r})"
      )
    return self.config.data.tokenizer


def load_model(checkpoint, overrides=()):
  """Loads a training checkpoint as a model to run.

  Args:
    checkpoint: a training workdir (its latest step) or one of its step directories.
    overrides: `KEY=VALUE` overrides of model config fields (e.g. `attention.kind=fsb`, `attention.zha.top_p=0.8`);
      τ is inserted from the checkpoint's calibration file when they make it an FS-B model.

  Returns:
    A `LoadedModel`.

  Raises:
    CheckpointError: no checkpoint at `checkpoint`, or an FS-B model without a usable calibration file.
    ConfigError: an override names an unknown field or breaks a config rule.
  """
  config, params, frozen, step = load(checkpoint)
  fault = parameter_fault(params, config.train.max_abs_param)
  if fault:
    print(f"warning: {checkpoint} (step {step}) holds {fault}", file=sys.stderr)
  model_config = override_model(config.model, list(overrides))
  variables = {"params": params, **attach_tau(model_config, frozen, checkpoint)}
  name = f"{Path(workdir_of(checkpoint)[0]).name}@{step}" + "".join(
    f"[{key.split('.')[-1]}={value}]" for key, value in (a.split("=", 1) for a in overrides)
  )
  return LoadedModel(name=name, config=config, model=Transformer(model_config), variables=variables, step=step)


def workdir_of(checkpoint_path):
  """The training workdir of a workdir or one of its step directories, and the step it resolves to."""
  directory, step = resolve(checkpoint_path)
  return (os.path.dirname(directory) if os.path.basename(directory) == CHECKPOINT_SUBDIR else directory), step


def calibration_path(checkpoint_path):
  """`<workdir>/calibration.json` of a training workdir or step directory, and the step it resolves to."""
  workdir, step = workdir_of(checkpoint_path)
  return os.path.join(workdir, CALIBRATION_FILE), step


def attention_entries(tree, model_config):
  """The per-layer attention sub-dicts of a collection: one stacked entry (scanned layers) or one per layer."""
  if model_config.scan_layers:
    return [tree["layers"]["layer"]["attention"]]
  return [tree[f"layer_{i}"]["attention"] for i in range(model_config.num_layers)]


def attach_tau(model_config, frozen, checkpoint_path):
  """`frozen` with FS-B's τ from the checkpoint's calibration file inserted into the "routing" collection, when
  `model_config` is an FS-B model whose checkpoint holds none; otherwise `frozen` unchanged."""
  routing = frozen.get("routing", {})
  if model_config.attention.kind != "fsb" or "tau" in attention_entries(routing, model_config)[0]:
    return frozen
  path, step = calibration_path(checkpoint_path)
  if not os.path.exists(path):
    raise CheckpointError(
      f"an FS-B model needs τ: run `python -m fsjax.calibrate --checkpoint {checkpoint_path}` first (no {path})"
    )
  with open(path) as f:
    saved = json.load(f)
  if saved["step"] != step:
    raise CheckpointError(
      f"{path} was computed for step {saved['step']}, the checkpoint is step {step}: calibrate again"
    )
  tau = jnp.asarray(saved["tau"], jnp.float32)  # [layers, kv_heads]
  if tau.shape != (model_config.num_layers, model_config.kv_heads):
    raise CheckpointError(
      f"{path} holds τ of shape {tuple(tau.shape)}, the model needs {(model_config.num_layers, model_config.kv_heads)}"
    )
  return with_tau(model_config, frozen, tau)


def with_tau(model_config, variables, tau):
  """`variables` with τ `[layers, kv_heads]` set in every layer's "routing" entry (stacked for scanned layers)."""
  routing = variables.get("routing", {})
  tau = jnp.asarray(tau, jnp.float32)
  set_tau = lambda entry, value: {**entry, "tau": value}
  if model_config.scan_layers:
    layers = routing["layers"]
    routing = {
      **routing,
      "layers": {**layers, "layer": {**layers["layer"], "attention": set_tau(layers["layer"]["attention"], tau)}},
    }
  else:
    routing = {
      **routing,
      **{
        f"layer_{i}": {**routing[f"layer_{i}"], "attention": set_tau(routing[f"layer_{i}"]["attention"], tau[i])}
        for i in range(model_config.num_layers)
      },
    }
  return {**variables, "routing": routing}
