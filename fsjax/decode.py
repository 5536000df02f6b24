"""Chunked prefill, a jitted decode step and an on-device generation loop.

    model = Transformer(config); cache = init_cache(config, batch, max_len)
    logits, cache = prefill(model, variables, tokens, lengths, cache, chunk=2048)
    out = generate(model, variables, tokens, lengths, max_len=..., max_new_tokens=64, eos_id=2)

Prompts are right-padded `[batch, P]` with their `lengths` `[batch]`; every row then advances at its own position.
Prefill runs the same causal operator as training, chunk by chunk, so its logits equal the full forward pass.
"""

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from fsjax import kinds, memory
from fsjax.cache import init_cache
from fsjax.ops import dispatch

DEFAULT_CHUNK = 2048  # tokens per chunk where the training operator is a reference (its memory grows faster)
ACTIVATION_BUDGET = 24 * 2**30  # bytes of one chunk's forward activations where the device reports no memory size


def _apply(model, variables, tokens, cache, positions, valid, first_chunk=False, logits_at=None):
  (logits, cache), state = model.apply(
    variables, tokens, cache, positions, valid, first_chunk=first_chunk, logits_at=logits_at, mutable=["intermediates"]
  )
  return logits, cache, state.get("intermediates", {})


@functools.partial(jax.jit, static_argnums=0, static_argnames="first_chunk", donate_argnums=3)
def extend(model, variables, tokens, cache, positions, valid, first_chunk=False, logits_at=None):
  """One chunk through the model: `(logits, cache, intermediates)`. The cache is donated.

  logits are `[batch, C, vocab]`, or `[batch, vocab]` at the chunk indices `logits_at` `[batch]`. `first_chunk`
  (static): the cache is empty and `positions` are `0..C-1` in every row, so every layer runs its training
  operator over the chunk and writes its cache in bulk (`fsjax.model.Transformer`).
  """
  return _apply(model, variables, tokens, cache, positions, valid, first_chunk, logits_at)


def activation_bytes_per_token(config):
  """An estimate of one token's share of a forward pass's live activations: the residual stream and norms,
  q/k/v and the attention output, the SwiGLU hidden states, in the compute dtype (33 KB for the 341M shape in
  bf16). The compiled first chunk's temporaries on an H200 (341M, bf16, scanned): 21-23 KB per token for TF++,
  FS and FS-L at 128k-256k, but 42.6 KB for FS-L at 1M, where its selection's share grows with the number of
  cells; `activation_budget` keeps the other half of the free memory as headroom."""
  width = 4 * config.d_model + 2 * (config.num_heads + config.kv_heads) * config.head_dim + 3 * config.ffn_hidden_size
  return width * jnp.dtype(config.dtype).itemsize


def activation_budget():
  """Bytes one prefill chunk's activations may take: half the memory the first device has left (call it with
  the cache allocated), or `ACTIVATION_BUDGET` where the platform reports no memory size."""
  free = memory.free_bytes()
  return ACTIVATION_BUDGET if free is None else free // 2


