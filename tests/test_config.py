"""Config validation: each rule raises one clear error naming the field; YAML is strict."""

import dataclasses
from pathlib import Path

import pytest

from fsjax.config import AttentionConfig, Config, ConfigError, ModelConfig, load_config, model_preset, to_dict

ATTENTION_RULES = [
    (dict(block=100, cell=32), "attention.block must be a multiple of attention.cell"),
    (dict(window=64, block=128), r"attention.window must be >= attention.block - 1"),
    (dict(top_k=0), "attention.top_k must be >= 1"),
    (dict(cell=0), "attention.cell must be >= 1"),
    (dict(retain_top=0), "attention.retain_top must be >= 1"),
    (dict(retain_recent=-1), "attention.retain_recent must be >= 0"),
    (dict(kind="flash"), "attention.kind must be one of"),
    (dict(impl="triton"), "attention.impl must be one of"),
    (dict(sigma=0.0), "attention.sigma must be positive"),
    (dict(lam=-1.0), "attention.lam must be >= 0"),
    (dict(kind="moba", moba_top_k=0), "attention.moba_top_k must be positive"),
]


@pytest.mark.parametrize("fields,message", ATTENTION_RULES, ids=[m.split()[0] + str(i) for i, (_, m) in
                                                                 enumerate(ATTENTION_RULES)])
def test_attention_rules(fields, message):
  with pytest.raises(ConfigError, match=message):
    AttentionConfig(**fields)


def test_dense_kinds_skip_freesolo_geometry():
  AttentionConfig(kind="tfpp", window=64, block=128)  # window < block - 1 only matters to FreeSolo


@pytest.mark.parametrize("fields,message", [
    (dict(head_dim=63), "model.head_dim must be even"),
    (dict(num_heads=0), "model.num_heads must be positive"),
    (dict(vocab_size=-5), "model.vocab_size must be positive"),
    (dict(ffn_hidden=0), "model.ffn_hidden must be positive"),
    (dict(dtype="float8"), "model.dtype must be one of"),
])
def test_model_rules(fields, message):
  with pytest.raises(ConfigError, match=message):
    ModelConfig(**fields)


def test_yaml_round_trip_and_overrides(tmp_path):
  import yaml
  config = Config(model=model_preset("tiny", kind="fsl"))
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(to_dict(config)))
  assert load_config(path) == config
  loaded = load_config(path, ["model.attention.top_k=3", "model.ffn_hidden=128"])
  assert loaded.model.attention.top_k == 3 and loaded.model.ffn_hidden == 128
  assert loaded.model.ffn_hidden_size == 128


@pytest.mark.parametrize("yaml_text,message", [
    ("model:\n  widht: 3\n", "unknown key model.widht"),
    ("model:\n  attention:\n    topk: 3\n", "unknown key model.attention.topk"),
    ("trainer: {}\n", "unknown key trainer"),
    ("model:\n  num_layers: two\n", "model.num_layers must be of type int"),
    ("model:\n  tie_embeddings: 1\n", "model.tie_embeddings must be of type bool"),
    ("model:\n  attention: [1]\n", "model.attention must be a mapping"),
    ("model:\n  attention:\n    block: 100\n", "attention.block must be a multiple of attention.cell"),
    ("data: {seq_len: 128}\neval: {niah_samples: 4}\n", "eval.niah_samples needs data.seq_len >= 256"),
])
def test_bad_yaml_raises_naming_the_field(tmp_path, yaml_text, message):
  path = tmp_path / "bad.yaml"
  path.write_text(yaml_text)
  with pytest.raises(ConfigError, match=message):
    load_config(path)


def test_bad_override_is_rejected():
  with pytest.raises(ConfigError, match="must look like key.sub=value"):
    load_config(None, ["model.num_layers"])


def test_ffn_hidden_follows_llama_rounding():
  assert model_preset("fs_341m").ffn_hidden_size == 2816
  assert model_preset("fs_743m").ffn_hidden_size == 4096
  assert dataclasses.replace(model_preset("tiny"), d_model=100).ffn_hidden_size == 512


def test_float_fields_accept_exponents_without_a_dot():
  config = load_config(None, ["train.learning_rate=3e-4"])
  assert config.train.learning_rate == 3e-4
  with pytest.raises(ConfigError, match="train.learning_rate must be of type float"):
    load_config(None, ["train.learning_rate=fast"])


def test_repro_preset_is_the_repro_configs_shape():
  config = load_config(Path(__file__).resolve().parent.parent / "configs/repro/repro_fs.yaml").model
  preset = model_preset("repro_43m", dtype=config.dtype, scan_layers=config.scan_layers)
  assert preset == config


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parent.parent / "configs").rglob("*.yaml")),
                         ids=lambda path: path.name)
def test_every_shipped_config_loads_and_passes_the_rules(path):
  """A field renamed or a rule added in code cannot leave a shipped config that fails only when someone runs it."""
  load_config(path)  # raises ConfigError naming the field
