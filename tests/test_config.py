"""Config validation: each rule raises one clear error naming the field; YAML is strict."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from fsjax import kinds
from fsjax.config import (
  AttentionConfig,
  Config,
  ConfigError,
  MoBAConfig,
  ModelConfig,
  ZHAConfig,
  from_dict,
  load_config,
  model_preset,
  override_model,
  to_dict,
)

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
  (dict(kind="moba", moba=dict(top_k=0)), "attention.moba.top_k must be positive"),
  (dict(kind="moba", moba_top_k=0), "attention.moba.top_k must be positive"),  # a flat key of earlier configs
  (dict(kind="tfpp", zha=dict(distill=True)), "attention.zha.distill needs attention.kind zha"),
  (dict(rope_fraction=1.5), r"attention.rope_fraction must be in \(0, 1\]"),
  (dict(rope_scaling=dict(type="yarn")), "attention.rope_scaling.type must be one of"),
  (dict(rope_scaling=dict(factor=8.0)), "attention.rope_scaling.type must be one of"),  # the type is required
  (dict(rope_scaling=dict(type="llama3", factor=0.5)), "attention.rope_scaling.factor must be >= 1"),
  (
    dict(rope_scaling=dict(type="llama3", low_freq_factor=4.0, high_freq_factor=2.0)),
    "attention.rope_scaling.high_freq_factor must be greater than attention.rope_scaling.low_freq_factor",
  ),
  (dict(rope_scaling=dict(type="llama3", beta=1)), "unknown key model.attention.rope_scaling.beta"),
]


@pytest.mark.parametrize(
  "fields,message", ATTENTION_RULES, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(ATTENTION_RULES)]
)
def test_attention_rules(fields, message):
  with pytest.raises(ConfigError, match=message):
    from_dict(AttentionConfig, fields, "model.attention")


def test_dense_kinds_skip_freesolo_geometry():
  AttentionConfig(kind="tfpp", window=64, block=128)  # window < block - 1 only matters to FreeSolo


@pytest.mark.parametrize(
  "fields,message",
  [
    (dict(head_dim=63), "model.head_dim must be even"),
    (dict(num_heads=0), "model.num_heads must be positive"),
    (dict(vocab_size=-5), "model.vocab_size must be positive"),
    (dict(ffn_hidden=0), "model.ffn_hidden must be positive"),
    (dict(dtype="float8"), "model.dtype must be one of"),
    (dict(num_kv_heads=3), r"model.num_kv_heads must be positive and divide model.num_heads \(16\), got 3"),
    (dict(num_kv_heads=0), "model.num_kv_heads must be positive and divide model.num_heads"),
    (
      dict(head_dim=16, attention=AttentionConfig(rope_fraction=0.3)),
      r"model.attention.rope_fraction \(0.3\) times model.head_dim \(16\) must be an even whole number",
    ),
  ],
)
def test_model_rules(fields, message):
  with pytest.raises(ConfigError, match=message) as error:
    ModelConfig(**fields)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind", kinds.names(grouped_kv=True))
def test_grouped_query_attention_is_taken_where_the_kind_has_it(kind):
  assert ModelConfig(num_kv_heads=4, attention=AttentionConfig(kind=kind)).kv_heads == 4


def test_every_kind_takes_grouped_query_attention():
  assert kinds.names(grouped_kv=True) == kinds.names()


def test_the_hugging_face_options_load_from_yaml_and_overrides(tmp_path):
  """`attention.rope_scaling` is null by default: an override of one of its keys starts it empty."""
  config = load_config(
    None,
    [
      "model.attention.kind=tfpp",
      "model.num_kv_heads=4",
      "model.qk_norm=true",
      "model.qkv_bias=true",
      "model.attention.rope_fraction=0.5",
      "model.attention.rope_scaling.type=llama3",
      "model.attention.rope_scaling.original_max_position_embeddings=4096",
    ],
  )
  model = config.model
  assert (model.kv_heads, model.qk_norm, model.qkv_bias) == (4, True, True)
  assert model.attention.rope.fraction == 0.5 and model.attention.rope.scaling.original_max_position_embeddings == 4096
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(to_dict(config)))
  assert load_config(str(path)) == config
  assert Config().model.attention.rope_scaling is None and Config().model.kv_heads == Config().model.num_heads


def test_yaml_round_trip_and_overrides(tmp_path):
  config = Config(model=model_preset("tiny", kind="fsl"))
  path = tmp_path / "c.yaml"
  path.write_text(yaml.safe_dump(to_dict(config)))
  assert load_config(path) == config
  loaded = load_config(path, ["model.attention.top_k=3", "model.ffn_hidden=128"])
  assert loaded.model.attention.top_k == 3 and loaded.model.ffn_hidden == 128
  assert loaded.model.ffn_hidden_size == 128


@pytest.mark.parametrize(
  "yaml_text,message",
  [
    ("model:\n  widht: 3\n", "unknown key model.widht"),
    ("model:\n  attention:\n    topk: 3\n", "unknown key model.attention.topk"),
    ("trainer: {}\n", "unknown key trainer"),
    ("model:\n  num_layers: two\n", "model.num_layers must be of type int"),
    ("model:\n  tie_embeddings: 1\n", "model.tie_embeddings must be of type bool"),
    ("model:\n  attention: [1]\n", "model.attention must be a mapping"),
    ("model:\n  attention:\n    block: 100\n", "attention.block must be a multiple of attention.cell"),
    ("data: {seq_len: 128}\neval: {niah_samples: 4}\n", "eval.niah_samples needs data.seq_len >= 256"),
  ],
)
def test_bad_yaml_raises_naming_the_field(tmp_path, yaml_text, message):
  path = tmp_path / "bad.yaml"
  path.write_text(yaml_text)
  with pytest.raises(ConfigError, match=message):
    load_config(path)


FLAT_ATTENTION = """\
model:
  attention: {kind: zha, zha_refs: 4, zha_chunk: 4, zha_levels: 3, zha_top_p: [0.5, 0.6, 0.7], zha_max_nodes: 2,
              moba_block: 64, moba_top_k: 2}
