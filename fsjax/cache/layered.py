"""Layer views into a scanned model's stacked decode cache, so a decode step updates the cache in place.

A scanned model (`ModelConfig.scan_layers`) keeps its cache stacked `[layers, ...]` and carries it through the
scan over layers. Slicing a layer's cache out and writing it back whole would cost passes over the whole cache
per step (XLA does not fold `stack.at[i].set(layer.at[j].set(u))` into `stack.at[i, j].set(u)`). So the arrays
that grow with the sequence (the KV store's, the FS archive's, FS-B's forests, ZHA's tangents) reach a layer as
`LayerSlice`s: `read` indexes the layer, which XLA fuses into the fusion that consumes it, and `scatter` writes a
chunk's slots straight into the stack. The other cache fields are sliced out and written back whole
(`layer_view`, `write_back`).

Cache code reads viewed fields with `read` and writes them with `scatter`; with an unstacked cache both act on
the plain array, so the same code serves unrolled layers. A Pallas kernel or cuDNN given `read(x)` receives a
copy of the layer's array, so one-token TF++ attention and FS readout take XLA paths, and FS-B's beam-search
kernel and ZHA's two decode kernels take the stacks and the layer index. Still copied per token, for the kernel
that reads them: FS's cell summaries (1/s of the keys). FS-L's bounded cache, which does not grow with the
sequence, is sliced out and written back.
"""

import flax.struct
import jax


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
  """The layer's array: `x` itself, or a `LayerSlice`'s layer of its stack."""
  return x.stack[x.layer] if isinstance(x, LayerSlice) else x


def scatter(x, index, values, mode=None):
  """`x.at[index].set(values, mode=mode)` for an array; for a `LayerSlice`, the same write into its stack."""
  if isinstance(x, LayerSlice):
    return x.replace(stack=x.stack.at[(x.layer, *index)].set(values, mode=mode))
  return x.at[index].set(values, mode=mode)


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
