"""Hugging Face tensors ↔ fsjax parameters: the name table, the layout of each tensor, safetensors reading
(planned from the files' headers, then one tensor at a time, sharded or not) and writing.

Hugging Face stores a linear layer as `weight [out, in]` (torch's layout) and heads flattened into the feature
axis; fsjax's `DenseGeneral` kernels are `[in, out]` with heads as an axis of their own:

| tensor | Hugging Face | fsjax |
|---|---|---|
| q/k/v projection | `[heads · head_dim, d_model]` | `[d_model, heads, head_dim]` |
| output projection | `[d_model, heads · head_dim]` | `[heads, head_dim, d_model]` |
| q/k/v bias | `[heads · head_dim]` | `[heads, head_dim]` |
| MLP, lm_head | `[out, in]` | `[in, out]` |
| embedding, norms | as is | as is |

RoPE needs no permutation: Hugging Face's Llama and Qwen rotate halves (feature i with i + d/2), as
`fsjax.reference.rope` does.
"""

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import jax
import ml_dtypes  # noqa: F401  (numpy's names for bfloat16: safetensors' numpy reader needs them)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from fsjax.config import ModelConfig
from fsjax.convert.hf_config import ConversionError
from fsjax.model import init_variables

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LAYER = "model.layers.{i}."
# Buffers some exports include that hold no parameters (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter: its Hugging Face name (`{i}` for the layer), fsjax path (inside the layer for layer
  tensors), layout (a row of the module table) and the head count its layout splits by."""

  hf: str
  path: tuple
  layout: str  # "as_is" | "matrix" | "heads_in" | "heads_out" | "heads_bias"
  heads: str | None = None  # "num_heads" | "num_kv_heads"


def layer_tensors(config: ModelConfig):
  """The tensors of one decoder layer (names relative to `model.layers.{i}.`)."""
  att = [
    Tensor("self_attn.q_proj.weight", ("attention", "q_proj", "kernel"), "heads_in", "num_heads"),
    Tensor("self_attn.k_proj.weight", ("attention", "k_proj", "kernel"), "heads_in", "num_kv_heads"),
    Tensor("self_attn.v_proj.weight", ("attention", "v_proj", "kernel"), "heads_in", "num_kv_heads"),
    Tensor("self_attn.o_proj.weight", ("attention", "o_proj", "kernel"), "heads_out", "num_heads"),
  ]
  if config.qkv_bias:
    att += [
      Tensor(f"self_attn.{p}_proj.bias", ("attention", f"{p}_proj", "bias"), "heads_bias", h)
      for p, h in (("q", "num_heads"), ("k", "num_kv_heads"), ("v", "num_kv_heads"))
    ]
  if config.qk_norm:
    att += [Tensor(f"self_attn.{p}_norm.weight", ("attention", f"{p}_norm", "scale"), "as_is") for p in "qk"]
  return att + [
    Tensor("input_layernorm.weight", ("attention_norm", "scale"), "as_is"),
    Tensor("post_attention_layernorm.weight", ("mlp_norm", "scale"), "as_is"),
    Tensor("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), "matrix"),
    Tensor("mlp.up_proj.weight", ("mlp", "up", "kernel"), "matrix"),
    Tensor("mlp.down_proj.weight", ("mlp", "down", "kernel"), "matrix"),
  ]


def global_tensors(config: ModelConfig):
  """The tensors outside the layers; `lm_head.weight` only when the embeddings are untied."""
  tensors = [
    Tensor("model.embed_tokens.weight", ("embed", "embedding"), "as_is"),
    Tensor("model.norm.weight", ("final_norm", "scale"), "as_is"),
  ]
  if not config.tie_embeddings:
    tensors.append(Tensor("lm_head.weight", ("lm_head", "kernel"), "matrix"))
  return tensors


def _heads(config, tensor):
  if tensor.heads == "num_kv_heads":
    return config.num_kv_heads or config.num_heads
  return config.num_heads


def hf_shape(config: ModelConfig, tensor: Tensor, fsjax_shape):
  """The Hugging Face shape of a tensor whose fsjax shape is `fsjax_shape` (one layer's)."""
  if tensor.layout == "matrix":
    return fsjax_shape[::-1]
  if tensor.layout == "heads_in":  # [d, H, hd] → [H·hd, d]
    return (fsjax_shape[1] * fsjax_shape[2], fsjax_shape[0])
  if tensor.layout == "heads_out":  # [H, hd, d] → [d, H·hd]
    return (fsjax_shape[2], fsjax_shape[0] * fsjax_shape[1])
  if tensor.layout == "heads_bias":
    return (fsjax_shape[0] * fsjax_shape[1],)
  return tuple(fsjax_shape)


def to_fsjax(array, tensor: Tensor, heads: int, head_dim: int):
  """A Hugging Face array (numpy or jax) in fsjax's layout, `heads` the count its layout splits: a view or a
  transposed copy of `array`."""
  if tensor.layout == "matrix":
    return array.T
  if tensor.layout == "heads_in":
    return array.T.reshape(array.shape[1], heads, head_dim)
  if tensor.layout == "heads_out":
    return array.T.reshape(heads, head_dim, array.shape[0])
  if tensor.layout == "heads_bias":
    return array.reshape(heads, head_dim)
  return array


def to_hf(array, tensor: Tensor):
  """An fsjax array (one layer's) in Hugging Face's layout, contiguous."""
  if tensor.layout == "matrix":
    array = array.T
  elif tensor.layout == "heads_in":
    array = array.reshape(array.shape[0], -1).T
  elif tensor.layout == "heads_out":
    array = array.reshape(-1, array.shape[-1]).T
  elif tensor.layout == "heads_bias":
    array = array.reshape(-1)
  return np.ascontiguousarray(array)


def shard_map(directory):
  """`{tensor name: file path}` of a checkpoint directory: its `model.safetensors.index.json` when sharded,
  else its single `model.safetensors`."""
  directory = Path(directory)
  index = directory / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
      raise ConversionError(f"{index}: not a safetensors index ({e})") from None
    return {name: str(directory / file) for name, file in weight_map.items()}
  single = directory / SINGLE_FILE
  if not single.is_file():
    raise ConversionError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
  with safe_open(str(single), framework="numpy") as f:
    return {name: str(single) for name in f.keys()}


@dataclasses.dataclass(frozen=True)
class Source:
  """One Hugging Face tensor of a `Leaf`: where it lies, its table row, and the head count its layout splits."""

  file: str
  name: str
  tensor: Tensor
  heads: int
  head_dim: int


@dataclasses.dataclass(frozen=True, eq=False)
class Leaf:
  """One fsjax parameter array of a checkpoint directory, not read yet: its fsjax `shape` and `dtype` and the
  Hugging Face tensors it is made of, one `Source` per layer (layers stacked on axis 0) when `stacked`, else one.

  A writer that streams `parts()` (`read_part` each) holds one tensor at a time, never the whole array;
  `read()` assembles the array in memory."""

  shape: tuple
  dtype: np.dtype
  sources: tuple
  stacked: bool

  @property
  def size(self):
    return math.prod(self.shape)

  @property
  def nbytes(self):
    return self.size * self.dtype.itemsize

  def parts(self):
    """`[(index, Source)]`: `read_part(source, dtype)` belongs at `leaf[index]`, the layer `(i,)` of a stacked
    leaf or `()` (the whole array)."""
    return [((i,) if self.stacked else (), source) for i, source in enumerate(self.sources)]

  def read(self):
    """The whole array, `[shape]` of `dtype`, on the host."""
    if not self.stacked:
      return read_part(self.sources[0], self.dtype)
    array = np.empty(self.shape, self.dtype)
    for index, source in self.parts():
      array[index] = read_part(source, self.dtype)
    return array


def plan_params(directory, config: ModelConfig):
  """The fsjax `params` tree of a Hugging Face checkpoint directory with a `Leaf` for each array (layers
  stacked under `layers/layer` when `config.scan_layers`), checked against the checkpoint's tensor names and
  shapes (its safetensors headers) without reading any tensor.

  Raises ConversionError naming a missing, unexpected or misshapen tensor, or a file that cannot be read.
  """
  files = shard_map(directory)
  shapes = _fsjax_shapes(config)
  dtype = np.dtype(jax.numpy.dtype(config.param_dtype))
  wanted = {t.hf: (t, None) for t in global_tensors(config)}
  for i in range(config.num_layers):
    wanted.update({LAYER.format(i=i) + t.hf: (t, i) for t in layer_tensors(config)})
  missing = sorted(set(wanted) - set(files))
  if missing:
    raise ConversionError(f"{directory}: tensor {missing[0]} is missing ({len(missing)} in all)")
  ignored = IGNORED_SUFFIXES + (("lm_head.weight",) if config.tie_embeddings else ())  # tied: never read
  unexpected = sorted(n for n in set(files) - set(wanted) if not n.endswith(ignored))
  if unexpected:
    raise ConversionError(
      f"{directory}: tensor {unexpected[0]} has no place in the fsjax model ({len(unexpected)} in all); "
      "the config.json does not describe these weights"
    )
  stored = _stored_shapes(files, wanted)
  params, stacked = {}, {}
  for name, (tensor, layer) in wanted.items():
    file = files[name]
    fsjax_shape = _get(shapes if layer is None else shapes[f"layer_{layer}"], tensor.path).shape
    expected = hf_shape(config, tensor, fsjax_shape)
    if stored[name] != expected:
      shape = list(stored[name])
      raise ConversionError(f"{file}: tensor {name} has shape {shape}, the config says {list(expected)}")
    source = Source(file, name, tensor, _heads(config, tensor), config.head_dim)
    if layer is not None and config.scan_layers:
      stacked.setdefault(tensor.path, (tuple(fsjax_shape), []))[1].append(source)
    else:
      tree = params if layer is None else params.setdefault(f"layer_{layer}", {})
      _set(tree, tensor.path, Leaf(tuple(fsjax_shape), dtype, (source,), stacked=False))
  for path, (shape, sources) in stacked.items():
    _set(params, ("layers", "layer", *path), Leaf((len(sources), *shape), dtype, tuple(sources), stacked=True))
  return params


def read_params(directory, config: ModelConfig):
  """The fsjax `params` tree (numpy arrays of `config.param_dtype`) of a Hugging Face checkpoint directory:
  `plan_params`, each leaf read. The host holds the parameters plus one tensor in flight."""
  return jax.tree_util.tree_map(Leaf.read, plan_params(directory, config), is_leaf=lambda x: isinstance(x, Leaf))


def _stored_shapes(files, names):
  """`{name: shape}` of `names` as the safetensors headers give them (no tensor is read)."""
  by_file = {}
  for name in names:
    by_file.setdefault(files[name], []).append(name)
  shapes = {}
  for file, in_file in by_file.items():
    try:
      with safe_open(file, framework="numpy") as f:
        shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in in_file})
    except (OSError, SafetensorError) as e:
      raise ConversionError(f"{file}: cannot read tensor {in_file[0]} ({e})") from None
  return shapes


