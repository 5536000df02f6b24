"""Softmax over a masked set of logits (the readout of FS Eq. 1, 4 and 9)."""

import jax
import jax.numpy as jnp


def masked_softmax(logits, mask, axis=-1):
  """Softmax of `logits` over the entries where `mask` is True.

  Args:
    logits: floating array.
    mask: boolean array broadcastable to `logits`.
    axis: the axis (or tuple of axes) normalised jointly.

  Returns:
    Probabilities shaped like `logits`: zero at masked-out entries, and zero everywhere along `axis` where the
    mask selects nothing (an empty set reads out zero, FS Eq. 9).
  """
  mask = jnp.broadcast_to(mask, logits.shape)
  neg_inf = jnp.asarray(-jnp.inf, logits.dtype)
  masked = jnp.where(mask, logits, neg_inf)
  row_max = jnp.max(masked, axis=axis, keepdims=True)
  # An empty row has max -inf; shift by 0 there so no inf - inf NaN reaches the gradient.
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.where(mask, jnp.exp(masked - row_max), 0.0)
  total = jnp.sum(weights, axis=axis, keepdims=True)
  return weights / jnp.where(total > 0, total, 1.0)
