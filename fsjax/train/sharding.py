"""Device mesh, parameter partition rules and multi-process start-up.

Mesh axes: "data" (pure data parallelism) and "fsdp" (parameters and optimizer state sharded, batch too).
The batch is sharded over both axes; parameters over "fsdp" by the rules below, replicated over "data".
"""

import json
import os
import re
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fsjax.config import ConfigError, MeshConfig

BATCH_AXES = ("data", "fsdp")
HEARTBEAT_TIMEOUT_S = 100

# (regex on the "/"-joined parameter path, spec). First match wins; an axis whose size the fsdp axis does not
# divide is replicated instead.
PARTITION_RULES = (
  (r"embed/embedding$", P("fsdp", None)),  # [vocab, d_model]
  (r"(q_proj|k_proj|v_proj)/kernel$", P("fsdp", None, None)),  # [d_model, heads, head_dim]
  (r"o_proj/kernel$", P(None, None, "fsdp")),  # [heads, head_dim, d_model]
  (r"mlp/(gate|up)/kernel$", P("fsdp", None)),  # [d_model, hidden]
  (r"mlp/down/kernel$", P(None, "fsdp")),  # [hidden, d_model]
  (r"lm_head/kernel$", P("fsdp", None)),  # [d_model, vocab]
)


def initialize_distributed():
  """Joins a multi-process run when the coordinator variables are set; a no-op otherwise.

  Reads JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID (one process per
  host or GPU), and FSJAX_HEARTBEAT_TIMEOUT: seconds without a heartbeat after which the coordinator declares a
  process dead and ends every other (default 100, JAX's). Must run before anything touches a device: a backend
  started first is a one-process backend.
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address or jax.distributed.is_initialized():
    return
  count, index = _integer_variable("JAX_NUM_PROCESSES"), _integer_variable("JAX_PROCESS_ID")
  heartbeat = _integer_variable("FSJAX_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)
  if not 0 <= index < count:
    raise ConfigError(f"JAX_PROCESS_ID ({index}) must be in [0, JAX_NUM_PROCESSES={count})")
  if heartbeat <= 0:
    raise ConfigError(f"FSJAX_HEARTBEAT_TIMEOUT must be a positive number of seconds, got {heartbeat}")
  jax.distributed.initialize(address, count, index, heartbeat_timeout_seconds=heartbeat)


def _integer_variable(name, default=None):
  text = os.environ.get(name)
  if text is None and default is not None:
    return default
  try:
    return int(text)
  except (TypeError, ValueError):
    raise ConfigError(f"{name} must be an integer (with JAX_COORDINATOR_ADDRESS set), got {text!r}") from None


def exit_after_error(error):
  """Ends a multi-process run's process at once after `error`, with one line naming it (exit status 1). Its peers
  stop at their next collective, which usually fails once this process is gone (one that waits instead, or a save
  barrier, ends at the heartbeat timeout, when JAX aborts the process); a normal exit would first wait in
  `jax.distributed`'s shutdown barrier for every peer, some of which may be dead, until the heartbeat timeout
  and then abort. Returns in a single-process run."""
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return
  message = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  print(
    f"error: process {jax.process_index()} of {jax.process_count()} stopped: {type(error).__name__}: {message}; "
    "if another process died, its log says why. Rerun every process to resume from the last checkpoint.",
    file=sys.stderr,
    flush=True,
  )
  sys.stdout.flush()
  os._exit(1)


def make_mesh(mesh: MeshConfig, devices=None):
  """A ("data", "fsdp") mesh over all devices; -1 takes the devices the other axis leaves."""
  devices = np.asarray(devices if devices is not None else jax.devices())
  count = devices.size
  data, fsdp = mesh.data, mesh.fsdp
  if data == -1:
    data = count // fsdp
  if fsdp == -1:
    fsdp = count // data
  if data * fsdp != count:
    raise ConfigError(f"mesh.data x mesh.fsdp must equal the {count} devices, got {data} x {fsdp}")
  return Mesh(devices.reshape(data, fsdp), BATCH_AXES)


def path_name(path):
  """ "a/b/0/c" for a pytree key path of dict keys, attribute names and sequence indices."""
  return "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def param_spec(name, shape, fsdp_size):
  """The PartitionSpec of one parameter: its rule's spec, with non-divisible axes replicated. Parameters
  stacked by `scan_layers` ("layers/layer/...") keep their layer axis unsharded."""
  if re.search(r"(^|/)layers/layer/", name) and shape:
    return P(None, *param_spec(name.replace("layers/layer/", "layer/"), shape[1:], fsdp_size))
  for pattern, spec in PARTITION_RULES:
    if re.search(pattern, name) and len(spec) == len(shape):
      return P(*(axis if axis is None or shape[i] % fsdp_size == 0 else None for i, axis in enumerate(spec)))
  return P()


def tree_shardings(tree, mesh):
  """NamedShardings for a pytree of arrays (params, optimizer state, train state) by parameter rules.

  Optimizer moments mirror parameter paths (their paths end with the parameter's), so the same rules apply.
  """
  fsdp_size = mesh.shape["fsdp"]
  return jax.tree_util.tree_map_with_path(
    lambda path, leaf: NamedSharding(mesh, param_spec(path_name(path), getattr(leaf, "shape", ()), fsdp_size)), tree
  )


def batch_sharding(mesh):
  """Sequences split over both mesh axes."""
  return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(local_batch, mesh):
  """Assembles each process's numpy batch (dict of `[local_B, ...]`) into global sharded arrays."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}


def gather_json(value):
  """`value` (JSON-serialisable) of every process, in process order: `[value]` in a single-process run. Every
  process must call it at the same point."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.int32(data.size))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[: data.size] = data
  rows = multihost_utils.process_allgather(padded)
  return [json.loads(row[:size].tobytes()) for row, size in zip(rows, sizes)]


def any_process(flag):
  """Whether `flag` is true in any process (every process must ask at the same point)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))


def to_host(tree):
  """Numpy copies of a pytree of (possibly process-spanning) global arrays, whole on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)
