"""A short causal depthwise convolution before each layer's attention (Zoology's hybrid mixer, Arora et al. 2023).

Not part of the FreeSolo or ZHA architectures, and off unless `model.short_conv` asks for it. Zoology's attention
baseline runs a short convolution (kernel 3) over the attention's input, which hands every position its previous
tokens: attention then binds a value to the key before it with one head. Without it a model must first learn a
previous-token head, and on associative recall with the loss on the answers alone none of fsjax's models did in
4,000 steps (docs/notes.md, "Associative recall"). The convolution only mixes neighbouring tokens; every
long-range read is still the attention's own.

    y_t = sum_{j < kernel} w_j * h_{t-j},  h_{t<0} = 0      (w: `[kernel, d_model]`, one filter per channel)

`w_0 = 1` and the other taps 0 at initialisation: a fresh model computes what the model without the convolution
computes. Decoding keeps each layer's last `kernel - 1` inputs (the cache's `conv`, `STATE_KEY`), so a chunk sees
the same history as the training forward.
"""

import jax.numpy as jnp

STATE_KEY = "conv"  # a decode cache's entry for every layer's history, `[num_layers, batch, kernel - 1, d_model]`


def init_weights(kernel, d_model, dtype=jnp.float32):
  """`[kernel, d_model]` taps: the identity (tap 0, the position itself, is 1; earlier positions 0)."""
  return jnp.zeros((kernel, d_model), dtype).at[0].set(1)


def causal_conv(h, w, history=None):
  """`y [batch, C, d]` with `y_t = sum_j w_j * h_{t-j}`.

  Args:
    h: `[batch, C, d]` inputs; w: `[kernel, d]` taps.
    history: `[batch, kernel - 1, d]`, the inputs just before the chunk (oldest first), or None for zeros (a
      sequence that starts at the chunk).
  """
  kernel, length = w.shape[0], h.shape[1]
  if history is None:
    history = jnp.zeros((h.shape[0], kernel - 1, h.shape[2]), h.dtype)
  padded, w = _after(history, h), w.astype(h.dtype)
  return sum(w[j] * padded[:, kernel - 1 - j : kernel - 1 - j + length] for j in range(kernel))


def next_history(h, history, valid):
  """The `kernel - 1` inputs before each row's next token once the chunk is consumed: `[batch, kernel - 1, d]`.

  Args:
    h: `[batch, C, d]` the chunk's inputs; history: `[batch, kernel - 1, d]` before it; valid: `[batch, C]` bool,
      a prefix of each row (right padding is not consumed: a row with no valid token keeps its history).
  """
  consumed = jnp.sum(valid, axis=1, dtype=jnp.int32)  # [batch]
  index = consumed[:, None] + jnp.arange(history.shape[1])  # [batch, kernel - 1]
  return jnp.take_along_axis(_after(history, h), index[..., None], axis=1).astype(history.dtype)


def _after(history, h):
  """The chunk `h` `[batch, C, d]` after its history `[batch, kernel - 1, d]`: `[batch, kernel - 1 + C, d]`."""
  return jnp.concatenate([history.astype(h.dtype), h], axis=1)


def init_state(num_layers, batch, kernel, d_model, dtype=jnp.float32):
  """Empty decode history of every layer: zeros `[num_layers, batch, kernel - 1, d_model]`."""
  return jnp.zeros((num_layers, batch, kernel - 1, d_model), dtype)