def prefill_chunk(config, prompt_len, batch=1):
  """Tokens per row per prefill chunk for a batch of `prompt_len`-token prompts: a performance choice, never a
  semantic one.

  Where the kind's training operator runs fused on this platform (`fsjax.kinds.Kind.prefill_op`: cuDNN or the
  Pallas kernels, whose memory grows linearly with the chunk), as few chunks as `activation_budget` allows for
  `batch` rows, of equal size; otherwise `DEFAULT_CHUNK`. Rounded up to whole query blocks (the FS-L bounded
  cache needs them) and to a multiple of an eighth of its power of two, so prompts of nearby lengths share a
  compiled program at most 12.5% padding. `prefill` halves it where the compiled chunk does not fit.
  """
  att = config.attention
  tokens = DEFAULT_CHUNK
  op = kinds.get(att.kind).prefill_op
  facts = dict(cell=att.cell, head_dim=config.head_dim, dtype=jnp.dtype(config.dtype))
  if op is not None and dispatch.resolve(op, dispatch.for_op(op, att.impl), **facts) != "reference":
    tokens = max(DEFAULT_CHUNK, activation_budget() // (batch * activation_bytes_per_token(config)))
  prompt_len = max(1, prompt_len)
  chunk = -(-prompt_len // -(-prompt_len // tokens))  # the prompt in equal shares of at most `tokens`
  unit = math.lcm(att.block, max(1, 2 ** (chunk.bit_length() - 4)))
  return -(-chunk // unit) * unit


def prefill(model, variables, tokens, lengths, cache, chunk=None, all_logits=True, logits_at=None):
  """Runs right-padded prompts through the model in chunks, filling an empty `cache`.

  The first chunk runs each layer's training operator and writes the caches in bulk (`first_chunk`); later
  chunks attend through the caches. Either way the logits equal the full forward's (the tests hold every kind
  to it), so the chunk size only trades memory for speed. Each chunk program is compiled ahead and halved until
  its temporaries fit the device memory left beside the cache (`fsjax.memory.fitted_program`), so any batch
  whose cache fits is prefilled; `fsjax.memory.DeviceMemoryError` says so when not even one block fits.

  Args:
    tokens: `[batch, P]` int32; lengths: `[batch]` real prompt lengths (>= 1).
    cache: empty, from `fsjax.cache.init_cache`.
    chunk: tokens per row per forward call, rounded up to whole query blocks; None chooses the first chunk from
      the prompt length and batch (`prefill_chunk`) and the later ones from the cache: as long as the first
      where the kind's cache path is bounded (`fsjax.kinds.Kind.bounded_chunks`), else `DEFAULT_CHUNK`.
    all_logits: return every position's logits; False computes only each row's last prompt position.
    logits_at: optional `[batch, n]` int32 prompt positions (each below its row's length): compute only their
      logits, `[batch, n, vocab]` (overrides `all_logits`); what a recall evaluation reads at its queries.

  Returns:
    (logits `[batch, P, vocab]` (padding positions hold garbage), `[batch, vocab]` or `[batch, n, vocab]`, cache).
  """
  batch, prompt_len = tokens.shape
  picked = _picked(all_logits, logits_at, lengths)
  (first, run_first), (later, run_later) = _chunk_programs(model, variables, cache, batch, prompt_len, chunk, picked)
  padded = first + -(-max(prompt_len - first, 0) // later) * later
  tokens = jnp.pad(jnp.asarray(tokens, jnp.int32), ((0, 0), (0, padded - prompt_len)))
  lengths = jnp.asarray(lengths, jnp.int32)
  wanted = None if picked is None else (lengths - 1 if picked == 0 else jnp.asarray(logits_at, jnp.int32))
  outputs, last = [], None
  start = 0
  while start < padded:
    size, run = (first, run_first) if start == 0 else (later, run_later)
    positions = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (batch, size))
    offset = None if picked is None else jnp.clip(wanted - start, 0, size - 1)
    logits, cache, _ = run(
      variables, tokens[:, start : start + size], cache, positions, positions < lengths[:, None], logits_at=offset
    )
    if picked is None:
      outputs.append(logits)
    else:
      in_chunk = ((wanted >= start) & (wanted < start + size))[..., None]
      last = logits if last is None else jnp.where(in_chunk, logits, last)
    start += size
  return (jnp.concatenate(outputs, axis=1)[:, :prompt_len] if picked is None else last), cache


def _picked(all_logits, logits_at, lengths=None):
  """The logits a prefill keeps: None (all), 0 (each row's last position) or n (`logits_at` `[batch, n]`, each
  position inside its row's prompt: ValueError otherwise)."""
  if logits_at is None:
    return None if all_logits else 0
  at = np.asarray(logits_at)
  if at.ndim != 2 or at.shape[1] < 1:
    raise ValueError(f"logits_at must be [batch, n] prompt positions with n >= 1, got shape {at.shape}")
  if lengths is not None and ((at < 0) | (at >= np.asarray(lengths)[:, None])).any():
    raise ValueError("logits_at must hold positions inside each row's prompt (0 <= position < its length)")
  return at.shape[1]


def chunk_sizes(model, variables, cache, batch, prompt_len, chunk=None, all_logits=True):
  """`(first, later)`: the tokens per row of the chunks `prefill` runs for these arguments, after fitting them to
  the free memory (what a benchmark should report; the programs are compiled once and shared with `prefill`)."""
  (first, _), (later, _) = _chunk_programs(model, variables, cache, batch, prompt_len, chunk, _picked(all_logits, None))
  return first, later


def _chunk_programs(model, variables, cache, batch, prompt_len, chunk, picked):
  """`((first size, its program), (later size, its program))` for `prefill` (its docstring says how sizes are
  chosen); the later pair repeats the first where one chunk holds the prompt."""
  block = model.config.attention.block
  whole_blocks = lambda n: -(-n // block) * block
  if chunk is None:
    first = prefill_chunk(model.config, prompt_len, batch)
    bounded = kinds.get(model.config.attention.kind).bounded_chunks
    later = first if bounded else min(first, whole_blocks(DEFAULT_CHUNK))
  else:
    first = later = whole_blocks(min(chunk, prompt_len))
  first_program = _chunk_program(model, variables, cache, batch, first, True, picked)
  if prompt_len <= first_program[0]:
    return first_program, first_program
  later = min(later, whole_blocks(prompt_len - first_program[0]))
  return first_program, _chunk_program(model, variables, cache, batch, later, False, picked)


def _chunk_program(model, variables, cache, batch, size, first_chunk, picked):
  """`(size, compiled extend)` for chunks of at most `size` tokens per row that fit the free device memory."""

  def lower_args(size):
    ints = jax.ShapeDtypeStruct((batch, size), jnp.int32)
    logits_at = None if picked is None else jax.ShapeDtypeStruct((batch, picked) if picked else (batch,), jnp.int32)
    valid = jax.ShapeDtypeStruct((batch, size), jnp.bool_)
    args = (model, variables, ints, cache, ints, valid)  # lowering reads shapes: the cache is not donated
    return args, dict(first_chunk=first_chunk, logits_at=logits_at)

  key = (model, memory.signature(variables), memory.signature(cache), batch, first_chunk, picked)
  what = f"prefill of {model.config.attention.kind} at batch {batch} ({'first' if first_chunk else 'later'} chunk)"
  return memory.fitted_program(extend, key, size, model.config.attention.block, lower_args, what)


def sample(logits, rng, temperature=0.0, top_p=1.0):
  """Next tokens `[batch]` from logits `[batch, vocab]`: greedy at temperature 0, else nucleus sampling."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # The smallest prefix whose mass reaches top_p: keep tokens whose preceding mass is below it.
    cutoff_index = jnp.sum(cumulative - jax.nn.softmax(sorted_logits, axis=-1) < top_p, axis=-1) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index[:, None], axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@flax.struct.dataclass
class _Loop:
  cache: dict
  token: jax.Array  # [batch] last token, fed next
  position: jax.Array  # [batch] its position
  out: jax.Array  # [batch, max_new_tokens]
  done: jax.Array  # [batch]
  step: jax.Array
  rng: jax.Array
  cells: jax.Array  # [batch, max_new_tokens, layers, heads, K] selected cells, or [0] when not recorded


def selected_cells(intermediates, config):
  """The cells every FreeSolo layer selected for a chunk, from `extend`'s intermediates:
  `[batch, C, layers, heads, K]` (-1 = none)."""
  return sown_by_layer(intermediates, config, "selected_cells")


def sown_by_layer(intermediates, config, name):
  """What every layer's attention sowed as `name` for a chunk (`[batch, C, ...]` each), from `extend`'s
  intermediates, stacked on axis 2: `[batch, C, layers, ...]` (e.g. ZHA's `attended_fraction`)."""
  if config.scan_layers:  # sown inside the scan: [layers, batch, C, ...]
    return jnp.moveaxis(intermediates["layers"]["layer"]["attention"][name][0], 0, 2)
  per_layer = [intermediates[f"layer_{i}"]["attention"][name][0] for i in range(config.num_layers)]
  return jnp.stack(per_layer, axis=2)


def decode_loop(
  model,
  variables,
  cache,
  first_token,
  position,
  rng,
  *,
  max_new_tokens,
  eos_id,
  temperature,
  top_p,
  return_cells=False,
  limits=None,
):
  """Generates on device with `lax.while_loop` until every row emitted EOS or reached its limit.

  Args:
    cache: the prefilled cache; donated: the loop updates it in place, so it cannot be used afterwards.
    first_token: `[batch]` the token sampled from the prompt's last logits; position: `[batch]` its position.
    return_cells: also return, for FreeSolo models, the cells each layer and head selected when consuming
      generated token j: `cells[:, j]` `[batch, layers, heads, K]` (-1 = none; the last token is never consumed).
    limits: optional `[batch]` int32, each row's own cap on new tokens (1..max_new_tokens); None: all
      `max_new_tokens`. A row that reached its limit stops like one that emitted EOS; the loop ends when all have.

  Returns:
    `[batch, max_new_tokens]` int32 tokens (first_token first; after EOS or the row's limit a row holds EOS), and
    the cells when `return_cells`.
  """
  batch = first_token.shape[0]
  limits = jnp.full((batch,), max_new_tokens, jnp.int32) if limits is None else jnp.asarray(limits, jnp.int32)
  out, cells, _ = _decode_loop(
    model,
    variables,
    cache,
    first_token,
    position,
    rng,
    limits,
    max_new_tokens=max_new_tokens,
    eos_id=eos_id,
    temperature=temperature,
    top_p=top_p,
    return_cells=return_cells,
  )
  return (out, cells) if return_cells else out


@functools.partial(
  jax.jit,
  static_argnames=("model", "max_new_tokens", "eos_id", "temperature", "top_p", "return_cells"),
  donate_argnames=("cache",),
)
def _decode_loop(
  model,
  variables,
  cache,
  first_token,
  position,
  rng,
  limits,
  *,
  max_new_tokens,
  eos_id,
  temperature,
  top_p,
  return_cells,
):
  """`decode_loop`, returning `(tokens, cells, final cache)`. Returning the cache lets XLA give the donated input
  buffers to the loop: otherwise it copies the whole cache into the loop's state, doubling its memory."""
  state = initial_state(
    model.config, cache, first_token, position, rng, limits, max_new_tokens, eos_id, return_cells=return_cells
  )
  final = _run(model, variables, state, limits, 0, max_new_tokens, eos_id, temperature, top_p, return_cells)
  return final.out, final.cells, final.cache


def initial_state(config, cache, first_token, position, rng, limits, max_new_tokens, eos_id, return_cells=False):
  """The loop's state before its first step: `first_token` `[batch]` at `position` `[batch]` is out[:, 0]."""
  batch = first_token.shape[0]
  out = jnp.full((batch, max_new_tokens), eos_id, jnp.int32).at[:, 0].set(first_token)
  cells_shape = (
    (batch, max_new_tokens, config.num_layers, config.num_heads, config.attention.top_k) if return_cells else (0,)
  )
  return _Loop(
    cache=cache,
    token=first_token,
    position=position,
    out=out,
    done=(first_token == eos_id) | (limits <= 1),
    step=jnp.int32(1),
    rng=rng,
    cells=jnp.full(cells_shape, -1, jnp.int32),
  )


@functools.partial(
  jax.jit, static_argnames=("model", "max_new_tokens", "eos_id", "temperature", "top_p"), donate_argnames=("state",)
)
def resume(model, variables, state, limits, live_floor, *, max_new_tokens, eos_id, temperature, top_p):
  """Runs the loop on from `state` (donated) until `max_new_tokens`, every row done, or at most `live_floor` (int32
  scalar) rows still running; returns the state there. `fsjax.compaction` calls it between shrinking the batch."""
  return _run(model, variables, state, limits, live_floor, max_new_tokens, eos_id, temperature, top_p, False)


def _run(model, variables, state, limits, live_floor, max_new_tokens, eos_id, temperature, top_p, return_cells):
  """The on-device loop over one-token steps from `state` while some step is left and more than `live_floor` rows
  are still running."""
  batch = state.token.shape[0]
  config = model.config

  def cond(s):
    return (s.step < max_new_tokens) & (jnp.sum(~s.done) > live_floor)

  def body(s):
    logits, cache, intermediates = _apply(
      model, variables, s.token[:, None], s.cache, s.position[:, None], jnp.ones((batch, 1), bool)
    )
    rng, key = jax.random.split(s.rng)
    token = jnp.where(s.done, eos_id, sample(logits[:, 0], key, temperature, top_p))
    cells = s.cells.at[:, s.step - 1].set(selected_cells(intermediates, config)[:, 0]) if return_cells else s.cells
    return _Loop(
      cache=cache,
      token=token,
      position=s.position + 1,
      out=s.out.at[:, s.step].set(token),
      done=s.done | (token == eos_id) | (s.step + 1 >= limits),
      step=s.step + 1,
      rng=rng,
      cells=cells,
    )

  return jax.lax.while_loop(cond, body, state)


def generate(
  model,
  variables,
  tokens,
  lengths,
  *,
  max_new_tokens,
  eos_id,
  temperature=0.0,
  top_p=1.0,
  seed=0,
  chunk=None,
  max_len=None,
  return_cells=False,
  limits=None,
  compact=False,
):
  """Prefill right-padded prompts, then decode on device. A cache larger than the free device memory is refused
  with `fsjax.memory.DeviceMemoryError` before anything is compiled.

  Args:
    tokens: `[batch, P]` right-padded prompts; lengths: `[batch]` their lengths (>= 1).
    max_new_tokens: the most tokens any row generates (the loop's static bound); limits: optional `[batch]` caps
      of each row (1..max_new_tokens), see `decode_loop`.
    compact: halve the batch whenever at most half of its rows are still running, so finished rows stop costing
      steps (`fsjax.compaction`; not with `return_cells`). Greedy output is the same either way.

  Returns:
    `[batch, max_new_tokens]` int32 tokens (EOS after a row's end or limit); with `return_cells` (FreeSolo models)
    also the selected cells `[batch, max_new_tokens, layers, heads, K]` (see `decode_loop`).
  """
  if return_cells and compact:
    raise ValueError("return_cells needs compact=False: a batch that halves does not record cells")
  if return_cells and kinds.get(model.config.attention.kind).family != "freesolo":
    raise ValueError(f"return_cells needs a FreeSolo model, got attention kind {model.config.attention.kind!r}")
  tokens = jnp.asarray(tokens, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  max_len = max_len or tokens.shape[1] + max_new_tokens
  if tokens.shape[1] + max_new_tokens > max_len:
    raise ValueError(
      f"max_len ({max_len}) must hold the prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens})"
    )
  make_cache = lambda: init_cache(model.config, tokens.shape[0], max_len)
  memory.check_fits(
    f"the {model.config.attention.kind} cache for {tokens.shape[0]} rows of {max_len} tokens",
    memory.tree_bytes(jax.eval_shape(make_cache)),
  )
  cache = make_cache()
  last, cache = prefill(model, variables, tokens, lengths, cache, chunk, all_logits=False)
  rng, key = jax.random.split(jax.random.PRNGKey(seed))
  first = sample(last, key, temperature, top_p)
  if compact:
    from fsjax.compaction import decode_compacting  # at call time: it runs this module's loop

    loop = decode_compacting
  else:
    loop = functools.partial(decode_loop, return_cells=return_cells)
  return loop(
    model,
    variables,
    cache,
    first,
    lengths,
    rng,
    max_new_tokens=max_new_tokens,
    eos_id=eos_id,
    temperature=temperature,
    top_p=top_p,
    limits=limits,
  )


def generate_each(
  model,
  variables,
  prompts,
  limits,
  *,
  eos_id,
  batch_size=8,
  temperature=0.0,
  top_p=1.0,
  seed=0,
  chunk=None,
  compact=False,
):
  """Generates for a list of prompts of any lengths, each with its own cap, `batch_size` rows at a time.

  Prompts are sorted longest first so a batch holds rows of similar length, right-padded to a power of two of
  at least 64 tokens (few programs compile), and each row stops at EOS or its cap (`generate`'s `limits`). With
  `compact` a batch halves as its rows finish (`fsjax.compaction`), so finished rows stop costing steps, at one
  compile of the loop per new batch size.
  Batch b samples with seed `seed + b * batch_size`, so sampled output depends on the batching; greedy does not.

  Args:
    prompts: list of non-empty token-id lists; limits: list of caps (>= 1), one per prompt.

  Returns:
    list of `(new token ids before EOS, whether EOS ended the row)`, in the order of `prompts`.
  """
  if len(limits) != len(prompts) or min(map(len, prompts), default=1) < 1 or min(limits, default=1) < 1:
    raise ValueError("generate_each needs one cap >= 1 per prompt and no empty prompt")
  order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
  results = [None] * len(prompts)
  for start in range(0, len(order), batch_size):
    rows = order[start : start + batch_size]
    width = max(64, 1 << (len(prompts[rows[0]]) - 1).bit_length())
    tokens = np.zeros((len(rows), width), np.int32)
    for row, i in enumerate(rows):
      tokens[row, : len(prompts[i])] = prompts[i]
    row_limits = [limits[i] for i in rows]
    out = generate(
      model,
      variables,
      tokens,
      [len(prompts[i]) for i in rows],
      max_new_tokens=max(row_limits),
      eos_id=eos_id,
      temperature=temperature,
      top_p=top_p,
      seed=seed + start,
      chunk=chunk,
      limits=row_limits,
      compact=compact,
    )
    out = np.asarray(out)  # one transfer per batch
    for row, i in enumerate(rows):
      new = out[row, : limits[i]].tolist()
      results[i] = (new[: new.index(eos_id)], True) if eos_id in new else (new, False)
  return results
