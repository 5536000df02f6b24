"""A decode batch that shrinks as its rows finish, so that finished rows stop costing steps.

`fsjax.decode.decode_loop` runs a fixed batch: a row that emitted EOS or reached its cap rides along (its token is
EOS) until the last row ends, and pays its share of every step (its cache reads, its attention). `decode_compacting`
runs the same loop but stops it whenever at most half of the batch is still running. It then keeps only the
running rows, padded with finished ones to a power of two, and runs on. So a finished row costs steps only until
the next halving, and a batch of B compiles the loop for at most log2(B) + 1 sizes (jit keeps each for the next
batch).

Greedy output equals `decode_loop`'s token for token: rows are independent, and a step's tokens do not depend on
which other rows share it. Sampled output does not, because a step samples the whole batch with one key.

The price: taking the rows copies the running rows' state, the cache above all. For a moment both batches are
held, at most 1.5× the cache. Where the device reports too little free memory for that copy, the batch stays as
it is for the rest of the loop.
"""

import jax
import jax.numpy as jnp
import numpy as np

from fsjax import memory
from fsjax.cache import cache_rows
from fsjax.decode import initial_state, resume


def _bucket(rows):
  """The batch that holds `rows` running rows: the next power of two."""
  return 1 << (rows - 1).bit_length()


def _take(state, limits, slots):
  """The loop's state and caps at batch slots `slots` `[n]`, in that order."""
  slots = jnp.asarray(slots)
  pick = lambda x: jnp.take(x, slots, axis=0)
  state = state.replace(
    cache=cache_rows(state.cache, slots),
    token=pick(state.token),
    position=pick(state.position),
    out=pick(state.out),
    done=pick(state.done),
  )
  return state, pick(limits)


def decode_compacting(
  model, variables, cache, first_token, position, rng, *, max_new_tokens, eos_id, temperature, top_p, limits=None
):
  """`decode_loop` whose batch halves whenever at most half of its rows are still running.

  Args: as `fsjax.decode.decode_loop` (the cache is donated); cells are not recorded.

  Returns:
    `[batch, max_new_tokens]` int32 tokens in the rows' order (first_token first; EOS after a row's end or cap).
  """
  batch = first_token.shape[0]
  limits = jnp.full((batch,), max_new_tokens, jnp.int32) if limits is None else jnp.asarray(limits, jnp.int32)
  state = initial_state(model.config, cache, first_token, position, rng, limits, max_new_tokens, eos_id)
  out = np.full((batch, max_new_tokens), eos_id, np.int32)
  rows = np.arange(batch)  # the batch row each slot holds; -1 for a padding slot
  shrink = True
  while True:
    size = rows.size
    floor = size // 2 if shrink and size > 1 else 0
    state = resume(
      model,
      variables,
      state,
      limits,
      jnp.int32(floor),
      max_new_tokens=max_new_tokens,
      eos_id=eos_id,
      temperature=temperature,
      top_p=top_p,
    )
    done, step = np.asarray(state.done), int(state.step)
    running = np.flatnonzero(~done)
    if step >= max_new_tokens or running.size == 0 or running.size > floor:
      break
    slots = np.concatenate([running, np.flatnonzero(done)[: _bucket(running.size) - running.size]])
    need = memory.tree_bytes(state.cache) * slots.size // size
    free = memory.free_bytes()
    if free is not None and need > free:
      shrink = False
      continue
    leaving = np.flatnonzero(done & (rows >= 0))
    out[rows[leaving]] = np.asarray(state.out)[leaving]
    state, limits = _take(state, limits, slots)
    rows = np.where(np.arange(slots.size) < running.size, rows[slots], -1)
  final = np.asarray(state.out)
  real = np.flatnonzero(rows >= 0)
  out[rows[real]] = final[real]
  return jax.device_put(out)
