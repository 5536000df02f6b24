"""Orbax checkpoints: `<workdir>/checkpoints/<step>/{state, data, config}`.

`state` is the whole TrainState (params, routing buffers, optimizer, counters), `data` the data iterator's
state (so a resumed run continues with the next batch), `config` the resolved config. Orbax writes each step to
a temporary directory and renames it when complete, so a killed or failed run never leaves a half-written or
overwritten checkpoint behind.
"""

import logging
import os

import jax
import orbax.checkpoint as ocp

from fsjax.config import Config, ConfigError, from_dict, to_dict
from fsjax.train.sharding import path_name

CHECKPOINT_SUBDIR = "checkpoints"


def _manager(directory, **options):
  """A CheckpointManager that knows how each item is stored, so a fresh process can read metadata.

  A `read_only` one gets the options Orbax would otherwise force with a warning each, and its remaining
  "Given directory is read only" warning is dropped: loading a checkpoint to run it is not worth three lines
  through a progress bar."""
  handlers = dict(
    state=ocp.StandardCheckpointHandler(), data=ocp.JsonCheckpointHandler(), config=ocp.JsonCheckpointHandler()
  )
  if options.get("read_only"):
    options = dict(save_interval_steps=0, create=False, **options)
  quiet = _DropMessage("Given directory is read only")
  logging.getLogger("absl").addFilter(quiet)
  try:
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options), item_handlers=handlers)
  finally:
    logging.getLogger("absl").removeFilter(quiet)


class _DropMessage(logging.Filter):
  """Drops log records whose message starts with `prefix`."""

  def __init__(self, prefix):
    super().__init__()
    self.prefix = prefix

  def filter(self, record):
    return not record.getMessage().startswith(self.prefix)


class CheckpointError(ValueError):
  """A checkpoint is missing or does not fit the config."""


class Checkpointer:
  """Saves and restores train states in one directory, keeping the newest `keep`."""

  def __init__(self, directory, *, keep=3, async_save=True):
    self.directory = os.path.abspath(directory)
    self.manager = _manager(self.directory, max_to_keep=keep, enable_async_checkpointing=async_save)

  def latest_step(self):
    return self.manager.latest_step()

  def save(self, step, state, data_state, config: Config, tokens_seen):
    """Starts writing step `step` (asynchronously when configured), with the tokens trained on up to it."""
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave({"iterator": data_state, "tokens_seen": int(tokens_seen)}),
        config=ocp.args.JsonSave(to_dict(config)),
      ),
      force=True,
    )

  def saved_config(self, step):
    """The config dict step `step` was trained with (`to_dict` form)."""
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

  def restore(self, step, abstract_state):
    """(state laid out like `abstract_state`, data iterator state, tokens trained on up to `step` or None for a
    checkpoint written before they were recorded). Shapes are checked first."""
    check_shapes(self.manager.item_metadata(step)["state"], abstract_state, f"{self.directory}/{step}")
    restored = self.manager.restore(
      step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
    )
    return restored["state"], restored["data"]["iterator"], restored["data"].get("tokens_seen")

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


def _shapes(tree):
  tree = getattr(tree, "tree", tree)  # orbax wraps tree metadata in newer versions
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
  return {path_name(path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


def check_shapes(saved, expected, where):
  """Raises CheckpointError naming the first array whose saved shape differs from `expected` (or is missing)."""
  saved, expected = _shapes(saved), _shapes(expected)
  for name, shape in expected.items():
    if name not in saved:
      raise CheckpointError(f"checkpoint {where} has no array {name} that the config needs (shape {shape})")
    if saved[name] != shape:
      raise CheckpointError(
        f"checkpoint {where}: {name} has shape {saved[name]} but the config gives {shape}; "
        "does the config match the one the checkpoint was trained with?"
      )


def resolve(path):
  """(checkpoint directory, step) for a training workdir (its latest step) or one step's directory."""
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint path does not exist: {path}")
  if not os.path.isdir(path):
    raise CheckpointError(f"not a checkpoint: {path} is a file (expected a training workdir or a step directory)")
  if os.path.isdir(os.path.join(path, CHECKPOINT_SUBDIR)):
    path = os.path.join(path, CHECKPOINT_SUBDIR)
  name = os.path.basename(path)
  if name.isdigit() and os.path.isdir(os.path.join(path, "state")):
    return os.path.dirname(path), int(name)
  steps = [int(d) for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d, "state"))]
  if not steps:
    raise CheckpointError(f"no checkpoint found in {path} (expected a training workdir or a step directory)")
  return path, max(steps)


def load(path):
  """Loads a checkpoint for inference or continued pretraining.

  Args:
    path: a training workdir (its latest step) or one step's directory.

  Returns:
    (Config it was trained with, params, frozen collections such as "routing", step).
  """
  directory, step = resolve(path)
  manager = _manager(directory, read_only=True)
  restored = manager.restore(
    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), config=ocp.args.JsonRestore())
  )
  manager.close()
  try:
    config = from_dict(Config, restored["config"])
  except ConfigError as e:
    raise CheckpointError(f"checkpoint {directory}/{step} holds an invalid config: {e}") from None
  state = restored["state"]
  return config, state["params"], state.get("frozen") or {}, step
