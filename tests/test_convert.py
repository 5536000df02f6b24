"""fsjax.convert: Hugging Face Llama / Qwen2.5 / Qwen3 checkpoints in and out.

The committed fixtures (`tests/fixtures/hf/`, written by `python tests/hf_models.py` with `transformers`) hold
the reference logits, so the import is checked against `transformers` without torch; where `transformers` is
installed, fresh checkpoints of other seeds are checked too, and an export is read back by `transformers`.
"""

import functools
import importlib.util
import json
import shutil

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tokenizers
from hf_models import FAMILIES, FIXTURES, read_reference, write_checkpoint
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from fsjax import loading
from fsjax.config import load_config
from fsjax.convert import ConversionError, export_checkpoint, hf_weights, import_checkpoint, load_hf
from fsjax.convert.__main__ import main as convert_main
from fsjax.data.tokenizer import bos_id, eos_id, load_tokenizer
from fsjax.model import Transformer
from fsjax.train import checkpoint as ckpt_lib
from fsjax.train import loop

RELATIVE = 1e-5  # the bound: max |fsjax - transformers| / max |transformers| on float32 logits


def logits_of(config, params, tokens):
  return np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(tokens)))


def max_relative(actual, expected):
  return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def copy_fixture(family, tmp_path):
  directory = tmp_path / family
  shutil.copytree(FIXTURES / family, directory)
  return directory


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fixture_logits_equal_transformers(family, scan_layers):
  config, params = load_hf(FIXTURES / family, dtype="float32", scan_layers=scan_layers)
  assert config.attention.kind == "tfpp" and config.param_dtype == "float32"
  tokens, expected = read_reference(FIXTURES / family)
  error = max_relative(logits_of(config, params, tokens), expected)
  assert error <= RELATIVE, f"{family}: max relative error {error:.2e}"


def test_fixture_features_are_read():
  """Each fixture exercises the feature its family adds (a fixture that lost one would test nothing)."""
  llama, _ = load_hf(FIXTURES / "llama", dtype="float32")
  qwen2, _ = load_hf(FIXTURES / "qwen2", dtype="float32")
  qwen3, _ = load_hf(FIXTURES / "qwen3", dtype="float32")
  assert llama.num_kv_heads == 2 and not llama.tie_embeddings and llama.attention.rope_scaling is not None
  assert qwen2.qkv_bias and qwen2.tie_embeddings and not qwen2.qk_norm
  assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.d_model == 32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_workdir_round_trip_is_bit_exact(family, tmp_path):
  """import → workdir → export (sharded) → import gives the same parameters bit for bit, the same config, and the
  checkpoint's other config.json fields back; the workdir loads as a model that gives the reference logits."""
  import_checkpoint(FIXTURES / family, tmp_path / "work", dtype="float32")
  loaded = loading.load_model(tmp_path / "work")
  tokens, expected = read_reference(FIXTURES / family)
  assert max_relative(np.asarray(loaded.model.apply(loaded.variables, jnp.asarray(tokens))), expected) <= RELATIVE
  export_checkpoint(tmp_path / "work", tmp_path / "out", max_shard_bytes=20_000)
  assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
  original = json.loads((FIXTURES / family / "config.json").read_text())
  exported = json.loads((tmp_path / "out" / "config.json").read_text())
  for field in ("bos_token_id", "eos_token_id", "max_position_embeddings", "vocab_size", "num_key_value_heads"):
    assert exported[field] == original[field], field
  config_a, params_a = load_hf(FIXTURES / family, dtype="float32")
  config_b, params_b = load_hf(tmp_path / "out", dtype="float32")
  assert config_a == config_b
  same = jax.tree_util.tree_map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), params_a, params_b)
  assert all(jax.tree_util.tree_leaves(same))


