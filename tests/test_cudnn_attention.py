"""cuDNN TF++/SWA against the reference (GPU only; skipped on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsjax import ops
from fsjax.ops.cudnn import causal_rope_attention_cudnn
from helpers import assert_close, random_qkv

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")


@pytest.mark.parametrize("window", [None, 64], ids=["tfpp", "swa"])
def test_cudnn_matches_reference_in_bf16(rng, window):
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, (2, 384, 4, 64), np.float32))
  fast = causal_rope_attention_cudnn(q, k, v, window=window)
  reference = (ops.tfpp_attention(q, k, v) if window is None else ops.swa_attention(q, k, v, window=window))
  assert fast.dtype == jnp.bfloat16
  assert_close(np.asarray(fast, np.float32), np.asarray(reference, np.float32), jnp.bfloat16)
