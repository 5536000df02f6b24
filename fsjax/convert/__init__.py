"""Pretrained Hugging Face checkpoints in and out of fsjax: Llama 3.x, Qwen2.5 and Qwen3 dense models.

    from fsjax.convert import import_checkpoint, export_checkpoint
    import_checkpoint("Qwen3-0.6B/", "runs/qwen3")   # an Orbax workdir: init_from, generate, evaluations
    export_checkpoint("runs/qwen3", "qwen3_out/")   # config.json + safetensors, as transformers reads them

An imported model is a TF++ model (`attention.kind: tfpp`): the dense parent from which ZHA is distilled
(`train.objective: zha_kl`) or FS / FS-L are continued-pretrained (`train.init_from`). The workdir holds the
parameters as step 0 (no optimizer state: `train.init_from` starts a fresh optimizer, as it does for any
parent), `model.yaml` (its model section, and `data.tokenizer`: a training config's `base:`), the checkpoint's
own `config.json` as `hf_config.json` (export writes its other fields back), and its `tokenizer.json` when there
is one, beside a `tokenizer_config.json` that names its BOS and EOS tokens (`_copy_tokenizer`). Continued
pretraining or distillation from it:

    # configs/my_zha.yaml
    base: ../runs/qwen3/model.yaml
    model: {attention: {kind: zha}}
    train: {init_from: runs/qwen3, objective: zha_kl}
"""

import asyncio
import inspect
import json
import os
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
import yaml
from tokenizers import Tokenizer

from fsjax.config import Config, DataConfig, to_dict
from fsjax.convert.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from fsjax.convert.hf_weights import (
  INDEX_FILE,
  SINGLE_FILE,
  Leaf,
  hf_tensors,
  plan_params,
  read_params,
  read_part,
  write_tensors,
)
from fsjax.data.tokenizer import TOKENIZER_CONFIG
from fsjax.train import checkpoint as ckpt_lib

HF_CONFIG = "hf_config.json"
MODEL_YAML = "model.yaml"
TOKENIZER = "tokenizer.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's own default shard size
# Leaves an import writes at once: enough to keep the cores busy reading, transposing and compressing, each
# holding one tensor (and its encoded chunk) at a time.
WRITE_CONCURRENCY = min(8, os.cpu_count() or 1)

__all__ = ["ConversionError", "export_checkpoint", "import_checkpoint", "load_hf", "model_config_from_hf"]


def _read_json(path):
  try:
    return json.loads(Path(path).read_text())
  except FileNotFoundError:
    raise ConversionError(f"{path}: no such file") from None
  except ValueError as e:
    raise ConversionError(f"{path}: not JSON ({e})") from None


def load_hf(directory, *, dtype="bfloat16", param_dtype=None, scan_layers=True):
  """A Hugging Face checkpoint directory as `(ModelConfig, params)` (numpy arrays), without writing anything.

  Args:
    directory: holds `config.json` and `model.safetensors` or a sharded `model.safetensors.index.json`.
    dtype: the fsjax model's activation dtype.
    param_dtype: the dtype parameters are stored in; None keeps the checkpoint's (`torch_dtype` / `dtype` in
      its config.json), so the host holds no more than the weights themselves.
    scan_layers: stack the layers for `nn.scan`.
  """
  config = _model_config(_read_json(Path(directory) / "config.json"), dtype, param_dtype, scan_layers)
  return config, read_params(directory, config)


def _model_config(hf, dtype, param_dtype, scan_layers):
  if param_dtype is None:
    param_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  return model_config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers)


def import_checkpoint(directory, workdir, *, dtype="bfloat16", param_dtype=None, scan_layers=True):
  """Converts a Hugging Face checkpoint directory into an fsjax workdir (see the module docstring).

  The tensors stream from the safetensors files into the Orbax checkpoint a few at a time (`_StreamedLeaves`):
  the host never holds the whole model. Returns the workdir's `Config`. Raises ConversionError, before writing
  anything, for an unsupported checkpoint or a workdir that already holds checkpoints (nothing is overwritten).
  """
  workdir = Path(workdir)
  if (workdir / ckpt_lib.CHECKPOINT_SUBDIR).exists():
    raise ConversionError(f"{workdir} already holds checkpoints: import into a new workdir")
  hf = _read_json(Path(directory) / "config.json")
  model_config = _model_config(hf, dtype, param_dtype, scan_layers)
  params = plan_params(directory, model_config)  # every name and shape checked before anything is written
  streamed = _StreamedLeaves(WRITE_CONCURRENCY)
  workdir.mkdir(parents=True, exist_ok=True)
  tokenizer = _copy_tokenizer(Path(directory), workdir, hf)
  shutil.copyfile(Path(directory) / "config.json", workdir / HF_CONFIG)
  config = Config(model=model_config, data=DataConfig(tokenizer=tokenizer))
  base = {"model": to_dict(model_config), **({"data": {"tokenizer": tokenizer}} if tokenizer else {})}
  (workdir / MODEL_YAML).write_text(yaml.safe_dump(base, sort_keys=False))
  checkpointer = ckpt_lib.Checkpointer(
    workdir / ckpt_lib.CHECKPOINT_SUBDIR,
    keep=1,
    async_save=False,
    ocdbt=False,
    type_handlers=[(Leaf, streamed)],
  )
  try:
    checkpointer.save(0, {"params": params, "frozen": {}}, None, config, 0)
    checkpointer.wait()
  finally:
    checkpointer.close()
  return config


