"""Causal RoPE attention through cuDNN's fused kernel (GPU, half precision): the fast path of
`local_attention` for TF++, SWA and FreeSolo's local branch, chosen by `fsjax.ops.dispatch`. It is held to the
reference `local_attention` within bf16 tolerance on GPU (tests/test_cudnn_attention.py).
"""

import jax
import jax.numpy as jnp

from fsjax.reference.rope import apply_rope


def causal_rope_attention_cudnn(q, k, v, *, window=None, rope_theta=10000.0):
  """Attention over `i - window <= j <= i` (all `j <= i` when window is None) after RoPE, via cuDNN.

  Args:
    q: `[batch, T, heads, head_dim]`, k, v: `[batch, T, kv_heads, head_dim]`, unrotated, bf16 or fp16; cuDNN reads
      fewer key/value heads than query heads natively, in the layout of `fsjax.reference.grouped`.
    rope_theta: θ or a `fsjax.reference.rope.RoPE`, applied here before the kernel, so every RoPE option works.

  Returns:
    `[batch, T, heads, head_dim]` in the dtype of `q`.
  """
  positions = jnp.arange(q.shape[1])
  q_rot, k_rot = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
  local_window = None if window is None else (window, 0)
  return jax.nn.dot_product_attention(
    q_rot, k_rot, v, is_causal=True, implementation="cudnn", local_window_size=local_window
  )
