"""AdamW with the paper's schedules (FS App. A cosine with warmup and floor; ZHA App. B-A WSD)."""

import jax
import optax

from fsjax.config import TrainConfig


def learning_rate_schedule(train: TrainConfig):
  """Step → learning rate.

  cosine: linear warmup 0 → peak over `warmup_steps`, cosine decay to `lr_floor` at `decay_steps` (warmup
  included), then flat at the floor. wsd: the same warmup, flat at the peak, then linear decay to `lr_floor`
  over the last `decay_fraction` of `decay_steps`.
  """
  horizon = train.decay_steps or train.steps
  warmup = min(train.warmup_steps, horizon)
  if train.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
      0.0, train.learning_rate, warmup, max(horizon, warmup + 1), end_value=train.lr_floor
    )
  decay = max(1, round(train.decay_fraction * horizon))
  stable = max(0, horizon - warmup - decay)
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, train.learning_rate, warmup),
      optax.constant_schedule(train.learning_rate),
      optax.linear_schedule(train.learning_rate, train.lr_floor, decay),
    ],
    boundaries=[warmup, warmup + stable],
  )


DECAYED = ("kernel", "embedding")


def decay_mask(params):
  """Weight decay on projection kernels and the embedding only: not on norm scales, readout gains, α or ZHA's
  reference queries. Decided by name, not rank: with `scan_layers` every parameter gains a leading layer axis, so a
  rule of `ndim >= 2` would decay the stacked norm scales, gains and α."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) in DECAYED, params)


def make_optimizer(train: TrainConfig, trainable=None):
  """Global-norm clipping, then AdamW with the schedule and the decay mask.

  Args:
    train: the optimisation settings.
    trainable: None (every parameter trains), or `params` → a pytree of bools like it (an objective's
      `trainable`): parameters marked False get zero updates and no optimizer state.
  """
  adamw = optax.chain(
    optax.clip_by_global_norm(train.clip_norm),
    optax.adamw(
      learning_rate_schedule(train),
      b1=train.beta1,
      b2=train.beta2,
      eps=train.eps,
      weight_decay=train.weight_decay,
      mask=decay_mask,
    ),
  )
  if trainable is None:
    return adamw
  labels = lambda params: jax.tree_util.tree_map(lambda t: "train" if t else "frozen", trainable(params))
  return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)