def _copy_tokenizer(directory, workdir, hf):
  """Copies the checkpoint's `tokenizer.json` into the workdir beside a `tokenizer_config.json` naming its BOS
  and EOS tokens, which `fsjax.data.tokenizer.bos_id` / `eos_id` (generation, evaluations, the data pipeline)
  look up: the checkpoint's own file when it has one (the tokenizer's word on its special tokens, as
  transformers reads it), else one written from config.json's `bos_token_id` and `eos_token_id` (the first of
  a list). Returns the copy's path; None for a checkpoint without a tokenizer.json, whose workdir names no
  tokenizer (fsjax then reads text with its packaged tokenizer, whose ids are not the checkpoint's)."""
  if not (directory / TOKENIZER).is_file():
    return None
  tokenizer = (workdir / TOKENIZER).resolve()
  shutil.copyfile(directory / TOKENIZER, tokenizer)
  if (directory / TOKENIZER_CONFIG).is_file():
    shutil.copyfile(directory / TOKENIZER_CONFIG, workdir / TOKENIZER_CONFIG)
  else:
    vocabulary = Tokenizer.from_file(str(tokenizer))
    special = {f"{kind}_token": _token(vocabulary, hf.get(f"{kind}_token_id")) for kind in ("bos", "eos")}
    (workdir / TOKENIZER_CONFIG).write_text(json.dumps(special, indent=2, ensure_ascii=False) + os.linesep)
  return str(tokenizer)


def _token(vocabulary, token_id):
  """The token of a config.json id (an int, a list whose first is taken, or None) in `vocabulary`, or None."""
  if isinstance(token_id, list):
    token_id = token_id[0] if token_id else None
  return vocabulary.id_to_token(token_id) if isinstance(token_id, int) else None


class _StreamedLeaves(ocp.type_handlers.NumpyHandler):
  """Writes `Leaf`s as Orbax writes numpy arrays (the same TensorStore arrays and tree metadata, which
  `fsjax.train.checkpoint.load` reads like any other), but reads each leaf's tensors only as it writes them:
  one tensor at a time per leaf, `concurrency` leaves at once. The host holds a few tensors and their encoded
  chunks, not the model.

  A stacked leaf is chunked by layer, so each tensor fills whole chunks that TensorStore encodes and writes as
  they come, in parallel; a chunk holding several layers would be read back and re-encoded for each layer
  written into it."""

  def __init__(self, concurrency):
    # `_open_and_write` is Orbax's per-array write (orbax-checkpoint 0.12); a release without it must fail here,
    # in one line, not write a checkpoint of unread leaves.
    if not callable(getattr(ocp.type_handlers.NumpyHandler, "_open_and_write", None)):
      raise ConversionError(
        f"orbax-checkpoint {ocp.__version__} has no NumpyHandler._open_and_write, the per-array write the "
        "import streams tensors through (present in 0.11 and 0.12)"
      )
    # A Leaf holds no data to copy. Releases before the option (0.12.0 and older) copy every value, which for a
    # Leaf copies only its plan.
    has_option = "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler.__init__).parameters
    super().__init__(**({"deepcopy_host_arrays": False} if has_option else {}))
    self._slots = asyncio.Semaphore(concurrency)

  async def _open_and_write(self, value, tspec, ts_context):
    if value.stacked:
      _chunk_by_layer(tspec["metadata"], value.shape)
    async with self._slots:
      array = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
      for index, source in value.parts():
        # Reading and the layout's transpose run in a thread: the event loop keeps the other leaves going.
        part = await asyncio.to_thread(read_part, source, value.dtype)
        await array[index].write(part, can_reference_source_data_indefinitely=True)


def _chunk_by_layer(metadata, shape):
  """Sets the chunks of a TensorStore array's `metadata` to one layer of a stacked `shape`, in either array format
  Orbax writes (its handlers' `use_zarr3`): zarr's `chunks`, or zarr3's chunk grid and the inner chunks of its
  sharding codec. Any other format keeps Orbax's chunks: still exact, only slower to write."""
  layer = [1, *shape[1:]]
  if "chunks" in metadata:
    metadata["chunks"] = layer
  elif "chunk_grid" in metadata:
    metadata["chunk_grid"]["configuration"]["chunk_shape"] = layer
    for codec in metadata.get("codecs", ()):
      if codec.get("name") == "sharding_indexed":
        codec["configuration"]["chunk_shape"] = layer


def export_checkpoint(checkpoint, out, *, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES):
  """Writes an fsjax TF++ checkpoint (a workdir or one step's directory) as a Hugging Face checkpoint directory:
  `config.json` and safetensors in the parameters' dtype, sharded past `max_shard_bytes`. Raises
  ConversionError, before writing anything, for a model no family can hold or an `out` that holds a checkpoint."""
  out = Path(out)
  held = [name for name in ("config.json", SINGLE_FILE, INDEX_FILE) if (out / name).exists()]
  if held:
    raise ConversionError(f"{out} already holds {held[0]}: export into a new directory")
  config, params, _, _ = ckpt_lib.load(checkpoint)
  params = jax.device_get(params)
  workdir = Path(ckpt_lib.resolve(checkpoint)[0]).parent
  base = _read_json(workdir / HF_CONFIG) if (workdir / HF_CONFIG).is_file() else None
  dtype = str(jax.tree_util.tree_leaves(params)[0].dtype)
  hf = hf_config_from_model(config.model, dtype, base)
  out.mkdir(parents=True, exist_ok=True)
  write_tensors(out, hf_tensors(params, config.model), max_shard_bytes)
  (out / "config.json").write_text(json.dumps(hf, indent=2) + os.linesep)
  for name in (TOKENIZER, TOKENIZER_CONFIG):
    if (workdir / name).is_file():
      shutil.copyfile(workdir / name, out / name)
  return hf
