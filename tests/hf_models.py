"""Tiny random Hugging Face checkpoints of the three families `fsjax.convert` reads, written with `transformers`
(torch, float32, eager attention), and their reference logits.

`tests/fixtures/hf/` holds one of each, written once by `python tests/hf_models.py` (the CI machine has no
torch); `tests/test_convert.py` also writes fresh ones with other seeds where `transformers` is installed.
"""

import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PROMPT = (2, 24)  # rows × tokens of the reference logits

# Each family's shape: GQA everywhere; Llama untied with Llama 3's RoPE scaling over a 16-token original context
# (so the 24-token prompt meets the smoothed, the divided and the untouched frequencies); Qwen2.5 with q/k/v
# biases; Qwen3 with q/k norms and head_dim 16 ≠ hidden_size / heads.
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
  "llama": dict(
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_parameters=dict(
      rope_type="llama3",
      rope_theta=500000.0,
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=16,
    ),
  ),
  "qwen2": dict(num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
  "qwen3": dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
}


def write_checkpoint(family, directory, seed):
  """Writes a random `family` checkpoint (`save_pretrained`: config.json + model.safetensors) and returns
  `(tokens [2, 24] int32, logits [2, 24, vocab] float32)` of `transformers`' forward.

  Norm scales and biases are drawn around their init values, so a norm or bias read into the wrong place
  changes the logits."""
  import torch
  import transformers

  torch.manual_seed(seed)
  classes = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
  }
  config_class, model_class = classes[family]
  config = config_class(**SHAPE, **FAMILIES[family], initializer_range=0.2, attn_implementation="eager")
  model = model_class(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.2 * torch.randn_like(p))
  model.save_pretrained(directory, safe_serialization=True)
  generator = np.random.default_rng(seed)
  tokens = generator.integers(0, SHAPE["vocab_size"], PROMPT).astype(np.int32)
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
  return tokens, logits


def read_reference(directory):
  """`(tokens, logits)` stored beside a fixture checkpoint."""
  with np.load(Path(directory) / "reference.npz") as ref:
    return ref["tokens"], ref["logits"]


def main():
  import transformers

  for seed, family in enumerate(FAMILIES):
    directory = FIXTURES / family
    directory.mkdir(parents=True, exist_ok=True)
    tokens, logits = write_checkpoint(family, directory, seed)
    np.savez(directory / "reference.npz", tokens=tokens, logits=logits)
    about = dict(transformers=transformers.__version__, seed=seed, prompt=list(PROMPT))
    (directory / "about.json").write_text(json.dumps(about) + "\n")
    print(family, sum(f.stat().st_size for f in directory.iterdir()), "bytes")


if __name__ == "__main__":
  main()
