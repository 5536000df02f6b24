"""Head projections shared by every attention module (FS Sec. 3.1: W_q, W_k, W_v, W_o), with the options Hugging
Face Llama 3 / Qwen2.5 / Qwen3 checkpoints need: fewer key/value heads (grouped-query attention), q/k biases
(Qwen2.5) and a per-head RMSNorm of q and k (Qwen3). The defaults are the papers' bias-free multi-head
projections, whose parameters are unchanged by the options' existence.

Parameters, per attention module (the layout checkpoint converters write):
`q_proj/kernel [d_model, heads, head_dim]`, `k_proj/kernel` and `v_proj/kernel [d_model, kv_heads, head_dim]`,
with `qkv_bias` also `q_proj/bias [heads, head_dim]`, `k_proj/bias` and `v_proj/bias [kv_heads, head_dim]`;
with `qk_norm` `q_norm/scale` and `k_norm/scale [head_dim]`; `o_proj/kernel [heads, head_dim, d_model]`.
"""

import dataclasses

import flax.linen as nn

from fsjax.layer_weights import dense_products

QKV = ("q_proj", "k_proj", "v_proj")  # the input projections, whose products share their input


@dataclasses.dataclass(frozen=True)
class Projection:
  """How an attention module makes q, k, v from its input (`fsjax.config.ModelConfig` documents each option).

  Attributes:
    num_kv_heads: key/value heads; None = as many as query heads. Query head h reads key/value head
      `h // (heads // num_kv_heads)`.
    qk_norm: RMSNorm over head_dim on each head of q and k, before RoPE (Qwen3).
    qkv_bias: biases on the q, k and v projections (Qwen2.5).
    norm_eps: epsilon of the q/k RMSNorm.
  """

  num_kv_heads: int | None = None
  qk_norm: bool = False
  qkv_bias: bool = False
  norm_eps: float = 1e-6

  def kv_heads(self, num_heads):
    """Key/value heads for `num_heads` query heads; ValueError unless they divide them."""
    kv_heads = num_heads if self.num_kv_heads is None else self.num_kv_heads
    if kv_heads <= 0 or num_heads % kv_heads:
      raise ValueError(f"num_kv_heads must be positive and divide num_heads ({num_heads}), got {kv_heads}")
    return kv_heads


def project_heads(x, num_heads, head_dim, name, dtype, param_dtype, bias=False):
  """`[batch, seq, d_model]` → `[batch, seq, heads, head_dim]`; call inside a compact module."""
  return nn.DenseGeneral((num_heads, head_dim), use_bias=bias, dtype=dtype, param_dtype=param_dtype, name=name)(x)


def project_qkv(x, num_heads, head_dim, projection: Projection, dtype, param_dtype, weights=None):
  """`x [batch, seq, d_model]` → q `[batch, seq, heads, head_dim]`, k and v `[batch, seq, kv_heads, head_dim]`,
  unrotated (q and k normed per head when `projection.qk_norm`); call inside a compact module. `weights`: the
  attention module's `fsjax.layer_weights.LayerWeights` at a decode step (one launch for W_q, W_k and W_v; x
  arrives unnormed where it carries a prenorm)."""
  kv_heads = projection.kv_heads(num_heads)
  bias = projection.qkv_bias
  products = dense_products(weights, x, QKV, 1, dtype, normed_input=True)
  if products is not None:
    q, k, v = products
  else:
    q = project_heads(x, num_heads, head_dim, "q_proj", dtype, param_dtype, bias)
    k = project_heads(x, kv_heads, head_dim, "k_proj", dtype, param_dtype, bias)
    v = project_heads(x, kv_heads, head_dim, "v_proj", dtype, param_dtype, bias)
  if projection.qk_norm:
    norm = lambda name: nn.RMSNorm(epsilon=projection.norm_eps, dtype=dtype, param_dtype=param_dtype, name=name)
    q, k = norm("q_norm")(q), norm("k_norm")(k)
  return q, k, v


def project_out(o, features, dtype, param_dtype, weights=None):
  """`[batch, seq, heads, head_dim]` → `[batch, seq, features]` through W_o; call inside a compact module.
  `weights`: as for `project_qkv`."""
  products = dense_products(weights, o, ("o_proj",), 2, dtype)
  if products is not None:
    return products[0]
  return nn.DenseGeneral(features, axis=(-2, -1), use_bias=False, dtype=dtype, param_dtype=param_dtype, name="o_proj")(
    o
  )
