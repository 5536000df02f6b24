"""What the kernel families share: interpret-mode default, power-of-two padding and geometry checks, a scanned
model's layer stack as kernel input, an in-kernel erf.

Triton tiles must have power-of-two shapes and `tl.dot` needs every matmul dimension >= 16, so the launchers
pad head_dim and top_k to powers of two (zeros and -1 change nothing) and reject cells smaller than 16 (and
other tile sizes that are not powers of two) when compiling for a GPU; interpret mode (CPU) takes any size.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MIN_DOT_DIM = 16  # Triton's tl.dot tile minimum
NO_CELL = -1

# XLA's float32 erf (clamp to [-4, 4], then x·P(x²)/Q(x²)); Triton has no erf, and using XLA's own
# approximation keeps the kernel's scores within float32 rounding of the reference's.
_ERF_ALPHA = (
  -2.72614225801306e-10,
  2.77068142495902e-08,
  -2.10102402082508e-06,
  -5.69250639462346e-05,
  -7.34990630326855e-04,
  -2.95459980854025e-03,
  -1.60960333262415e-02,
)
_ERF_BETA = (
  -1.45660718464996e-05,
  -2.13374055278905e-04,
  -1.68282697438203e-03,
  -7.37332916720468e-03,
  -1.42647390514189e-02,
)


def default_interpret():
  """Kernels run compiled (Triton) on a GPU and in Pallas interpret mode anywhere else."""
  return jax.default_backend() != "gpu"


def compilable(*, cell, head_dim):
  """Whether Triton can tile this geometry."""
  return cell >= MIN_DOT_DIM and cell & (cell - 1) == 0 and head_dim >= MIN_DOT_DIM


def check_compilable(*, cell, head_dim, interpret):
  """Raises ValueError if Triton cannot compile tiles of this geometry (interpret mode accepts any)."""
  if interpret or compilable(cell=cell, head_dim=head_dim):
    return
  if cell < MIN_DOT_DIM or cell & (cell - 1):
    raise ValueError(f"cell must be a power of two >= {MIN_DOT_DIM} for the compiled Pallas kernels, got {cell}")
  if head_dim < MIN_DOT_DIM:
    raise ValueError(f"head_dim must be >= {MIN_DOT_DIM} for the compiled Pallas kernels, got {head_dim}")


def group_size(heads, kv_heads):
  """Query heads per key/value head (grouped-query attention: query head h reads key/value head `h // group`);
  ValueError unless `kv_heads` divides `heads`."""
  if kv_heads <= 0 or heads % kv_heads:
    raise ValueError(f"key/value heads ({kv_heads}) must divide the query heads ({heads})")
  return heads // kv_heads


def fold_group(x, kv_heads):
  """Per-query-head `[batch, T, heads, ...]` as `[batch, T · group, kv_heads, ...]`: each key/value head's query
  heads folded into the query axis, position-major (row `t · group + j` is query head `kv · group + j` at t), so
  a kernel over key/value heads reads each key and value once for the whole group. Exact; the identity for
  multi-head attention. (`fsjax.reference.grouped.fold_group` is its twin on the reference side.)"""
  batch, seq, heads, *rest = x.shape
  group = group_size(heads, kv_heads)
  if group == 1:
    return x
  return jnp.moveaxis(x.reshape(batch, seq, kv_heads, group, *rest), 3, 2).reshape(batch, seq * group, kv_heads, *rest)


def unfold_group(x, heads):
  """The inverse of `fold_group`: `[batch, T · group, kv_heads, ...]` → `[batch, T, heads, ...]`."""
  batch, folded, kv_heads, *rest = x.shape
  group = group_size(heads, kv_heads)
  if group == 1:
    return x
  return jnp.moveaxis(x.reshape(batch, folded // group, group, kv_heads, *rest), 2, 3).reshape(
    batch, folded // group, heads, *rest
  )


def pad_axis(x, axis, size, value=0):
  """Pads `x` along `axis` up to `size` with `value` (no-op when already that size)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def pad_head_dim(x):
  """`[..., d]` → `[..., next_power_of_two(d)]` with zeros (dot products are unchanged)."""
  return pad_axis(x, -1, pl.next_power_of_2(x.shape[-1]))


def _polynomial(x, coefficients):
  result = jnp.full_like(x, coefficients[0])
  for c in coefficients[1:]:
    result = result * x + c
  return result


def erf(x):
  """float32 erf usable inside a Triton kernel (absolute error about 1e-7)."""
  x = jnp.clip(x, -4.0, 4.0)
  x2 = x * x
  return x * _polynomial(x2, _ERF_ALPHA) / _polynomial(x2, _ERF_BETA)


def check_power_of_two(name, value, interpret):
  """Raises ValueError naming `name` if a compiled kernel's tile size `value` is not a power of two."""
  if not interpret and value & (value - 1):
    raise ValueError(f"{name} must be a power of two for the compiled Pallas kernels, got {value}")


def layer_stack(array, layer, axes):
  """Kernel inputs for `array` (`axes` dims) or a scanned model's stack of it (`axes + 1` dims) with `layer`: the
  stack `[layers, ...]` (one layer as `[1, ...]`) and the `[1]` int32 layer the kernels index it at. Passing the
  stack lets a kernel read one layer where it lies; slicing the layer out first would copy it."""
  if layer is None:
    if array.ndim != axes:
      raise ValueError(f"an array of {axes} dims, or a stack of {axes + 1} with a layer, got shape {array.shape}")
    return array[None], jnp.zeros((1,), jnp.int32)
  if array.ndim != axes + 1:
    raise ValueError(f"with a layer, a stack of {axes + 1} dims, got shape {array.shape}")
  return array, jnp.asarray(layer, jnp.int32).reshape(1)
