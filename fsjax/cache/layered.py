"""Layer views into a scanned model's stacked decode cache, so a decode step updates the cache in place.

A scanned model (`ModelConfig.scan_layers`) keeps its cache stacked `[layers, ...]` and carries it through the
scan over layers. Slicing a layer's cache out and writing it back whole would cost passes over the whole cache
per step (XLA does not fold `stack.at[i].set(layer.at[j].set(u))` into `stack.at[i, j].set(u)`). So the arrays
that grow with the sequence (the KV store's, the FS archive's, FS-B's forests, ZHA's tangents) and FS-L's bounded
cache (whose step writes only a token's slots and a block's cells) reach a layer as
`LayerSlice`s: `read` indexes the layer, which XLA fuses into the fusion that consumes it, and `scatter` writes a
chunk's slots straight into the stack. The other cache fields are sliced out and written back whole
(`layer_view`, `write_back`).

On a GPU, `read` also pins the layer to the stack's row-major layout. Without the pin, XLA's GPU layout
assignment hands a matrix product's preferred operand layout (batch dimensions major: `[batch, heads, d, slots]`
for a `[batch, slots, heads, d]` key store) up through the layer index to the loop-carried stack, and then
transposes the whole stack on the way into and out of the scan: a second copy of the cache, which does not fit
beside a cache that fills the device (ZHA's node keys at batch 128 × 4k: 49 GiB). Pinned, a product that wants
another layout gets a copy of the one layer it reads, and where the layouts agree the pin compiles to nothing.
XLA's CPU compiler has no such preference, and there the pin would stop a gather from reading the stack in place
(a copy of the layer instead), so it is left out.
"""

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint


@flax.struct.dataclass
class LayerSlice:
  """Layer `layer` (int32 scalar) of `stack` `[layers, ...]`; `shape` and `dtype` are the layer's."""

  stack: jax.Array
  layer: jax.Array

  @property
  def shape(self):
    return self.stack.shape[1:]

  @property
  def dtype(self):
    return self.stack.dtype


def read(x):
  """The layer's array: `x` itself, or a `LayerSlice`'s layer of its stack (pinned to row-major on a GPU)."""
  if not isinstance(x, LayerSlice):
    return x
  layer = x.stack[x.layer]
  return row_major(layer) if jax.default_backend() == "gpu" else layer


def row_major(x):
  """`x`, constrained to the row-major layout in the compiled program."""
  return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def scatter(x, index, values, mode=None):
  """`x.at[index].set(values, mode=mode)` for an array; for a `LayerSlice`, the same write into its stack."""
  if isinstance(x, LayerSlice):
    return x.replace(stack=x.stack.at[(x.layer, *index)].set(values, mode=mode))
  return x.at[index].set(values, mode=mode)


def update_slice(x, start, values):
  """`lax.dynamic_update_slice(x, values, start)` for an array; for a `LayerSlice`, the same write into its
  stack. `start`: one scalar per dimension of the layer, which may be traced (as `after` gives them); they are
  cast to int32, since the op takes indices of one type and Python ints become int64 under `jax_enable_x64`."""
  as_int32 = lambda indices: tuple(jnp.asarray(i).astype(jnp.int32) for i in indices)
  if isinstance(x, LayerSlice):
    return x.replace(stack=jax.lax.dynamic_update_slice(x.stack, values[None], as_int32((x.layer, *start))))
  return jax.lax.dynamic_update_slice(x, values, as_int32(start))


def after(index, *reads):
  """`index` (an integer array) unchanged, but computed from `reads` (arrays read from buffers that a write at
  `index` then updates). XLA's copy insertion orders a read of a buffer before an in-place write into it only
  through data: a write whose indices and values do not depend on what was read gets a copy of the whole buffer
  (in a scanned model's step, of the layer's whole stack, every layer and token). `optimization_barrier` does
  not order them for it. The term added is 0 whatever the reads hold: no float exceeds +inf, NaN included."""
  never = jnp.zeros((), bool)
  for x in reads:
    never |= jnp.max(x) > jnp.inf
  return index + never.astype(index.dtype)


def kernel_arrays(fields):
  """What a kernel reading a layer in place is handed for `fields` (name → array, or `LayerSlice`s of one layer):
  `(arrays, layer)`, the whole stacks and their layer index where the fields are views, else the arrays and None."""
  first = next(iter(fields.values()))
  if isinstance(first, LayerSlice):
    return {name: x.stack for name, x in fields.items()}, first.layer
  return dict(fields), None


def rewritten(old, new):
  """`old` (an array or a `LayerSlice`) after a kernel returned `new` for it: the new stack viewed at the same
  layer, or the new array."""
  return old.replace(stack=new) if isinstance(old, LayerSlice) else new


def layer_view(stacked, layer, viewed):
  """Layer `layer` of a stacked cache: the arrays of nodes of the types in `viewed` as `LayerSlice`s, every
  other array sliced out."""

  def one(node):
    if isinstance(node, viewed):
      return jax.tree_util.tree_map(lambda x: LayerSlice(x, layer), node)
    return node[layer]

  return jax.tree_util.tree_map(one, stacked, is_leaf=lambda node: isinstance(node, viewed))


def write_back(stacked, view, layer):
  """The stacked cache after a layer updated `view` (from `layer_view`): slices written back whole, stacks as
  the layer left them."""

  def one(new, old):
    return new.stack if isinstance(new, LayerSlice) else old.at[layer].set(new)

  return jax.tree_util.tree_map(one, view, stacked, is_leaf=lambda node: isinstance(node, LayerSlice))
