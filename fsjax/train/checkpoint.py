"""Orbax checkpoints: `<workdir>/checkpoints/<step>/{state, data, config}`.

`state` is the whole TrainState (params, routing buffers, optimizer, counters), `data` the data iterator's
state (so a resumed run continues with the next batch), `config` the resolved config. Orbax writes each step to
a temporary directory and renames it when complete, so a killed or failed run never leaves a half-written or
overwritten checkpoint behind.
"""

import logging
import os
import re
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from fsjax.config import Config, ConfigError, from_dict, to_dict
from fsjax.train.sharding import path_name

CHECKPOINT_SUBDIR = "checkpoints"


def _manager(directory, ocdbt=True, type_handlers=(), **options):
  """A CheckpointManager that knows how each item is stored, so a fresh process can read metadata.

  A `read_only` one gets the options Orbax would otherwise force with a warning each, and its remaining
  "Given directory is read only" warning is dropped: loading a checkpoint to run it is not worth three lines
  through a progress bar. `ocdbt=False` writes one TensorStore array per parameter instead of Orbax's default
  database, which buffers what it writes (a second copy of a whole model in host memory); readers take both.
  `type_handlers` (`(type, orbax TypeHandler)` pairs) write a state whose leaves are of those types through
  Orbax's PyTreeCheckpointHandler, the handler StandardCheckpointHandler wraps (same files; the wrapper only
  refuses leaves that are not arrays)."""
  if options.get("read_only"):
    options = dict(save_interval_steps=0, create=False, **options)
  # A registry without jax.Array (the import's) makes Orbax warn that it keeps no metadata of jax arrays.
  quiet = _DropMessage(("Given directory is read only", "No jax.Array in TypeHandlerRegistry"))
  logging.getLogger("absl").addFilter(quiet)
  try:
    if type_handlers:
      registry = ocp.type_handlers.create_type_handler_registry(*type_handlers)
      state = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, type_handler_registry=registry)
    else:
      state = ocp.StandardCheckpointHandler(use_ocdbt=ocdbt)
    handlers = dict(state=state, data=ocp.JsonCheckpointHandler(), config=ocp.JsonCheckpointHandler())
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(**options), item_handlers=handlers)
  finally:
    logging.getLogger("absl").removeFilter(quiet)


class _DropMessage(logging.Filter):
  """Drops log records whose message starts with `prefix` (a string or a tuple of them), after any
  `[process=0][thread=...]` tags Orbax puts first."""

  def __init__(self, prefix):
    super().__init__()
    self.prefix = prefix

  def filter(self, record):
    return not re.sub(r"^(\[[^\]]*\])+\s*", "", record.getMessage()).startswith(self.prefix)


@jax.jit
def _magnitude(tree):
  """(every floating-point element of `tree` is finite, the largest magnitude among them)."""
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
  largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in leaves]))
  return finite, largest


def parameter_fault(params, max_abs):
  """What makes `params` unfit to save or run, or "" when nothing does: a non-finite element, or a magnitude
  beyond `max_abs` (`train.max_abs_param`: the run diverged)."""
  finite, largest = (x.item() for x in jax.device_get(_magnitude(params)))
  if not finite:
    return "non-finite parameters"
  if largest > max_abs:
    return f"parameters of magnitude {largest:.3g}, beyond train.max_abs_param {max_abs:g} (the run diverged)"
  return ""


class CheckpointError(ValueError):
  """A checkpoint is missing or does not fit the config."""


