"""Baseline attentions (TF++, SWA, MoBA) as a Flax linen module."""

import flax.linen as nn
import jax.numpy as jnp

from fsjax import ops
from fsjax.attention.cudnn import causal_rope_attention_cudnn, cudnn_usable
from fsjax.attention.projections import project_heads, project_out

KINDS = ("tfpp", "swa", "moba")


class DenseAttention(nn.Module):
  """`x [batch, seq, d_model]` → `[batch, seq, d_model]` through a RoPE baseline attention.

  `kind`: "tfpp" (full causal), "swa" (radius `window`) or "moba" (`moba_block`, `moba_top_k`; see
  `fsjax.ops.dense` for MoBA's documented choices). Params: `q_proj`, `k_proj`, `v_proj`, `o_proj`.
  `impl`: "reference" always runs `fsjax.ops`; otherwise TF++ and SWA use cuDNN on GPU in bf16/fp16.
  """
  num_heads: int
  head_dim: int
  kind: str = "tfpp"
  window: int = 512
  moba_block: int = 512
  moba_top_k: int = 3
  rope_theta: float = 10000.0
  impl: str = "auto"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    if self.kind not in KINDS:
      raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
    q, k, v = (project_heads(x, self.num_heads, self.head_dim, name, self.dtype, self.param_dtype)
               for name in ("q_proj", "k_proj", "v_proj"))
    if self.kind in ("tfpp", "swa") and self.impl != "reference" and cudnn_usable(q.dtype):
      o = causal_rope_attention_cudnn(q, k, v, window=self.window if self.kind == "swa" else None,
                                      rope_theta=self.rope_theta)
    elif self.kind == "tfpp":
      o = ops.tfpp_attention(q, k, v, rope_theta=self.rope_theta)
    elif self.kind == "swa":
      o = ops.swa_attention(q, k, v, window=self.window, rope_theta=self.rope_theta)
    else:
      o = ops.moba_attention(q, k, v, moba_block=self.moba_block, moba_top_k=self.moba_top_k,
                             rope_theta=self.rope_theta)
    return project_out(o, x.shape[-1], self.dtype, self.param_dtype)
