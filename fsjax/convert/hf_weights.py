"""Hugging Face tensors ↔ fsjax parameters: the name table, the layout of each tensor, safetensors reading
(one tensor at a time, sharded or not) and writing.

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
import json
import os
from pathlib import Path

import jax
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


def to_fsjax(array, tensor: Tensor, config: ModelConfig):
  """A Hugging Face array in fsjax's layout (a view or a transposed copy of `array`)."""
  heads, head_dim = _heads(config, tensor), config.head_dim
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
  with safe_open(str(single), framework="flax") as f:
    return {name: str(single) for name in f.keys()}


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def read_params(directory, config: ModelConfig):
  """The fsjax `params` tree (numpy arrays of `config.param_dtype`; layers stacked under `layers/layer` when
  `config.scan_layers`) of a Hugging Face checkpoint directory.

  Tensors are read one at a time and written into their place, so the host holds the converted parameters plus
  one tensor in flight. Raises ConversionError naming a missing, unexpected or misshapen tensor.
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
  params, stacked = {}, {}
  for name, (tensor, layer) in wanted.items():
    file = files[name]
    array = _read_tensor(file, name)
    tree = shapes if layer is None else shapes[f"layer_{layer}"]
    expected = hf_shape(config, tensor, _get(tree, tensor.path).shape)
    if array.shape != expected:
      raise ConversionError(f"{file}: tensor {name} has shape {list(array.shape)}, the config says {list(expected)}")
    value = to_fsjax(array, tensor, config).astype(dtype, copy=False)
    if layer is None:
      _set(params, tensor.path, value)
    elif config.scan_layers:
      if tensor.path not in stacked:
        stacked[tensor.path] = np.empty((config.num_layers, *value.shape), dtype)
      stacked[tensor.path][layer] = value
    else:
      _set(params.setdefault(f"layer_{layer}", {}), tensor.path, value)
  for path, value in stacked.items():
    _set(params, ("layers", "layer", *path), value)
  return params


def _read_tensor(file, name):
  """One tensor as a numpy array on the host. The file is mapped for this tensor only: its pages count as the
  process's memory while mapped, so a file held open across tensors would add the whole shard to the peak.
  safetensors' numpy reader has no bfloat16; its flax reader does (on the CPU device)."""
  try:
    with jax.default_device(jax.devices("cpu")[0]), safe_open(file, framework="flax") as f:
      return np.asarray(f.get_tensor(name))
  except (OSError, SafetensorError) as e:
    raise ConversionError(f"{file}: cannot read tensor {name} ({e})") from None


def _fsjax_shapes(config: ModelConfig):
  """The model's own parameter shapes, layers unrolled (`layer_i/...`), traced without allocating anything: what
  each Hugging Face tensor must hold is their `hf_shape`."""
  unrolled = dataclasses.replace(config, scan_layers=False)
  return jax.eval_shape(lambda: init_variables(unrolled, jax.random.PRNGKey(0)))["params"]


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