class Checkpointer:
  """Saves and restores train states in one directory, keeping the newest `keep`."""

  def __init__(self, directory, *, keep=3, async_save=True, ocdbt=True, type_handlers=()):
    """`type_handlers`: `(type, orbax TypeHandler)` pairs that write a state's leaves of those types, for a
    state that is not arrays (`fsjax.convert` saves tensors it has not read yet); see `_manager`."""
    self.directory = os.path.abspath(directory)
    self.manager = _manager(
      self.directory, ocdbt, type_handlers, max_to_keep=keep, enable_async_checkpointing=async_save
    )
    self._save_state = ocp.args.PyTreeSave if type_handlers else ocp.args.StandardSave
    # Without OCDBT there is nothing to merge, yet every save says it skipped the merge.
    self._quiet_save = None if ocdbt else _DropMessage("Skipping merge of OCDBT checkpoints")

  def latest_step(self):
    return self.manager.latest_step()

  def save(self, step, state, data_state, config: Config, tokens_seen):
    """Starts writing step `step` (asynchronously when configured), with the tokens trained on up to it."""
    if self._quiet_save:
      logging.getLogger("absl").addFilter(self._quiet_save)  # kept: an asynchronous save finishes later
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=self._save_state(state),
        data=ocp.args.JsonSave({"iterator": data_state, "tokens_seen": int(tokens_seen)}),
        config=ocp.args.JsonSave(to_dict(config)),
      ),
      force=True,
    )

  def restore_newest(self, abstract_state, check_config=lambda saved, step: None):
    """Restores the newest intact step: `(step, saved config dict, state laid out like abstract_state, data
    iterator state, tokens trained on or None where the checkpoint predates that record)`, or None when the
    directory holds no step.

    A damaged step (an item that cannot be read) is reported in one line on stderr, moved aside to
    `<step>.damaged` (never deleted: a later save of the same step needs its name) and the step before is tried;
    CheckpointError when none is intact. `check_config(saved, step)` may refuse a step's config (ConfigError);
    arrays whose shapes differ from `abstract_state` raise CheckpointError: both are mismatches, not damage.
    """
    failures = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        saved = _read_item(self.manager, step, "config", ocp.args.JsonRestore())
        check_config(saved, step)
        metadata = _read_item(self.manager, step, "state", None, metadata=True)
        check_shapes(metadata, abstract_state, f"{self.directory}/{step}")
        state = _read_item(self.manager, step, "state", ocp.args.StandardRestore(abstract_state))
        data = _read_item(self.manager, step, "data", ocp.args.JsonRestore())
      except DamagedCheckpoint as damage:
        failures.append(f"{step} ({damage})")
        if jax.process_count() > 1:  # the processes would have to agree on the rename first
          raise CheckpointError(
            f"checkpoint {self.directory}/{step} is damaged ({damage}); move it aside by hand and rerun"
          ) from None
        aside = _move_aside(os.path.join(self.directory, str(step)))
        print(f"warning: checkpoint {self.directory}/{step} is damaged ({damage}); moved to {aside}", file=sys.stderr)
        self.manager.reload()
        continue
      return step, saved, state, data["iterator"], data.get("tokens_seen")
    if failures:
      raise CheckpointError(f"no intact checkpoint in {self.directory}: damaged steps {', '.join(failures)}")
    return None

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


class DamagedCheckpoint(Exception):
  """An item of a checkpoint step that cannot be read; the message names the item and the cause."""


def _read_item(manager, step, item, args, metadata=False):
  """One item of a step (or its metadata), or DamagedCheckpoint naming the item and the first line of the cause."""
  quiet = _DropMessage("Item ")  # Orbax warns of each item a partial restore leaves unread
  logging.getLogger("absl").addFilter(quiet)
  _silence_abandoned_reads()  # before reading: some reports arrive while the failing restore unwinds
  try:
    if metadata:
      found = manager.item_metadata(step)[item]
      if found is None:
        raise FileNotFoundError("its metadata is missing")
      return found
    return manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]
  except Exception as error:  # Orbax, TensorStore and the file system fail in many types; all mean unreadable
    raise DamagedCheckpoint(f"{item}: {_innermost_cause(error)}") from None
  finally:
    logging.getLogger("absl").removeFilter(quiet)


def _innermost_cause(error):
  """The first line of the innermost exception behind `error` (at most 200 characters): Orbax wraps TensorStore's
  precise message, e.g. which array's byte range a truncated file lacks, in a generic one."""
  for _ in range(10):
    inner = error.__cause__ or error.__context__
    if inner is None:
      break
    error = inner
  return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


class _AbandonedReads(logging.Filter):
  """Drops asyncio's "... exception was never retrieved" records of Orbax's and TensorStore's reads."""

  def filter(self, record):
    error = record.exc_info[1] if record.exc_info else None
    text = f"{record.getMessage()} {error}"
    return not ("was never retrieved" in text and any(mark in text for mark in _READ_MARKS))


_ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"
_READ_MARKS = (_ORBAX, "OCDBT", "TensorStore")


def _closed_loop(kind, value):
  return kind is RuntimeError and str(value) == "Event loop is closed"


