"""The training loop: build or resume, step, log, checkpoint, evaluate.

The loop knows no attention kind and no objective: what differs between objectives (the loss, the trainable
parameters, the parent checkpoints a run starts from, extra metrics) it asks of `fsjax.train.objectives`, and
evaluations beyond held-out loss come from its caller as `final_evals` (train.py adds RULER's S-NIAH-1).
"""

import contextlib
import json
import math
import os
import signal
import threading
import time

import flax.traverse_util
import jax

from fsjax.config import Config, ConfigError, from_dict, to_dict
from fsjax.data.associative import check_filler, held_out_batches, held_out_task, make_associative_iterator, text_tokens
from fsjax.data.mixture import RowMixture
from fsjax.data.pipeline import DataError, check_documents, default_corpus_path, make_eval_batches, make_train_iterator
from fsjax.data.random_rows import make_random_iterator
from fsjax.data.tokenizer import load_tokenizer
from fsjax.model import Transformer, init_variables, param_counts
from fsjax.train import checkpoint as ckpt_lib
from fsjax.train import objectives, sharding
from fsjax.train.metrics import MetricsLog, print_table
from fsjax.train.optim import learning_rate_schedule, make_optimizer
from fsjax.train.step import create_state, make_eval_step, make_train_step


class TrainingStopped(RuntimeError):
  """The run stopped early (too many consecutive non-finite steps); the last good checkpoint is intact."""


class TrainingInterrupted(TrainingStopped):
  """SIGTERM stopped the run after the step in flight, and that step was saved: rerunning resumes from it."""


@contextlib.contextmanager
def _stop_on_sigterm():
  """Yields a function that tells whether SIGTERM (a preemption notice, `timeout`) has reached any process since
  entry, so the loop can finish its step and save it instead of dying between checkpoints. In a multi-process run
  the processes agree on it after every step (`sharding.any_process`: a SIGTERM to any one of them stops all at
  the same step). Python delivers signals to the main thread alone, so a run in another thread does not listen.
  The previous handler is restored on exit."""
  if threading.current_thread() is not threading.main_thread():
    yield lambda: sharding.any_process(False)
    return
  received = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
  try:
    yield lambda: sharding.any_process(received)
  finally:
    signal.signal(signal.SIGTERM, previous)


def _last_good(checkpoints):
  """Where a stopped run can resume from, once every pending save has finished."""
  checkpoints.wait()
  latest = checkpoints.latest_step()
  if latest is None:
    return "no checkpoint was saved before it, so a rerun starts over"
  return f"the last good checkpoint (step {latest}) is kept unchanged"


# Fields a resumed run may change without --allow-config-change: how long it runs, how it logs, saves and
# evaluates, and how it is laid out over devices. Every other field changes what is trained.
FREELY_RESUMABLE = (
  "train.steps",
  "train.max_bad_steps",
  "train.max_abs_param",
  "log.",
  "checkpoint.",
  "eval.",
  "mesh.",
)
CONFIG_CHANGES = "config_changes.jsonl"


def config_changes(saved, config: Config):
  """`{field: (saved value, new value)}` for the fields outside FREELY_RESUMABLE that differ between a
  checkpoint's config dict and `config`. A field added to the configs since the checkpoint was saved reads as its
  default there, so a checkpoint of an older fsjax resumes unless a field it knew changed."""
  flat = lambda tree: flax.traverse_util.flatten_dict(tree, sep=".")
  try:
    saved = to_dict(from_dict(Config, saved))
  except ConfigError:  # a dict today's rules refuse: compare it as saved
    pass
  old, new = flat(saved), flat(to_dict(config))
  return {
    name: (old.get(name), new.get(name))
    for name in sorted(set(old) | set(new))
    if old.get(name) != new.get(name) and not name.startswith(FREELY_RESUMABLE)
  }


def _check_resumable(saved, config: Config, workdir, step, allow_config_change):
  """Refuses to resume step `step` of `workdir` under a config that trains something else, naming the fields,
  unless `allow_config_change`."""
  changes = config_changes(saved, config)
  if changes and not allow_config_change:
    listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in changes.items())
    raise ConfigError(
      f"{workdir} was trained to step {step} with another config ({listed}); use another --workdir, or "
      "--allow-config-change to continue it under this one (recorded in config_changes.jsonl)"
    )


