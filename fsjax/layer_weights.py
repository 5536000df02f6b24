"""A decoder layer's parameters where they lie, for the products of decode steps (`pallas_kernels.matvec`).

Inside `nn.scan` a layer sees slices of its parameter stacks `[layers, ...]`. XLA fuses such a slice into the
fusion that reads it, but a custom call gets a copy of the slice. At a decode step, where every projection is a
product of a few rows, `Transformer` hands each layer the stacks themselves with its layer index, as a
`LayerWeights`. `dense_products` multiplies by each kernel at that index where it lies, and returns None where
the matrix-vector kernel does not apply. The layer's `nn.Dense` modules then run as they do everywhere else.

A module's input that still needs its RMSNorm reaches the products as it is, with the norm's scale beside the
weights (`LayerWeights.prenorm`): the kernel normalizes it in its prologue, which in XLA were two launches per
norm (a reduction, then the scaling). `DecoderLayer` decides this with `runs_kernel`, the same rule
`dense_products` follows. SwiGLU's three products are two launches (`gated_products`): the down projection forms
`silu(gate) * up` in its prologue from the gate/up launch's partial sums, which in XLA was a launch between them.

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
class Prenorm:
  """The RMSNorm a module's input still needs (flax's `nn.RMSNorm(epsilon=eps)`): `scale` `[K]`, or a scanned
  model's stack `[layers, K]` read at the layer, as the weights are."""

  scale: Any
  eps: float = flax.struct.field(pytree_node=False, default=1e-6)


@flax.struct.dataclass
class LayerWeights:
  """`params`: a layer's parameter subtree: a scanned model's stacks (every leaf `[layers, ...]`) with `layer`
  (int32 scalar), or an unscanned layer's own parameters with `layer` None. `impl`: the model's
  `attention.impl`, which picks the kernel (`fsjax.ops.dispatch`, op "matvec"). `routing`: the layer's subtree
  of the "routing" collection (FreeSolo's λ, σ, τ) in the same form, or None. `prenorm`: a `Prenorm` that the
  products of the module's input apply first (that input then arrives unnormed), or None."""

  params: Any
  layer: Any = None
  impl: str = flax.struct.field(pytree_node=False, default="auto")
  routing: Any = None
  prenorm: Any = None


def child(weights, name):
  """The `LayerWeights` of submodule `name` (None stays None); a prenorm stays with the module it was given to."""
  if weights is None:
    return None
  routing = None if weights.routing is None else weights.routing.get(name)
  return weights.replace(params=weights.params[name], routing=routing, prenorm=None)


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


def runs_kernel(weights, x_shape, names, contracted=1):
  """Whether `dense_products(weights, x, names, contracted, ...)` for an `x` of `x_shape` runs the matrix-vector
  kernel: `weights` given, at most `pallas_kernels.matvec.MAX_ROWS` rows, sizes it can tile, and an `impl`
  that picks it."""
  if weights is None:
    return False
  rows, k = math.prod(x_shape[: len(x_shape) - contracted]), math.prod(x_shape[len(x_shape) - contracted :])
  stacked = weights.layer is not None
  ns = [math.prod(weights.params[name]["kernel"].shape[int(stacked) + contracted :]) for name in names]
  if not matvec.compilable(rows=rows, k=k, ns=ns):
    return False
  return dispatch.resolve("matvec", dispatch.for_op("matvec", weights.impl), rows=rows, k=k, ns=ns) != "reference"


def dense_products(weights, x, names, contracted, dtype, normed_input=False):
  """`x [..., *in]` times the kernel `[*in, *out_j]` (plus its `bias` `[*out_j]`, if any) of each module in `names`
  → their outputs `[..., *out_j]` in `dtype`, as `nn.DenseGeneral(..., dtype=dtype)` over the last `contracted`
  axes of `x` gives them (the sums in float32). `normed_input`: `x` is the module's input, which `weights.prenorm`
  (if set) normalizes first.

  Returns None where the matrix-vector kernel does not apply (`runs_kernel`).
  """
  if not runs_kernel(weights, x.shape, names, contracted):
    if normed_input and weights is not None and weights.prenorm is not None:
      raise ValueError("a prenorm was handed to products that do not run the matrix-vector kernel")
    return None
  lead, inner = x.shape[: x.ndim - contracted], x.shape[x.ndim - contracted :]
  rows, k = math.prod(lead), math.prod(inner)
  stacked = weights.layer is not None
  kernels = [weights.params[name]["kernel"] for name in names]
  out_shapes = [w.shape[int(stacked) + contracted :] for w in kernels]
  ns = [math.prod(shape) for shape in out_shapes]
  mats = [w.reshape(w.shape[:1] + (k, n) if stacked else (k, n)) for w, n in zip(kernels, ns)]
  prenorm = weights.prenorm if normed_input else None
  norm = {} if prenorm is None else dict(norm_scale=prenorm.scale, norm_eps=prenorm.eps)
  sums = matvec.matvec(x.reshape(rows, k), mats, layer=weights.layer, dtype=dtype, **norm)
  outputs = []
  for name, total, shape in zip(names, sums, out_shapes):
    y = total.reshape(*lead, *shape)
    bias = weights.params[name].get("bias")
    if bias is not None:
      y = y + (bias[weights.layer] if stacked else bias).astype(jnp.float32)
    outputs.append(y.astype(dtype))
  return outputs


def gated_products(weights, x, gate_up, down, dtype):
  """SwiGLU's `W_down(silu(W_gate x) * W_up x)` for `x [..., K]` in `dtype`, as `nn.Dense(dtype=dtype)` modules
  and `nn.silu(gate) * up` give it, in two launches of the matrix-vector kernel: the gate/up launch returns its
  partial sums, and the down launch forms the hidden vector from them in its prologue. `gate_up`: the names of
  the gate and up modules; `down`: the down module's. `x` is the MLP's input, which `weights.prenorm` (if set)
  normalizes first.

  Returns None where the kernel does not apply to both launches (`runs_kernel`) or a module has a bias: the
  caller then runs the products one by one (`dense_products`).
  """
  if weights is None:
    return None
  hidden = weights.params[gate_up[0]]["kernel"].shape[-1]
  if not runs_kernel(weights, x.shape, gate_up) or not runs_kernel(weights, (*x.shape[:-1], hidden), (down,)):
    return None
  if any(weights.params[name].get("bias") is not None for name in (*gate_up, down)):
    return None
  lead, k = x.shape[:-1], x.shape[-1]
  prenorm = weights.prenorm
  norm = {} if prenorm is None else dict(norm_scale=prenorm.scale, norm_eps=prenorm.eps)
  kernel = lambda name: weights.params[name]["kernel"]
  common = dict(layer=weights.layer, dtype=dtype)
  partials = matvec.matvec(
    x.reshape(math.prod(lead), k), [kernel(name) for name in gate_up], partial_sums=True, **norm, **common
  )
  (y,) = matvec.matvec(partials, [kernel(down)], gated=True, **common)
  return y.reshape(*lead, y.shape[-1]).astype(dtype)