def test_tensors_round_trip_bit_exact_in_bfloat16(tmp_path):
  """A bfloat16 checkpoint stays bfloat16 (`param_dtype` defaults to the checkpoint's) and exports unchanged."""
  directory = copy_fixture("qwen3", tmp_path)
  tensors = load_file(str(directory / "model.safetensors"))
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(directory / "model.safetensors"))
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, "dtype": "bfloat16"}))
  config, params = load_hf(directory)
  assert config.param_dtype == "bfloat16"
  import_checkpoint(directory, tmp_path / "work")
  export_checkpoint(tmp_path / "work", tmp_path / "out")
  back = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(back) == set(tensors)
  for name, value in back.items():
    assert value.dtype == ml_dtypes.bfloat16 and np.array_equal(value, tensors[name].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_import_saves_each_tensor_in_fsjax_layout_and_dtype(scan_layers, tmp_path):
  """The import streams tensors into the checkpoint (transposed on the CPU device, cast to bfloat16 here):
  every saved array equals numpy's transpose and cast of the safetensors tensor, bit for bit."""
  import_checkpoint(FIXTURES / "qwen2", tmp_path / "work", param_dtype="bfloat16", scan_layers=scan_layers)
  config, saved, _, _ = ckpt_lib.load(str(tmp_path / "work"))
  assert config.model.param_dtype == "bfloat16"
  tensors = load_file(str(FIXTURES / "qwen2" / "model.safetensors"))
  saved = flax.traverse_util.flatten_dict(jax.device_get(saved))
  named = [(t.hf, t, None) for t in hf_weights.global_tensors(config.model)]
  for i in range(config.model.num_layers):
    named += [(hf_weights.LAYER.format(i=i) + t.hf, t, i) for t in hf_weights.layer_tensors(config.model)]
  checked = set()
  for name, tensor, layer in named:
    heads = config.model.num_kv_heads if tensor.heads == "num_kv_heads" else config.model.num_heads
    expected = hf_weights.to_fsjax(tensors[name], tensor, heads, config.model.head_dim).astype(ml_dtypes.bfloat16)
    if layer is None:
      key, value = tensor.path, saved[tensor.path]
    elif scan_layers:
      key = ("layers", "layer", *tensor.path)
      value = saved[key][layer]
    else:
      key = (f"layer_{layer}", *tensor.path)
      value = saved[key]
    assert value.dtype == ml_dtypes.bfloat16 and np.array_equal(value, expected), name
    checked.add(key)
  assert checked == set(saved)


def write_tokenizer(path):
  """A word-level tokenizer.json of 6 ids holding Llama 3's BOS and EOS (ids 0, 1) and Qwen's chat EOS (2)."""
  vocabulary = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|im_end|>": 2, "<unk>": 3, "a": 4, "b": 5}
  tokenizer = Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(list(vocabulary)[:4])
  tokenizer.save(str(path))


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr", "zarr3"])
def test_import_streams_either_array_format_one_layer_per_chunk(zarr3, tmp_path, monkeypatch):
  """Orbax writes zarr or zarr3 arrays (`use_zarr3`): the streamed import writes either, each stacked leaf
  chunked by layer (zarr3: its shards and their inner chunks), and reads back equal to `load_hf`."""
  monkeypatch.setattr(ocp, "PyTreeCheckpointHandler", functools.partial(ocp.PyTreeCheckpointHandler, use_zarr3=zarr3))
  import_checkpoint(FIXTURES / "llama", tmp_path / "work", dtype="float32")
  _, params = load_hf(FIXTURES / "llama", dtype="float32")
  _, saved, _, _ = ckpt_lib.load(str(tmp_path / "work"))
  saved = flax.traverse_util.flatten_dict(jax.device_get(saved))
  params = flax.traverse_util.flatten_dict(params)
  assert saved.keys() == params.keys() and all(np.array_equal(saved[k], params[k]) for k in params)
  array = next((tmp_path / "work").rglob("params.layers.layer.attention.k_proj.kernel"))
  layer = [1, *saved[("layers", "layer", "attention", "k_proj", "kernel")].shape[1:]]
  if zarr3:
    metadata = json.loads((array / "zarr.json").read_text())
    sharding = [c for c in metadata["codecs"] if c["name"] == "sharding_indexed"]
    assert metadata["chunk_grid"]["configuration"]["chunk_shape"] == layer
    assert all(c["configuration"]["chunk_shape"] == layer for c in sharding)
  else:
    assert json.loads((array / ".zarray").read_text())["chunks"] == layer


@pytest.mark.parametrize("source", ["config_json", "tokenizer_config", "none"])
def test_an_imported_tokenizer_gives_the_checkpoint_bos_and_eos(source, tmp_path):
  """generate, the evaluations and the data pipeline take BOS / EOS from `bos_id` / `eos_id` of the workdir's
  tokenizer: the checkpoint's tokenizer_config.json names them when it has one (copied, and exported back),
  else config.json's ids (the first of a list). Without a tokenizer.json the workdir names no tokenizer."""
  directory = copy_fixture("llama", tmp_path)
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, "bos_token_id": 0, "eos_token_id": [1, 2]}))
  if source != "none":
    write_tokenizer(directory / "tokenizer.json")
  added = {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False, "special": True}
  if source == "tokenizer_config":
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": added}))
  config = import_checkpoint(directory, tmp_path / "work", dtype="float32")
  if source == "none":
    assert config.data.tokenizer is None and not (tmp_path / "work" / "tokenizer_config.json").exists()
    return
  path = loading.load_model(tmp_path / "work").tokenizer_path
  assert path == str((tmp_path / "work" / "tokenizer.json").resolve())
  tokenizer = load_tokenizer(path)
  if source == "config_json":
    assert (bos_id(tokenizer), eos_id(tokenizer)) == (0, 1)
  else:
    assert eos_id(tokenizer) == 2
    with pytest.raises(ValueError, match="no BOS token"):
      bos_id(tokenizer)
  export_checkpoint(tmp_path / "work", tmp_path / "out")
  exported = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
  assert exported == json.loads((tmp_path / "work" / "tokenizer_config.json").read_text())


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda hf: hf.update(model_type="mistral"), "model_type 'mistral' is not supported"),
    (lambda hf: hf.update(use_sliding_window=True), "use_sliding_window True is not supported"),
    (lambda hf: hf.update(attention_bias=True), "attention_bias True is not supported"),
    (lambda hf: hf.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda hf: hf["rope_parameters"].update(rope_type="yarn"), "rope type 'yarn' is not supported"),
    (lambda hf: hf["rope_parameters"].pop("factor"), "llama3 rope scaling lacks factor"),
    (lambda hf: hf.update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
    (lambda hf: hf.update(num_key_value_heads=3), "model.num_kv_heads"),
    (lambda hf: hf.pop("intermediate_size"), "config.json lacks intermediate_size"),
  ],
  ids=["family", "sliding", "o_bias", "act", "rope_type", "llama3_field", "partial", "kv_heads", "missing"],
)
def test_unsupported_configs_are_refused_in_one_line(change, message, tmp_path):
  directory = copy_fixture("llama", tmp_path)
  hf = json.loads((directory / "config.json").read_text())
  change(hf)
  (directory / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ConversionError, match="config.json") as e:
    load_hf(directory)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_a_shard_the_index_names_but_the_directory_lacks_is_one_line(tmp_path):
  directory = copy_fixture("llama", tmp_path)
  names = list(load_file(str(directory / "model.safetensors")))
  index = {"weight_map": {name: "model-00001-of-00001.safetensors" for name in names}}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ConversionError, match="model-00001-of-00001.safetensors: cannot read tensor") as e:
    load_hf(directory)
  assert "\n" not in str(e.value)