def _record_config_changes(saved, config: Config, workdir, step):
  """Appends the fields a resume changed to `<workdir>/config_changes.jsonl` (once the resume has succeeded)."""
  changes = config_changes(saved, config)
  if changes:
    with open(os.path.join(workdir, CONFIG_CHANGES), "a") as f:
      f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def check_paths(config: Config):
  """Raises ConfigError for a data, tokenizer or parent-checkpoint path that does not exist. `data.train_path` is
  checked only when training reads it (not with `data.source: random`)."""
  train_path = config.data.train_path if config.data.reads_train_path else None
  for field, path in (
    ("data.train_path", train_path),
    ("data.eval_path", config.data.eval_path),
    ("data.tokenizer", config.data.tokenizer),
    ("train.init_from", config.train.init_from),
  ):
    if path is not None and not os.path.exists(path):
      raise ConfigError(f"{field}: path does not exist: {path}")


def check_vocabulary(config: Config):
  """Raises ConfigError when the tokenizer has ids the model's embedding does not hold: held-out evaluation reads
  text (except for associative recall without text filler, whose ids `Config` checks), and an out-of-range id
  would embed as NaN (`jnp.take` fills) instead of failing."""
  if config.data.source == "associative" and config.data.associative.filler == "random":
    return
  size = load_tokenizer(config.data.tokenizer).get_vocab_size()
  if size > config.model.vocab_size:
    raise ConfigError(
      f"model.vocab_size ({config.model.vocab_size}) must hold every id of the tokenizer "
      f"(data.tokenizer: {size} ids); held-out evaluation reads text even with data.source random"
    )


def _check_divisible(config: Config, mesh):
  for field, size in (("train.batch_size", config.train.batch_size), ("eval.batch_size", config.eval.batch_size)):
    if size % mesh.size:
      raise ConfigError(f"{field} ({size}) must be a multiple of the device count ({mesh.size})")


def _local_rows(global_rows):
  return global_rows // jax.process_count()


def _shard_iterator(config: Config, shard, shards):
  """Shard `shard` of `shards` of the training stream (`data.shards`): its `1/shards` of every batch's text or
  random rows, then of its tiled rows."""
  data, ids = config.data, dict(shard_index=shard, shard_count=shards)
  rows = (config.train.batch_size - data.tiled_rows) // shards
  if data.source == "associative":
    filler = None
    if data.associative.filler == "text":
      path = data.train_path or default_corpus_path("train")
      filler = text_tokens(path, data.tokenizer)
      check_filler(filler, data.seq_len + 1, path)
    return make_associative_iterator(
      seq_len=data.seq_len, batch_size=rows, seed=config.train.seed, task=data.associative.task(filler), **ids
    )
  if data.source == "random":
    main = make_random_iterator(
      seq_len=data.seq_len,
      batch_size=rows,
      seed=config.train.seed,
      vocab=data.random_ids,
      copies=data.copies,
      period=None if data.tiled_rows else data.random_period,
      **ids,
    )
  else:
    main = make_train_iterator(
      path=data.train_path or default_corpus_path("train"),
      tokenizer_path=data.tokenizer,
      seq_len=data.seq_len,
      batch_size=rows,
      seed=config.train.seed,
      recall_masks=data.recall,
      copies=data.copies,
      **ids,
    )
  if not data.tiled_rows:
    return main
  # Beside random copy rows, tiled rows from the same seed would replay those rows' ids (DataConfig.tiled_rows).
  tiled_seed = config.train.seed + 1 if data.source == "random" else config.train.seed
  tiled = make_random_iterator(
    seq_len=data.seq_len,
    batch_size=data.tiled_rows // shards,
    seed=tiled_seed,
    vocab=data.random_ids,
    period=data.random_period,
    **ids,
  )
  return RowMixture(main, tiled)


def _stream_shards(config: Config, saved=None):
  """How many shards the training stream has: `data.shards`, else the checkpoint's (`saved`: its list of shard
  states), else one per process. ConfigError where the processes cannot divide them or a batch cannot."""
  processes = jax.process_count()
  if config.data.shards:
    count, shards = config.data.shards, f"data.shards ({config.data.shards})"
  elif saved is not None:
    count, shards = len(saved), f"the checkpoint's data stream's {len(saved)} shards (data.shards 0)"
  else:
    count, shards = processes, f"data.shards (0: one per process, {processes})"
  if saved is not None and len(saved) != count:
    raise ConfigError(
      f"{shards} differs from the {len(saved)} shards of the checkpoint's data stream, whose position cannot "
      "carry over; leave data.shards at 0 or set it to the checkpoint's"
    )
  if count % processes:
    raise ConfigError(f"{shards} must be a multiple of the process count ({processes})")
  for field, rows in (
    ("train.batch_size - data.tiled_rows", config.train.batch_size - config.data.tiled_rows),
    ("data.tiled_rows", config.data.tiled_rows),
  ):
    if rows % count:
      raise ConfigError(f"{field} ({rows}) must be a multiple of {shards}")
  return count