def _silence_abandoned_reads():
  """When one array of a restore fails (a truncated file), Orbax raises at once and closes its event loop while
  TensorStore still completes the other reads on its own threads: each then reports through `sys.excepthook`
  (`RuntimeError: Event loop is closed`), `sys.unraisablehook` (an Orbax read coroutine never awaited) or
  asyncio's logger (a read task's exception never retrieved), a hundred lines apiece, after the damage has
  been reported in one line. Installs, once per process, filters that drop exactly these reports; anything else
  still reaches the previous hooks."""
  if getattr(sys.excepthook, "fsjax_drops_abandoned_reads", False):
    return
  except_hook, unraisable_hook = sys.excepthook, sys.unraisablehook

  def excepthook(kind, value, traceback):
    if not _closed_loop(kind, value):
      except_hook(kind, value, traceback)

  def unraisablehook(unraisable):
    code = getattr(unraisable.object, "cr_code", None)
    orbax_read = code is not None and _ORBAX in code.co_filename
    if not (orbax_read or _closed_loop(unraisable.exc_type, unraisable.exc_value)):
      unraisable_hook(unraisable)

  excepthook.fsjax_drops_abandoned_reads = True
  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
  logging.getLogger("asyncio").addFilter(_AbandonedReads())


def _move_aside(path):
  """Renames a damaged step directory to `<path>.damaged` (or `.damaged.2`, ...) and returns the new path."""
  target, n = f"{path}.damaged", 1
  while os.path.exists(target):
    n += 1
    target = f"{path}.damaged.{n}"
  os.rename(path, target)
  return target


def _on_one_device(metadata):
  """A restore target for the arrays `metadata` describes, each whole on this process's first device: a checkpoint
  then loads on any devices, not only on those of the processes that saved it."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.tree_util.tree_map(
    lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device),
    getattr(metadata, "tree", metadata),
    is_leaf=lambda x: hasattr(x, "shape"),
  )


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
  """(checkpoint directory, newest step) for a training workdir or one step's directory."""
  directory, steps, _ = _steps(path)
  return directory, steps[0]


def _steps(path):
  """(checkpoint directory, its steps newest first, whether `path` named one step)."""
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint path does not exist: {path}")
  if not os.path.isdir(path):
    raise CheckpointError(f"not a checkpoint: {path} is a file (expected a training workdir or a step directory)")
  if os.path.isdir(os.path.join(path, CHECKPOINT_SUBDIR)):
    path = os.path.join(path, CHECKPOINT_SUBDIR)
  name = os.path.basename(path)
  if name.isdigit() and os.path.isdir(os.path.join(path, "state")):
    return os.path.dirname(path), [int(name)], True
  steps = [int(d) for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d))]
  if not steps:
    raise CheckpointError(f"no checkpoint found in {path} (expected a training workdir or a step directory)")
  return path, sorted(steps, reverse=True), False


def load(path):
  """Loads a checkpoint for inference or continued pretraining.

  Args:
    path: a training workdir (its newest intact step: a damaged newer one is reported on stderr and skipped,
      never changed) or one step's directory (CheckpointError if it is damaged).

  Returns:
    (Config it was trained with, params, frozen collections such as "routing", step); the arrays on this
    process's first device, whatever devices and processes saved them.
  """
  directory, steps, one_step = _steps(path)
  manager = _manager(directory, read_only=True)
  failures = []
  try:
    for step in steps:
      try:
        saved = _read_item(manager, step, "config", ocp.args.JsonRestore())
        metadata = _read_item(manager, step, "state", None, metadata=True)
        state = _read_item(manager, step, "state", ocp.args.StandardRestore(_on_one_device(metadata)))
      except DamagedCheckpoint as damage:
        failures.append(f"{step} ({damage})")
        if not one_step:
          print(f"warning: checkpoint {directory}/{step} is damaged ({damage}); trying the one before", file=sys.stderr)
        continue
      try:
        config = from_dict(Config, saved)
      except ConfigError as e:
        raise CheckpointError(f"checkpoint {directory}/{step} holds an invalid config: {e}") from None
      return config, state["params"], state.get("frozen") or {}, step
  finally:
    manager.close()
  raise CheckpointError(f"no intact checkpoint in {directory}: damaged steps {', '.join(failures)}")
