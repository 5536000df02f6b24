"""Local and dense RoPE attention ops with their implementation chosen by `fsjax.ops.dispatch`: the references
(`fsjax.reference.local`, `fsjax.reference.dense`), cuDNN's fused kernel (`fsjax.ops.cudnn`, on a GPU in half
precision) or, for MoBA, the reference's rows over blocks of queries (`fsjax.ops.moba`). All take fewer key/value
heads than query heads (k, v `[batch, T, kv_heads, d]`, grouped-query attention) and any RoPE (`rope_theta`: θ or
a `fsjax.reference.rope.RoPE`)."""

from fsjax.ops import dispatch, moba
from fsjax.ops.cudnn import causal_rope_attention_cudnn
from fsjax.reference import dense as reference
from fsjax.reference.local import local_attention as local_reference


def local_attention(q, k, v, *, window, rope_theta=10000.0, impl="reference"):
  """Causal RoPE attention over `i - window <= j <= i` (FS Eq. 3-4). q, k, v `[batch, T, heads, d]` unrotated →
  `[batch, T, heads, d]` in the dtype of `q`."""
  if dispatch.resolve("local_attention", impl, dtype=q.dtype) == "cudnn":
    return causal_rope_attention_cudnn(q, k, v, window=window, rope_theta=rope_theta)
  return local_reference(q, k, v, window=window, rope_theta=rope_theta)


def tfpp_attention(q, k, v, *, rope_theta=10000.0, impl="reference"):
  """TF++: full causal RoPE attention. q, k, v `[batch, T, heads, d]` unrotated → `[batch, T, heads, d]`."""
  if dispatch.resolve("tfpp_attention", impl, dtype=q.dtype) == "cudnn":
    return causal_rope_attention_cudnn(q, k, v, window=None, rope_theta=rope_theta)
  return reference.tfpp_attention(q, k, v, rope_theta=rope_theta)


def swa_attention(q, k, v, *, window=reference.SWA_WINDOW, rope_theta=10000.0, impl="reference"):
  """SWA: causal RoPE attention over the last `window` + 1 tokens. Shapes as `tfpp_attention`."""
  if dispatch.resolve("swa_attention", impl, dtype=q.dtype) == "cudnn":
    return causal_rope_attention_cudnn(q, k, v, window=window, rope_theta=rope_theta)
  return reference.swa_attention(q, k, v, window=window, rope_theta=rope_theta)


def moba_attention(q, k, v, *, moba_block=512, moba_top_k=3, rope_theta=10000.0, impl="reference"):
  """MoBA (`fsjax.reference.dense.moba_attention`). `impl` "auto" runs the reference's rows over blocks of queries
  (`fsjax.ops.moba`, in memory that grows with T instead of T²) wherever the queries span more than one block of
  `query_blocks.query_block_for` them; "reference" always runs the reference."""
  batch, seq, heads, _ = q.shape
  if dispatch.resolve("moba_attention", impl, batch=batch, heads=heads, tokens=seq) == "blocked":
    return moba.moba_attention(q, k, v, moba_block=moba_block, moba_top_k=moba_top_k, rope_theta=rope_theta)
  return reference.moba_attention(q, k, v, moba_block=moba_block, moba_top_k=moba_top_k, rope_theta=rope_theta)