"""


def test_flat_attention_keys_of_earlier_configs_load_into_their_sections(tmp_path):
  path = tmp_path / "flat.yaml"
  path.write_text(FLAT_ATTENTION)
  att = load_config(path).model.attention
  assert att.zha == ZHAConfig(refs=4, chunk=4, levels=3, top_p=(0.5, 0.6, 0.7), max_nodes=2)
  assert att.moba == MoBAConfig(block=64, top_k=2)
  nested = dict(
    kind="zha", zha=dict(refs=4, chunk=4, levels=3, top_p=[0.5, 0.6, 0.7], max_nodes=2), moba=dict(block=64, top_k=2)
  )
  assert from_dict(AttentionConfig, nested, "model.attention") == att
  assert load_config(path, ["model.attention.zha_distill=true"]).model.attention.zha.distill  # a flat override
  assert to_dict(att)["zha"]["levels"] == 3 and "zha_levels" not in to_dict(att)  # saved nested


@pytest.mark.parametrize(
  "attention,message",
  [
    (
      "{kind: zha, zha_levels: 2, zha: {levels: 3}}",
      "model.attention.zha_levels and model.attention.zha.levels both set: keep model.attention.zha.levels",
    ),
    ("{kind: moba, moba_top_k: 2, moba: {top_k: 2}}", "model.attention.moba_top_k and model.attention.moba.top_k"),
    ("{kind: zha, zha_levels: 2, zha: 3}", "model.attention.zha must be a mapping"),
  ],
)
def test_a_flat_key_beside_its_section_field_is_an_error(tmp_path, attention, message):
  path = tmp_path / "both.yaml"
  path.write_text(f"model:\n  attention: {attention}\n")
  with pytest.raises(ConfigError, match=message):
    load_config(path)


def test_nested_section_overrides():
  config = load_config(
    None, ["model.attention.kind=zha", "model.attention.zha.top_p=[0.5, 0.9]", "model.attention.moba.block=64"]
  )
  assert config.model.attention.zha.top_p == (0.5, 0.9) and config.model.attention.moba.block == 64
  assert override_model(config.model, ["attention.zha.levels=3", "attention.zha.top_p=0.8"]).attention.zha == ZHAConfig(
    levels=3, top_p=(0.8,)
  )


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


@pytest.mark.parametrize(
  "path", sorted((Path(__file__).resolve().parent.parent / "configs").rglob("*.yaml")), ids=lambda path: path.name
)
def test_every_shipped_config_loads_and_passes_the_rules(path):
  """A field renamed or a rule added in code cannot leave a shipped config that fails only when someone runs it."""
  load_config(path)  # raises ConfigError naming the field


def test_flat_overrides_land_in_their_sections_of_a_nested_config():
  """`--set attention.zha_top_p=0.8` (the flat form of earlier commands) sets `attention.zha.top_p`, also on a
  nested config or a checkpoint's saved one, where a flat key beside the section would be ambiguous."""
  nested = override_model(model_preset("tiny", kind="zha"), ["attention.zha.levels=3"])
  flat = override_model(nested, ["attention.zha_top_p=0.8", "attention.moba_block=64"])
  assert flat.attention.zha == dataclasses.replace(nested.attention.zha, top_p=(0.8,))
  assert flat.attention.moba.block == 64
  config = load_config(
    Path(__file__).resolve().parent.parent / "configs/zha_distill_tiny.yaml", ["model.attention.zha_top_p=0.7"]
  )
  assert config.model.attention.zha.top_p == (0.7,)
