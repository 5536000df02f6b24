"""Device mesh, parameter partition rules and multi-process start-up.

Mesh axes: "data" (pure data parallelism) and "fsdp" (parameters and optimizer state sharded, batch too).
The batch is sharded over both axes; parameters over "fsdp" by the rules below, replicated over "data".
"""

import os
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fsjax.config import ConfigError, MeshConfig

BATCH_AXES = ("data", "fsdp")

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

  Reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (one process per host or GPU).
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address and jax.process_count() == 1 and not jax.distributed.is_initialized():
    jax.distributed.initialize(address, int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"]))


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
