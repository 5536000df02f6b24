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

from fsjax.config import Config, ConfigError, to_dict
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
  """Yields a function that tells whether SIGTERM (a preemption notice, `timeout`) has arrived since entry, so the
  loop can finish its step and save it instead of dying between checkpoints. Only a single-process run in the main
  thread listens: several processes would first have to agree on the step to save, and Python delivers signals to
  the main thread alone. The previous handler is restored on exit."""
  if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
    yield lambda: False
    return
  received = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
  try:
    yield lambda: bool(received)
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
  checkpoint's config dict and `config`."""
  flat = lambda tree: flax.traverse_util.flatten_dict(tree, sep=".")
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
  train_path = config.data.train_path if config.data.source == "text" else None
  for field, path in (
    ("data.train_path", train_path),
    ("data.eval_path", config.data.eval_path),
    ("data.tokenizer", config.data.tokenizer),
    ("train.init_from", config.train.init_from),
  ):
    if path is not None and not os.path.exists(path):
      raise ConfigError(f"{field}: path does not exist: {path}")


def check_vocabulary(config: Config):
  """Raises ConfigError when the tokenizer has ids the model's embedding does not hold. Held-out evaluation always
  reads text, and an out-of-range id would embed as NaN (`jnp.take` fills) instead of failing."""
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


def _train_iterator(config: Config):
  data, shards = config.data, dict(shard_index=jax.process_index(), shard_count=jax.process_count())
  if data.tiled_rows % jax.process_count():
    raise ConfigError(
      f"data.tiled_rows ({data.tiled_rows}) must be a multiple of the process count ({jax.process_count()})"
    )
  rows = _local_rows(config.train.batch_size - data.tiled_rows)
  if data.source == "random":
    main = make_random_iterator(
      seq_len=data.seq_len,
      batch_size=rows,
      seed=config.train.seed,
      vocab=data.random_ids,
      copies=data.copies,
      period=None if data.tiled_rows else data.random_period,
      **shards,
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
      **shards,
    )
  if not data.tiled_rows:
    return main
  # Beside random copy rows, tiled rows from the same seed would replay those rows' ids (DataConfig.tiled_rows).
  tiled_seed = config.train.seed + 1 if data.source == "random" else config.train.seed
  tiled = make_random_iterator(
    seq_len=data.seq_len,
    batch_size=_local_rows(data.tiled_rows),
    seed=tiled_seed,
    vocab=data.random_ids,
    period=data.random_period,
    **shards,
  )
  return RowMixture(main, tiled)


def check_train_documents(config: Config):
  """Reads a configured `data.train_path` once, so a malformed or empty corpus stops the run before anything
  compiles (DataError naming the file and line), not in the data loader mid-run."""
  if config.data.source == "text" and config.data.train_path is not None:
    check_documents(config.data.train_path, "data.train_path")


def _eval_batches(config: Config):
  """The held-out batches; DataError when the eval documents do not fill one."""
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
  rows = _local_rows(config.eval.batch_size)
  start = jax.process_index() * rows
  return [b[start : start + rows] for b in batches]  # each process feeds its share of every batch


def _parent_variables(config: Config, objective, abstract_params, abstract_frozen):
  """Params and routing buffers of `train.init_from`, checked against this config's shapes for the arrays the
  objective says a parent holds (`Objective.parent_params`)."""
  parent_config, params, frozen, step = ckpt_lib.load(config.train.init_from)
  where = f"{config.train.init_from} (step {step})"
  abstract_params = objective.parent_params(config, parent_config, abstract_params, where)
  ckpt_lib.check_shapes(
    {"params": params, "frozen": frozen}, {"params": abstract_params, "frozen": abstract_frozen}, where
  )
  print(
    f"continuing from {where}: {parent_config.model.attention.kind} -> {config.model.attention.kind}, "
    "fresh optimizer and schedule",
    flush=True,
  )
  return params, frozen


def evaluate(model, params, frozen, batches, mesh):
  """Held-out loss (mean NLL per token) and perplexity over `batches`."""
  eval_step = jax.jit(make_eval_step(model))
  total, count = 0.0, 0
  for tokens in batches:
    nll_sum, n = eval_step(params, frozen, sharding.global_batch({"tokens": tokens}, mesh)["tokens"])
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
  log = MetricsLog(workdir, config.train.steps)
  data = _train_iterator(config)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  tokens_seen = 0
  check_config = lambda saved, step: _check_resumable(saved, config, workdir, step, allow_config_change)
  restored = checkpoints.restore_newest(abstract_state, check_config)  # before anything compiles
  if restored is not None:  # resume from the newest intact step
    latest, saved, state, data_state, tokens_seen = restored
    _record_config_changes(saved, config, workdir, latest)
    if tokens_seen is None:  # written before checkpoints recorded it: every step had the saved config's size
      tokens_seen = latest * saved["train"]["batch_size"] * saved["data"]["seq_len"]
    data.set_state(data_state)
    log.truncate_after(latest)
    print(f"resumed from {checkpoints.directory}/{latest}", flush=True)
  else:
    log.truncate_after(0)  # a run killed before its first checkpoint starts over: so do its records
    parent = (
      _parent_variables(config, objective, abstract_state.params, abstract_state.frozen)
      if config.train.init_from
      else None
    )
    state = jax.jit(init_state, out_shardings=state_shardings)()
    if parent is not None:
      parent_params, parent_frozen = parent
      fresh = flax.traverse_util.flatten_dict(jax.device_get(state.params))
      fresh.update(flax.traverse_util.flatten_dict(parent_params))  # arrays the parent lacks stay fresh
      params, frozen = jax.device_put(
        (flax.traverse_util.unflatten_dict(fresh), parent_frozen), (state_shardings.params, state_shardings.frozen)
      )
      state = state.replace(params=params, frozen=frozen, opt_state=optimizer.init(params))
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
        checkpoints.save(step, state, data.get_state(), config, tokens_seen)
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
  for final_eval in final_evals:
    clock = time.perf_counter()
    print(f"final evaluation {final_eval.__name__} ...", flush=True)
    summary.update(final_eval(config, model, {"params": state.params, **state.frozen}))
    print(f"final evaluation {final_eval.__name__} done in {time.perf_counter() - clock:.1f} s", flush=True)
  with open(os.path.join(workdir, "eval.json"), "w") as f:
    json.dump(summary, f, indent=2)
  if jax.process_index() == 0:
    print_table([summary])
  return summary
