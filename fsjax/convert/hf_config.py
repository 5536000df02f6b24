"""Hugging Face `config.json` ↔ fsjax `ModelConfig`, for the dense Llama 3.x, Qwen2.5 and Qwen3 families.

What each family adds to the LLaMA decoder fsjax already is (and the `ModelConfig` field that holds it):
- Llama 3.x: grouped KV heads (`num_kv_heads`), RoPE θ = 500,000 and Llama 3's frequency scaling
  (`attention.rope_scaling`), untied embeddings above 3B parameters.
- Qwen2.5: biases on the q, k and v projections (`qkv_bias`; the output projection has none).
- Qwen3: a per-head RMSNorm on queries and keys before RoPE (`qk_norm`), head_dim independent of d_model.

A field that would change the function (a sliding window, another RoPE type, biases on the output projection or
MLP, another activation) is refused with one line naming it: importing it silently would give a model whose
logits are not the checkpoint's. Fields that only matter to Hugging Face (token ids, max_position_embeddings)
are kept verbatim in the workdir and written back on export.
"""

import dataclasses

from fsjax.config import ConfigError, ModelConfig, from_dict

# model_type → the architecture class Hugging Face names in config.json.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConversionError(ValueError):
  """A checkpoint or config that fsjax cannot convert faithfully; the message names the file or field."""


def family_of(hf):
  """The `model_type` of a Hugging Face config dict, checked against the families fsjax converts."""
  family = hf.get("model_type")
  if family not in ARCHITECTURES:
    raise ConversionError(
      f"config.json: model_type {family!r} is not supported (fsjax converts {', '.join(ARCHITECTURES)})"
    )
  architectures = hf.get("architectures") or [ARCHITECTURES[family]]
  if architectures != [ARCHITECTURES[family]]:
    raise ConversionError(
      f"config.json: architectures {architectures} is not supported (expected [{ARCHITECTURES[family]!r}])"
    )
  return family


def rope_settings(hf):
  """(θ, rotated fraction of the head dim, Llama 3 scaling dict or None) from either of Hugging Face's layouts:
  `rope_parameters` (transformers 5) or top-level `rope_theta` + `rope_scaling` (earlier checkpoints)."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  merged = {**scaling, **params}
  rope_type = merged.get("rope_type", merged.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ConversionError(f"config.json: rope type {rope_type!r} is not supported (fsjax has {', '.join(ROPE_TYPES)})")
  if rope_type == "default":
    return float(theta), float(fraction), None
  missing = [k for k in LLAMA3_KEYS if k not in merged]
  if missing:
    raise ConversionError(f"config.json: llama3 rope scaling lacks {', '.join(missing)}")
  return float(theta), float(fraction), {"type": "llama3", **{k: merged[k] for k in LLAMA3_KEYS}}


def _refuse(hf, family):
  """Raises ConversionError for the first field whose value fsjax's model cannot reproduce."""
  checks = [
    ("hidden_act", hf.get("hidden_act", "silu") == "silu", "must be silu (SwiGLU)"),
    ("mlp_bias", not hf.get("mlp_bias", False), "must be false (fsjax's MLP has no biases)"),
    ("use_sliding_window", not hf.get("use_sliding_window", False), "must be false (every layer attends fully)"),
    (
      "layer_types",
      all(t == "full_attention" for t in hf.get("layer_types") or ()),
      "must be full_attention in every layer",
    ),
    ("pretraining_tp", hf.get("pretraining_tp", 1) == 1, "must be 1"),
  ]
  if family in ("llama", "qwen3"):
    checks.append(("attention_bias", not hf.get("attention_bias", False), "must be false (fsjax's o_proj has no bias)"))
  for field, ok, rule in checks:
    if not ok:
      raise ConversionError(f"config.json: {field} {hf.get(field)!r} is not supported: {rule}")