def _local_shards(shards, process_index, process_count):
  """The shards process `process_index` of `process_count` reads: a contiguous run, so the processes' rows in
  process order are the shards' rows in shard order."""
  local = shards // process_count
  return range(process_index * local, (process_index + 1) * local)


def train_iterator(config: Config, shards, process_index=0, process_count=1):
  """The training stream of `shards` shards as process `process_index` of `process_count` reads it: one
  iterator of its rows of every global batch (`[batch_size / process_count, seq_len + 1]` arrays)."""
  return RowMixture(*(_shard_iterator(config, s, shards) for s in _local_shards(shards, process_index, process_count)))


def _stream_state(data):
  """The whole training stream's position, `{"shards": [state of each shard]}`, gathered from every process."""
  return {"shards": [state for states in sharding.gather_json(data.get_state()["parts"]) for state in states]}


def _saved_shards(data_state):
  """Each shard's state in a checkpoint's data item; a checkpoint of one unsharded stream holds its state."""
  return data_state["shards"] if isinstance(data_state, dict) and "shards" in data_state else [data_state]


def restore_stream(data, shards, process_index=0, process_count=1):
  """Sets the shards of `data` (a `train_iterator` of process `process_index` of `process_count`) to their states
  among `shards`, the state of every shard of the stream."""
  local = _local_shards(len(shards), process_index, process_count)
  data.set_state({"parts": shards[local.start : local.stop]})


def check_train_documents(config: Config):
  """Reads a configured `data.train_path` once, so a malformed or empty corpus stops the run before anything
  compiles (DataError naming the file and line), not in the data loader mid-run."""
  if config.data.reads_train_path and config.data.train_path is not None:
    check_documents(config.data.train_path, "data.train_path")


def _eval_batches(config: Config):
  """This process's share of the held-out batches, `{"tokens"[, "loss_mask"]}` dicts: held-out text, or for
  associative recall rows of the test stream (answers only); DataError when the eval documents do not fill one."""
  rows, start = _local_rows(config.eval.batch_size), jax.process_index() * _local_rows(config.eval.batch_size)
  if config.data.source == "associative":
    return [
      {key: value[start : start + rows] for key, value in batch.items()} for batch in _recall_eval_batches(config)
    ]
  path = config.data.eval_path or default_corpus_path("valid")
  batches = make_eval_batches(
    path=path,
    tokenizer_path=config.data.tokenizer,
    seq_len=config.data.seq_len,
    batch_size=config.eval.batch_size,
    max_batches=config.eval.batches,
  )
  if not batches:
    raise DataError(
      f"data.eval_path: {path} is too short for one eval batch (eval.batch_size {config.eval.batch_size} rows "
      f"of data.seq_len + 1 = {config.data.seq_len + 1} tokens)"
    )
  return [{"tokens": b[start : start + rows]} for b in batches]  # each process feeds its share of every batch


def _recall_eval_batches(config: Config):
  """`eval.batches` batches of the associative test stream (`fsjax.data.associative.TEST`), text filler from the
  held-out corpus: the training stream never holds these rows."""
  data = config.data
  return held_out_batches(
    task=held_out_task(data.associative, data.seq_len + 1, data.tokenizer, data.eval_path),
    length=data.seq_len + 1,
    batch_size=config.eval.batch_size,
    batches=config.eval.batches,
    seed=config.train.seed,
  )


def _parent_variables(config: Config, objective, abstract_params, abstract_frozen):
  """Params and routing buffers of `train.init_from`, checked against this config's shapes for the arrays the
  objective says a parent holds (`Objective.parent_params`).

  A frozen collection the parent has none of starts at its initial values: a dense parent (TF++, or a Hugging
  Face import) continued as FreeSolo has no routing buffers, and FS's λ, σ start where FS from scratch starts
  (Eq. 7). A collection the parent has must hold every array this config needs."""
  parent_config, params, frozen, step = ckpt_lib.load(config.train.init_from)
  params, frozen = jax.device_get((params, frozen))  # on the host: every process then places its shards
  where = f"{config.train.init_from} (step {step})"
  abstract_params = objective.parent_params(config, parent_config, abstract_params, where)
  fresh = sorted(set(abstract_frozen) - set(frozen))
  abstract_frozen = {name: value for name, value in abstract_frozen.items() if name not in fresh}
  ckpt_lib.check_shapes(
    {"params": params, "frozen": frozen}, {"params": abstract_params, "frozen": abstract_frozen}, where
  )
  print(
    f"continuing from {where}: {parent_config.model.attention.kind} -> {config.model.attention.kind}, "
    "fresh optimizer and schedule" + "".join(f", fresh {name} buffers" for name in fresh),
    flush=True,
  )
  return params, frozen


