"""A decoder layer's parameters where they lie, for the products of decode steps (`pallas_kernels.matvec`).

Inside `nn.scan` a layer sees slices of its parameter stacks `[layers, ...]`. XLA fuses such a slice into the
fusion that reads it, but a custom call gets a copy of the slice. At a decode step, where every projection is a
product of a few rows, `Transformer` hands each layer the stacks themselves with its layer index, as a
`LayerWeights`. `dense_products` multiplies by each kernel at that index where it lies, and returns None where
the matrix-vector kernel does not apply. The layer's `nn.Dense` modules then run as they do everywhere else.

The parameters, their tree and their shapes are the same either way: this is how a step reads them, not how they
are stored.
"""

import math
from typing import Any

import flax.struct
import jax.numpy as jnp

from fsjax.cache.layered import LayerSlice
from fsjax.ops import dispatch
from pallas_kernels import matvec


@flax.struct.dataclass
class LayerWeights:
  """`params`: a layer's parameter subtree: a scanned model's stacks (every leaf `[layers, ...]`) with `layer`
  (int32 scalar), or an unscanned layer's own parameters with `layer` None. `impl`: the model's
  `attention.impl`, which picks the kernel (`fsjax.ops.dispatch`, op "matvec"). `routing`: the layer's subtree
  of the "routing" collection (FreeSolo's λ, σ, τ) in the same form, or None."""

  params: Any
  layer: Any = None
  impl: str = flax.struct.field(pytree_node=False, default="auto")
  routing: Any = None


def child(weights, name):
  """The `LayerWeights` of submodule `name` (None stays None)."""
  if weights is None:
    return None
  routing = None if weights.routing is None else weights.routing.get(name)
  return weights.replace(params=weights.params[name], routing=routing)


def _in_place(stacks, weights, name, value):
  if weights is None or weights.layer is None or stacks is None or name not in stacks:
    return value
  return LayerSlice(stacks[name], weights.layer)


def routing_variable(weights, name, value):
  """The "routing" variable `name` whose value in this layer is `value`, as a kernel may read it: a
  `LayerSlice` of the scanned model's stack at the layer (read where it lies), else `value` itself."""
  return _in_place(None if weights is None else weights.routing, weights, name, value)


def parameter(weights, name, value):
  """The parameter `name` of this module whose value in this layer is `value`, as `routing_variable` gives a
  routing variable: a `LayerSlice` of the scanned model's stack at the layer, else `value` itself."""
  return _in_place(None if weights is None else weights.params, weights, name, value)


def dense_products(weights, x, names, contracted, dtype):
  """`x [..., *in]` times the kernel `[*in, *out_j]` (plus its `bias` `[*out_j]`, if any) of each module in `names`
  → their outputs `[..., *out_j]` in `dtype`, as `nn.DenseGeneral(..., dtype=dtype)` over the last `contracted`
  axes of `x` gives them (the sums in float32).

  Returns None where the matrix-vector kernel does not apply: no `weights`, more than
  `pallas_kernels.matvec.MAX_ROWS` rows, sizes it cannot tile, or an `impl` that does not pick it.
  """
  if weights is None:
    return None
  lead, inner = x.shape[: x.ndim - contracted], x.shape[x.ndim - contracted :]
  rows, k = math.prod(lead), math.prod(inner)
  stacked = weights.layer is not None
  kernels = [weights.params[name]["kernel"] for name in names]
  out_shapes = [w.shape[int(stacked) + contracted :] for w in kernels]
  ns = [math.prod(shape) for shape in out_shapes]
  if not matvec.compilable(rows=rows, k=k, ns=ns):
    return None
  if dispatch.resolve("matvec", dispatch.for_op("matvec", weights.impl), rows=rows, k=k, ns=ns) == "reference":
    return None
  mats = [w.reshape(w.shape[:1] + (k, n) if stacked else (k, n)) for w, n in zip(kernels, ns)]
  sums = matvec.matvec(x.reshape(rows, k), mats, layer=weights.layer, dtype=dtype)
  outputs = []
  for name, total, shape in zip(names, sums, out_shapes):
    y = total.reshape(*lead, *shape)
    bias = weights.params[name].get("bias")
    if bias is not None:
      y = y + (bias[weights.layer] if stacked else bias).astype(jnp.float32)
    outputs.append(y.astype(dtype))
  return outputs