def model_config_from_hf(hf, *, dtype="bfloat16", param_dtype="float32", scan_layers=True):
  """The fsjax `ModelConfig` (attention kind tfpp: the dense parent of every conversion) of a Hugging Face
  config dict.

  Args:
    hf: the parsed `config.json`.
    dtype: activation dtype of the fsjax model.
    param_dtype: dtype the parameters are stored in.
    scan_layers: stack the layers for `nn.scan` (one compiled layer body).

  Raises:
    ConversionError: an unsupported family or field, named.
  """
  family = family_of(hf)
  _refuse(hf, family)
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
  missing = [k for k in required if k not in hf]
  if missing:
    raise ConversionError(f"config.json lacks {', '.join(missing)}")
  heads = hf["num_attention_heads"]
  theta, fraction, scaling = rope_settings(hf)
  if fraction != 1.0:  # transformers' Llama and Qwen rotate every feature whatever this field says
    raise ConversionError(
      f"config.json: partial_rotary_factor {fraction} is not supported: {family} models rotate the whole head"
    )
  attention = dict(kind="tfpp", rope_theta=theta)
  if scaling is not None:
    attention["rope_scaling"] = scaling
  fields = dict(
    vocab_size=hf["vocab_size"],
    num_layers=hf["num_hidden_layers"],
    d_model=hf["hidden_size"],
    num_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    ffn_hidden=hf["intermediate_size"],
    tie_embeddings=bool(hf.get("tie_word_embeddings", family != "llama")),
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    qkv_bias=family == "qwen2",
    qk_norm=family == "qwen3",
    dtype=dtype,
    param_dtype=param_dtype,
    scan_layers=scan_layers,
  )
  try:
    return from_dict(ModelConfig, {**fields, "attention": attention}, "model")
  except ConfigError as e:
    raise ConversionError(f"config.json: {e}") from None


def family_of_model(config: ModelConfig):
  """The Hugging Face family an fsjax model exports as: Qwen3 with q/k norms, Qwen2 with q/k/v biases, else
  Llama."""
  if config.qk_norm and config.qkv_bias:
    raise ConversionError("no Hugging Face family has both model.qk_norm and model.qkv_bias")
  return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


def hf_config_from_model(config: ModelConfig, torch_dtype, base=None):
  """The Hugging Face config dict of an fsjax model: `base` (the imported checkpoint's own config.json, kept in
  its workdir) with every field fsjax defines overwritten, so token ids and the like survive a round trip.

  Raises:
    ConversionError: the model has features no supported family has (an attention kind other than tfpp, a short
      convolution).
  """
  if config.attention.kind != "tfpp":
    raise ConversionError(
      f"model.attention.kind {config.attention.kind!r} has no Hugging Face form: export a tfpp model"
    )
  if config.short_conv:
    raise ConversionError("model.short_conv has no Hugging Face form (Llama and Qwen have no convolution)")
  if config.attention.rope_fraction != 1.0:
    raise ConversionError("model.attention.rope_fraction has no Hugging Face form: Llama and Qwen rotate whole heads")
  family = family_of_model(config)
  att = config.attention
  dropped = ("rope_parameters", "rope_scaling", "rope_theta")
  hf = {k: v for k, v in (base or {}).items() if k not in dropped}
  rope = {"rope_type": "default", "rope_theta": att.rope_theta}
  if att.rope_scaling is not None:
    scaling = att.rope_scaling if isinstance(att.rope_scaling, dict) else dataclasses.asdict(att.rope_scaling)
    rope = {"rope_type": "llama3", "rope_theta": att.rope_theta, **{k: scaling[k] for k in LLAMA3_KEYS}}
  hf.update(
    architectures=[ARCHITECTURES[family]],
    model_type=family,
    vocab_size=config.vocab_size,
    hidden_size=config.d_model,
    intermediate_size=config.ffn_hidden_size,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_heads,
    num_key_value_heads=config.num_kv_heads or config.num_heads,
    head_dim=config.head_dim,
    hidden_act="silu",
    rms_norm_eps=config.norm_eps,
    tie_word_embeddings=config.tie_embeddings,
    rope_parameters=rope,
    dtype=torch_dtype,  # transformers 5's name; earlier versions read torch_dtype
    torch_dtype=torch_dtype,
  )
  hf.setdefault("max_position_embeddings", 32768)
  if family != "qwen2":
    hf["attention_bias"] = False
  return hf