def evaluate(model, params, frozen, batches, mesh):
  """Held-out loss (mean NLL per target) and perplexity over `batches` (`{"tokens"[, "loss_mask"]}` dicts; with
  a loss mask only the targets it marks count)."""
  eval_step = jax.jit(make_eval_step(model))
  total, count = 0.0, 0
  for batch in batches:
    batch = sharding.global_batch(batch, mesh)
    nll_sum, n = eval_step(params, frozen, batch["tokens"], batch.get("loss_mask"))
    total, count = total + float(nll_sum), count + int(n)
  loss = total / count
  return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def train(config: Config, workdir, final_evals=(), allow_config_change=False):
  """Trains (or resumes) in `workdir` up to `config.train.steps`; returns the final evaluation dict.

  Args:
    config: the run's config.
    workdir: checkpoints, metrics.jsonl, config.json and eval.json go here.
    final_evals: callables `(config, model, variables) -> {name: value}` run on the final model after the held-out
      loss; their entries extend the summary (eval.json and the printed table) in order.
    allow_config_change: resume a checkpoint written under a config that differs outside FREELY_RESUMABLE
      (otherwise ConfigError names the fields); a resume that succeeds records the change in
      `config_changes.jsonl`.

  Returns:
    The summary written to eval.json.
  """
  check_paths(config)
  check_vocabulary(config)
  check_train_documents(config)
  sharding.initialize_distributed()
  eval_batches = _eval_batches(config)  # before anything compiles: a too-short eval set stops the run here
  mesh = sharding.make_mesh(config.mesh)
  _check_divisible(config, mesh)
  os.makedirs(workdir, exist_ok=True)
  process = jax.process_index(), jax.process_count()
  primary = process[0] == 0  # the one process that writes the workdir's records

  objective = objectives.get(config.train.objective)
  model = Transformer(config.model)
  train_model = Transformer(objective.model_config(config.model))
  optimizer = make_optimizer(config.train, objective.trainable)
  schedule = learning_rate_schedule(config.train)
  rng = jax.random.PRNGKey(config.train.seed)
  init_state = lambda: create_state(init_variables(config.model, rng, config.model.attention.block), optimizer)
  abstract_state = jax.eval_shape(init_state)
  state_shardings = sharding.tree_shardings(abstract_state, mesh)
  abstract_state = jax.tree_util.tree_map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, state_shardings
  )

  checkpoints = ckpt_lib.Checkpointer(
    os.path.join(workdir, ckpt_lib.CHECKPOINT_SUBDIR),
    keep=config.checkpoint.keep,
    async_save=config.checkpoint.async_save,
  )
  log = MetricsLog(workdir, config.train.steps, write=primary)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  tokens_seen = 0
  check_config = lambda saved, step: _check_resumable(saved, config, workdir, step, allow_config_change)
  restored = checkpoints.restore_newest(abstract_state, check_config)  # before anything compiles
  if restored is not None:  # resume from the newest intact step
    latest, saved, state, data_state, tokens_seen = restored
    shards = _saved_shards(data_state)
    data = train_iterator(config, _stream_shards(config, shards), *process)
    if primary:
      _record_config_changes(saved, config, workdir, latest)
    if tokens_seen is None:  # written before checkpoints recorded it: every step had the saved config's size
      tokens_seen = latest * saved["train"]["batch_size"] * saved["data"]["seq_len"]
    restore_stream(data, shards, *process)
    log.truncate_after(latest)
    print(f"resumed from {checkpoints.directory}/{latest}", flush=True)
  else:
    data = train_iterator(config, _stream_shards(config), *process)
    log.truncate_after(0)  # a run killed before its first checkpoint starts over: so do its records
    parent = (
      _parent_variables(config, objective, abstract_state.params, abstract_state.frozen)
      if config.train.init_from
      else None
    )
    state = jax.jit(init_state, out_shardings=state_shardings)()
    if parent is not None:
      parent_params, parent_frozen = parent
      fresh = flax.traverse_util.flatten_dict(sharding.to_host(state.params))
      fresh.update(flax.traverse_util.flatten_dict(parent_params))  # arrays the parent lacks stay fresh
      frozen = {**sharding.to_host(state.frozen), **parent_frozen}  # collections the parent lacks stay fresh
      params, frozen = jax.device_put(
        (flax.traverse_util.unflatten_dict(fresh), frozen), (state_shardings.params, state_shardings.frozen)
      )
      state = state.replace(params=params, frozen=frozen, opt_state=optimizer.init(params))
  if primary:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(to_dict(config), f, indent=2)

  counts = param_counts(config.model)
  print(
    f"{config.model.attention.kind} model, {counts['total']:,} parameters, mesh {dict(mesh.shape)}, "
    f"{config.train.batch_size} x {config.data.seq_len} tokens per step",
    flush=True,
  )
  batch_shardings = sharding.batch_sharding(mesh)
  train_step = jax.jit(
    make_train_step(objective.loss(train_model, config.train), optimizer, schedule),
    in_shardings=(state_shardings, batch_shardings),
    out_shardings=(state_shardings, None),
    donate_argnums=0,
  )
  step = int(state.step)
  last_time, last_step = time.perf_counter(), step
  if step < config.train.steps:
    print(f"compiling the train step (step {step + 1} includes it) ...", flush=True)
  with _stop_on_sigterm() as stop_requested:
    while step < config.train.steps:
      batch = sharding.global_batch(next(data), mesh)
      state, metrics = train_step(state, batch)
      step += 1
      tokens_seen += tokens_per_step
      metrics = jax.device_get(metrics)
      bad_steps = int(state.bad_steps)
      if bad_steps >= config.train.max_bad_steps:
        raise TrainingStopped(
          f"stopped at step {step}: {bad_steps} consecutive non-finite losses or gradients "
          f"(train.max_bad_steps={config.train.max_bad_steps}); {_last_good(checkpoints)}"
        )
      stopping = stop_requested()
      if bad_steps == 0 and (step % config.checkpoint.every == 0 or step == config.train.steps or stopping):
        fault = ckpt_lib.parameter_fault(state.params, config.train.max_abs_param)
        if fault:
          raise TrainingStopped(f"stopped at step {step}: {fault}, not saved; {_last_good(checkpoints)}")
        checkpoints.save(step, state, _stream_state(data), config, tokens_seen)
      if step % config.log.every == 0 or step == config.train.steps or stopping:
        now = time.perf_counter()
        extra = {name: metrics[name] for name in objective.metric_names(config.model)}
        log.write(
          step,
          dict(
            loss=metrics["loss"],
            grad_norm=metrics["grad_norm"],
            learning_rate=metrics["learning_rate"],
            skipped=int(state.skipped),
            tokens_per_s=tokens_per_step * (step - last_step) / (now - last_time),
            **extra,
          ),
        )
        last_time, last_step = now, step
      if stopping:
        checkpoints.wait()
        saved = checkpoints.latest_step()
        checkpoints.close()
        raise TrainingInterrupted(
          f"stopped by SIGTERM after step {step}; the latest checkpoint is step {saved} (a "
          "step with a non-finite loss is not saved): rerun the same command to resume"
        )
      if config.eval.every and step % config.eval.every == 0:
        result = evaluate(model, state.params, state.frozen, eval_batches, mesh)
        print(f"step {step}: held-out loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}", flush=True)
  checkpoints.wait()
  checkpoints.close()

  clock = time.perf_counter()
  print(f"held-out evaluation: {len(eval_batches)} batches of {config.eval.batch_size} rows ...", flush=True)
  result = evaluate(model, state.params, state.frozen, eval_batches, mesh)
  print(f"held-out evaluation done in {time.perf_counter() - clock:.1f} s", flush=True)
  summary = dict(
    model=config.model.attention.kind,
    parameters=counts["total"],
    steps=step,
    tokens_seen=tokens_seen,
    heldout_loss=result["loss"],
    heldout_perplexity=result["perplexity"],
  )
  variables = {"params": state.params, **state.frozen}
  if final_evals and jax.process_count() > 1:
    variables = sharding.to_host(variables)  # each process evaluates a whole copy on its own devices
  for final_eval in final_evals:
    clock = time.perf_counter()
    print(f"final evaluation {final_eval.__name__} ...", flush=True)
    summary.update(final_eval(config, model, variables))
    print(f"final evaluation {final_eval.__name__} done in {time.perf_counter() - clock:.1f} s", flush=True)
  if primary:
    with open(os.path.join(workdir, "eval.json"), "w") as f:
      json.dump(summary, f, indent=2)
    print_table([summary])
  return summary