def read_part(source: Source, dtype):
  """One Hugging Face tensor in fsjax's layout and `dtype`, a contiguous numpy array.

  The file is mapped for this tensor only: its pages count as the process's memory while mapped, so a file
  held open across tensors would add the whole shard to the peak. The transposing layouts run as one XLA
  program on the CPU: numpy's strided copy of a transpose is several times slower."""
  try:
    with safe_open(source.file, framework="numpy") as f:
      array = f.get_tensor(source.name)
  except (OSError, SafetensorError) as e:
    raise ConversionError(f"{source.file}: cannot read tensor {source.name} ({e})") from None
  if source.tensor.layout in ("as_is", "heads_bias"):
    return to_fsjax(array, source.tensor, source.heads, source.head_dim).astype(dtype, copy=False)
  cpu = jax.local_devices(backend="cpu")[0]
  converted = _transposed(jax.device_put(array, cpu), source.tensor, source.heads, source.head_dim, dtype)
  return np.asarray(converted)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _transposed(array, tensor, heads, head_dim, dtype):
  return to_fsjax(array, tensor, heads, head_dim).astype(dtype)


def _fsjax_shapes(config: ModelConfig):
  """The model's own parameter shapes, layers unrolled (`layer_i/...`), traced without allocating anything: what
  each Hugging Face tensor must hold is their `hf_shape`."""
  unrolled = dataclasses.replace(config, scan_layers=False)
  return jax.eval_shape(lambda: init_variables(unrolled, jax.random.PRNGKey(0)))["params"]


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def hf_tensors(params, config: ModelConfig):
  """Yields `(Hugging Face name, numpy array)` for every tensor of an fsjax `params` tree, in Hugging Face's
  layout and the parameters' own dtype."""
  for tensor in global_tensors(config):
    yield tensor.hf, to_hf(np.asarray(_get(params, tensor.path)), tensor)
  for i in range(config.num_layers):
    for tensor in layer_tensors(config):
      if config.scan_layers:
        value = np.asarray(_get(params, ("layers", "layer", *tensor.path))[i])
      else:
        value = np.asarray(_get(params, (f"layer_{i}", *tensor.path)))
      yield LAYER.format(i=i) + tensor.hf, to_hf(value, tensor)


def write_tensors(directory, tensors, max_shard_bytes):
  """Writes `(name, array)` pairs as `model.safetensors`, or as shards of at most `max_shard_bytes` each
  (a tensor larger than that gets a shard of its own) with `model.safetensors.index.json`."""
  directory = Path(directory)
  shards, current, size = [], {}, 0
  for name, array in tensors:
    if current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = array
    size += array.nbytes
  shards.append(current)
  if len(shards) == 1:
    save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
    return
  weight_map, total = {}, 0
  for n, shard in enumerate(shards, 1):
    file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(directory / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, file))
    total += sum(a.nbytes for a in shard.values())
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + os.linesep)