def test_a_tied_checkpoint_may_store_its_lm_head(tmp_path):
  """Some tied checkpoints store lm_head.weight anyway; transformers ties it on load, so it is never read."""
  directory = copy_fixture("qwen2", tmp_path)
  tensors = load_file(str(directory / "model.safetensors"))
  tensors["lm_head.weight"] = np.zeros_like(tensors["model.embed_tokens.weight"])
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  config, params = load_hf(directory, dtype="float32")
  tokens, expected = read_reference(FIXTURES / "qwen2")
  assert config.tie_embeddings and max_relative(logits_of(config, params, tokens), expected) <= RELATIVE


@pytest.mark.parametrize("fault", ["missing", "unexpected", "shape"])
def test_weights_that_do_not_fit_the_config_are_refused(fault, tmp_path):
  directory = copy_fixture("qwen2", tmp_path)
  tensors = load_file(str(directory / "model.safetensors"))
  name = "model.layers.1.self_attn.k_proj.bias"
  if fault == "missing":
    del tensors[name]
  elif fault == "unexpected":
    tensors["model.layers.1.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
  else:
    tensors[name] = np.zeros(8, np.float32)
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  expected = {"missing": f"{name} is missing", "unexpected": "o_proj.bias has no place", "shape": "has shape [8]"}
  with pytest.raises(ConversionError, match=expected[fault].replace("[", r"\[")):
    load_hf(directory)


def test_cli_imports_exports_and_refuses_with_status_2(tmp_path, capsys):
  assert convert_main(["import", str(FIXTURES / "llama"), "--workdir", str(tmp_path / "w")]) == 0
  assert "2 KV" in capsys.readouterr().out
  assert convert_main(["import", str(FIXTURES / "llama"), "--workdir", str(tmp_path / "w")]) == 2
  assert "already holds checkpoints" in capsys.readouterr().err
  assert convert_main(["export", str(tmp_path / "w"), "--out", str(tmp_path / "hf")]) == 0
  assert (tmp_path / "hf" / "model.safetensors").is_file()
  assert convert_main(["export", str(tmp_path / "w"), "--out", str(tmp_path / "hf")]) == 2
  assert "already holds config.json" in capsys.readouterr().err
  assert convert_main(["import", str(tmp_path / "nowhere"), "--workdir", str(tmp_path / "v")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error:") and "config.json" in err and len(err.splitlines()) == 1
  assert not (tmp_path / "v").exists()


def _continued_config(tmp_path, workdir, kind, overrides=()):
  """A training config on the imported model (`base:` its model.yaml), trained on recall rows its 96 ids hold."""
  path = tmp_path / f"{kind}.yaml"
  path.write_text(
    f"""base: {workdir / "model.yaml"}
model: {{attention: {{kind: {kind}, window: 16, cell: 8, block: 16, top_k: 2, retain_top: 2, retain_recent: 1}}}}
data:
  seq_len: 64
  source: associative
  associative: {{pairs: 2, keys: [3, 20], values: [20, 40], filler_ids: [40, 96]}}
train: {{init_from: {workdir}, steps: 1, batch_size: 2, warmup_steps: 2}}
checkpoint: {{async_save: false}}
eval: {{batches: 1, batch_size: 2}}
"""
  )
  return load_config(str(path), list(overrides))


@pytest.mark.parametrize("kind", ["tfpp", "fsl"])
def test_continued_pretraining_starts_from_the_imported_weights(kind, tmp_path):
  """`base: <workdir>/model.yaml` + `train.init_from` trains the imported (grouped-KV) model as TF++ or converts
  it to FS-L; step 1 runs at the warmup learning rate 0, so every parameter the import holds is exactly the
  imported one (FS-L's own, if any, start fresh)."""
  import_checkpoint(FIXTURES / "llama", tmp_path / "work", dtype="float32", param_dtype="float32")
  loop.train(_continued_config(tmp_path, tmp_path / "work", kind), str(tmp_path / "child"))
  _, imported, _, _ = ckpt_lib.load(str(tmp_path / "work"))
  config, child, _, step = ckpt_lib.load(str(tmp_path / "child"))
  assert step == 1 and config.model.attention.kind == kind and config.model.num_kv_heads == 2
  imported, child = flax.traverse_util.flatten_dict(imported), flax.traverse_util.flatten_dict(child)
  assert set(imported) <= set(child)
  for key, value in imported.items():
    np.testing.assert_array_equal(child[key], value)


def test_zha_distils_from_an_imported_grouped_model(tmp_path):
  """ZHA III-C on an imported checkpoint: one tree and one set of reference queries per key/value head; only the
  reference queries train, the KL falls, and every imported array is kept."""
  import_checkpoint(FIXTURES / "qwen3", tmp_path / "work", dtype="float32", param_dtype="float32")
  zha = ["model.attention.zha.refs=4", "model.attention.zha.chunk=4", "model.attention.zha.levels=2"]
  distill = ["train.objective=zha_kl", "train.steps=8", "train.learning_rate=3.2e-2", "train.warmup_steps=1"]
  config = _continued_config(tmp_path, tmp_path / "work", "zha", [*zha, *distill, "log.every=1"])
  loop.train(config, str(tmp_path / "zha"))
  with open(tmp_path / "zha" / "metrics.jsonl") as f:
    losses = [json.loads(line)["loss"] for line in f]
  assert len(losses) == 8 and losses[-1] < losses[0]
  _, imported, _, _ = ckpt_lib.load(str(tmp_path / "work"))
  _, child, _, _ = ckpt_lib.load(str(tmp_path / "zha"))
  imported, child = flax.traverse_util.flatten_dict(imported), flax.traverse_util.flatten_dict(child)
  assert {k for k in child if k not in imported} == {k for k in child if k[-1] == "ref_queries"} != set()
  assert all(child[k].shape[-3] == 2 for k in child if k[-1] == "ref_queries")  # [.., kv_heads, R, d]
  for key, value in imported.items():
    np.testing.assert_array_equal(child[key], value)


@pytest.mark.skipif(
  not all(importlib.util.find_spec(m) for m in ("transformers", "torch")), reason="needs transformers and torch"
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fresh_checkpoints_equal_transformers_and_export_reads_back(family, tmp_path):
  """Other seeds than the fixtures'; then the export, read by `transformers`, gives the same logits."""
  import torch
  import transformers

  tokens, expected = write_checkpoint(family, tmp_path / "hf", seed=100 + len(family))
  config, params = load_hf(tmp_path / "hf", dtype="float32", scan_layers=False)
  assert max_relative(logits_of(config, params, tokens), expected) <= RELATIVE
  import_checkpoint(tmp_path / "hf", tmp_path / "work", dtype="float32")
  export_checkpoint(tmp_path / "work", tmp_path / "out")
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
  with torch.no_grad():
    again = model.float()(torch.from_numpy(tokens).long()).logits.numpy()
  np.testing.assert_array_equal(again, expected)
