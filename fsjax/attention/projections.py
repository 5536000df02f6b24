"""Bias-free head projections shared by every attention module (FS Sec. 3.1: W_q, W_k, W_v, W_o)."""

import flax.linen as nn


def project_heads(x, num_heads, head_dim, name, dtype, param_dtype):
  """`[batch, seq, d_model]` → `[batch, seq, heads, head_dim]`; call inside a compact module."""
  return nn.DenseGeneral((num_heads, head_dim), use_bias=False, dtype=dtype, param_dtype=param_dtype, name=name)(x)


def project_out(o, features, dtype, param_dtype):
  """`[batch, seq, heads, head_dim]` → `[batch, seq, features]` through W_o; call inside a compact module."""
  return nn.DenseGeneral(features, axis=(-2, -1), use_bias=False, dtype=dtype, param_dtype=param_dtype, name="o_proj")(
    o
  )
